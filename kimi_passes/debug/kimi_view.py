"""``graph_text(graph, view="kimi")``: what the passes guarantee, in words that survive torch.

The golden files print this view. It holds every kimi call with its arguments, and
what the graph returns (the taps among it), and nothing else: the unrelated ops around
them (attention, MLP) are counted, ordered and decomposed differently by each torch
release, so they are not printed, not even as a count. Each argument is named by what
produces it::

    k0: f32[5, 16] = kimi.attn_res_capture(prefix=aten.embedding(embed_tokens.weight, x),
        delta=None, blocks=aten.full([5, 2, 16], 0), norm_weight=layers.0.attn_norm.weight,
        qk_weight=view(layers.0.attn_proj.weight), ...) [functional, mutates prefix, blocks]
    k1: f32[5, 16] = kimi.attn_res(prefix=aten.mm(...), delta=None, blocks=k0.updated.blocks, ...)
    return (..., k0.ret[1], k1.ret[0])

- a graph input by its name (``layers.0.attn_norm.weight``, ``x``, a symbol ``s0``);
- another kimi call's output by that call (``k0.ret[1]``, ``k0.updated.blocks``, ``k2``);
- a view of either (any chain of reshapes, permutes, selects, slices, clones) as
  ``view(...)`` of it, and a dtype conversion as ``to(bf16, ...)``;
- any other op by its name, its tensor arguments written ``...`` unless they are graph
  inputs (``aten.embedding(embed_tokens.weight, x)``, ``aten.mm(...)``); only positional
  arguments, no keyword (device, layout, dtype).

Kimi calls are numbered ``k0, k1, ...`` in graph order: their order is the data flow
through the bank and the prefix, which the rewrite fixes, not Inductor.
"""

from __future__ import annotations

import operator
from typing import Any, cast

import torch
from torch.fx import Graph, Node

from kimi_passes.debug.graph_names import op_name
from kimi_passes.fx.functionalized import FunctionalCall, mutated_args
from kimi_passes.fx.fx_toolkit import AUTO_FUNCTIONALIZED, CASTS, kimi_op

#: Ops that show the same values under another shape (printed ``view(...)``).
VIEWS = frozenset({
    "view", "reshape", "_unsafe_view", "squeeze", "unsqueeze", "expand", "permute", "t",
    "transpose", "select", "slice", "alias", "clone", "contiguous", "as_strided",
    "detach", "flatten", "unflatten",
})


