"""Base class for kimi_passes' Inductor passes: cache key and graph dumps.

A pass's ``uuid()`` hashes its own source file, this file and every option, so
Inductor's FX graph cache stays on and a cached graph compiled under other
options is never served.
"""

from __future__ import annotations

import inspect
import json
import logging

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

logger = logging.getLogger("kimi_passes")


class KimiGraphPass(CustomGraphPass):
    """A post-grad pass over ``torch.fx.Graph`` with a cache-safe ``uuid()``."""

    #: Position in the pass manager, used in dump names ``post_grad.<i>.<Pass>.<stage>``.
    index: int = 0

    def options(self) -> dict:
        """Every option that changes what the pass does; part of ``uuid()``."""
        return {}

    def uuid(self) -> str:
        files = (inspect.getfile(type(self)), __file__)
        extra = json.dumps({"pass": type(self).__qualname__, **self.options()}, sort_keys=True)
        return get_hash_for_files(files, extra).hex()

    def dump(self, graph: torch.fx.Graph, stage: str) -> None:
        """Hand the graph to depyf / TORCH_LOGS as ``post_grad.<i>.<Pass>.<stage>``."""
        gm = graph.owning_module
        if gm is None:
            return
        name = f"post_grad.{self.index}.{type(self).__name__}.{stage}"
        # Looked up at call time: depyf's prepare_debug patches this attribute.
        text = torch._dynamo.utils.lazy_format_graph_code(name, gm, colored=False)
        logger.debug("%s", text)
