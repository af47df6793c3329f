"""``check_unrouted``: vLLM's own Kimi K3 ``attn_res`` is never compiled silently unrouted.

Invariant, per graph the ``kimi`` backend or the aux-stream pass sees (raised as
``AuxCaptureError``, before any rewrite): under the ``"attn_res"`` stream no node calls
vLLM's K3 ``attn_res`` as vLLM ships it. The kimi passes recognise aux captures only
around ``kimi::attn_res``; a K3 forward whose ``attn_res`` was not routed to it
(``kimi_passes.vllm.k3_route``) keeps vLLM's captures, the running prefix (the legacy stream),
and the drafter would silently lose acceptance. Under the ``"prefix"`` stream vLLM's
values are the ones asked for: nothing is checked.

vLLM's ``attn_res`` reaches a graph in one of two forms:

- its Triton launch, which Dynamo records as the higher-order op
  ``triton_kernel_wrapper_mutation`` (functionalized: ``triton_kernel_wrapper_functional``)
  whose ``kernel_idx`` names, in ``kernel_side_table``, the JIT function
  ``_attn_res_kernel`` defined in ``vllm/models/kimi_k3/{nvidia,amd}/ops/attn_res.py``;
- on SM100, vLLM's compiled op ``_C::kimi_k3_attn_res`` (called directly, or
  functionalized as ``auto_functionalized(_v2)``).

Before (refused under the attn_res stream)::

    triton_kernel_wrapper_functional(kernel_idx=<vLLM's _attn_res_kernel>, ...)
    output = [..., prefix_plus_pending]      # capture: the legacy prefix

After: nothing is rewritten; the error names the calls found and the switch
(``$KIMI_PASSES_AUX_STREAM``, ``VLLM_PLUGINS``) that routes them.
"""

from __future__ import annotations

import os

import torch

from kimi_passes.config.stream import ENV_VAR
from kimi_passes.errors import AuxCaptureError

#: Where vLLM 0.33.0 defines its K3 ``attn_res`` kernel (source files, module names).
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
    shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    raise AuxCaptureError(
        f"kimi_passes: the compiled graph calls vLLM's Kimi K3 attn_res as vLLM ships it "
        f"({len(found)} call(s): {shown}), not kimi::attn_res. The kimi passes see only "
        "kimi::attn_res, so this K3 forward's aux captures would stay vLLM's running prefix "
        "(the legacy stream) although the attn_res stream is requested, and the drafter "
        f"would silently lose acceptance. Remedy: start vLLM with ${ENV_VAR}=attn_res set "
        "(kimi_passes' vllm.general_plugins entry point then routes vLLM's attn_res to "
        "kimi::attn_res before the model is built; if $VLLM_PLUGINS is set, it must list "
        "kimi_passes; without the package metadata call kimi_passes.vllm.k3_route.register() "
        "after importing vLLM), or request aux_stream='prefix' to serve vLLM's own values. "
        "Serving no drafter, the kimi passes have nothing to do in this graph: compile with "
        "backend='inductor'. docs/reference.md, \"vLLM's Kimi K3\"")
