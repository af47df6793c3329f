"""The argument records of the ``kimi`` op family: one ``NamedTuple`` per argument list.

- ``AttnResArgs``: ``kimi::attn_res`` / ``attn_res_capture`` (ten arguments);
- ``MixArgs``: ``kimi::attn_res_mix`` (six), the pure pre-norm mixture: ``attn_res`` with
  no delta, no block write and no output norm (``PURE_MIXTURE``). ``AttnResArgs.mix``
  takes ``MixArgs``' fields and builds that form of ``AttnResArgs``, which the checks,
  the CPU path and the Triton launch take; ``MixArgs.part_of`` goes the other way;
- ``MixListArgs``: ``kimi::attn_res_mix_list`` (a list of sources, no bank);
- ``MixBackwardArgs`` / ``MixListBackwardArgs``: the two backward ops: ``grad``, then the
  forward's fields (the list's but ``out_dtype``: ``grad`` has the output's dtype), then
  which gradients to compute. Their fields are built from the forward's records.

Each argument is spelled here only. The ops' schemas are inferred from these records
(``record_signature``: ``torch.library`` reads an op's schema off its function's
signature), and every other function of the family (fake, CPU and CUDA kernels, checks,
autograd, the reference and differentiable statements, the lowering's statements) takes
or builds the record, so the order, the names, the types and the defaults live in one
place. The registered schemas are pinned in tests/test_ops.py: reordering the fields is
an ABI change, seen there.

A ``NamedTuple``: built for every eager call, it costs one tuple, and ``*record`` gives
the op's positional arguments back. The tensor fields come first in every record
(``tensors``).
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
    """``kimi::attn_res``'s arguments in schema order (docs/design.md section 3).

    ``AttnResArgs.mix(prefix, blocks, norm_weight, qk_weight, num_blocks, eps)`` (positional
    or by name: ``MixArgs``' fields) is ``kimi::attn_res_mix``'s call in this form; it is
    generated from the two records, below."""

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

    @property
    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The tensor arguments (the first six fields; None where absent)."""
        return self[:6]


#: ``AttnResArgs``' fields that ``MixArgs`` lacks, at the values that make ``attn_res`` the
#: pure mixture: no delta, no block write, no output norm.
PURE_MIXTURE = {"delta": None, "output_norm_weight": None, "block_write_idx": -1,
                "output_norm_eps": 0.0}


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


def _fields(record, drop=()) -> list[tuple[str, object]]:
    """``record``'s ``(name, type)`` pairs in order, but the fields named in ``drop``."""
    hints = typing.get_type_hints(record)
    return [(name, hints[name]) for name in record._fields if name not in drop]


def _backward_fields(forward, needs, drop=()) -> list[tuple[str, object]]:
    """A backward op's fields: ``grad`` (dL/d(forward output)), ``forward``'s fields but
    ``drop``, then the bool flags ``needs`` (which gradients to compute)."""
    return [("grad", torch.Tensor), *_fields(forward, drop), *((n, bool) for n in needs)]


def _take(record, source, **changes):
    """A ``record`` whose fields are ``source``'s fields of the same names, or ``changes``."""
    unknown = set(changes).difference(record._fields)
    if unknown:
        raise TypeError(f"{record.__name__} has no field(s) {sorted(unknown)}")
    return record(**{name: changes[name] if name in changes else getattr(source, name)
                     for name in record._fields})


#: Where ``MixBackwardArgs`` holds the forward's arguments (after ``grad``).
_MIX_SPAN = slice(1, 1 + len(MixArgs._fields))


class MixBackwardArgs(NamedTuple("MixBackwardArgs", _backward_fields(
        MixArgs, ("need_prefix", "need_blocks", "need_weights")))):
    """``kimi::attn_res_mix_backward``'s arguments in schema order: ``grad`` ``[T, H]``, the
    forward's (``MixArgs``), and ``need_prefix``, ``need_blocks``, ``need_weights`` (the
    gradient of ``norm_weight * qk_weight``)."""

    __slots__ = ()

    @classmethod
    def of(cls, grad: torch.Tensor, forward: MixArgs, **needs: bool) -> MixBackwardArgs:
        """The backward's arguments for the forward call ``forward``; ``needs`` by name."""
        return cls(grad, *forward, **needs)

    @property
    def forward(self) -> MixArgs:
        """The forward call's arguments."""
        return MixArgs._make(self[_MIX_SPAN])

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensor arguments: ``grad`` and the forward's (the first five fields)."""
        return self[:5]


class MixListBackwardArgs(NamedTuple("MixListBackwardArgs", _backward_fields(
        MixListArgs, ("need_sources", "need_weights"), drop=("out_dtype",)))):
    """``kimi::attn_res_mix_list_backward``'s arguments in schema order: ``grad`` (the
    sources' shape), the forward's (``MixListArgs``) but ``out_dtype``, and
    ``need_sources``, ``need_weights`` (the gradient of ``norm_weight * qk_weight``)."""

    __slots__ = ()

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


def _pure_mixture_form():
    """``AttnResArgs.mix``: a classmethod taking ``MixArgs``' fields (by position or by
    name) that returns the ``AttnResArgs`` of the pure mixture (``PURE_MIXTURE``) in one
    tuple. Its source is generated from the two records' fields, as ``namedtuple``
    generates its ``__new__``: an eager ``attn_res_mix`` call builds this record only, not
    a ``MixArgs`` first."""
    hints, mix_hints = typing.get_type_hints(AttnResArgs), typing.get_type_hints(MixArgs)
    if (set(mix_hints) | set(PURE_MIXTURE) != set(hints) or set(mix_hints) & set(PURE_MIXTURE)
            or any(hints[name] != hint for name, hint in mix_hints.items())):
        raise TypeError("MixArgs' fields must be AttnResArgs' fields but PURE_MIXTURE's, "
                        "with the same types")
    value = {name: name for name in MixArgs._fields}
    value.update((name, repr(v)) for name, v in PURE_MIXTURE.items())
    source = (f"def mix(cls, {', '.join(MixArgs._fields)}):\n"
              f"    return cls({', '.join(value[name] for name in AttnResArgs._fields)})\n")
    namespace: dict = {}
    exec(source, namespace)  # the text above: field names and PURE_MIXTURE's reprs
    mix = namespace["mix"]
    mix.__qualname__ = "AttnResArgs.mix"
    mix.__module__ = __name__
    mix.__doc__ = ("``kimi::attn_res_mix``'s arguments (``MixArgs``' fields) as the "
                   "pure-mixture form of the record (``PURE_MIXTURE``).")
    return classmethod(mix)


AttnResArgs.mix = _pure_mixture_form()


def record_signature(record, returns):
    """Decorate a ``*args`` op function with ``record``'s fields as its signature.

    ``torch.library`` infers the schema from ``inspect.signature`` of the function, which
    reads ``__signature__``: the schema then takes the record's names, types, order and
    defaults.
    """
    hints, defaults = typing.get_type_hints(record), record._field_defaults
    signature = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=hints[name],
                           default=defaults.get(name, inspect.Parameter.empty))
         for name in record._fields], return_annotation=returns)

    def decorate(fn):
        fn.__signature__ = signature
        return fn

    return decorate
