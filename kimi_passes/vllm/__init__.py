"""kimi_passes inside vLLM: the compile-pipeline pass and the K3 route.

- ``compile_pass``: ``KimiVllmPass``, the kimi pass manager as vLLM's post-grad
  ``InductorPass`` (``compile_config_entries``, ``make_vllm_pass``, the two named
  ``<stream>_stream_pass`` objects for ``inductor_passes``). Imports vLLM.
- ``k3_route``: the ``vllm.general_plugins`` entry point; once vLLM imports its K3 model
  (``k3_hook``) and a source asks for a stream (``k3_stream``) it routes vLLM's own K3
  ``attn_res`` and wraps its model's methods: ``k3_eager`` (the stream in eager K3) and
  ``k3_plan`` (served or refused at the model's init); ``plan_command`` is ``vllm-plan``.
  Imports no vLLM module itself.
- ``peer``: ``load_peer``, vLLM's K3 kernel file as the benches', tests' and tools' peer
  (an installed vLLM's file or a prepared copy, run with stand-ins). Never imports vLLM.

Importing this package imports neither: the names of ``compile_pass`` load on first use,
so vLLM's plugin loader reaches ``k3_route`` without importing vLLM's compile pipeline.
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
