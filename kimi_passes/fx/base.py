"""Base class for kimi_passes' Inductor passes: one ``__call__``, a cache-safe ``uuid()``.

A pass implements ``run(graph)``. ``__call__`` around it hands the graph to depyf /
TORCH_LOGS before and after (``<phase>.<index>.<Pass>.<before|after>``, phase ``post_grad``
or, for the fusion of training graphs, ``pre_autograd``), times it
(``last_time_s``) and logs what ``run`` reports at INFO on logger ``kimi_passes``.

``uuid()`` hashes the source of the pass's module and of every kimi_passes module its
import runs, directly or not, package ``__init__`` files included
(``cache_key.dependencies``), with the pass name and every
option, so Inductor's FX graph cache stays on and never serves a graph compiled by other
code or under other options.
"""

from __future__ import annotations

import json
import logging
import time

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from kimi_passes.fx.cache_key import dependencies, source_hash

logger = logging.getLogger("kimi_passes")


class KimiGraphPass(CustomGraphPass):
    """A post-grad pass over ``torch.fx.Graph`` that dumps, times and logs itself."""

    #: Dump position when the pass runs alone; a ``KimiPassManager`` passes its own.
    index: int = 0
    #: Seconds the last call took (dumps included).
    last_time_s: float = 0.0

    def run(self, graph: torch.fx.Graph) -> list[str]:
        """Rewrite ``graph`` in place; return the lines to log (first: the summary)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement run(graph)")

    def options(self) -> dict:
        """Every option that changes what the pass does; part of ``uuid()``."""
        return {}

    def __call__(self, graph: torch.fx.Graph, index: int | None = None,
                 phase: str = "post_grad") -> None:
        """Run the pass; ``index`` and ``phase`` name the dumps (default: ``self.index``)."""
        index = self.index if index is None else index
        t0 = time.perf_counter()
        self.dump(graph, "before", index, phase)
        lines = self.run(graph)
        self.dump(graph, "after", index, phase)
        self.last_time_s = time.perf_counter() - t0
        if lines:
            logger.info("%s (%.2f ms)", lines[0], self.last_time_s * 1e3)
            for line in lines[1:]:
                logger.info("%s", line)

    def source_modules(self) -> list[str]:
        """The modules whose source is part of ``uuid()``."""
        return dependencies(type(self).__module__)

    def uuid(self) -> str:
        extra = json.dumps({"pass": type(self).__qualname__, **self.options()}, sort_keys=True)
        return source_hash(self.source_modules(), extra)

    def dump(self, graph: torch.fx.Graph, stage: str, index: int | None = None,
             phase: str = "post_grad") -> None:
        """Hand the graph to depyf / TORCH_LOGS as ``<phase>.<index>.<Pass>.<stage>``."""
        gm = graph.owning_module
        if gm is None:
            return
        index = self.index if index is None else index
        name = f"{phase}.{index}.{type(self).__name__}.{stage}"
        # Looked up at call time: depyf's prepare_debug patches this attribute.
        text = torch._dynamo.utils.lazy_format_graph_code(name, gm, colored=False)
        logger.debug("%s", text)
