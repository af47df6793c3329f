"""A capture id at a pipeline stage's end, served through vLLM's own K3 and runner code.

vLLM's code runs as installed: ``KimiLinearModel.forward`` (NVIDIA), the mixin's PP slot
layout, packing and collection (``EagleModelMixin``), the runner's load-time calls
(``set_eagle3_aux_hidden_state_layers``: the drafter's ids set through the model, then
``reserve_aux_intermediate_tensor_slots``), its relay keys (``aux_hidden_state_relay_keys``)
and relay (``PPHandler.relay_aux_hidden_states``), ``KimiLinearForCausalLM``'s
``make_empty_intermediate_tensors`` for the persistent receive buffers. Stand-ins: the
modules' GPU parts (graphs/vllm_k3.py: attention, MoE/MLP, embedding, norm/projection
holders, the PP group ``Stage``), the send/recv between stages (a clone) and the runner's
copy of what it received into its persistent buffers (``model_runner.py``'s three lines,
not a function of its own), the drafter's ``SpeculativeConfig`` (no checkpoint).

The expected value: the one-stage forward, unrouted, vLLM's flag on and its own kernel
(``FlagOnTruth``) at the op's tolerance; and bit for bit the one-stage routed forward,
whose captures the same op computes from the same inputs (``k3/boundary.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import types
from pathlib import Path
from unittest import mock

import pytest

if importlib.util.find_spec("vllm") is None:  # test_vllm_required.py fails on CI then
    pytest.skip("vLLM is not installed (bash tools/install_vllm.sh installs it)",
                allow_module_level=True)

import torch  # noqa: E402
from helpers.vllm_harness import (  # noqa: E402
    resolved_k3,
    speculative_config,
    start_route,
    vllm_log_records,
)
from helpers.vllm_truth import FlagOnTruth, assert_aux  # noqa: E402

import kimi_passes  # noqa: E402
import kimi_passes.graphs.vllm_k3 as h  # noqa: E402
import kimi_passes.vllm.k3.route as route  # noqa: E402
from kimi_passes.vllm.k3 import boundary  # noqa: E402
from kimi_passes.vllm.k3.eager import capture_call  # noqa: E402
from kimi_passes.vllm.k3.plan import startup  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("aten_fallback", "caches_off")]

SPEC = h.Spec()  # 6 layers, H=64, blocks of 2
TWO = ((0, 4, 6), (0, 3, 4, 5, 6))  # stage ends, capture ids: 4 at the end, 3 and 5 beside
THREE = ((0, 2, 5, 6), (1, 2, 3, 5, 6))  # ends 2 and 5 at once, mid-block and block-write
MAX_TOKENS = 16  # the runner's persistent receive buffers
ROOT = Path(__file__).resolve().parent.parent


def own_kernels(T: int):
    """vLLM's own ``attn_res`` (NVIDIA, ROCm), its installed source interpreted."""
    return h.vllm_attn_res(), h.vllm_amd_attn_res()


@contextlib.contextmanager
def served(nvidia_fn, stream: str | None = "attn_res"):
    """The plugin loaded as vLLM loads it, the stream resolved; ``nvidia_fn`` is vLLM's own
    ``attn_res`` at every call that is no capture's consumer."""
    with h.with_own_attn_res(nvidia_fn, h.kimi_own):
        try:
            yield start_route(stream)
        finally:
            route.unroute_attn_res()


@dataclasses.dataclass
class RankState:
    """One PP rank as vLLM's v2 runner holds it after ``load_model``."""

    model: torch.nn.Module
    pp: h.Stage
    relay: types.SimpleNamespace  # what PPHandler.relay_aux_hidden_states reads of itself
    buffers: object  # the persistent IntermediateTensors (non-first ranks)


