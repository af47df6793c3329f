"""The argument records of the ``kimi`` op family: one ``NamedTuple`` per argument list.

- ``AttnResArgs``: ``kimi::attn_res`` / ``attn_res_capture`` (ten arguments);
- ``MixArgs``: ``kimi::attn_res_mix`` (six), the pure pre-norm mixture: ``attn_res`` with
  no delta, no block write and no output norm (``PURE_MIXTURE``). ``AttnResArgs.mix``
  takes ``MixArgs``' fields and builds that form of ``AttnResArgs``, which the checks,
  the CPU path and the Triton launch take; ``MixArgs.part_of`` goes the other way;
- ``AttnResQuantArgs``: ``kimi::attn_res_quant`` / ``attn_res_quant_capture``: an
  ``AttnResArgs`` (``base``), then the per-token FP8 quant's fields; the op's flat
  argument list is ``base``'s ten then those (``from_args`` / ``to_args``);
- ``MixListArgs``: ``kimi::attn_res_mix_list`` (a list of sources, no bank);
- ``MixBackwardArgs`` / ``MixListBackwardArgs``: the two backward ops: ``grad``, then the
  forward's fields (the list's but ``out_dtype``: ``grad`` has the output's dtype), then
  which gradients to compute. Where records overlap they agree, checked at import.

Each argument is spelled here only. The ops' schemas are inferred from these records
(``record_signature``, ``schema_fields``), and every other function of the family
(kernels, checks, autograd, reference, the lowering's statements, the vLLM route) takes
or builds the record. The schemas are pinned in tests/test_ops.py: reordering the
fields is an ABI change, seen there. A ``NamedTuple``: built for every eager call, it
costs one tuple; ``*record`` (``to_args()`` for the quant's) gives the op's positional
arguments back. The tensor fields come first in every record (``tensors``).
"""

from __future__ import annotations

import inspect
import typing
from typing import NamedTuple

import torch


class MixArgs(NamedTuple):
    """``kimi::attn_res_mix``'s arguments in schema order (docs/design.md section 3)."""

    prefix: torch.Tensor  # [T, H], the last source
    blocks: torch.Tensor  # [T, NB, H]
    norm_weight: torch.Tensor  # [H]
    qk_weight: torch.Tensor  # [H]
    num_blocks: int  # slots mixed: blocks[:, :num_blocks], then prefix
    eps: float

    @classmethod
    def part_of(cls, a: AttnResArgs, **changes) -> MixArgs:
        """The mixture's arguments within ``kimi::attn_res``'s record ``a``, with the
        fields named in ``changes`` replaced."""
        return _take(cls, a, **changes)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensor arguments (the first four fields)."""
        return self[:4]


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
        """``kimi::attn_res_mix``'s arguments (``MixArgs``' fields) as the pure-mixture form
        of this record (``PURE_MIXTURE``), in one tuple: the eager mix call builds only it."""
        return cls(prefix, None, blocks, norm_weight, qk_weight, None, num_blocks, -1, eps, 0.0)

    @property
    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The tensor arguments (the first six fields; None where absent)."""
        return self[:6]


#: ``AttnResArgs``' fields that ``MixArgs`` lacks, at the values that make ``attn_res`` the
#: pure mixture: no delta, no block write, no output norm.
PURE_MIXTURE = {"delta": None, "output_norm_weight": None, "block_write_idx": -1,
                "output_norm_eps": 0.0}


