"""Reading AttnRes calls out of a post-grad FX graph.

In the functional post-grad graph a mutating ``kimi.attn_res`` call is an
``auto_functionalized`` (v1) or ``auto_functionalized_v2`` node. ``AttnResCall``
hides the difference: it names the call's prefix, delta, blocks, weights and
int arguments, and where its outputs (the op's return, then the mutated bases)
are read. Copies such as ``clone`` are seen through by ``root``.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import torch
from torch._higher_order_ops.auto_functionalize import (
    auto_functionalized,
    auto_functionalized_v2,
)
from torch.fx import Node

aten = torch.ops.aten
kimi = torch.ops.kimi

ATTN_RES_OPS = (kimi.attn_res.default, kimi.attn_res_capture.default)
AUX_TAP = kimi.aux_tap.default
ATTN_RES_MIX = kimi.attn_res_mix.default

# Ops that hand on the same values (a copy or a view of the whole tensor).
_COPIES = (aten.clone.default, aten.alias.default, aten.detach.default)

# Module path of a decoder layer: "layers.3", "layers['3']" or "layers[3]".
_LAYER_PATH = re.compile(r"layers(?:\.|\[['\"]?)(\d+)")

_MUTATED = ("prefix", "blocks")


def root(node):
    """Follow copies back to the value they copy."""
    while isinstance(node, Node) and node.op == "call_function" and node.target in _COPIES:
        node = node.args[0]
    return node


def layer_index(node: Node) -> int | None:
    """The decoder layer a node was traced in (from Dynamo's nn_module_stack), if any."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, *_ in reversed(list(stack.values())):
        found = _LAYER_PATH.findall(str(path))
        if found:
            return int(found[-1])
    return None


@dataclass
class AttnResCall:
    """One functionalized ``kimi.attn_res`` / ``attn_res_capture`` call."""

    node: Node

    @property
    def op(self):
        return self.node.args[0]

    @property
    def is_v2(self) -> bool:
        return self.node.target is auto_functionalized_v2

    def arg(self, name: str):
        if name in _MUTATED:
            return self.base(name)
        return self.node.kwargs.get(name)

    def base(self, name: str) -> Node:
        """The value passed as mutated argument ``name`` (prefix or blocks)."""
        if self.is_v2:
            return self.node.kwargs["_all_bases"][self.node.kwargs[f"_{name}_base_index"]]
        return self.node.kwargs[name]

    @property
    def num_returns(self) -> int:
        return 2 if self.op is kimi.attn_res_capture.default else 1

    def output_index(self, name: str) -> int:
        """getitem index of a mutated base's new value."""
        if self.is_v2:
            return self.num_returns + self.node.kwargs[f"_{name}_base_index"]
        return self.num_returns + _MUTATED.index(name)

    @property
    def layer(self) -> int | None:
        return layer_index(self.node)

    @property
    def has_output_norm(self) -> bool:
        return self.node.kwargs.get("output_norm_weight") is not None

    def getitem(self, index: int) -> Node:
        """The existing ``getitem(node, index)`` user, or a new one right after the call."""
        for user in self.node.users:
            if user.target is operator.getitem and user.args[1] == index:
                return user
        with self.node.graph.inserting_after(self.node):
            item = self.node.graph.call_function(operator.getitem, (self.node, index))
        item.meta["val"] = self.node.meta["val"][index]
        return item

    def describe(self) -> str:
        where = "output aggregation" if self.layer is None else f"layer {self.layer}"
        return (
            f"{where} {self.op.name()}(num_blocks={self.arg('num_blocks')}, "
            f"block_write_idx={self.arg('block_write_idx')})"
        )


def attn_res_calls(graph: torch.fx.Graph) -> list[AttnResCall]:
    """Every functionalized AttnRes call, in graph order."""
    return [
        AttnResCall(n)
        for n in graph.nodes
        if n.op == "call_function"
        and n.target in (auto_functionalized, auto_functionalized_v2)
        and n.args
        and n.args[0] in ATTN_RES_OPS
    ]


def mix_nodes(graph: torch.fx.Graph) -> list[Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is ATTN_RES_MIX]


_CASTS = (torch.ops.prims.convert_element_type.default, aten._to_copy.default)
_WIDTH = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def _dtype(node):
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _sum_operands(node: Node) -> list | None:
    """The operands ``[x, y]`` of a sum ``node`` computes in its own dtype, or None.

    A plain ``add(x, y)``; or that sum done wider and rounded once into ``node``'s dtype,
    as ``prefix.copy_(prefix.float() + delta.float())`` functionalizes for a bf16 prefix:
    ``copy(dst, add(convert(x, f32), convert(y, f32)))`` or ``convert(add(..), bf16)``.
    Both give ``round(x + y)``, what a bf16 ``add(x, y)`` computes (in fp32, rounded once).
    """
    if node.op != "call_function":
        return None
    if node.target is aten.add.Tensor and not node.kwargs:
        return [root(x) for x in node.args]
    if node.target is aten.copy.default and _dtype(node.args[0]) == _dtype(node):
        wide = node.args[1]
    elif node.target in _CASTS:
        wide = node.args[0]
    else:
        return None
    if not (isinstance(wide, Node) and wide.target is aten.add.Tensor and not wide.kwargs):
        return None
    narrow = _dtype(node)
    operands = []
    for x in wide.args:
        if not (isinstance(x, Node) and x.target in _CASTS and isinstance(x.args[0], Node)):
            return None
        base = x.args[0]
        if _dtype(base) != narrow or _WIDTH.get(_dtype(x), 0) <= _WIDTH.get(narrow, 9):
            return None
        operands.append(root(base))
    return operands


def _same_sum(a, b) -> bool:
    """True when ``a`` and ``b`` compute the same ``x + y`` from the same operands."""
    if not (isinstance(a, Node) and isinstance(b, Node)):
        return False
    if a is b:
        return True
    ra, rb = _sum_operands(a), _sum_operands(b)
    if ra is None or rb is None:
        return False
    return ra == rb or ra == rb[::-1]


def reads_value(call: AttnResCall, value) -> bool:
    """Does ``call`` mix against ``value`` (its prefix after the optional delta)?"""
    prefix, delta = root(call.base("prefix")), root(call.arg("delta"))
    value = root(value)
    if delta is None:
        return prefix is value or _same_sum(prefix, value)
    if value.op == "call_function" and value.target is aten.add.Tensor and not value.kwargs:
        a, b = (root(x) for x in value.args)
        return (a is prefix and b is delta) or (b is prefix and a is delta)
    return False


def find_consumers(graph: torch.fx.Graph, value, calls=None, mixes=None) -> list:
    """AttnRes calls (``AttnResCall``) or ``attn_res_mix`` nodes that mix against ``value``.

    ``calls`` / ``mixes``: the graph's calls and mix nodes when the caller already has
    them (a pass looking up many taps scans the graph once, not once per tap).
    """
    calls = attn_res_calls(graph) if calls is None else calls
    mixes = mix_nodes(graph) if mixes is None else mixes
    found: list = [c for c in calls if reads_value(c, value)]
    found += [m for m in mixes if _same_sum(root(m.args[0]), root(value))]
    return found
