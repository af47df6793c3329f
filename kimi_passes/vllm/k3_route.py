"""Deprecated name of ``kimi_passes.vllm.k3.route``, kept for one release.

Importing it emits a ``DeprecationWarning`` naming the new module and gives the very
objects of ``kimi_passes.vllm.k3.route`` (the entry point ``register`` included, so a
``vllm.general_plugins`` entry still naming this module loads the same route).
"""

from __future__ import annotations

import warnings

from kimi_passes.vllm.k3.route import (
    EagerRoute,
    current,
    register,
    route_attn_res,
    serve_eager,
    unroute_attn_res,
    vllm_attn_res,
    vllm_attn_res_amd,
)

warnings.warn(
    "kimi_passes.vllm.k3_route is deprecated and goes in the next release: import "
    "kimi_passes.vllm.k3.route (vLLM's entry point is kimi_passes.vllm.k3.route:register; "
    "reinstall with `pip install -e .` if your metadata still names the old one)",
    DeprecationWarning, stacklevel=2)

__all__ = ["EagerRoute", "current", "register", "route_attn_res", "serve_eager",
           "unroute_attn_res", "vllm_attn_res", "vllm_attn_res_amd"]
