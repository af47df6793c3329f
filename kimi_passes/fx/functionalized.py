"""An ``auto_functionalized`` (v1) / ``auto_functionalized_v2`` node, decoded once.

Functionalization wraps a call to a mutating op ``op`` in a node
``auto_functionalized(op, **kwargs)`` (v1) or ``auto_functionalized_v2(op, **kwargs)`` (v2),
whose ``getitem`` users read the op's own outputs, then the new values of what it writes.
``FunctionalCall`` reads both spellings as torch writes them
(torch/_higher_order_ops/auto_functionalize.py):

- v1: every schema argument is a keyword, the mutated ones as passed. Outputs: the op's
  returns (one slot, None, for an op returning nothing), then one new value per mutated
  argument in schema order.
- v2: a mutated argument is not a keyword. Its base is ``_all_bases[_<name>_base_index]``
  (two arguments viewing one tensor share a base; index None: None was passed) and the
  view of it that was passed is given by ``_<name>_alias`` (the whole base), or
  ``_<name>_slice_dim/_start/_end``, or ``_<name>_size/_stride/_storage_offset``
  (``as_strided``), or nothing (the base itself). Outputs: the op's returns as in v1, then
  one new value per base, in ``_all_bases`` order.

``_only_clone_these_tensors`` (v1) / ``_only_clone_these_bases`` (v2), which Inductor's
reinplacing adds, say which inputs are copied before the op writes them: not what is
passed, so no argument here. A mutated ``Tensor[]`` argument (v2's ``_<name>_length``) is
refused by name: no op the passes read has one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2
from torch.fx import Node

from kimi_passes.fx.fx_toolkit import AUTO_FUNCTIONALIZED

#: v2's keywords that say which view of its base a mutated argument is.
VIEW_KEYS = ("alias", "slice_dim", "slice_start", "slice_end", "size", "stride",
             "storage_offset")
#: Those of an ``as_strided`` view (any layout; a slice or an alias keeps the base's strides).
STRIDED_KEYS = ("size", "stride", "storage_offset")


@functools.cache
def mutated_args(op: torch._ops.OpOverload) -> tuple[str, ...]:
    """The names of the arguments ``op`` writes, in schema order (read once per op: every
    ``arg``, ``output_index`` and ``updated`` of every call asks)."""
    return tuple(a.name for a in op._schema.arguments
                 if a.alias_info is not None and a.alias_info.is_write)


@dataclass(frozen=True)
class Argument:
    """One schema argument of the wrapped call. ``value``: what was passed; for a mutated
    argument under v2, its base (``view`` then says which view of it was passed)."""

    name: str
    value: object
    mutated: bool
    view: dict[str, Any]

    @property
    def strided_view(self) -> bool:
        """Was an ``as_strided`` view of the base passed (v2: size, stride or offset given)?"""
        return any(self.view.get(k) is not None for k in STRIDED_KEYS)


@dataclass
class FunctionalCall:
    """``node``, an ``auto_functionalized(_v2)`` node, read as a call to ``op``.

    Every read goes to ``node`` (nothing is cached): a pass may edit its keywords.
    """

    node: Node

    def __post_init__(self) -> None:
        if self.node.target not in AUTO_FUNCTIONALIZED:
            raise TypeError(f"FunctionalCall: {self.node.format_node()} is no "
                            "auto_functionalized(_v2) node; pass one of those")

    @property
    def op(self) -> torch._ops.OpOverload:
        return cast("torch._ops.OpOverload", self.node.args[0])

    @property
    def is_v2(self) -> bool:
        return self.node.target is auto_functionalized_v2

    @property
    def mutated(self) -> tuple[str, ...]:
        return mutated_args(self.op)

    @property
    def num_returns(self) -> int:
        """The outputs before the new values: the op's returns, at least one slot."""
        return max(1, len(self.op._schema.returns))

    def _base_index(self, name: str) -> int | None:
        kwargs = self.node.kwargs
        if f"_{name}_length" in kwargs:
            raise NotImplementedError(
                f"{self.node.name}: {self.op.name()} mutates the tensor list {name!r}; "
                "FunctionalCall decodes mutated Tensor arguments only: extend it for lists")
        return cast("int | None", kwargs[f"_{name}_base_index"])

    def base(self, name: str):
        """The value of mutated argument ``name``: v1 the tensor passed, v2 its base."""
        if not self.is_v2:
            return self.node.kwargs[name]
        index = self._base_index(name)
        return None if index is None else cast(list, self.node.kwargs["_all_bases"])[index]

    def view(self, name: str) -> dict[str, Any]:
        """v2's keywords for which view of its base mutated argument ``name`` is (``VIEW_KEYS``
        without the ``_name_`` prefix); empty under v1 and for the base itself."""
        if not self.is_v2:
            return {}
        return {k: self.node.kwargs[f"_{name}_{k}"] for k in VIEW_KEYS
                if f"_{name}_{k}" in self.node.kwargs}

    def arg(self, name: str):
        """Argument ``name`` (a mutated one as ``base`` gives it); None if not given."""
        if name in self.mutated:
            return self.base(name)
        return self.node.kwargs.get(name)

    def arguments(self) -> list[Argument]:
        """The schema's arguments given to the call, in schema order."""
        mutated = self.mutated
        out = []
        for a in self.op._schema.arguments:
            if a.name in mutated:
                out.append(Argument(a.name, self.base(a.name), True, self.view(a.name)))
            elif a.name in self.node.kwargs:
                out.append(Argument(a.name, self.node.kwargs[a.name], False, {}))
        return out

    def output_index(self, name: str) -> int | None:
        """The ``getitem`` index of mutated argument ``name``'s new value (None: v2 was
        passed None for it, so there is none)."""
        if not self.is_v2:
            return self.num_returns + self.mutated.index(name)
        index = self._base_index(name)
        return None if index is None else self.num_returns + index

    def updated(self, index: int) -> tuple[str, ...]:
        """The mutated arguments whose new value ``getitem(node, index)`` is (v2: every
        argument viewing that base); empty for the op's own returns."""
        return tuple(m for m in self.mutated if self.output_index(m) == index)