class AttnResQuantArgs(NamedTuple):
    """``kimi::attn_res_quant`` / ``attn_res_quant_capture``'s arguments: ``kimi::attn_res``'s
    record ``base``, then the per-token FP8 quant's fields, in schema order (the op takes
    them flat: ``from_args`` / ``to_args``; docs/design.md, "FP8 output quant").

    The defaults are vLLM's AMD K3 kernel's quant (``scale = max(amax, 1e-10) * (1 / qmax)``);
    ``amax_floor=0.0, scale_floor=1 / (qmax * 512), divide=True`` (and ``scale_ub``) are
    vLLM's ``QuantFP8`` per-token native form (``scale = max(amax / qmax, floor)``), and
    with ``divide_values=True`` vLLM's CUDA op ``_C::dynamic_per_token_scaled_fp8_quant``.
    """

    base: AttnResArgs  # the unquantized call: kimi::attn_res's ten arguments
    quant_dtype: torch.dtype  # torch.float8_e4m3fn or torch.float8_e4m3fnuz
    quant_max: float = 0.0  # the fp8 bound; 0: 448 (e4m3fn) or 224 (e4m3fnuz), vLLM's
    amax_floor: float = 1e-10  # amax = max(amax, amax_floor), before the division
    scale_floor: float = 0.0  # scale = max(scale, scale_floor), after it
    divide: bool = False  # scale = amax / qmax (True) or amax * (1 / qmax) (False)
    scale_ub: torch.Tensor | None = None  # [1] fp32: amax = min(amax, scale_ub) first
    divide_values: bool = False  # data = y / scale (True) or y * (1 / scale) (False)

    @classmethod
    def from_args(cls, *args, **kwargs) -> AttnResQuantArgs:
        """The record of the op's flat arguments (positional in schema order, or by name)."""
        n = len(AttnResArgs._fields)
        if not kwargs:  # the dispatcher's form: every kernel call
            return cls(AttnResArgs._make(args[:n]), *args[n:])
        base = {k: kwargs.pop(k) for k in AttnResArgs._fields if k in kwargs}
        return cls(AttnResArgs(*args[:n], **base), *args[n:], **kwargs)

    def to_args(self) -> tuple:
        """The op's flat positional arguments, in schema order."""
        return (*self.base, *self[1:])

    @property
    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The tensor arguments of the mixture (``base.tensors``); ``scale_ub`` is apart
        (fp32, whatever the sources' dtype)."""
        return self.base.tensors


class MixListArgs(NamedTuple):
    """``kimi::attn_res_mix_list``'s arguments in schema order (``ops/mix_list.py``)."""

    sources: list[torch.Tensor]  # N >= 1 tensors of one shape [*, H], in mixing order
    norm_weight: torch.Tensor | None  # [H]; None: RMSNorm without a weight
    qk_weight: torch.Tensor  # [H]
    eps: float
    out_dtype: torch.dtype | None = None  # None: the sources' dtype

    @property
    def tensors(self) -> tuple[list[torch.Tensor] | torch.Tensor | None, ...]:
        """The tensor arguments (the first three fields)."""
        return self[:3]


def _take(record, source, **changes):
    """A ``record`` whose fields are ``source``'s fields of the same names, or ``changes``."""
    unknown = set(changes).difference(record._fields)
    if unknown:
        raise TypeError(f"{record.__name__} has no field(s) {sorted(unknown)}")
    return record(**{name: changes[name] if name in changes else getattr(source, name)
                     for name in record._fields})


class MixBackwardArgs(NamedTuple):
    """``kimi::attn_res_mix_backward``'s arguments in schema order: ``grad`` ``[T, H]``, the
    forward's (``MixArgs``' fields, in its order), then which gradients to compute."""

    grad: torch.Tensor
    prefix: torch.Tensor
    blocks: torch.Tensor
    norm_weight: torch.Tensor
    qk_weight: torch.Tensor
    num_blocks: int
    eps: float
    need_prefix: bool
    need_blocks: bool
    need_weights: bool  # the gradient of norm_weight * qk_weight

    @classmethod
    def of(cls, grad: torch.Tensor, forward: MixArgs, **needs: bool) -> MixBackwardArgs:
        """The backward's arguments for the forward call ``forward``; ``needs`` by name."""
        return _take(cls, forward, grad=grad, **needs)

    @property
    def forward(self) -> MixArgs:
        """The forward call's arguments."""
        return MixArgs._make(self[1:1 + len(MixArgs._fields)])

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensor arguments: ``grad`` and the forward's (the first five fields)."""
        return self[:5]


class MixListBackwardArgs(NamedTuple):
    """``kimi::attn_res_mix_list_backward``'s arguments in schema order: ``grad`` (the
    sources' shape), the forward's (``MixListArgs``' fields but ``out_dtype``: ``grad`` has
    the output's dtype), then which gradients to compute."""

    grad: torch.Tensor
    sources: list[torch.Tensor]
    norm_weight: torch.Tensor | None
    qk_weight: torch.Tensor
    eps: float
    need_sources: bool
    need_weights: bool  # the gradient of norm_weight * qk_weight

    @classmethod
    def of(cls, grad: torch.Tensor, forward: MixListArgs,
           **needs: bool) -> MixListBackwardArgs:
        """The backward's arguments for the forward call ``forward``; ``needs`` by name."""
        return _take(cls, forward, grad=grad, **needs)

    @property
    def forward(self) -> MixListArgs:
        """The forward call's arguments, its output dtype ``grad``'s."""
        return _take(MixListArgs, self, out_dtype=self.grad.dtype)

    @property
    def tensors(self) -> tuple[torch.Tensor | list[torch.Tensor] | None, ...]:
        """The tensor arguments: ``grad`` and the forward's (the first four fields)."""
        return self[:4]


def schema_fields(record) -> list[inspect.Parameter]:
    """The op arguments ``record`` stands for, in schema order, with their types and
    defaults: its fields, a field that holds a record (``AttnResQuantArgs.base``) spelled
    out as that record's."""
    hints, defaults = typing.get_type_hints(record), record._field_defaults
    params: list[inspect.Parameter] = []
    for name in record._fields:
        if hasattr(hints[name], "_fields"):  # a nested record
            params += schema_fields(hints[name])
            continue
        params.append(inspect.Parameter(
            name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=hints[name],
            default=defaults.get(name, inspect.Parameter.empty)))
    return params


def _check_records() -> None:
    """The records agree where they overlap: a backward holds its forward's fields in the
    forward's order and types, and ``MixArgs`` is ``AttnResArgs`` but ``PURE_MIXTURE``."""
    def fields(record, drop=()):
        return [(p.name, p.annotation) for p in schema_fields(record) if p.name not in drop]

    pairs = [(fields(MixBackwardArgs)[1:1 + len(MixArgs._fields)], fields(MixArgs)),
             (fields(MixListBackwardArgs)[1:5], fields(MixListArgs, drop=("out_dtype",))),
             (fields(AttnResArgs, drop=tuple(PURE_MIXTURE)), fields(MixArgs))]
    for got, want in pairs:
        if got != want:
            raise TypeError(f"ops/attn_res_args.py: records disagree: {got} != {want}")


_check_records()


def record_signature(record, returns):
    """Decorate a ``*args`` op function with ``record``'s fields (``schema_fields``) as its
    signature.

    ``torch.library`` infers the schema from ``inspect.signature`` of the function, which
    reads ``__signature__``: the schema then takes the record's names, types, order and
    defaults.
    """
    signature = inspect.Signature(schema_fields(record), return_annotation=returns)

    def decorate(fn):
        fn.__signature__ = signature
        return fn

    return decorate
