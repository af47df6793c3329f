"""``LowerKimiOps``: on CPU, every kimi op of a post-grad graph becomes generated code.

Invariant after the pass: no ``kimi.attn_res`` / ``attn_res_capture`` (bare or inside
``auto_functionalized`` v1/v2), ``attn_res_mix``, ``attn_res_mix_list`` or
``attn_res_mix_backward`` call on a CPU tensor of the ops' dtypes is left; each is
replaced by its ATen statement (``decompositions.py``), which Inductor compiles into C++
loops fused with its neighbours, with no Python op dispatch. CUDA calls stay the Triton
kernels. A call the pass cannot lower (a mutated argument that is a view of another
tensor, under ``auto_functionalized_v2``; fp64) stays the op, and the log says so.

Before (one K3 layer)::

    af = auto_functionalized(kimi.attn_res, prefix=p, delta=d, blocks=bank, ...)
    out, p2, bank2 = af[0], af[1], af[2]

After::

    x = add(p, d); ...per-source logits, exp, weighted sum...; out = mul(...)
    bank2 = select_scatter(bank, x, 1, w)      # after the last read of bank
    (out, x, bank2 replace af[0], af[1], af[2])

It runs last, after every other kimi pass has seen the kimi ops (the aux-stream rewrite
and the fusion find their consumers by them; the goldens record the graph before it).
"""

from __future__ import annotations

import functools
import operator

import torch
from torch._inductor.pattern_matcher import fwd_only
from torch.fx import Graph, Node

from kimi_passes.lowering import decompositions as dec
from kimi_passes.passes.base import KimiGraphPass
from kimi_passes.passes.fx_toolkit import call_function
from kimi_passes.taps.consumer import AttnResCall, attn_res_calls

kimi = torch.ops.kimi
MUTATED = ("prefix", "blocks")


class LowerKimiOps(KimiGraphPass):
    """Replace CPU kimi op calls with their ATen statements (see the module docstring)."""

    #: Counts of the last run: lowered calls, and calls left as ops (with why).
    last_lowered: int = 0
    last_kept: list[str] = []

    def run(self, graph: Graph) -> list[str]:
        lowered, kept = 0, []
        for call in attn_res_calls(graph):
            why = _why_not(call)
            if why:
                kept.append(f"{call.node.name}: {why}")
                continue
            _lower_attn_res(graph, call)
            lowered += 1
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in (
                    kimi.attn_res_mix.default, kimi.attn_res_mix_list.default,
                    kimi.attn_res_mix_backward.default):
                continue
            if not _on_cpu(node) or not _supported(node):
                continue
            if node.target is kimi.attn_res_mix_backward.default:
                _lower_mix_backward(graph, node)
            else:
                _lower_mix(graph, node)
            lowered += 1
        _drop_self_copies(graph)
        graph.eliminate_dead_code()
        self.last_lowered, self.last_kept = lowered, kept
        if not lowered and not kept:
            return []
        return [f"LowerKimiOps: {lowered} kimi call(s) lowered to generated code"
                + (f"; kept as ops: {'; '.join(kept)}" if kept else "")]


def _drop_self_copies(graph: Graph) -> None:
    """Erase ``copy_(x, x)``: a bank the call did not write comes back as the bank itself,
    and functionalization's copy-back of it becomes a self-copy (Inductor mis-schedules one)."""
    for node in list(graph.nodes):
        if (node.op == "call_function" and node.target is torch.ops.aten.copy_.default
                and node.args[0] is node.args[1] and not node.users):
            graph.erase_node(node)


#: The dtypes the statements are written for (fp32 accumulation); fp64 (the tests'
#: gradcheck) stays the op.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _supported(node: Node) -> bool:
    first = node.args[0]
    first = first[0] if isinstance(first, (list, tuple)) else first
    val = first.meta.get("val") if isinstance(first, Node) else None
    return isinstance(val, torch.Tensor) and val.dtype in DTYPES


def _on_cpu(node: Node) -> bool:
    val = node.meta.get("val")
    val = val[0] if isinstance(val, (tuple, list)) else val
    return isinstance(val, torch.Tensor) and val.device.type == "cpu"


