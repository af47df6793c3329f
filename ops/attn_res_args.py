"""``AttnResArgs``: the arguments of ``kimi::attn_res`` / ``attn_res_capture``, as one record.

The ten arguments are spelled here only. The two mutating ops' schemas are inferred from
this record (``record_signature``: ``torch.library.custom_op`` reads an op's schema off its
function's signature), and every other function of the op family (fake and CUDA kernels,
checks, CPU path, Triton launches, the differentiable and reference statements) passes the
record, so the order, the names and the types live in one place. The registered schemas
are pinned in tests/test_ops.py: reordering the fields is an ABI change, seen there.
``kimi::attn_res_mix`` is the same computation with no delta, no block write and no output
norm: ``AttnResArgs.mix``.

A ``NamedTuple``: built for every eager call, it costs one tuple, and ``*record`` gives
the op's positional arguments back.
"""

from __future__ import annotations

import inspect
import typing
from typing import NamedTuple

import torch


class AttnResArgs(NamedTuple):
    """``kimi::attn_res``'s arguments in schema order (docs/design.md section 3)."""

    prefix: torch.Tensor  # [T, H], updated in place by delta
    delta: torch.Tensor | None  # [T, H]
    blocks: torch.Tensor  # [T, NB, H], slot block_write_idx written in place
    norm_weight: torch.Tensor  # [H]
    qk_weight: torch.Tensor  # [H]
    output_norm_weight: torch.Tensor | None  # [H]
    num_blocks: int  # slots mixed: blocks[:, :num_blocks], then prefix
    block_write_idx: int  # -1: no write
    eps: float
    output_norm_eps: float

    @classmethod
    def mix(cls, prefix, blocks, norm_weight, qk_weight, num_blocks, eps) -> AttnResArgs:
        """``kimi::attn_res_mix``'s arguments as the pure-mixture form of the record."""
        return cls(prefix, None, blocks, norm_weight, qk_weight, None, num_blocks, -1, eps, 0.0)

    @property
    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The tensor arguments (the first six fields; None where absent)."""
        return self[:6]


def record_signature(returns):
    """Decorate a ``*args`` op function with ``AttnResArgs``' fields as its signature.

    ``torch.library.custom_op`` infers the schema from ``inspect.signature`` of the function,
    which reads ``__signature__``: the schema then takes the record's names, types and order.
    """
    fields = typing.get_type_hints(AttnResArgs)
    signature = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=hint)
         for name, hint in fields.items()], return_annotation=returns)

    def decorate(fn):
        fn.__signature__ = signature
        return fn

    return decorate
