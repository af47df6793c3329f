"""``GraphRecorder``: a ``torch.compile`` backend that records each graph around the passes.

    rec = GraphRecorder(make_kimi_backend(aux_stream="attn_res"))
    torch.compile(model, backend=rec)(ids)
    print(rec.last.text("skeleton"))

Per compiled graph it keeps the input names Dynamo gave the graph (``graph_text``
prints them), copies of the post-grad graph before and after the kimi passes, and the
taps the aux-stream pass rewrote. It watches the backend's ``KimiPassManager`` as a
``PassObserver``; the passes themselves are the backend's, unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.fx import Graph, GraphModule, Node

from kimi_passes.backend import KimiBackend, make_kimi_backend
from kimi_passes.debug.graph_names import input_names
from kimi_passes.debug.graph_text import graph_text, kimi_op_counts
from kimi_passes.fx.manager import PassObserver


@contextlib.contextmanager
def graph_caches_off() -> Iterator[None]:
    """The caches that hand back a compiled graph (Inductor's FX graph cache, AOTAutograd's
    cache) off inside the block, so that every compile runs the passes.

    Inductor's kernel build cache stays on: it is keyed by a kernel's generated source, so
    a hit skips only the C++ compiler, after the passes and codegen have run.
    ``force_disable_caches`` would turn that off too, and build every kernel (and the
    compiler's ISA probes) again in a fresh directory on every compile.
    """
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def copy_graph(graph: Graph) -> Graph:
    """A structural copy of ``graph`` (node metadata shared), safe from later mutation."""
    new = Graph()
    # With return_output_node, graph_copy returns (the output's value, the output node).
    out, out_node = cast("tuple[Any, Node]", new.graph_copy(graph, {}, return_output_node=True))
    result = new.output(out)
    result.meta.update(out_node.meta)
    return new


@dataclass
class RecordedGraph:
    """One compiled graph: its input names and the post-grad graph around the kimi passes."""

    names: dict[int, str] = field(default_factory=dict)
    before: Graph | None = None
    after: Graph | None = None
    rewrites: list = field(default_factory=list)

    def text(self, view: str = "full", stage: str = "after") -> str:
        graph = self.before if stage == "before" else self.after
        if graph is None:
            raise ValueError(f"RecordedGraph: no {stage!r} graph was recorded")
        return graph_text(graph, view, names=self.names)

    def counts(self, stage: str = "after") -> dict[str, int]:
        # Typed as recorded; a stage never recorded (None) fails in kimi_op_counts.
        return kimi_op_counts(cast(Graph, self.before if stage == "before" else self.after))


class _Recording(PassObserver):
    """Copies the graph before and after the passes into the recorder's current graph."""

    def __init__(self, recorder: GraphRecorder):
        self.recorder = recorder

    def before_passes(self, graph: Graph) -> None:
        record = self.recorder.current()
        record.before = copy_graph(graph)
        record.rewrites = []

    def after_pass(self, graph_pass, graph: Graph) -> None:
        self.recorder.current().rewrites += getattr(graph_pass, "last_rewrites", [])

    def after_passes(self, graph: Graph, seconds: float) -> None:
        self.recorder.current().after = copy_graph(graph)


class GraphRecorder:
    """A ``torch.compile`` backend: ``KimiBackend`` that records each graph around its passes.

    The graph caches must be off (``graph_caches_off``) for the passes to run on a graph
    compiled before.
    """

    def __init__(self, backend: KimiBackend | None = None, **backend_options):
        self.backend = backend if backend is not None else make_kimi_backend(**backend_options)
        self.backend.passes.observe(_Recording(self))
        self.graphs: list[RecordedGraph] = []
        self._pending = False

    def __call__(self, gm: GraphModule, example_inputs):
        self.graphs.append(RecordedGraph(names=input_names(gm)))
        self._pending = True
        try:
            return self.backend(gm, example_inputs)
        finally:
            self._pending = False

    def current(self) -> RecordedGraph:
        """The graph being compiled (a new record when the passes run outside ``__call__``)."""
        if not self._pending or not self.graphs:
            self.graphs.append(RecordedGraph())
            self._pending = True
        return self.graphs[-1]

    @property
    def aux_pass(self):
        return self.backend.aux_pass

    @property
    def last(self) -> RecordedGraph:
        if not self.graphs:
            raise ValueError("GraphRecorder: nothing was compiled through this backend yet")
        return self.graphs[-1]