def load_ranks(ends, ids, w, dtype) -> list[RankState]:
    """Each stage built, then loaded as vLLM's runner loads it (see the module docstring);
    the plan run as the init runs it."""
    nvidia, _ = h.vllm_modules()
    from vllm.v1.worker.gpu.spec_decode.eagle import eagle3_utils as e3

    n = len(ends) - 1
    spec = speculative_config("eagle3", types.SimpleNamespace(
        eagle_aux_hidden_state_layer_ids=list(ids), to_dict=lambda: {"ids": list(ids)}))
    config, _ = resolved_k3({}, None)
    ranks = []
    for r in range(n):
        pp = h.Stage(is_first_rank=r == 0, is_last_rank=r == n - 1, world_size=n)
        stage = h.build(SPEC, w, (), start=ends[r], end=ends[r + 1], pp=pp)
        startup(stage, config, route.current().choice)  # type: ignore[union-attr]
        outer = object.__new__(nvidia.KimiLinearForCausalLM)  # vLLM's, holding the stage
        torch.nn.Module.__init__(outer)
        outer.model = stage
        with h.stage(pp):
            e3.set_eagle3_aux_hidden_state_layers(outer, spec, use_pp=True)
            relay = types.SimpleNamespace(aux_hidden_state_relay_keys=(
                e3.aux_hidden_state_relay_keys(outer)))
            buffers = None if r == 0 else outer.make_empty_intermediate_tensors(
                MAX_TOKENS, dtype, "cpu")
        ranks.append(RankState(stage, pp, relay, buffers))
    return ranks


def step(ranks: list[RankState], ids, sent_bytes: list | None = None,
         around=contextlib.nullcontext):
    """One forward through the ranks as the runner runs it; the last rank's output.
    ``sent_bytes`` gets, per hop, the bytes of the aux slots sent; ``around()`` is entered
    around each stage's forward (not the runner's send and receive)."""
    from vllm.sequence import IntermediateTensors
    from vllm.v1.worker.gpu.pp_utils import PPHandler

    T, sent, out = ids.shape[0], None, None
    for rank in ranks:
        received = None
        if sent is not None:  # the runner's receive: into its persistent buffers' views
            received = IntermediateTensors({k: v[:T].copy_(sent[k][:T])
                                            for k, v in rank.buffers.tensors.items()})
        with around():
            out = h.call(rank.model, ids, pp=rank.pp, carry=received)
        if not rank.pp.is_last_rank:
            out = PPHandler.relay_aux_hidden_states(rank.relay, received, out)
            sent = {k: v.clone() for k, v in out.tensors.items()}  # send / recv
            if sent_bytes is not None:
                sent_bytes.append(sum(v.numel() * v.element_size() for k, v in sent.items()
                                      if k.startswith("aux_hidden_states_")))
    return out


def one_stage_routed(ids_cap, w, T):
    """The one-stage forward through the route (the same op at every capture)."""
    return h.aux_of(h.call(h.build(SPEC, w, ids_cap), h.token_ids(SPEC, T)))


def split_and_whole(layout, dtype, T, on, nvidia_fn):
    """The split forward's aux and the one-stage routed forward's, vLLM's flag ``on``."""
    ends, ids = layout
    w = h.weights(SPEC, dtype)
    with h.flag(on), served(nvidia_fn):
        got = h.aux_of(step(load_ranks(ends, ids, w, dtype), h.token_ids(SPEC, T)))
        whole = one_stage_routed(ids, w, T)
    return got, whole


def assert_bitwise(got, want, what):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"{what}: aux {i} differs by {(g - w).abs().max()}"


TRUTH = {layout: FlagOnTruth(SPEC, layout[1], (1, 8), kernels=own_kernels)
         for layout in (TWO, THREE)}


@pytest.mark.parametrize("layout", [TWO, THREE], ids=["2 stages", "3 stages"])
def test_vllm_k3_stage_end_capture_is_the_one_stage_value(layout):
    """fp32, vLLM's flag off and on, T = 1 and 8: two stages (capture 4 ends stage
    [0, 4); 3 and 5 beside it) and three (2 and 5 end stages at once, the middle one
    relays 1 and 2 and fills 2; 3 beside). Every aux state, in vLLM's slot order, is the
    one-stage flag-on value (vLLM's kernel) and bit for bit the one-stage routed one.
    Stand-ins: see the module docstring; in the routed forwards vLLM's kernel at calls
    that are no consumer is ``kimi::attn_res`` (``h.kimi_own``: its interpreted Triton is
    slow here), the truth's is its own."""
    for T in (1, 8):
        for on in ((False, True) if T == 1 else (True,)):
            got, whole = split_and_whole(layout, torch.float32, T, on, h.kimi_own)
            what = f"stage ends {layout[0]}, T={T}, flag {on}"
            assert_aux(got, TRUTH[layout](torch.float32, T), torch.float32, what)
            assert_bitwise(got, whole, what)


