"""Aux captures with no marker (``kimi_passes/taps/capture.py``), as vLLM's K3 returns them.

The programs (``helpers.unmarked_programs.VllmLikeK3``) follow vLLM 0.33.0's K3 forward with
``torch.ops.kimi.attn_res`` and return their aux states in a list: flag off, capture k is
``prefix_sum + pending`` (either operand order); flag on, a separate pure mixing call.
Under the ``attn_res`` stream every capture reads its consumer's pre-norm mixture (checked
against the program's eager flag-on output, which is that mixture), fused, with no more
mixing calls than the flag-off graph; the ``prefix`` stream leaves the graph as it is. A
stage's carry is no capture; a value two consumers read, and a marker that contradicts a
capture, are refused; a drafter's declared ids are checked against the captures.
"""

from __future__ import annotations

import pytest
import torch
from helpers.k3 import ids
from helpers.op import OP_TOL
from helpers.unmarked_programs import VllmLikeK3
from torch._inductor import config as inductor_config

import kimi_passes
from kimi_passes import AuxCaptureError, AuxStreamPass, make_kimi_backend
from kimi_passes.fx.fx_toolkit import kimi_op
from kimi_passes.fx.manager import PassObserver

pytestmark = pytest.mark.usefixtures("caches_off", "aten_fallback")

kimi = torch.ops.kimi
MIXING = (kimi.attn_res.default, kimi.attn_res_capture.default, kimi.attn_res_mix.default)
TAPS = (0, 1, 2, 3, 5)  # L=5, S=2: the embedding, inside a block, a block write, past it, L


def mixing_calls(graph) -> int:
    return sum(kimi_op(n) in MIXING for n in graph.nodes)


class Watch(PassObserver):
    """The graph around ``AuxStreamPass``: its code and mixing calls before and after."""

    def before_passes(self, graph):
        self.code_before, self.calls_before = graph.python_code("self").src, mixing_calls(graph)

    def after_pass(self, graph_pass, graph):
        if isinstance(graph_pass, AuxStreamPass):
            self.code_after, self.calls_after = graph.python_code("self").src, mixing_calls(graph)
            self.rewrites = graph_pass.last_rewrites


def with_manager(model, *inputs, v2=True, **options):
    """``model`` compiled by Inductor with ``kimi_passes.pass_manager(**options)``."""
    watch = Watch()
    manager = kimi_passes.pass_manager(observers=(watch,), fuse_torch_mixing=False,
                                       lower_kimi_ops=False, **options)
    torch._dynamo.reset()
    with torch.no_grad(), inductor_config.patch(enable_auto_functionalized_v2=v2,
                                                post_grad_custom_post_pass=manager):
        out = torch.compile(model, backend="inductor", fullgraph=True)(*inputs)
    return out, watch


def with_backend(model, *inputs, **options):
    torch._dynamo.reset()
    backend = make_kimi_backend(**options)
    with torch.no_grad():
        out = torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    return out, backend.aux_pass.last_rewrites


def eager(**kw):
    """The program's eager outputs: flag on (the mixture) and flag off (the prefix)."""
    with torch.no_grad():
        return VllmLikeK3(flag=True, **kw)(ids()), VllmLikeK3(flag=False, **kw)(ids())


def assert_close(got, want, dtype=torch.float32):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=OP_TOL[dtype], rtol=OP_TOL[dtype],
                                   msg=lambda m, i=i: f"aux state {i}: {m}")


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("flag", [False, True], ids=["flag-off", "flag-on"])
def test_captures_read_the_mixture_fused(flag, v2):
    """Every capture is its consumer's mixture; flag on merges the pure calls away."""
    (mixed_out, mixed), (_, prefix) = eager()
    (out, aux), watch = with_manager(VllmLikeK3(flag=flag), ids(), v2=v2)
    assert_close(aux, mixed)
    torch.testing.assert_close(out, mixed_out, atol=1e-5, rtol=1e-5)
    assert all((a - b).abs().max() > 1e-2 for a, b in zip(mixed[1:], prefix[1:], strict=True))
    assert [(r.capture_id, r.fused) for r in watch.rewrites] == [(k, True) for k in TAPS]
    source = "pure attn_res call" if flag else "returned value"
    assert [r.source for r in watch.rewrites] == ["returned value"] + [source] * 4
    # 2 calls a layer and the output aggregation; flag on also had one call per tap past 0.
    assert watch.calls_after == 2 * 5 + 1
    assert watch.calls_before == 2 * 5 + 1 + (4 if flag else 0)


