"""KimiPassManager: dump names from the real pass order, observers, passes that time and log.

No compile here: the manager runs on a small traced graph; the dump hook
(``torch._dynamo.utils.lazy_format_graph_code``, what depyf patches) is recorded.
"""

from __future__ import annotations

import logging

import pytest
import torch

from kimi_passes.fx.base import KimiGraphPass
from kimi_passes.fx.manager import KimiPassManager, PassObserver
from kimi_passes.pipeline import pass_manager


@pytest.fixture
def dumped(monkeypatch):
    names = []

    def record(name, gm, **kwargs):
        names.append(name)
        return name

    monkeypatch.setattr(torch._dynamo.utils, "lazy_format_graph_code", record)
    return names


def small_graph() -> torch.fx.Graph:
    return torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1).graph


@pytest.mark.parametrize("fuse,want", [
    (True, ["post_grad.0.AttnResFusionPass.before", "post_grad.0.AttnResFusionPass.after",
            "post_grad.1.AuxStreamPass.before", "post_grad.1.AuxStreamPass.after",
            "post_grad.2.FuseQuantPass.before", "post_grad.2.FuseQuantPass.after",
            "post_grad.3.LowerKimiOps.before", "post_grad.3.LowerKimiOps.after"]),
    (False, ["post_grad.0.AuxStreamPass.before", "post_grad.0.AuxStreamPass.after",
             "post_grad.1.LowerKimiOps.before", "post_grad.1.LowerKimiOps.after"]),
])
def test_dump_indices_follow_the_pass_order(dumped, fuse, want):
    pass_manager(aux_stream="attn_res", fuse_torch_mixing=fuse, fuse_quant=fuse)(small_graph())
    assert dumped == want


class Relu2Gelu(KimiGraphPass):
    """A stand-in pass: rewrites relu to gelu and says so."""

    def run(self, graph):
        n = 0
        for node in graph.find_nodes(op="call_function", target=torch.relu):
            node.target = torch.nn.functional.gelu
            n += 1
        return [f"Relu2Gelu: {n} node(s)", "Relu2Gelu: second line"] if n else []


class Log(PassObserver):
    def __init__(self):
        self.events = []

    def before_passes(self, graph):
        self.events.append(("before", _targets(graph)))

    def after_pass(self, graph_pass, graph):
        self.events.append((type(graph_pass).__name__, graph_pass.last_time_s >= 0))

    def after_passes(self, graph, seconds):
        self.events.append(("after", _targets(graph), seconds >= 0))


def _targets(graph):
    return [n.target.__name__ for n in graph.nodes if n.op == "call_function"]


def test_observers_see_each_pass_and_the_graph_around_them(dumped):
    log = Log()
    manager = KimiPassManager([Relu2Gelu(), Relu2Gelu()], observers=[log])
    manager(small_graph())
    assert log.events == [("before", ["relu", "add"]), ("Relu2Gelu", True),
                          ("Relu2Gelu", True), ("after", ["gelu", "add"], True)]
    assert dumped[::2] == ["post_grad.0.Relu2Gelu.before", "post_grad.1.Relu2Gelu.before"]
    assert manager.observe(Log()) is manager.observers[-1]


def test_a_pass_logs_its_lines_with_its_time(dumped, caplog):
    p = Relu2Gelu()
    with caplog.at_level(logging.INFO, logger="kimi_passes"):
        p(small_graph())
        p(small_graph())
    lines = [r.getMessage() for r in caplog.records if r.name == "kimi_passes"]
    assert len(lines) == 4
    assert lines[0].startswith("Relu2Gelu: 1 node(s) (") and lines[0].endswith(" ms)")
    assert lines[1] == "Relu2Gelu: second line"
    assert p.last_time_s > 0
    assert dumped[:2] == ["post_grad.0.Relu2Gelu.before", "post_grad.0.Relu2Gelu.after"]


def test_a_pass_without_run_says_so():
    class Empty(KimiGraphPass):
        pass

    with pytest.raises(NotImplementedError, match="Empty does not implement run"):
        Empty()(small_graph())


def test_the_record_is_the_only_positional_argument():
    """``pass_manager`` / ``KimiBackend`` take a ``KimiPassConfig`` positionally (a stream
    given there, as ``AuxStreamPass`` takes it, is refused by name), or options by name."""
    from kimi_passes import KimiBackend, KimiPassConfig

    for make in (pass_manager, KimiBackend):
        with pytest.raises(TypeError, match="expected a KimiPassConfig, got 'prefix'"):
            make("prefix")
        with pytest.raises(TypeError, match="not both"):
            make(KimiPassConfig(), aux_stream="prefix")
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['fuse'\]"):
        pass_manager(fuse=False)
    assert pass_manager(KimiPassConfig(aux_stream="prefix")).config.aux_stream == "prefix"
