"""Zero-gradient anchors: graph inputs a fused site stops reading keep their gradient.

A plain-torch mixture may read a tensor the fused op does not need: a bias on the logits
(``Linear(H, 1)`` with bias) shifts every source's logit by the same amount and the
softmax ignores it. After fusion nothing reads such an input; under autograd its ``.grad``
would be None where plain torch gives a tensor (0 up to rounding), and optimizers skip a
parameter whose grad is None (no step, no weight decay). ``keep_gradients`` feeds each
such input into the fused op's pseudo-query as ``qk + 0 * sum(x)``: its gradient is
exactly 0, the values are unchanged, and a NaN or inf in it still poisons the site's
output as it did before fusion. Only inputs that require grad are anchored, so inference
graphs (nothing requires grad) are left as they are.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from kimi_passes.fx.base import logger
from kimi_passes.fx.fx_toolkit import call_function, dtype_of
from kimi_passes.ops.attn_res_args import MixArgs, MixListArgs

aten = torch.ops.aten
kimi = torch.ops.kimi

#: Node meta key on graph inputs: does the input require grad (set by ``training.trace``;
#: fake values traced below autograd do not keep the flag).
REQUIRES_GRAD = "requires_grad"
#: The fused ops and the position of their pseudo-query argument (from the ops' records).
_QUERY_ARG: dict[object, int] = {
    op: record._fields.index("qk_weight")
    for op, record in ((kimi.attn_res_mix.default, MixArgs),
                       (kimi.attn_res_mix_list.default, MixListArgs))}


def requires_grad(node: Node) -> bool:
    """``REQUIRES_GRAD`` of a graph input; False where it is not set."""
    return bool(node.meta.get(REQUIRES_GRAD))


def leaf_inputs(region) -> set[Node]:
    """Graph inputs requiring grad that the nodes of ``region`` read, directly or through
    chains of single-input ops (views, transposes, casts)."""
    inside = set(region)
    found = set()
    for n in region:
        for a in n.all_input_nodes:
            if a in inside:
                continue
            while a.op == "call_function" and len(a.all_input_nodes) == 1:
                a = a.all_input_nodes[0]
            if a.op == "placeholder" and requires_grad(a):
                found.add(a)
    return found


def keep_gradients(graph: Graph, sites: list[tuple[Node, set[Node]]]) -> None:
    """Anchor each input that lost every reader onto the first fused op whose site read it.

    ``sites``: (fused op node, ``leaf_inputs`` of its replaced region). Call after dead-code
    elimination.
    """
    for x in sorted({x for _, xs in sites for x in xs if not x.users}):
        node = next(n for n, xs in sites if x in xs)
        i = _QUERY_ARG.get(node.target)
        if i is None:
            logger.warning("kimi_passes: input %s lost its readers to fused node %s and cannot "
                           "be anchored: its gradient is None instead of 0", x.name, node.name)
            continue
        qk = node.args[i]
        zero = call_function(graph, aten.mul.Tensor,
                             (call_function(graph, aten.sum.default, (x,), before=node), 0.0),
                             before=node)
        if dtype_of(zero) != dtype_of(qk):
            zero = call_function(graph, aten._to_copy.default, (zero,),
                                 {"dtype": dtype_of(qk)}, before=node)
        node.update_arg(i, call_function(graph, aten.add.Tensor, (qk, zero), before=node))
