"""``aux_tap``: the model-side marker for an aux hidden-state capture."""

from __future__ import annotations

import torch

from kimi_passes.ops import aux_tap_op  # noqa: F401  (registers torch.ops.kimi.aux_tap)
from kimi_passes.ops.aux_tap import validate_tap


def aux_tap(x: torch.Tensor, capture_id: int) -> torch.Tensor:
    """Mark ``x`` (the legacy value ``prefix + pending``) as the tap for ``capture_id``.

    Eagerly this is the identity. Under ``torch.compile`` it records the marker op
    ``kimi::aux_tap``, which the aux-stream pass rewrites (never a graph break).
    """
    if torch.compiler.is_compiling():
        return torch.ops.kimi.aux_tap(x, capture_id)
    validate_tap(x, capture_id)
    return x
