"""The kimi calls of a post-grad FX graph, as every pass reads them.

In the functional post-grad graph a mutating ``kimi.attn_res`` call is an
``auto_functionalized`` (v1) or ``auto_functionalized_v2`` node. ``AttnResCall``, a
``FunctionalCall`` (``functionalized.py`` decodes both spellings), names the call's prefix,
delta, blocks, weights and int arguments, and where its outputs (the op's return, then the
mutated bases) are read. ``layer_index`` names the decoder layer a node was traced in;
``on_cpu`` and ``has_cpu_kimi_call`` tell where kimi calls run. The aux-stream rewrite, the
fusion, the lowering and the backend read calls through this module only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import cast

import torch
from torch.fx import Node

from kimi_passes.fx.functionalized import FunctionalCall
from kimi_passes.fx.fx_toolkit import (
    arg_int,
    arg_node,
    calls_to,
    functional_calls,
    getitem,
    kimi_op,
)

kimi = torch.ops.kimi

ATTN_RES_OPS = (kimi.attn_res.default, kimi.attn_res_capture.default)
#: The quantizing forms (``kimi.attn_res_quant`` / ``attn_res_quant_capture``): the same
#: arguments and effects, ``(data, scale[, mixed])`` returned. Kept apart from
#: ``ATTN_RES_OPS``: the tap and fusion passes read only the unquantized ops.
ATTN_RES_QUANT_OPS = (kimi.attn_res_quant.default, kimi.attn_res_quant_capture.default)
AUX_TAP = kimi.aux_tap.default
ATTN_RES_MIX = kimi.attn_res_mix.default

# Module path of a decoder layer: "layers.3", "layers['3']" or "layers[3]"; Dynamo also
# spells a module reached through its __dict__ "...['_modules']['layers'].3".
_LAYER_PATH = re.compile(r"layers(?:['\"]\])?(?:\.|\[['\"]?)(\d+)")


def layer_index(node: Node) -> int | None:
    """The decoder layer a node was traced in (from Dynamo's nn_module_stack), if any."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, *_ in reversed(list(stack.values())):
        found = _LAYER_PATH.findall(str(path))
        if found:
            return int(found[-1])
    return None


@dataclass
class AttnResCall(FunctionalCall):
    """One functionalized ``kimi.attn_res`` / ``attn_res_capture`` call (or one of its
    quantizing forms, ``ATTN_RES_QUANT_OPS``); its arguments and outputs as
    ``FunctionalCall`` decodes them."""

    def base(self, name: str) -> Node:
        """The value passed as mutated argument ``name`` (prefix or blocks; v2: its base)."""
        return cast(Node, super().base(name))

    def output_index(self, name: str) -> int:
        """getitem index of a mutated base's new value."""
        index = super().output_index(name)
        if index is None:  # the schema's prefix and blocks are Tensors, never None
            raise ValueError(f"{self.node.name}: no new value of {name!r} (None was passed)")
        return index

    @property
    def layer(self) -> int | None:
        return layer_index(self.node)

    @property
    def has_output_norm(self) -> bool:
        return self.node.kwargs.get("output_norm_weight") is not None

    def getitem(self, index: int) -> Node:
        """The existing ``getitem(node, index)`` user, or a new one right after the call."""
        return getitem(self.node, index)

    def describe(self) -> str:
        where = "output aggregation" if self.layer is None else f"layer {self.layer}"
        return (
            f"{where} {self.op.name()}(num_blocks={self.arg('num_blocks')}, "
            f"block_write_idx={self.arg('block_write_idx')})"
        )


def attn_res_quant_calls(graph: torch.fx.Graph) -> list[AttnResCall]:
    """Every functionalized ``kimi.attn_res_quant`` / ``attn_res_quant_capture`` call."""
    return [AttnResCall(n) for n in functional_calls(graph, ATTN_RES_QUANT_OPS)]


def tap_args(tap: Node) -> tuple[Node, int]:
    """A ``kimi.aux_tap`` node's tapped value and capture id."""
    return arg_node(tap, 0), arg_int(tap, 1)


def attn_res_calls(graph: torch.fx.Graph) -> list[AttnResCall]:
    """Every functionalized AttnRes call, in graph order."""
    return [AttnResCall(n) for n in functional_calls(graph, ATTN_RES_OPS)]


def mix_nodes(graph: torch.fx.Graph) -> list[Node]:
    """Every ``kimi.attn_res_mix`` node, in graph order."""
    return calls_to(graph, ATTN_RES_MIX)


def on_cpu(node: Node) -> bool:
    """Does the kimi call ``node`` (bare or functionalized) run on CPU tensors?"""
    for arg in node.all_input_nodes:
        val = arg.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device.type == "cpu"
    return False


def has_cpu_kimi_call(graph: torch.fx.Graph) -> bool:
    """Does ``graph`` call a kimi op (a marker aside) on CPU tensors?"""
    return any(kimi_op(n) not in (None, AUX_TAP) and on_cpu(n) for n in graph.nodes)
