"""How the golden printer names things: graph inputs, call targets, dynamic symbols.

Names must survive torch upgrades, so none comes from a node's own (generated) name:
inputs are named from Dynamo's source (``layers.0.weight``, ``x``), targets by their
namespace and op name, and sympy symbols are renumbered in order of first use.
"""

from __future__ import annotations

import re
from typing import cast

import torch
from torch.fx import GraphModule, Node


def input_names(gm: GraphModule) -> dict[int, str]:
    """Names for a Dynamo graph's inputs, by position: parameter names, ``x``, symbols.

    ``L['self']._modules['layers']._modules['0']._parameters['weight']`` becomes
    ``layers.0.weight``; ``L['x']`` becomes ``x``. Inputs with no Dynamo source
    are left out (``graph_text`` then names them ``in<i>``).
    """
    names = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        name = source_name(node)
        if name is not None:
            names[i] = name
    return names


def source_name(node: Node) -> str | None:
    """The name Dynamo's source gives a placeholder (``layers.0.weight``, ``x``), if any."""
    arg = node.meta.get("grapharg")
    source = getattr(arg, "source", None)
    if source is None:
        return None
    text = source.name() if callable(source.name) else source.name
    return name_from_source(str(text))


def name_from_source(text: str) -> str | None:
    """``L['self']._modules['layers']...['weight']`` -> ``layers.0.weight``; None for symbols."""
    m = re.match(r"^[LG]\[['\"]([^'\"]+)['\"]\](.*)$", text)
    if m is None:
        return None
    head, rest = m.groups()
    if "(" in rest:  # e.g. L['x'].size()[0]: a symbol, named by the printer
        return None
    parts = re.findall(r"\[['\"]?([^'\"\]]+)['\"]?\]", rest)
    if head == "self" and parts:
        return ".".join(parts)
    return ".".join([head, *parts])


def op_name(target) -> str:
    """A call target as the printer writes it: ``aten.mm``, ``kimi.attn_res``, ``operator.mul``."""
    if isinstance(target, torch._ops.OpOverload):
        name = f"{target.namespace}.{target._opname}"
        return name if target._overloadname == "default" else f"{name}.{target._overloadname}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    module = {"_operator": "operator", "builtins": ""}.get(module, module)
    name = cast(str, getattr(target, "__qualname__", None)  # a function's or class's name
                or getattr(target, "__name__", repr(target)))
    return f"{module}.{name}" if module else name


def _first_use(text: str, name: str) -> int:
    m = re.search(rf"\b{re.escape(name)}\b", text)
    return m.start() if m else len(text)


class Symbols:
    """Renames sympy symbols in order of first use: s0, s1, ... (u0, ... for unbacked)."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}
        self.counts: dict[str, int] = {}

    def expr(self, e) -> str:
        import sympy

        e = getattr(getattr(e, "node", None), "expr", e)  # SymInt -> sympy expression
        if not isinstance(e, sympy.Basic):
            return str(e)
        text = str(e)
        syms = sorted(e.free_symbols, key=lambda s: (_first_use(text, str(s)), str(s)))
        mapping = {s: sympy.Symbol(self._name(str(s)), **s.assumptions0) for s in syms}
        return str(e.xreplace(mapping))

    def _name(self, old: str) -> str:
        if old not in self.names:
            prefix = old[0] if old[:1].isalpha() else "s"
            i = self.counts.get(prefix, 0)
            self.counts[prefix] = i + 1
            self.names[old] = f"{prefix}{i}"
        return self.names[old]
