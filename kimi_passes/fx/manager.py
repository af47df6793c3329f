"""``KimiPassManager``: the kimi passes in order as one Inductor custom pass; ``PassObserver``.

Inductor (and vLLM) take one ``post_grad_custom_post_pass``; the manager is that one object.
Its ``uuid()`` hashes the options record it was built for (``KimiPassConfig.key()``) and
folds in each pass's key. Observers watch a run without changing the graph (goldens record
through one, benchmarks time through one). Which passes a record asks for is
``kimi_passes.pipeline``'s business; the manager only runs them.
"""

from __future__ import annotations

import hashlib
import json

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from kimi_passes.config.pass_config import KimiPassConfig
from kimi_passes.fx.host_key import check_host_key


class PassObserver:
    """Watches a ``KimiPassManager`` run (recording goldens, timing benchmarks).

    Hand one to ``KimiPassManager(passes, observers=[...])`` or ``manager.observe(o)``.
    Every hook is optional; none may change the graph (they are not part of ``uuid()``).
    """

    def before_passes(self, graph: torch.fx.Graph) -> None:
        """The post-grad graph, before the first pass."""

    def after_pass(self, graph_pass, graph: torch.fx.Graph) -> None:
        """``graph_pass`` has run (its ``last_time_s`` and ``last_*`` results are set)."""

    def after_passes(self, graph: torch.fx.Graph, seconds: float) -> None:
        """Every pass has run; ``seconds``: the passes' own time, observers excluded."""


class KimiPassManager(CustomGraphPass):
    """Runs the kimi passes in order as one ``post_grad_custom_post_pass``.

    One object rather than a list: torch releases before 2.13 accept a single pass.
    Each pass dumps its graphs under its position here (``<phase>.<i>.<Pass>``; phase
    ``post_grad``, or ``pre_autograd`` for the manager that fuses training graphs).
    """

    def __init__(self, passes, observers=(), phase: str = "post_grad", lowering=None,
                 config: KimiPassConfig | None = None):
        self.passes = list(passes)
        self.observers: list[PassObserver] = list(observers)
        self.phase = phase
        #: Run after the passes and the observers (``kimi_passes.lowering.LowerKimiOps``):
        #: the passes and the goldens see the kimi ops; Inductor then gets generated code.
        self.lowering = lowering
        #: The options the passes were built for (part of ``uuid()``); None for a manager
        #: assembled by hand from passes, whose keys then carry every option.
        self.config = config

    def observe(self, observer: PassObserver) -> PassObserver:
        """Add ``observer``; returns it."""
        self.observers.append(observer)
        return observer

    def __call__(self, graph: torch.fx.Graph) -> None:
        check_host_key(self)
        for o in self.observers:
            o.before_passes(graph)
        seconds = 0.0
        for i, p in enumerate(self.passes):
            p(graph, index=i, phase=self.phase)
            seconds += p.last_time_s
            for o in self.observers:
                o.after_pass(p, graph)
        for o in self.observers:
            o.after_passes(graph, seconds)
        if self.lowering is not None:
            self.lowering(graph, index=len(self.passes), phase=self.phase)

    def uuid(self) -> str:
        passes = self.passes + ([self.lowering] if self.lowering is not None else [])
        config = {} if self.config is None else self.config.key()
        head = hashlib.sha256(json.dumps({"phase": self.phase, **config},
                                         sort_keys=True).encode()).hexdigest()[:16]
        return ":".join([head, *(p.uuid() for p in passes)])

    def get(self, cls):
        return next(p for p in self.passes if isinstance(p, cls))