class KimiView:
    """Prints one graph's kimi view; ``printer`` (graph_text's) names inputs and literals."""

    def __init__(self, graph: Graph, printer):
        self.p = printer
        self.graph = graph
        self.kimi = [n for n in graph.nodes if kimi_op(n) is not None]
        self.names = {n: f"k{i}" for i, n in enumerate(self.kimi)}

    def text(self) -> str:
        lines = [self._call_line(n) for n in self.kimi]
        for node in self.graph.nodes:
            if node.op == "output":
                lines.append(f"return {self._returns(node.args[0])}")
        return "\n".join(lines) + "\n"

    # -- lines --------------------------------------------------------------------------------
    def _call_line(self, node: Node) -> str:
        op = kimi_op(node)
        val = node.meta.get("val")
        if node.target in AUTO_FUNCTIONALIZED:
            parts = []
            for a in FunctionalCall(node).arguments():
                text = self.describe(a.value)
                parts.append(f"{a.name}={f'view({text})' if a.strided_view else text}")
            call = f"{op_name(op)}({', '.join(parts)}) [{functional_how(op)}]"
        else:
            args = [self.describe(a) for a in node.args]
            args += [f"{k}={self.describe(v)}" for k, v in node.kwargs.items()]
            call = f"{op_name(op)}({', '.join(args)})"
        first = val[0] if isinstance(val, (tuple, list)) and val else val
        t = self.p.type_of_value(first)
        return f"{self.names[node]}: {t} = {call}" if t else f"{self.names[node]} = {call}"

    def _returns(self, out) -> str:
        if isinstance(out, (list, tuple)):
            inner = ", ".join(self._returns(x) for x in out)
            if isinstance(out, list):
                return f"[{inner}]"
            return f"({inner},)" if len(out) == 1 else f"({inner})"
        text, computed = self._describe(out)
        return "..." if computed else text  # the model's own outputs: not kimi values

    # -- producers ------------------------------------------------------------------------------
    def describe(self, a) -> str:
        """What produces argument ``a`` (see the module docstring)."""
        return self._describe(a)[0]

    def _describe(self, a) -> tuple[str, bool]:
        """(text, whether ``a`` is computed by a non-kimi op rather than an input or a kimi
        output, through views and casts)."""
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self.describe(x) for x in a)
            return (f"[{inner}]" if isinstance(a, list) else f"({inner})"), False
        if not isinstance(a, Node):
            return self.p.fmt(a), False
        if a.op == "placeholder":
            return self.p.ref(a), False
        if a in self.names:
            return self.names[a], False
        if a.op == "call_function" and a.target is operator.getitem and a.args[0] in self.names:
            base, index = cast("tuple[Node, Any]", a.args)  # getitem(base, index)
            if base.target in AUTO_FUNCTIONALIZED:
                return f"{self.names[base]}.{functional_output(base, index)}", False
            return f"{self.names[base]}[{index}]", False
        if a.op == "call_function" and a.target in CASTS:
            dtype = a.args[1] if len(a.args) > 1 else a.kwargs.get("dtype")
            inner, computed = self._describe(a.args[0])
            return f"to({self.p.fmt_dtype(dtype)}, {inner})", computed
        if _view_source(a) is not None:
            # A chain of views is one ``view(...)``; of a computed value, the value's op
            # (releases insert and drop reshapes around computations).
            inner, computed = self._describe(_base(a))
            return (inner, True) if computed else (f"view({inner})", False)
        return self._compute(a), True

    def _compute(self, node: Node) -> str:
        if node.op != "call_function":
            return "..."
        return f"{_packet_name(node.target)}({', '.join(self._leaf(x) for x in node.args)})"

    def _leaf(self, x) -> str:
        """An argument of a non-kimi op: inputs, sizes and literals; other tensors ``...``."""
        if isinstance(x, (list, tuple)):
            inner = ", ".join(self._leaf(y) for y in x)
            return f"[{inner}]" if isinstance(x, list) else f"({inner})"
        if not isinstance(x, Node):
            return self.p.fmt(x)
        if x.op == "placeholder":
            return self.p.ref(x)
        val = x.meta.get("val")
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return self.p.fmt(val)
        return "..."


def _base(node: Node) -> Node:
    """The first node under a chain of views that is not a view."""
    while (source := _view_source(node)) is not None:
        node = source
    return node


def _view_source(node: Node) -> Node | None:
    """The tensor a view-like call reads, or None when ``node`` is not one."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node):
        return None
    packet = getattr(node.target, "_overloadpacket", None)
    return node.args[0] if getattr(packet, "__name__", "") in VIEWS else None


def _packet_name(target) -> str:
    """``aten.mm``, ``aten.full``: the op without its overload (which torch releases move)."""
    packet = getattr(target, "_overloadpacket", None)
    if isinstance(target, torch._ops.OpOverload) and packet is not None:
        return f"{target.namespace}.{packet.__name__}"
    return op_name(target)


def functional_how(op) -> str:
    """``functional, mutates prefix, blocks``: the bracket both views print after the call."""
    mutated = mutated_args(op)
    return f"functional, mutates {', '.join(mutated)}" if mutated else "functional"


def functional_output(node: Node, index: int) -> str:
    """What ``getitem(node, index)`` of an auto_functionalized(_v2) node reads: ``ret[i]``,
    ``updated.<argument>`` (v2, one base viewed by several: ``updated.<a>/<b>``)."""
    call = FunctionalCall(node)
    if index < call.num_returns:
        return f"ret[{index}]"
    names = call.updated(index)
    return f"updated.{'/'.join(names)}" if names else f"out[{index}]"
