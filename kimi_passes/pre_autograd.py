"""Fusion before AOTAutograd: training graphs get a fused forward and a fused backward.

Invariant: when a compiled graph needs a backward, every AttnRes mixture the fusion pass
recognises is a ``kimi.attn_res_mix`` / ``attn_res_mix_list`` call *before* AOTAutograd
differentiates the graph. The forward graph then calls the kimi op and the backward graph
its registered backward (``kimi.attn_res_mix_backward`` / ``attn_res_mix_list_backward``,
ops/backward.py); neither holds the plain-torch mixture, its derivative, or the keys and
probabilities it would save. Fusing post-grad, as for inference, cannot do this:
AOTAutograd has by then written the backward from the plain-torch nodes, so the forward
would be fused and the backward would still recompute or load the stacked sources.

How: Dynamo's torch-level graph is traced to ATen with ``make_fx`` under Dynamo's fake
mode, functionalized, below autograd and with no decomposition table. Those are the ops
autograd sees when AOTAutograd traces the original graph (CompositeImplicitAutograd ops
such as ``einsum``, ``linear``, ``matmul`` and ``softmax.int`` decompose before autograd
either way), so every op outside a fused site is differentiated by the formula it would
have had; in-place updates become their functional forms (``copy_`` into a slice becomes
``slice_scatter``; a plain ``copy``, which has no derivative, becomes the cast and
broadcast of its source). The fusion pass rewrites that graph; ``compile_fx`` gets it in
place of Dynamo's.

    Dynamo graph (torch level)          traced, then fused (ATen)
    stack = torch.stack([x0, x1])       m = kimi.attn_res_mix_list([x0, x1], None, w, 1e-6)
    k = F.rms_norm(stack, (H,))         ... the rest of the graph, op for op
    p = einsum(k, w).softmax(0)
    h = einsum(p, stack)
    forward (post-grad):  attn_res_mix_list(...)
    backward (post-grad): attn_res_mix_list_backward(grad, [x0, x1], None, w, 1e-6, ...)

Refusals: the graph is compiled unfused (exactly what plain Inductor would compile, plus
the aux-stream pass) with a WARNING on logger ``kimi_passes`` naming the reason, when it
changes the grad mode (``make_fx`` would bake the mode into the trace and AOTAutograd would
then differentiate through a ``no_grad`` region), holds a higher-order op (their autograd
is not reproduced by tracing below it), or cannot be traced. Nothing in such a graph is
fused post-grad either: that would bring back the duplicate backward.
"""

from __future__ import annotations

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.func import functionalize
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx

from kimi_passes.fusion import AttnResFusionPass
from kimi_passes.fx_toolkit import call_function
from kimi_passes.grad_anchor import REQUIRES_GRAD
from kimi_passes.inductor_pass import logger

aten = torch.ops.aten

#: Calls in a Dynamo graph that change the grad mode for the ops after them.
_GRAD_MODE_CALLS = (torch._C._set_grad_enabled, torch.set_grad_enabled)


def needs_autograd(example_inputs) -> bool:
    """Will ``compile_fx`` compile a forward and a backward for these inputs?

    The same test as Inductor's: grad mode on and some input requires grad.
    """
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