def _why_not(call: AttnResCall) -> str | None:
    prefix = call.base("prefix")
    val = prefix.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.device.type != "cpu":
        return "not on CPU"  # CUDA keeps the Triton kernel
    if val.dtype not in DTYPES:
        return f"dtype {val.dtype}"
    if call.is_v2:
        view = [n for n in MUTATED if any(f"_{n}_{k}" in call.node.kwargs and
                                         call.node.kwargs[f"_{n}_{k}"] is not None
                                         for k in ("size", "stride", "storage_offset"))]
        if view:
            return f"mutates a view of another tensor ({', '.join(view)})"
    return None


def _inline(graph: Graph, anchor: Node, fn, inputs: list[Node]) -> list:
    """Trace ``fn(*inputs' values)`` to ATen and insert it before ``anchor``; its outputs."""
    vals = [n.meta["val"] for n in inputs]
    mode = torch._guards.detect_fake_mode(vals)
    with mode if mode is not None else torch._subclasses.FakeTensorMode():
        traced = fwd_only(fn, vals)
    env: dict[Node, object] = {}
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, inputs, strict=True))
    outputs = None
    for n in traced.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            outputs = torch.fx.map_arg(n.args[0], env.__getitem__)
            break
        env[n] = call_function(graph, n.target, torch.fx.map_arg(n.args, env.__getitem__),
                               torch.fx.map_arg(n.kwargs, env.__getitem__),
                               before=anchor, stands_for=anchor)
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def _closed(fn, layout: list[int | None], **const):
    """``fn`` over the present tensors only (``layout``: where each argument comes from)."""

    def call(*tensors):
        return fn(*[None if i is None else tensors[i] for i in layout], **const)

    return call


def _pack(args: list) -> tuple[list[Node], list[int | None]]:
    inputs, layout = [], []
    for a in args:
        if a is None:
            layout.append(None)
        else:
            layout.append(len(inputs))
            inputs.append(a)
    return inputs, layout


def _lower_attn_res(graph: Graph, call: AttnResCall) -> None:
    capture = call.op is kimi.attn_res_capture.default
    args = [call.base("prefix"), call.arg("delta"), call.base("blocks"),
            call.arg("norm_weight"), call.arg("qk_weight"), call.arg("output_norm_weight")]
    inputs, layout = _pack(args)
    fn = _closed(dec.attn_res, layout, num_blocks=call.arg("num_blocks"),
                 block_write_idx=call.arg("block_write_idx"), eps=call.arg("eps"),
                 output_norm_eps=call.arg("output_norm_eps"), capture=capture)
    outs = _inline(graph, call.node, fn, inputs)
    returns = outs[:call.num_returns]
    new = {i: v for i, v in enumerate(returns)}
    new.update({call.output_index(name): outs[call.num_returns + k]
                for k, name in enumerate(MUTATED)})
    for user in list(call.node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(new[user.args[1]])
            graph.erase_node(user)
    if call.node.users:
        raise AssertionError(f"LowerKimiOps: {call.node.name} has users other than getitem")
    graph.erase_node(call.node)


def _lower_mix(graph: Graph, node: Node) -> None:
    if node.target is kimi.attn_res_mix.default:
        prefix, blocks, nw, qk, num_blocks, eps = node.args
        inputs, layout = _pack([prefix, blocks, nw, qk])
        fn = _closed(dec.attn_res_mix, layout, num_blocks=num_blocks, eps=eps)
    else:
        sources, nw, qk, eps, *rest = node.args
        out_dtype = rest[0] if rest else node.kwargs.get("out_dtype")
        n = len(sources)
        inputs, layout = _pack([*sources, nw, qk])
        fn = _closed(functools.partial(_mix_list_flat, n), layout, eps=eps,
                     out_dtype=out_dtype)
    (out,) = _inline(graph, node, fn, inputs)
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _lower_mix_backward(graph: Graph, node: Node) -> None:
    grad, prefix, blocks, nw, qk, num_blocks, eps, need_p, need_b, need_w = node.args
    fn = _closed(dec.attn_res_mix_backward, [0, 1, 2, 3, 4], num_blocks=num_blocks, eps=eps,
                 need_prefix=need_p, need_blocks=need_b, need_weights=need_w)
    outs = _inline(graph, node, fn, [grad, prefix, blocks, nw, qk])
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outs[user.args[1]])
            graph.erase_node(user)
    if node.users:
        raise AssertionError(f"LowerKimiOps: {node.name} has users other than getitem")
    graph.erase_node(node)


def _mix_list_flat(n, *args, eps, out_dtype):
    return dec.attn_res_mix_list(list(args[:n]), args[n], args[n + 1], eps=eps,
                                 out_dtype=out_dtype)
