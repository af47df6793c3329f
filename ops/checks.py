"""What the op modules' argument checks share: the error, the dtypes, the ``grad`` check.

Each op's own checks live beside its registration (``attn_res_ops.py``, ``mix.py``,
``mix_list.py``, ``aux_tap.py``); every path of an op (eager, Triton, fake) runs them, so
a malformed model fails when it is compiled, not when it is served.
"""

from __future__ import annotations

from typing import NoReturn

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class AttnResArgumentError(ValueError):
    """An AttnRes op was called with arguments that break its contract."""


def fail(msg: str) -> NoReturn:
    """Refuse a call: ``msg`` names the op, the argument at fault and what to pass."""
    raise AttnResArgumentError(msg)


def check_grad(op: str, grad, like) -> None:
    """``grad`` (dL/d(output) of op ``op``) must match the forward output ``like``."""
    if grad.shape != like.shape or grad.device != like.device:
        raise AttnResArgumentError(
            f"kimi {op}: grad has shape {tuple(grad.shape)} on {grad.device} but the forward "
            f"output has shape {tuple(like.shape)} on {like.device}; pass dL/d(output)")
    if grad.dtype not in SUPPORTED_DTYPES:
        raise AttnResArgumentError(
            f"kimi {op}: grad dtype {grad.dtype} is not one of float32, bfloat16, float16")
