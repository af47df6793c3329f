"""Errors raised at compile time when a tap cannot be given the value it asks for."""


class AuxCaptureError(RuntimeError):
    """A tap cannot read its consumer's pre-norm mixture; raised at compile time.

    The message names the capture id, the stage's layer range and the remedy.
    Never replaced by a silent fallback to the running prefix.
    """
