"""``LowerKimiOps``: on CPU, every kimi op of a post-grad graph becomes generated code.

Invariant after the pass: no ``kimi.attn_res`` / ``attn_res_capture`` /
``attn_res_quant`` / ``attn_res_quant_capture`` (bare or inside ``auto_functionalized``
v1/v2), ``attn_res_mix``, ``attn_res_mix_list`` or their ``_backward`` call on a CPU
tensor of the ops' dtypes is left; each is replaced by its ATen statement
(``decompositions.py``), which Inductor compiles into C++ loops fused with its
neighbours. CUDA calls stay the Triton kernels. A call the pass cannot lower (a mutated
view under ``auto_functionalized_v2``; fp64) stays the op, and the log says so; under
Inductor's ``fallback_by_default`` every call stays (there is no code to fuse into).

Before (one K3 layer)::

    af = auto_functionalized(kimi.attn_res, prefix=p, delta=d, blocks=bank, ...)
    out, p2, bank2 = af[0], af[1], af[2]

After::

    x = add(p, d); ...per-source logits, exp, weighted sum...; out = mul(...)
    bank2 = select_scatter(bank, x, 1, w)      # after the last read of bank
    (out, x, bank2 replace af[0], af[1], af[2])

It runs last: the other kimi passes find their sites by the kimi ops, and the goldens
record the graph before it. docs/design.md section 9.
"""

from __future__ import annotations

import operator
from typing import Any, cast

import torch
import torch.utils._pytree as pytree
from torch.fx import Graph, Node

from kimi_passes.fx.base import KimiGraphPass
from kimi_passes.fx.fx_toolkit import call_function
from kimi_passes.fx.kimi_calls import AttnResCall, attn_res_calls, attn_res_quant_calls
from kimi_passes.lowering import decompositions as dec
from kimi_passes.lowering.private_trace import PrivateTrace, TraceRefused
from kimi_passes.ops.attn_res_args import AttnResArgs, AttnResQuantArgs, schema_fields
from kimi_passes.ops.conventions import MUTATED_ARGS as MUTATED

kimi = torch.ops.kimi
#: The dtypes the statements are written for (fp32 accumulation); fp64 (the tests'
#: gradcheck) stays the op.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Pure ops, lowered by ``_lower_pure``: op -> its statement, which takes the op's
#: arguments as the op does (and builds the op's record from them).
PURE = {
    kimi.attn_res_mix.default: dec.attn_res_mix,
    kimi.attn_res_mix_list.default: dec.attn_res_mix_list,
    kimi.attn_res_mix_backward.default: dec.attn_res_mix_backward,
    kimi.attn_res_mix_list_backward.default: dec.attn_res_mix_list_backward,
}
#: Pure ops with several outputs (read through ``getitem``).
MULTI_OUTPUT = (kimi.attn_res_mix_backward.default, kimi.attn_res_mix_list_backward.default)


class LowerKimiOps(KimiGraphPass):
    """Replace CPU kimi op calls with their ATen statements (see the module docstring)."""

    def __init__(self) -> None:
        #: Counts of the last run: lowered calls, and calls left as ops (with why).
        self.last_lowered = 0
        self.last_kept: list[str] = []

    def run(self, graph: Graph) -> list[str]:
        lowered, kept = 0, []
        if torch._inductor.config.fallback_by_default:
            # Every op becomes an ATen call: the statement (tens of ATen calls per site)
            # would cost more than the one op call, and no code is generated to fuse it into.
            self.last_lowered, self.last_kept = 0, ["all: Inductor's fallback_by_default"]
            return (["LowerKimiOps: kimi calls kept as ops (Inductor's fallback_by_default "
                     "generates no code)"] if _kimi_calls(graph) else [])
        before = _shape_env_state(graph)
        for call in attn_res_calls(graph) + attn_res_quant_calls(graph):
            why = _why_not(call.base("prefix"))
            if why is None and call.is_v2:
                why = _mutated_view(call)
            if why is None:
                try:
                    _lower_attn_res(graph, call)
                    lowered += 1
                    continue
                except TraceRefused as e:
                    why = str(e)
            kept.append(f"{call.node.name}: {why}")
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in PURE:
                continue
            first = pytree.tree_leaves(node.args[0])[0]
            if _why_not(first) is None:  # elsewhere (CUDA) the op's own kernel runs
                try:
                    _lower_pure(graph, node)
                    lowered += 1
                except TraceRefused as e:
                    kept.append(f"{node.name}: {e}")
        if _shape_env_state(graph) != before:
            raise AssertionError(
                f"LowerKimiOps changed the graph's ShapeEnv ({before} -> "
                f"{_shape_env_state(graph)}): a lowering statement must be traced in its "
                "own fake mode (lowering/private_trace.py); please report this graph")
        _drop_self_copies(graph)
        graph.eliminate_dead_code()
        self.last_lowered, self.last_kept = lowered, kept
        if not lowered and not kept:
            return []
        return [f"LowerKimiOps: {lowered} kimi call(s) lowered to generated code"
                + (f"; kept as ops: {'; '.join(kept)}" if kept else "")]


def _shape_env_state(graph: Graph) -> tuple:
    """What the graph's ``ShapeEnv`` holds that the lowering must never change: its
    symbols, guards, replacements and runtime asserts (counts and names)."""
    vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    mode = torch._guards.detect_fake_mode(vals)
    env = mode.shape_env if mode is not None else None
    if env is None:
        return ()
    return (sorted(map(str, env.var_to_range)), len(env.guards), len(env.replacements),
            sum(len(v) for v in env.deferred_runtime_asserts.values()))


def _kimi_calls(graph: Graph) -> bool:
    return bool(attn_res_calls(graph) or attn_res_quant_calls(graph)) or any(
        n.op == "call_function" and n.target in PURE for n in graph.nodes)


