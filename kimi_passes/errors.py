"""Errors raised at compile time when a tap cannot be given the value it asks for."""

from __future__ import annotations

try:
    # Dynamo re-raises a ShortenTraceback from a backend as it is, instead of wrapping
    # it in BackendCompilerFailed: users can `except kimi_passes.AuxCaptureError`.
    from torch._dynamo.exc import ShortenTraceback as _Base
except ImportError:  # pragma: no cover - torch without that class
    _Base = RuntimeError  # type: ignore[misc,assignment]  # the fallback base, same role


class AuxCaptureError(_Base):
    """A tap cannot read its consumer's pre-norm mixture; raised at compile time.

    The message names the capture id, the stage's layer range and the remedy.
    Never replaced by a silent fallback to the running prefix. A RuntimeError.
    """

    def __init__(self, message: str):
        self.message = message
        if _Base is RuntimeError:
            RuntimeError.__init__(self, message)
        else:
            super().__init__(message, first_useful_frame=None)

    def __str__(self) -> str:
        # Dynamo appends its own debugging hints to args[0]; the message stands alone.
        return self.message
