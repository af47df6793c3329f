"""Trace a lowering statement in a fake mode of its own, never in the graph's.

A post-grad graph's ``meta["val"]`` tensors belong to the fake mode of the compile that
made it; in a Dynamo compile that is Dynamo's, whose ``ShapeEnv`` becomes the frame's
guards (``produce_guards``). A symbol or guard the lowering left there would be one more
guard of the user's frame, and a symbol no input of the frame binds fails Dynamo's
``produce_guards`` (``sources must not be empty for symbol sN``). So the statement is
traced on mirrors of the inputs in a private ``FakeTensorMode`` with a ``ShapeEnv`` of
its own:

- each symbol of the inputs' sizes and strides gets one private symbol (same hint, same
  value range, never duck-sized or specialized to 0/1), and each size is the same
  expression over the private symbols;
- after the trace, the private ``ShapeEnv`` must hold only those symbols (no unbacked
  one, no runtime assert), and each guard it recorded, read over the graph's symbols,
  must already be implied by the graph's ``ShapeEnv`` (ranges, replacements, guards):
  then the traced ATen graph is valid wherever the graph is, and nothing is added;
  otherwise ``TraceRefused`` says which guard or symbol, and the call stays the op;
- the traced nodes' values come back as fake tensors of the graph's mode, built from
  sizes over the graph's own symbols (no op runs in the graph's mode).

The graph's ``ShapeEnv`` is only read: ``LowerKimiOps`` checks that after every call.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv


class TraceRefused(Exception):
    """The statement's trace would need a fact about sizes the graph does not have."""


class PrivateTrace:
    """Mirrors of the graph's fake values in a private fake mode, and back (module doc)."""

    def __init__(self, ambient: FakeTensorMode | None):
        self.ambient = ambient
        self.ambient_env = ambient.shape_env if ambient is not None else None
        self.env = ShapeEnv() if self.ambient_env is not None else None
        self.mode = FakeTensorMode(shape_env=self.env)
        self._to_private: dict[sympy.Symbol, sympy.Symbol] = {}
        self._to_ambient: dict[sympy.Symbol, sympy.Symbol] = {}

    # -- graph -> private ----------------------------------------------------------
    def mirror(self, value: Any) -> Any:
        """``value`` (a fake tensor, SymInt, or a structure of them) in the private mode."""
        return pytree.tree_map(self._mirror_leaf, value)

    def _mirror_leaf(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            size = [self._private_int(d) for d in x.shape]
            stride = [self._private_int(d) for d in x.stride()]
            with self.mode:
                return torch.empty_strided(size, stride, dtype=x.dtype, device=x.device)
        if isinstance(x, torch.SymInt):
            return self._private_int(x)
        if isinstance(x, (torch.SymFloat, torch.SymBool)):
            raise TraceRefused(f"a symbolic {type(x).__name__} argument ({x})")
        return x

    def _private_int(self, d: int | torch.SymInt) -> int | torch.SymInt:
        if not isinstance(d, torch.SymInt):
            return d
        expr = d.node.expr
        if expr.is_number:
            return int(expr)
        assert self.env is not None and self.ambient_env is not None  # a SymInt has an env
        for s in expr.free_symbols:
            if s not in self._to_private:
                hint = self.ambient_env.backed_var_to_val.get(s)
                if hint is None:
                    raise TraceRefused(f"size {expr} has no hint (unbacked symbol {s})")
                p = self.env.create_symbol(
                    int(hint), ConstantSource(f"kimi_lowering_{s}"),
                    dynamic_dim=DimDynamic.DYNAMIC, do_not_specialize_zero_one=True)
                assert isinstance(p, sympy.Symbol), p  # DYNAMIC, never specialized
                vr = self.ambient_env.var_to_range.get(s)
                if vr is not None:
                    self.env.constrain_symbol_range(p, vr.lower, vr.upper)
                self._to_private[s], self._to_ambient[p] = p, s
        private = expr.xreplace(self._to_private)
        return self.env.create_symintnode(private, hint=int(expr.xreplace(
            self.ambient_env.backed_var_to_val)))

    # -- the trace's facts --------------------------------------------------------
    def check(self) -> None:
        """Raise ``TraceRefused`` unless the trace needed no fact the graph lacks."""
        if self.env is None:
            return
        assert self.ambient_env is not None
        extra = set(self.env.backed_var_to_val) - set(self._to_ambient)
        extra |= set(self.env.var_to_range) - set(self._to_ambient)
        if extra:
            raise TraceRefused(f"the trace created symbols {sorted(map(str, extra))}")
        if any(self.env.deferred_runtime_asserts.values()):
            raise TraceRefused("the trace recorded runtime asserts")
        for guard in self.env.guards:
            expr = guard.expr.xreplace(self._to_ambient)
            if self.ambient_env._maybe_evaluate_static(expr) != sympy.true:
                raise TraceRefused(f"the trace assumed {expr}, which the graph does not "
                                   "guarantee")

    # -- private -> graph ---------------------------------------------------------
    def to_ambient(self, value: Any) -> Any:
        """A traced node's ``meta["val"]`` as a value of the graph's fake mode."""
        return pytree.tree_map(self._ambient_leaf, value)

    def _ambient_leaf(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            size = [self._ambient_int(d) for d in x.shape]
            stride = [self._ambient_int(d) for d in x.stride()]
            if self.ambient is None:
                return torch.empty_strided(size, stride, dtype=x.dtype, device="meta")
            with self.ambient:
                return torch.empty_strided(size, stride, dtype=x.dtype, device=x.device)
        if isinstance(x, torch.SymInt):
            return self._ambient_int(x)
        return x

    def _ambient_int(self, d: int | torch.SymInt) -> int | torch.SymInt:
        if not isinstance(d, torch.SymInt):
            return d
        expr = d.node.expr.xreplace(self._to_ambient)
        if expr.is_number:
            return int(expr)
        assert self.ambient_env is not None
        return self.ambient_env.create_symintnode(
            expr, hint=int(expr.xreplace(self.ambient_env.backed_var_to_val)))
