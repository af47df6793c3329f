"""vLLM's config resolution for a GPU platform, on a machine without that GPU.

Invariant: inside ``stand_in(kind)``, what vLLM's config resolution reads as the platform
(``vllm.platforms.current_platform``, the one vLLM 0.33.0's breakable-architecture list
reads, and ``vllm.config.vllm.current_platform``, the one ``VllmConfig`` and 0.34.0's list
read) is vLLM's own ``Platform`` interface as a ``kind`` machine (``cuda``: NVIDIA, or
``rocm``) whose device is never asked; on exit the platform is vLLM's again and the
list's cache is cleared both ways. So a CPU machine resolves a ``vllm serve`` command as
the GPU server will (K3's breakable CUDA graphs, mode NONE), where vLLM's CPU platform
would resolve its own (0.34.0 refuses an x86 CPU without triton-cpu). Nothing else of
vLLM's is changed: kernels, workers and devices are never reached by a resolution.
Used by ``vllm-plan`` (``command``) and the tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

KINDS = ("cuda", "rocm")


@contextlib.contextmanager
def stand_in(kind: str) -> Iterator[Any]:
    """vLLM's platform as a ``kind`` machine while the block runs (see the module)."""
    if kind not in KINDS:
        raise ValueError(f"kimi_passes: no platform {kind!r} to resolve vLLM's config for: "
                         f"pass one of {', '.join(KINDS)}")
    import vllm.platforms
    from vllm.config import vllm as config_vllm
    from vllm.platforms.interface import Platform, PlatformEnum

    enum = {"cuda": PlatformEnum.CUDA, "rocm": PlatformEnum.ROCM}[kind]
    platform = type(f"StandIn{kind.upper()}Platform", (Platform,),
                    {"_enum": enum, "device_name": kind, "device_type": "cuda"})()
    owners = (vllm.platforms, config_vllm)
    own = [vars(m).get("current_platform") for m in owners]
    config_vllm.default_breakable_cudagraph_architectures.cache_clear()
    try:
        for module in owners:
            module.current_platform = platform
        yield platform
    finally:
        for module, value in zip(owners, own, strict=True):
            if value is None:
                vars(module).pop("current_platform", None)
            else:
                module.current_platform = value
        config_vllm.default_breakable_cudagraph_architectures.cache_clear()
