"""``FunctionalCall`` (kimi_passes/fx/functionalized.py) against torch's own decoder.

Graphs traced by torch.compile, under ``auto_functionalized`` (v1) and ``_v2``: a test op
called on its bases, on a slice, an ``as_strided`` view, an alias, two views of one base
and None; an op returning nothing; and the kimi calls of a small K3 model. For every
node, what ``FunctionalCall`` reads is checked against torch's
``read_view_information_from_args`` (v2: base index and view) and against the
``getitem`` users' values (the new value of each mutated argument has its tensor's shape).
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
from torch._higher_order_ops import auto_functionalize as af
from torch.fx import Graph, Node

from kimi_passes.debug.recording import GraphRecorder
from kimi_passes.fx.functionalized import FunctionalCall
from kimi_passes.fx.fx_toolkit import AUTO_FUNCTIONALIZED
from kimi_passes.graphs import K3Config, K3Model

pytestmark = pytest.mark.usefixtures("caches_off")


@torch.library.custom_op("kimi_test_af::update", mutates_args=("x", "z"))
def update(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
    x.add_(y)
    if z is not None:
        z.mul_(2)
    return y * 3


@update.register_fake
def _(x, y, z):
    return torch.empty_like(y)


@torch.library.custom_op("kimi_test_af::fill", mutates_args=("out",))
def fill(out: torch.Tensor, x: torch.Tensor) -> None:
    out.copy_(x)


def program(y: torch.Tensor):
    """Each way a mutated argument reaches the op (see the module docstring)."""
    a, b, c = torch.zeros(4, 8), torch.zeros(8, 2), torch.zeros(2, 8)
    r0 = update(a[1:3], y, b.t())  # a slice; an as_strided view (another stride)
    r1 = update(c.view(2, 8), y, a[:2])  # an alias of its base; a slice of a, again
    d = torch.zeros(2, 16)
    r2 = update(d[:, :8], y, d[:, 8:])  # two views of one base
    e = torch.zeros(2, 8)
    r3 = update(e, y, None)  # the base itself; None
    f = torch.zeros(2, 8)
    fill(f, y)  # an op returning nothing
    return r0 + r1 + r2 + r3, a, b, c, d, e, f


def traced(fn, *inputs, v2: bool) -> Graph:
    """The post-grad graph Inductor hands the kimi passes, with ``fn`` compiled."""
    rec = GraphRecorder(fallback_by_default=True)
    torch._dynamo.reset()
    with torch._inductor.config.patch(enable_auto_functionalized_v2=v2), torch.no_grad():
        torch.compile(fn, backend=rec, fullgraph=True)(*inputs)
    graph = rec.last.before
    assert graph is not None
    return graph


def shape(node) -> tuple:
    return tuple(cast(Node, node).meta["val"].shape)


def check(call: FunctionalCall) -> None:
    """What ``call`` reads against torch's decoder and the getitem users' values."""
    node, mutated = call.node, call.mutated
    items = {cast(int, u.args[1]): u for u in node.users}
    args = {a.name: a for a in call.arguments()}
    assert [a.name for a in call.op._schema.arguments] == list(args)
    assert all(args[m].mutated for m in mutated)
    written = len(cast(list, node.kwargs["_all_bases"])) if call.is_v2 else len(mutated)
    assert len(node.meta["val"]) == call.num_returns + written  # what the node returns
    if not call.is_v2:
        for i, m in enumerate(mutated):
            assert args[m].value is node.kwargs[m] and args[m].view == {}
            index = call.num_returns + i
            assert call.output_index(m) == index and call.updated(index) == (m,)
            if index in items and node.kwargs[m] is not None:
                assert shape(items[index]) == shape(node.kwargs[m])
        return
    kwargs = dict(node.kwargs)
    bases = cast(list, kwargs["_all_bases"])
    names, types = af.get_mutable_args(call.op)
    want = af.read_view_information_from_args(names, types, kwargs, bases)
    for m in mutated:
        info, arg = want[m], args[m]
        if info is None:
            assert arg.value is None and call.output_index(m) is None
            continue
        assert arg.value is bases[info.base_index]
        assert call.output_index(m) == call.num_returns + info.base_index
        assert m in call.updated(call.num_returns + info.base_index)
        if call.output_index(m) in items:
            assert shape(items[cast(int, call.output_index(m))]) == shape(arg.value)
        view: dict[str, Any] = {
            af.NotView: {},
            af.AliasViewInfo: {"alias": True},
            af.SliceViewInfo: {"slice_dim": getattr(info, "dim", None),
                               "slice_start": getattr(info, "start", None),
                               "slice_end": getattr(info, "end", None)},
            af.AsStridedViewInfo: {"size": getattr(info, "size", None),
                                   "stride": getattr(info, "stride", None),
                                   "storage_offset": getattr(info, "storage_offset", None)},
        }[type(info)]
        assert arg.view == view
        assert arg.strided_view == isinstance(info, af.AsStridedViewInfo)


def calls(graph: Graph) -> list[FunctionalCall]:
    return [FunctionalCall(n) for n in graph.nodes
            if n.op == "call_function" and n.target in AUTO_FUNCTIONALIZED]


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_every_way_an_argument_is_passed(v2):
    graph = traced(program, torch.ones(2, 8), v2=v2)
    found = calls(graph)
    assert [c.op.name() for c in found] == ["kimi_test_af::update"] * 4 + ["kimi_test_af::fill"]
    assert all(c.is_v2 == v2 for c in found)
    for c in found:
        check(c)
    r0, r1, r2, r3, filled = found
    assert filled.num_returns == 1 and filled.output_index("out") == 1  # slot 0: None
    if not v2:
        return
    assert set(r0.view("x")) == {"slice_dim", "slice_start", "slice_end"}
    assert r0.arguments()[2].strided_view and r1.view("x") == {"alias": True}
    assert r2.base("x") is r2.base("z") and r2.updated(1) == ("x", "z")
    assert r3.view("x") == {} and r3.base("z") is None and r3.output_index("z") is None


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_the_kimi_calls_of_a_model(v2):
    cfg = K3Config(num_layers=3, hidden_size=16, attn_res_block_size=2, num_heads=2,
                   intermediate_size=32, vocab_size=64, aux_layer_ids=(0, 2, 3))
    graph = traced(K3Model(cfg), torch.arange(5) * 7 % 64, v2=v2)
    found = calls(graph)
    assert len(found) == 7 and {c.op.name() for c in found} == {"kimi::attn_res"}
    for c in found:
        check(c)
        assert c.mutated == ("prefix", "blocks")
        assert {c.output_index("prefix"), c.output_index("blocks")} == {1, 2}


def test_a_node_of_another_kind_is_refused():
    graph = Graph()
    x = graph.placeholder("x")
    with pytest.raises(TypeError, match="no auto_functionalized"):
        FunctionalCall(graph.call_function(torch.ops.aten.relu.default, (x,)))