@pytest.mark.parametrize("order", ["prefix_first", "delta_first"])
def test_backend_serves_either_operand_order(order):
    (_, mixed), _ = eager()
    (_, aux), rewrites = with_backend(VllmLikeK3(order=order), ids())
    assert_close(aux, mixed)
    assert [r.capture_id for r in rewrites] == list(TAPS)
    assert all("unmarked" in r.how() for r in rewrites)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_merged_capture_is_the_pure_calls_value_bit_for_bit(dtype):
    """The consumer's own prefix add rounds as the pure call's ``prefix_sum + pending``:
    the fused mixture equals vLLM's separate read (prefix stream: the pure call kept)."""
    model = VllmLikeK3(flag=True, dtype=dtype)
    (_, merged), watch = with_manager(model, ids(), aux_stream="attn_res")
    (_, separate), kept = with_manager(model, ids(), aux_stream="prefix")
    assert watch.calls_after == 11 and kept.calls_after == 15
    for a, b in zip(merged, separate, strict=True):
        assert a.dtype == dtype and torch.equal(a, b)


@pytest.mark.parametrize("flag", [False, True], ids=["flag-off", "flag-on"])
def test_prefix_stream_leaves_the_graph_as_it_is(flag):
    (mixed_out, mixed), (_, prefix) = eager()
    (_, aux), watch = with_manager(VllmLikeK3(flag=flag), ids(), aux_stream="prefix")
    assert watch.code_after == watch.code_before
    assert [(r.capture_id, r.fused) for r in watch.rewrites] == [(k, None) for k in TAPS]
    assert_close(aux, mixed if flag else prefix)