def test_vllm_k3_stage_end_capture_bf16():
    """bf16, two stages, T = 8, flag on: bit for bit the one-stage routed forward, and the
    boundary capture equal, at the op's tolerance, to what vLLM's flag-on capture
    computes with its own kernel from the same inputs there (in bf16 the stand-ins amplify
    the consumers' last-bit differences with depth: docs/testing.md, Tolerances).
    Stand-ins: see the module docstring; vLLM's kernel at the route's non-consumer calls
    ``h.kimi_own``."""
    own = h.vllm_attn_res()
    at_boundary: list = []

    def record(args, kwargs):
        with torch.utils._python_dispatch._disable_current_modes():
            at_boundary.append(own(*capture_call(args, kwargs)))

    ends, ids = TWO
    w = h.weights(SPEC, torch.bfloat16)
    with h.flag(True), served(h.kimi_own) as r:
        ranks = load_ranks(ends, ids, w, torch.bfloat16)
        tokens = h.token_ids(SPEC, 8)
        with r.watch(record):
            got = h.aux_of(step(ranks, tokens))
        whole = one_stage_routed(ids, w, 8)
    assert_bitwise(got, whole, "bf16")
    # captures 0 (the embedding: no call), 3, 4 (the boundary, on stage 2), 5, 6
    assert len(at_boundary) == 4
    assert_aux([got[2]], [at_boundary[1]], torch.bfloat16, "bf16 boundary capture 4")


def test_vllm_k3_stage_end_capture_unfilled_is_caught():
    """Break the fill (the consumer's mixture dropped): the split forward's boundary slot
    is then no longer the one-stage value. Stand-ins: see the module docstring."""
    with mock.patch.object(boundary, "expect_received", lambda *a: None):
        got, whole = split_and_whole(TWO, torch.float32, 8, False, h.kimi_own)
    assert not torch.equal(got[2], whole[2])
    assert_bitwise(got[:2] + got[3:], whole[:2] + whole[3:], "the other captures")


def counted_step(ids_cap, T):
    """Two stages, vLLM's own kernel a counting stand-in (``kimi_own``); per stage the
    aten ops and AttnRes calls of its forward, and the aux bytes sent."""

    class Ops(h.Calls):
        def __init__(self):
            super().__init__()
            self.aten: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "aten":
                self.aten.append(func.overloadpacket.__name__)
            return super().__torch_dispatch__(func, types, args, kwargs)

    calls, sent = Ops(), []
    with h.flag(False), served(calls.wrap(h.kimi_own)):
        ranks = load_ranks(TWO[0], ids_cap, h.weights(SPEC), torch.float32)
        step(ranks, h.token_ids(SPEC, T), sent, around=lambda: calls)
    return calls, sent


def test_vllm_k3_stage_end_capture_costs():
    """What capture 4 at stage [0, 4)'s end adds per step, against the same ids without it
    (T = 8, fp32, two stages): no AttnRes call (its consumer becomes
    ``kimi::attn_res_capture``), one ``copy_`` (the fill) and one ``new_full`` (the earlier
    stage's slot, NaN until filled), and one ``[T, H]`` slot sent between the stages. Printed for
    BENCHMARKS.md (``-rP``). Stand-ins: see the module docstring; vLLM's kernel a
    counting ``kimi::attn_res``."""
    T = 8
    base_calls, base_sent = counted_step((0, 3, 5, 6), T)
    calls, sent = counted_step(TWO[1], T)
    attn_res = (len(calls.kimi) + len(calls.own), len(base_calls.kimi) + len(base_calls.own))
    assert attn_res[0] == attn_res[1] == 2 * SPEC.num_layers + 1, attn_res
    assert calls.kimi.count("attn_res_capture") == base_calls.kimi.count("attn_res_capture") + 1
    added = {op: calls.aten.count(op) - base_calls.aten.count(op)
             for op in set(calls.aten) | set(base_calls.aten)}
    added = {op: n for op, n in added.items() if n}
    assert added == {"copy_": 1, "new_full": 1}, added
    extra = [a - b for a, b in zip(sent, base_sent, strict=True)]
    assert extra == [T * SPEC.hidden * 4], extra
    print(f"boundary capture, T={T}, H={SPEC.hidden}, fp32, 2 stages: AttnRes calls "
          f"{attn_res[0]} (without it {attn_res[1]}), aten ops added {added}, aux bytes "
          f"sent per hop {sent} (without it {base_sent}): +{extra[0]} = T*H*4")


