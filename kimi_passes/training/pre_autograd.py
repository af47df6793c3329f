"""Fusion before AOTAutograd: training graphs get a fused forward and a fused backward.

Invariant: when a compiled graph needs a backward, every AttnRes mixture the fusion pass
recognises is a ``kimi.attn_res_mix`` / ``attn_res_mix_list`` call *before* AOTAutograd
differentiates the graph, so the backward graph calls the op's registered backward
(``kimi.attn_res_mix_backward`` / ``attn_res_mix_list_backward``) and holds neither the
plain-torch derivative nor the stacked sources it would save. Post-grad fusion cannot:
AOTAutograd has by then written the backward from the plain-torch nodes.

How: ``training.trace`` traces Dynamo's torch-level graph to a functional ATen graph below
autograd; the fusion pass rewrites it; ``compile_fx`` gets it in place of Dynamo's::

    stack = torch.stack([x0, x1])       ->  m = kimi.attn_res_mix_list([x0, x1], None, w, eps)
    p = einsum(F.rms_norm(stack, (H,)), w).softmax(0);  h = einsum(p, stack)
    backward (post-grad): attn_res_mix_list_backward(grad, [x0, x1], None, w, eps, ...)

Refused, the graph compiled unfused (plain Inductor plus the aux-stream pass) with a
WARNING naming the reason: a graph that changes the grad mode, holds a higher-order op,
or cannot be traced. Nothing in it is fused post-grad either (that would bring back the
duplicate backward). docs/design.md section 7.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from kimi_passes.fusion import AttnResFusionPass
from kimi_passes.fx.base import logger
from kimi_passes.training.trace import (
    differentiable_copies,
    mark_requires_grad,
    out_of_place,
    trace_to_aten,
)

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


__all__ = ["fuse_before_autograd", "needs_autograd", "untraceable_reason"]
