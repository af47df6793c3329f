"""``check_unrouted``: vLLM's own Kimi K3 ``attn_res`` is never compiled silently unrouted.

Invariant, per graph the ``kimi`` backend or the aux-stream pass sees (raised as
``AuxCaptureError``, before any rewrite): under the ``"attn_res"`` stream no node calls
vLLM's K3 ``attn_res`` as vLLM ships it. The kimi passes recognise aux captures only
around ``kimi::attn_res``; an unrouted K3 forward (``kimi_passes.vllm.k3.route`` routes
it) keeps vLLM's captures, the legacy running prefix, and the drafter would silently lose
acceptance. Under the ``"prefix"`` stream nothing is checked.

vLLM's ``attn_res`` reaches a graph as its Triton launch (the higher-order op
``triton_kernel_wrapper_mutation`` / ``_functional`` whose ``kernel_idx`` names vLLM's
``_attn_res_kernel`` in ``kernel_side_table``), or on SM100 as vLLM's compiled op
``_C::kimi_k3_attn_res`` (called directly or through ``auto_functionalized(_v2)``).
Nothing is rewritten: the error names the calls found and the switch that routes them.
docs/design.md section 4.
"""

from __future__ import annotations

import os

import torch

from kimi_passes.errors import AuxCaptureError
from kimi_passes.taps import messages as msg

#: Where vLLM (0.33.0, 0.34.0) defines its K3 ``attn_res`` kernel (source files, module names).
KERNEL_FILES = ("vllm/models/kimi_k3/nvidia/ops/attn_res.py",
                "vllm/models/kimi_k3/amd/ops/attn_res.py")
KERNEL_MODULES = tuple(f[:-3].replace("/", ".") for f in KERNEL_FILES)
KERNEL_NAME = "_attn_res_kernel"
#: vLLM's compiled SM100 op.
C_OP = "_C::kimi_k3_attn_res"

_TRITON_HOPS = ("triton_kernel_wrapper_mutation", "triton_kernel_wrapper_functional")


def _python_fn(kernel):
    """The Python function under a Triton JIT/interpreted function or autotuner chain."""
    for _ in range(8):
        inner = getattr(kernel, "fn", None)
        if inner is None:
            return kernel
        kernel = inner
    return kernel


def _is_vllm_kernel(kernel) -> bool:
    fn = _python_fn(kernel)
    if getattr(fn, "__name__", None) != KERNEL_NAME:
        return False
    code = getattr(fn, "__code__", None)
    path = (getattr(code, "co_filename", "") or "").replace(os.sep, "/")
    return getattr(fn, "__module__", None) in KERNEL_MODULES or path.endswith(KERNEL_FILES)


def _op_name(target) -> str | None:
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def unrouted_calls(graph: torch.fx.Graph) -> list[str]:
    """vLLM's K3 ``attn_res`` calls in ``graph``, described (node name and form)."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", None) or str(node.target)
        if name in _TRITON_HOPS:
            idx = node.kwargs.get("kernel_idx")
            if idx is None:
                continue
            from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

            try:
                kernel = kernel_side_table.get_kernel(idx)
            except (AssertionError, KeyError, IndexError):
                continue
            if _is_vllm_kernel(kernel):
                found.append(f"{node.name} ({name} of vLLM's Triton {KERNEL_NAME})")
            continue
        target = node.target
        if "auto_functionalized" in name and node.args:
            target = node.args[0]
        if _op_name(target) == C_OP:
            found.append(f"{node.name} ({C_OP})")
    return found


def check_unrouted(graph: torch.fx.Graph, stream: str) -> None:
    """Raise when ``graph`` calls vLLM's K3 ``attn_res`` unrouted under the attn_res stream."""
    if stream != "attn_res":
        return
    found = unrouted_calls(graph)
    if not found:
        return
    raise AuxCaptureError(msg.unrouted(found))