def untraceable_reason(gm: GraphModule) -> str | None:
    """Why ``gm`` must not be traced below autograd before AOTAutograd, or None."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        t = node.target
        if t in _GRAD_MODE_CALLS:
            return (f"node {node.name} changes the grad mode inside the compiled region "
                    "(torch.no_grad / enable_grad)")
        if isinstance(t, torch._ops.HigherOrderOperator):
            return f"node {node.name} calls the higher-order op {t.name()}"
    return None


def _may_mix(gm: GraphModule) -> bool:
    """Does ``gm`` (or a subgraph of it) call anything softmax-like (a possible site)?"""
    return any("softmax" in str(n.target) or "exp" == getattr(n.target, "__name__", n.target)
               for m in gm.modules() if isinstance(m, GraphModule)
               for n in m.graph.nodes if n.op in ("call_function", "call_method"))


def _fake_inputs(example_inputs, fake_mode) -> list:
    """Fake inputs in ``fake_mode`` with the symbolic sizes Dynamo gave them (the way
    AOTAutograd fakeifies them: Dynamo's symbolic context per tensor); static otherwise."""
    context = torch._guards.TracingContext.try_get()
    known = context.tensor_to_context if context is not None else {}
    fakes = []
    for x in example_inputs:
        if isinstance(x, FakeTensor):
            fakes.append(x if x.fake_mode is fake_mode else fake_mode.from_tensor(x))
        elif isinstance(x, torch.Tensor):
            sym = known.get(x) if x in known else None
            if sym is not None:
                fakes.append(fake_mode.from_tensor(x, symbolic_context=sym,
                                                   source=sym.tensor_source, trace=False))
            else:
                fakes.append(fake_mode.from_tensor(x, static_shapes=True))
        else:
            fakes.append(x)  # ints and Dynamo's SymInts
    return fakes


def out_of_place(graph: torch.fx.Graph) -> None:
    """Rewrite in-place ops on intermediates nothing else reads (``add_`` in ``F.rms_norm``'s
    decomposition) as their out-of-place forms, so the fusion pass sees the functional ops
    it reads in post-grad graphs. Other mutations stay."""
    for node in list(graph.nodes):
        t = node.target
        if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
            continue
        name = t._schema.name.split("::")[-1]
        if not (t._schema.is_mutable and name.endswith("_") and node.args):
            continue
        x = node.args[0]
        if not (isinstance(x, torch.fx.Node) and x.op == "call_function" and len(x.users) == 1):
            continue
        packet = getattr(torch.ops.aten, name[:-1], None)
        functional = getattr(packet, t._overloadname, None) if packet is not None else None
        if functional is None:
            continue
        node.target = functional


def differentiable_copies(graph: torch.fx.Graph) -> None:
    """Replace functional ``aten.copy(dst, src)`` (no derivative) with what it computes:
    ``src`` itself when shape and dtype agree (so the tap and the fused op after an
    in-place update read one node), else ``src`` broadcast to ``dst``'s shape and cast to
    its dtype."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.copy.default:
            continue
        dst, src = node.args[:2]
        want, have = dst.meta["val"], src.meta["val"]
        new = src
        if tuple(have.shape) != tuple(want.shape):
            new = call_function(graph, aten.expand.default, (new, list(want.shape)),
                                before=node)
        if have.dtype != want.dtype or new is not src:
            new = call_function(graph, aten._to_copy.default, (new,), {"dtype": want.dtype},
                                before=node)
        node.replace_all_uses_with(new)
        graph.erase_node(node)


def mark_requires_grad(gm: GraphModule, example_inputs) -> None:
    """Set ``grad_anchor.REQUIRES_GRAD`` on each input node (the trace's fake values do not
    keep the flag)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, x in zip(placeholders, example_inputs, strict=False):
        node.meta[REQUIRES_GRAD] = isinstance(x, torch.Tensor) and x.requires_grad


def trace_to_aten(gm: GraphModule, example_inputs) -> GraphModule:
    """``gm`` as a functional ATen graph traced below autograd (no decompositions), same
    signature. Functional, so a fused op that reads a source reads the value the stacking
    read even when the model updates that tensor in place later (K3's prefix and block
    writes): its backward needs those values, and autograd refuses a saved tensor that was
    modified in place. Input mutations stay, as ``copy_`` at the end."""
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        raise RuntimeError("no fake mode found for the graph's inputs (not a Dynamo graph?)")
    fakes = _fake_inputs(example_inputs, fake_mode)
    with fake_mode, enable_python_dispatcher():
        return make_fx(functionalize(gm, remove="mutations"), pre_dispatch=False)(*fakes)


def fuse_before_autograd(gm: GraphModule, example_inputs, manager) -> GraphModule:
    """``gm`` traced to ATen with ``manager``'s passes run on it, or ``gm`` itself.

    ``gm`` itself (unfused; WARNING logged) when it must not or cannot be traced; the
    traced graph only when the passes fused something (an unfused trace would change
    nothing but the compile time).
    """
    reason = untraceable_reason(gm)
    if reason is None:
        try:
            traced = trace_to_aten(gm, example_inputs)
        except Exception as e:  # compile unfused, loudly: the numbers stay plain Inductor's
            reason = f"tracing it to ATen failed: {type(e).__name__}: {e}"
    if reason is not None:
        # Only graphs that may hold a mixing site warn; the rest lose nothing.
        log = logger.warning if _may_mix(gm) else logger.info
        log("kimi_passes: AttnRes mixing in this training graph is left unfused (%s). Its "
            "forward and backward are plain Inductor's. To fuse it, keep that construct out "
            "of the compiled function; to silence this, compile with fuse_torch_mixing=False.",
            reason)
        return gm
    out_of_place(traced.graph)
    differentiable_copies(traced.graph)
    mark_requires_grad(traced, example_inputs)
    manager(traced.graph)
    if not manager.get(AttnResFusionPass).last_fused:
        return gm
    traced.graph.lint()
    traced.recompile()
    return traced


__all__ = ["fuse_before_autograd", "needs_autograd", "trace_to_aten", "untraceable_reason"]