def test_vllm_k3_stage_end_capture_refused_where_not_served():
    """ROCm (vLLM's ROCm K3 relays no aux states), the compiled plan
    (``STOCK_TORCH_COMPILE``, ``backend='kimi'``) and a Dynamo trace of vLLM's K3 stage
    under ``kimi_backend``: refused naming why. Served on NVIDIA eager: the startup log
    says so. Stand-ins: graphs/vllm_k3.py's modules and PP group."""
    stage, w = h.Stage(is_last_rank=False, world_size=2), h.weights(SPEC)
    with h.flag(False), served(h.kimi_own):
        with pytest.raises(RuntimeError, match=(
                r"capture id 4 ends pipeline stage \[0, 4\).*ROCm K3 returns no aux states")):
            h.build(SPEC, w, (0, 4), amd=True, start=0, end=4, pp=stage)
        with vllm_log_records() as records:
            model = h.build(SPEC, w, (0, 4), start=0, end=4, pp=stage)
        lines = [r.getMessage() for r in records]
        assert any(re.match(r"kimi_passes: aux capture id 4 ends pipeline stage \[0, 4\): "
                            "served", line) for line in lines), lines
        config, env = resolved_k3({"mode": 1, "backend": "kimi"}, "0")
        with mock.patch.dict(os.environ, env, clear=True):
            startup(model, config, "attn_res")
        assert model._kimi_passes_plan.route == "compiled"
        with h.stage(stage), pytest.raises(RuntimeError, match=(
                r"capture id 4 ends pipeline stage.*compiles each stage's graph alone")):
            model._set_aux_hidden_state_layers((0, 4))
        torch._dynamo.reset()
        traced = h.build(SPEC, w, (0, 4), start=0, end=4, pp=stage)
        compiled = torch.compile(traced, backend=kimi_passes.make_kimi_backend(
            aux_stream="attn_res"), fullgraph=True)
        with pytest.raises(Exception, match=r"(?s)capture id 4 ends.*compiles each stage"):
            h.call(compiled, h.token_ids(SPEC, 8), pp=stage)
    torch._dynamo.reset()


def test_vllm_plan_reports_a_stage_end_capture(tmp_path, capsys):
    """``vllm-plan`` for K3 (graphs/configs/k3: 32 layers) on two stages (vLLM's even split
    ends stage 0 at layer 16) serving a DFlash drafter with target layers 1, 15 and 20
    (capture ids 2, 16 and 21): NVIDIA serves
    it (a row, exit 0), ROCm refuses it naming why (exit 1). vLLM's ``EngineArgs`` resolve
    the command; stand-ins: vLLM's platform (``--platform``)."""
    from kimi_passes.vllm.vllm_plan import command

    drafter = tmp_path / "dflash"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 128, "vocab_size": 163840, "max_position_embeddings": 4096,
        "block_size": 8, "dflash_config": {"target_layer_ids": [1, 15, 20]},
        "aux_hidden_stream": "attn_res"}))
    args = [str(ROOT / "graphs" / "configs" / "k3"), "--pipeline-parallel-size", "2",
            "--speculative-config", json.dumps({"method": "dflash", "model": str(drafter),
                                                "num_speculative_tokens": 1})]
    env = {"HF_HUB_OFFLINE": "1", "VLLM_USE_V2_MODEL_RUNNER": "1"}
    for platform, status in (([], 0), (["--platform", "rocm"], 1)):
        with mock.patch.dict(os.environ, env), \
                mock.patch("torch.cuda.is_available", lambda: False):
            for name in ("KIMI_PASSES_AUX_STREAM", h.FLAG, "VLLM_USE_BREAKABLE_CUDAGRAPH"):
                os.environ.pop(name, None)
            try:
                assert command.main([*platform, *args]) == status
            finally:
                route.unroute_attn_res()  # vLLM may have loaded our plugin
        out = capsys.readouterr().out
        if status == 0:
            assert re.search(r"stage end +aux capture id 16 ends pipeline stage \[0, 16\): "
                             r"served", out), out
        else:
            assert re.search(r"refused +kimi_passes: aux capture id 16 ends pipeline stage "
                             r"\[0, 16\).*ROCm K3 returns no aux states", out), out
