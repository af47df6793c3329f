"""kimi_passes inside vLLM: the compile-pipeline pass, the K3 route, the ``vllm-plan`` command.

- ``compile_pass``: ``KimiVllmPass``, the kimi pass manager as vLLM's post-grad
  ``InductorPass`` (``compile_config_entries``, ``make_vllm_pass``, the two
  ``<stream>_stream_pass`` objects of fixed stream, which vLLM reaches by name through the
  top-level modules ``kimi_passes.<stream>_stream_pass``). Imports vLLM.
- ``k3/``: the K3 route, vLLM's ``vllm.general_plugins`` entry point
  (``k3.route.register``): once vLLM imports its K3 model (``k3.hook``) and a source asks
  for a stream (``k3.stream``), vLLM's own K3 ``attn_res`` is routed to the kimi ops and
  its model's methods are wrapped (``k3.route``, ``k3.eager``), a changed K3 refused
  (``k3.surface``), the config served or refused (``k3.plan``). Imports no vLLM module.
- ``vllm_plan/``: ``python -m kimi_passes vllm-plan``, a ``vllm serve`` command line run
  through vLLM's config resolution and the route's startup (``vllm_plan.command``), on a
  stand-in for a GPU platform this machine lacks (``vllm_plan.platform``).
- ``versions``: what differs between the vLLM versions we were written for, and the
  warning for an untested one.
- ``peer``: ``load_peer``, vLLM's K3 kernel file as the benches', tests' and tools' peer
  (an installed vLLM's file or a prepared copy, run with stand-ins). Never imports vLLM.
- ``k3_route``: the route's old module name, a deprecated alias of ``k3.route`` for one
  release.

Invariant: importing this package imports no vLLM module: the names of ``compile_pass``
load on first use, so vLLM's plugin loader reaches ``k3.route`` without importing vLLM's
compile pipeline.
"""

from __future__ import annotations

import importlib
from typing import Any

#: The names read from ``compile_pass`` on first use (needs vLLM).
COMPILE_PASS_NAMES = (
    "InductorPass", "KimiVllmPass", "attn_res_stream_pass",
    "compile_config_entries", "make_vllm_pass", "prefix_stream_pass", "served_drafter",
)

__all__ = list(COMPILE_PASS_NAMES)


def __getattr__(name: str) -> Any:
    if name in COMPILE_PASS_NAMES:
        return getattr(importlib.import_module(f"{__name__}.compile_pass"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