def test_non_final_stage_carry_is_left_alone():
    """Layers [0, 3) of 5 with taps 2 and 3 (= the stage's end): id 3's consumer runs on
    the next stage, so its value (and the carry) stay as computed; id 2 is served."""
    kw = dict(taps=(2, 3), end=3)
    with torch.no_grad():
        carry, bank, legacy = VllmLikeK3(**kw)(ids())
        _, mixed = VllmLikeK3(flag=True, taps=(2, 3))(ids())
    (got_carry, got_bank, aux), watch = with_manager(VllmLikeK3(**kw), ids())
    assert [r.capture_id for r in watch.rewrites] == [2]
    torch.testing.assert_close(aux[0], mixed[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux[1], legacy[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_carry, carry, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_bank[:, :2], bank[:, :2], atol=1e-5, rtol=1e-5)


class TwoReaders(torch.nn.Module):
    """``x + pending`` is the legacy input of layer 0's mixing and of a call after it
    (``pure``: the mixture of two calls after it, read by a pure call as vLLM does)."""

    def __init__(self, pure=False):
        super().__init__()
        self.layers = torch.nn.ModuleList([VllmLikeK3(num_layers=1).layers[0]])
        self.w = torch.nn.Parameter(torch.ones(16), requires_grad=False)
        self.pure = pure

    def forward(self, x, pending, bank):
        w = self.w
        cap = x + pending
        h, _, bank = self.layers[0](pending, x.clone(), bank)
        if self.pure:  # after layer 0's block write: the bank the calls below read
            cap = kimi.attn_res(cap, None, bank, w, w, None, 0, -1, 1e-6, 0.0)
        other = kimi.attn_res(x.clone(), pending, bank, w, w, None, 0, -1, 1e-6, 0.0)
        if self.pure:
            other = other + kimi.attn_res(x.clone(), pending, bank, w, w, None, 0, -1, 1e-6, 0.0)
        return h, other, cap


def test_value_read_by_two_consumers_is_refused():
    inputs = (torch.randn(4, 16), torch.randn(4, 16), torch.zeros(4, 1, 16))
    with pytest.raises(AuxCaptureError, match=r"returned value add is the legacy input of 2 "
                       r"AttnRes calls .*\(layer 0 kimi::attn_res.*; output aggregation"):
        with_backend(TwoReaders(), *inputs)
    (_, _, cap), watch = with_manager(TwoReaders(), *inputs, aux_stream="prefix")
    assert watch.code_after == watch.code_before
    torch.testing.assert_close(cap, inputs[0] + inputs[1], atol=0, rtol=0)
    with pytest.raises(AuxCaptureError, match=r"returned value getitem.* \(a pure attn_res "
                       r"mixing call auto_functionalized.*\) is the legacy input of 2 AttnRes "
                       r"calls .*\(output aggregation .*; output aggregation"):
        with_backend(TwoReaders(pure=True), *inputs)


def test_markers_agree_or_contradict():
    (_, mixed), _ = eager()
    (_, aux, marked), watch = with_manager(VllmLikeK3(markers={2: 2, 3: 3}), ids())
    assert_close(aux, mixed)
    assert_close(marked, mixed[2:4])
    assert sorted((r.capture_id, r.source) for r in watch.rewrites) == sorted(
        [(2, "marker"), (3, "marker")] + [(k, "returned value") for k in TAPS])
    with pytest.raises(AuxCaptureError, match=r"aux tap marker aux_tap.* \(capture id 4\) "
                       r"contradicts the unmarked capture returned value add.*layer 3"):
        with_backend(VllmLikeK3(markers={3: 4}), ids())


def test_drafter_ids_are_checked_against_captures():
    model = VllmLikeK3()
    with_manager(model, ids(), draft_config={"eagle_aux_hidden_state_layer_ids": list(TAPS)})
    with pytest.raises(AuxCaptureError, match=r"declared but not tapped: \[4\].*"
                       r"tapped but not declared: \[3\]"):
        with_backend(model, ids(),
                     draft_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2, 4, 5]})


class FirstPiece(torch.nn.Module):
    """The first piece of a stage starting at layer 3, split at attention as vLLM splits:
    layer 3's pre-attention mixing (no delta, 2 blocks), returning the running prefix and
    the bank the next piece reads."""

    def __init__(self):
        super().__init__()
        self.layers = VllmLikeK3().layers

    def forward(self, hidden, bank):
        prefix, layer = hidden.clone(), self.layers[3]
        h = kimi.attn_res(prefix, None, bank, layer.self_attention_res_norm,
                          layer.self_attention_res_proj.squeeze(0), layer.input_layernorm,
                          layer.prev_valid_blocks, -1, 1e-6, 1e-6)
        return h, prefix, bank


def test_running_prefix_handed_on_is_no_capture():
    hidden, bank = torch.randn(4, 16), torch.randn(4, 3, 16)
    (_, prefix, _), watch = with_manager(FirstPiece(), hidden, bank.clone())
    assert watch.rewrites == [] and watch.code_after == watch.code_before
    assert torch.equal(prefix, hidden)


@pytest.mark.parametrize("path", ["model.layers.3.mlp", "L['self'].layers[3]",
                                  "L['self'].__dict__['_modules']['layers'].3"])
def test_layer_index_reads_every_module_path_spelling(path):
    """Dynamo spells a module reached through ``__dict__`` (a model whose forward mutates an
    attribute of itself) ``['layers'].3``; its calls still carry their layer."""
    from kimi_passes.fx.kimi_calls import layer_index

    node = torch.fx.Graph().placeholder("x")
    node.meta["nn_module_stack"] = {"m": (path, torch.nn.Module)}
    assert layer_index(node) == 3
