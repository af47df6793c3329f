"""``kimi::aux_tap(Tensor x, SymInt capture_id) -> Tensor``: the tap marker.

Its whole registration: check, kernel (any device), fake kernel, autograd. In eager it
returns a copy of ``x`` (an op may not return its input); ``kimi_passes.aux_tap`` returns
``x`` itself and traces this op, and the aux-stream pass removes every one from the
graph (docs/design.md). The identity's gradient is the identity: without one,
AOTAutograd could not build the joint graph of a trainable model whose taps are outputs.
"""

from __future__ import annotations

import torch

from .checks import AttnResArgumentError
from .library import below_autograd, register


def validate_tap(x: torch.Tensor, capture_id: int) -> None:
    if isinstance(capture_id, bool) or not isinstance(capture_id, int) or capture_id < 0:
        raise AttnResArgumentError(
            f"kimi aux_tap: capture_id must be a non-negative int (vLLM capture id: "
            f"what layer k reads), got {capture_id!r}"
        )
    if x.dim() < 1:
        raise AttnResArgumentError(
            "kimi aux_tap: x must be a hidden-state tensor [..., H], got a 0-D tensor"
        )


def aux_tap(x: torch.Tensor, capture_id: int) -> torch.Tensor:
    validate_tap(x, capture_id)
    return x.clone()


def _aux_tap_fake(x, capture_id):
    validate_tap(x, capture_id)
    return torch.empty_like(x)


class _TapFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, keyset, x, capture_id):
        return below_autograd(op, keyset, (x, capture_id))

    @staticmethod
    def backward(ctx, grad):
        return None, None, grad, None


aux_tap_op = register(aux_tap, fake=_aux_tap_fake, any_device=True,
                      record=_TapFunction.apply)