def _drop_self_copies(graph: Graph) -> None:
    """Erase ``copy_(x, x)``: a bank the call did not write comes back as the bank itself,
    and functionalization's copy-back of it would copy the whole bank onto itself."""
    for node in list(graph.nodes):
        if (node.op == "call_function" and node.target is torch.ops.aten.copy_.default
                and node.args[0] is node.args[1] and not node.users):
            graph.erase_node(node)


def _why_not(tensor: Node) -> str | None:
    """Why a call whose first tensor is ``tensor`` stays the op (None: it is lowered)."""
    val = tensor.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.device.type != "cpu":
        return "not on CPU"  # CUDA keeps the Triton kernel
    if val.dtype not in DTYPES:
        return f"dtype {val.dtype}"
    return None


def _mutated_view(call: AttnResCall) -> str | None:
    view = [a.name for a in call.arguments() if a.strided_view]
    return f"mutates a view of another tensor ({', '.join(view)})" if view else None


def _inline(graph: Graph, anchor: Node, fn, args, const: dict) -> list:
    """Trace ``fn(*args, **const)`` to ATen and insert it before ``anchor``; its outputs.

    ``args`` may nest lists and hold None (pytree): only its nodes are traced inputs. The
    trace runs in a fake mode of its own (``private_trace.py``): the graph's ``ShapeEnv``
    gets no symbol and no guard from it. ``TraceRefused``: the call stays the op.
    """
    leaves, spec = pytree.tree_flatten(args)
    inputs = [x for x in leaves if isinstance(x, Node)]

    def statement(*tensors):
        given = iter(tensors)
        filled = [next(given) if isinstance(x, Node) else x for x in leaves]
        return fn(*pytree.tree_unflatten(filled, spec), **const)

    # Imported here: Inductor's pattern matcher is a heavy import that only a compile needs
    # (``import kimi_passes`` stays light).
    from torch._inductor.pattern_matcher import fwd_only

    vals = [n.meta["val"] for n in inputs]
    trace = PrivateTrace(torch._guards.detect_fake_mode(vals))
    mirrored = [trace.mirror(v) for v in vals]
    # Nothing reads the compile's tracing context (its fake mode) during the trace.
    with torch._guards.tracing(torch._guards.TracingContext(trace.mode)), trace.mode:
        traced = fwd_only(statement, mirrored)
    trace.check()
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    env: dict[Node, Any] = dict(zip(placeholders, inputs, strict=True))
    for n in traced.graph.nodes:
        if n.op == "output":
            outputs = torch.fx.map_arg(n.args[0], env.__getitem__)
            return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        if n.op != "placeholder":
            env[n] = call_function(graph, n.target,
                                   torch.fx.map_arg(n.args, env.__getitem__),
                                   torch.fx.map_arg(n.kwargs, env.__getitem__),
                                   before=anchor, stands_for=anchor,
                                   val=trace.to_ambient(n.meta["val"]))
    raise AssertionError("LowerKimiOps: a traced statement without an output")


def _replace(graph: Graph, node: Node, outputs: dict) -> None:
    """Point every ``node[i]`` reader at ``outputs[i]`` (``node[i][k]`` at ``outputs[i][k]``
    where that is a list); erase ``node``."""
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            new = outputs[user.args[1]]
            if isinstance(new, list):
                _replace(graph, user, dict(enumerate(new)))
                continue
            user.replace_all_uses_with(new)
            graph.erase_node(user)
    if node.users:
        raise AssertionError(f"LowerKimiOps: {node.name} has users other than getitem")
    graph.erase_node(node)


def _constants(record) -> tuple[str, ...]:
    """The op's non-tensor arguments, read off its record: passed to its statement as
    constants."""
    tensors = (torch.Tensor, torch.Tensor | None)
    return tuple(p.name for p in schema_fields(record) if p.annotation not in tensors)


_CONSTS, _QUANT_CONSTS = _constants(AttnResArgs), _constants(AttnResQuantArgs)


def _lower_attn_res(graph: Graph, call: AttnResCall) -> None:
    args = (call.base("prefix"), call.arg("delta"), call.base("blocks"),
            call.arg("norm_weight"), call.arg("qk_weight"), call.arg("output_norm_weight"))
    if call.op in (kimi.attn_res_quant.default, kimi.attn_res_quant_capture.default):
        defaults = AttnResQuantArgs._field_defaults  # a default argument is not in kwargs
        const = {k: call.node.kwargs.get(k, defaults.get(k)) for k in _QUANT_CONSTS}
        const["capture"] = call.op is kimi.attn_res_quant_capture.default
        outs = _inline(graph, call.node, dec.attn_res_quant, (*args, call.arg("scale_ub")),
                       const)
    else:
        const = {k: call.arg(k) for k in _CONSTS}
        const["capture"] = call.op is kimi.attn_res_capture.default
        outs = _inline(graph, call.node, dec.attn_res, args, const)
    new = dict(enumerate(outs[:call.num_returns]))
    new.update({call.output_index(name): outs[call.num_returns + k]
                for k, name in enumerate(MUTATED)})
    _replace(graph, call.node, new)


def _lower_pure(graph: Graph, node: Node) -> None:
    fn = PURE[cast(torch._ops.OpOverload, node.target)]
    # The arguments' nodes (a list of sources included) are the statement's traced inputs.
    outs = _inline(graph, node, lambda args, kwargs: fn(*args, **kwargs),
                   (node.args, node.kwargs), {})
    if node.target in MULTI_OUTPUT:
        _replace(graph, node, dict(enumerate(outs)))
    else:
        node.replace_all_uses_with(outs[0])
        graph.erase_node(node)
