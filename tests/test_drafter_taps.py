"""The compiled graph serves exactly the drafter's capture ids, or refuses at compile time.

With ``make_kimi_backend(draft_config=...)`` (and the vLLM adapter, which reads the drafter
vLLM serves): every declared id a graph owns is tapped there, every tap is declared
(capture id ``num_layers`` excepted for DFlash), ids beyond ``num_layers`` are refused;
the declared ids are part of the cache key, so a new drafter never reuses a graph
compiled for another (speculators #996), in one process or across processes sharing a
cache. Also: a tap cut off from its consumer by a graph break is refused naming the break.
"""

from __future__ import annotations

import json
import os
import sys
from unittest import mock

import pytest
import torch
from helpers.k3 import assert_taps_close, inference_model, small_config, token_ids
from helpers.process import one_after_another

import kimi_passes.graphs.k3 as k3_module
from kimi_passes import AuxCaptureError, AuxStreamPass, aux_tap, make_kimi_backend
from kimi_passes.config.drafter import drafter_capture_ids

CFG = small_config(4, 2, taps=(0, 2, 3, 4))  # 4 layers, blocks of 2; taps 0, 2, 3 and L=4


def eagle(*ids):
    return {"eagle_aux_hidden_state_layer_ids": list(ids)}


def dflash(*layer_ids):
    return {"dflash_config": {"target_layer_ids": list(layer_ids)}}


def serve(model, draft, *inputs):
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=make_kimi_backend(draft_config=draft),
                            fullgraph=True, dynamic=False)(*inputs)
    return out


def _taps(out):
    return list(out[1])


@pytest.fixture
def fallback_caches_off(caches_off, aten_fallback):
    yield


@pytest.mark.usefixtures("fallback_caches_off")
@pytest.mark.parametrize("draft", [eagle(0, 2, 3, 4), eagle(4, 3, 2, 0), dflash(-1, 1, 2, 3),
                                   dflash(-1, 1, 2)],
                         ids=["eagle3", "eagle3-reordered", "dflash", "dflash-final-apart"])
def test_declared_taps_are_served(draft):
    """The drafter's ids, tapped: compiled, and every tap is its consumer's mixture.

    ``dflash-final-apart``: DFlash takes the final state separately, so the model's tap
    at capture id 4 = num_layers need not be declared."""
    model = inference_model(CFG)
    ids = token_ids(CFG)
    got = _taps(serve(model, draft, ids))
    with torch.no_grad():
        want = model.ground_truth(ids)[1]
    assert_taps_close(got, want, torch.float32)


REFUSALS = [
    ("eagle3 without the final state", eagle(0, 2, 3),
     r"this graph \(AttnRes calls of layers 0 to 3 and the output aggregation\) taps "
     r"\[0, 2, 3, 4\]: tapped but not declared: \[4\]\."),
    ("a declared id the model does not tap", eagle(0, 1, 2, 3, 4),
     r"declared but not tapped: \[1\] \(this graph holds the AttnRes call that reads each "
     r"of them\)"),
    ("layer ids given as capture ids", dflash(0, 2, 3),
     r"declares capture ids \[1, 3, 4\] \(dflash_config.target_layer_ids \(layer ids, "
     r"capture id = layer id \+ 1\) in the drafter config a dict\).*declared but not tapped: "
     r"\[1\].*tapped but not declared: \[0, 2\]\. The taps are the declared ids -1: off by "
     r"one \(dflash_config.target_layer_ids holds layer ids, capture id = layer id \+ 1, and "
     r"the model was given the layer ids as capture ids\)"),
    ("capture ids given as layer ids", eagle(1, 3, 4),
     r"The taps are the declared ids -1: off by one \(the model was given layer ids", (0, 2, 3)),
    ("an id beyond num_layers", eagle(0, 2, 3, 4, 6),
     r"the drafter declares capture ids \[6\] .* but the model has num_layers=4 .*trained on "
     r"another target model"),
]


@pytest.mark.usefixtures("fallback_caches_off")
@pytest.mark.parametrize("draft,match,taps", [(*r[1:3], r[3] if len(r) > 3 else None)
                                              for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_mismatched_drafter_is_refused(draft, match, taps):
    with pytest.raises(AuxCaptureError, match=r"(?s)" + match):
        serve(inference_model(CFG, capture_ids=taps), draft, token_ids(CFG))


@pytest.mark.usefixtures("fallback_caches_off")
def test_pipeline_stages_check_the_ids_they_own():
    """Stage [0, 2) owns capture ids 0 and 1; stage [2, 4) owns 2, 3 and 4 = num_layers."""
    draft = eagle(0, 2, 3, 4)
    first = inference_model(CFG, 0, 2, capture_ids=(0,))
    ids = token_ids(CFG)
    serve(first, draft, ids)
    with torch.no_grad():
        prefix, bank = first(ids)[0]
    serve(inference_model(CFG, 2, 4, capture_ids=(2, 3, 4)), draft, prefix, bank)
    with pytest.raises(AuxCaptureError, match=r"declared but not tapped: \[2\]"):
        serve(inference_model(CFG, 2, 4, capture_ids=(3, 4)), draft, prefix, bank)
    with pytest.raises(AuxCaptureError, match=r"tapped but not declared: \[1\]"):
        serve(inference_model(small_config(4, 2, taps=(0, 1)), 0, 2), draft, ids)


def test_the_declared_ids_key_the_cache():
    a, b = (drafter_capture_ids(eagle(*ids)) for ids in ((0, 2, 3, 4), (0, 2, 3)))
    keys = {AuxStreamPass("attn_res", drafter=d).uuid() for d in (a, b, None)}
    assert len(keys) == 3
    # The same ids in another spelling are the same compile.
    same = drafter_capture_ids(dflash(-1, 1, 2))
    assert AuxStreamPass(drafter=same).uuid() != AuxStreamPass(drafter=b).uuid()  # dflash: exempt
    assert AuxStreamPass(drafter=drafter_capture_ids({"target_layer_ids": [-1, 1, 2]})).uuid() \
        == AuxStreamPass(drafter=b).uuid()


def test_drafter_changed_in_one_process_with_the_cache_on(aten_fallback):
    """speculators #996, in one process, FX graph cache on: the same model with another
    drafter is refused (not served from the cache), and the model re-tapped for the new
    drafter serves the new drafter's ids."""
    ids = token_ids(CFG)
    model = inference_model(CFG)
    assert len(_taps(serve(model, eagle(0, 2, 3, 4), ids))) == 4
    with pytest.raises(AuxCaptureError, match=r"tapped but not declared: \[4\]"):
        serve(model, eagle(0, 2, 3), ids)
    retapped = inference_model(CFG, capture_ids=(0, 2, 3))
    got = _taps(serve(retapped, eagle(0, 2, 3), ids))
    with torch.no_grad():
        assert_taps_close(got, retapped.ground_truth(ids)[1], torch.float32)


# --------------------------------------------------------------------------- processes

SCRIPT = r"""
import json, sys
import torch
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
import kimi_passes
from kimi_passes.graphs.k3 import K3Config, K3Model

declared, tapped = json.loads(sys.argv[1]), tuple(json.loads(sys.argv[2]))
inductor_config.fx_graph_cache = True
inductor_config.fallback_by_default = True
cfg = K3Config(num_layers=2, hidden_size=16, attn_res_block_size=1, num_heads=2,
               intermediate_size=32, vocab_size=64, aux_layer_ids=(0, 1, 2))
model = K3Model(cfg, capture_ids=tapped).eval()
ids = torch.arange(5) % cfg.vocab_size
backend = kimi_passes.make_kimi_backend(
    draft_config={"eagle_aux_hidden_state_layer_ids": declared})
result = {}
try:
    with torch.no_grad():
        taps = torch.compile(model, backend=backend, fullgraph=True)(ids)[1]
        want = model.ground_truth(ids)[1]
    result["errors"] = [float((a - b).abs().max()) for a, b in zip(taps, want, strict=True)]
except kimi_passes.AuxCaptureError as e:
    result["refused"] = str(e)
result["inductor"] = dict(counters["inductor"])
print(json.dumps(result))
"""
RUNS = [([0, 1, 2], [0, 1, 2]), ([0, 1], [0, 1, 2]), ([0, 1], [0, 1]), ([0, 1, 2], [0, 1, 2])]


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHINDUCTOR_", "KIMI_PASSES_"))}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor_cache"))
    commands = [[sys.executable, "-c", SCRIPT, json.dumps(d), json.dumps(t)] for d, t in RUNS]
    return [json.loads(out.strip().splitlines()[-1])
            for out in one_after_another(commands, env, timeout=300)]


@pytest.mark.heavy
def test_drafter_changed_across_processes_sharing_a_cache(processes):
    """speculators #996 across processes: process 2 changes the drafter on the cached model
    (refused, not served process 1's graph), process 3 serves the new drafter's taps,
    process 4 returns to the first drafter and is served from the cache."""
    first, changed, retapped, again = processes
    assert max(first["errors"]) <= 1e-5 and len(first["errors"]) == 3, first
    assert "tapped but not declared: [2]" in changed["refused"], changed
    assert changed["inductor"].get("fxgraph_cache_hit", 0) == 0, changed
    assert len(retapped["errors"]) == 2 and max(retapped["errors"]) <= 1e-5, retapped
    assert again["inductor"].get("fxgraph_cache_hit", 0) >= 1, again
    assert max(again["errors"]) <= 1e-5, again


# --------------------------------------------------------------------------- graph breaks

def _tap_then_break(x, k):
    tapped = aux_tap(x, k)
    if k == 2:
        torch._dynamo.graph_break()
    return tapped


@pytest.mark.usefixtures("fallback_caches_off")
def test_a_break_between_tap_and_consumer_is_named():
    """A break right after a tap, in the same function: the message names it and its line."""

    class TapBreakMix(torch.nn.Module):
        def forward(self, x, bank, w, q):
            tapped = aux_tap(x, 1)
            torch._dynamo.graph_break()
            return tapped, torch.ops.kimi.attn_res_mix(x, bank, w, q, 1, 1e-6)

    torch._dynamo.reset()
    f = torch.compile(TapBreakMix(), backend=make_kimi_backend())
    with pytest.raises(AuxCaptureError, match=(
            r"capture id 1 has no consumer in this graph: the graph ends before the tap's "
            r"consumer, at a Dynamo graph break \(Call to `torch._dynamo.graph_break\(\)`; at "
            r".*test_drafter_taps.py:\d+\)\..*fullgraph=True.*TORCH_LOGS=graph_breaks")):
        f(torch.randn(4, 16), torch.randn(4, 2, 16), torch.ones(16), torch.randn(16))


@pytest.mark.usefixtures("fallback_caches_off")
def test_a_break_that_isolates_the_tap_is_named():
    """A break inside the function holding the tap: Dynamo compiles the tap alone; that
    graph has no AttnRes op, but it is the break, not the model, and the message says so."""
    with mock.patch.object(k3_module, "aux_tap", _tap_then_break), \
            pytest.raises(AuxCaptureError, match=(
                r"capture id 0 has no consumer in this graph: the graph ends before the tap's "
                r"consumer: this graph only hands the tapped value on, so a graph break")):
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(inference_model(CFG), backend=make_kimi_backend())(token_ids(CFG))


# --------------------------------------------------------------------------- vLLM

def _served(config, method, ids):
    """``config`` serving a drafter whose hf_config declares ``ids`` (vLLM's
    SpeculativeConfig without the checkpoint it needs to build: the harness's stand-in)."""
    import types

    from helpers.vllm_harness import speculative_config

    hf = types.SimpleNamespace(to_dict=lambda: eagle(*ids))
    object.__setattr__(config, "speculative_config", speculative_config(method, hf))
    return config


@pytest.mark.vllm
def test_vllm_adapter_reads_the_served_drafter(monkeypatch):
    """The fixed-stream pass (``attn_res_stream_pass``, no draft_config) checks against the
    drafter vLLM serves, and its uuid() changes with it."""
    import helpers.vllm_harness as h
    from vllm.config import set_current_vllm_config

    from kimi_passes.vllm import attn_res_stream_pass

    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
    cfg = small_config(2, 1, taps=(0, 1, 2))
    ids = token_ids(cfg, 9)
    keys = []
    for declared, ok in (((0, 1, 2), True), ((0, 2), False)):
        config = _served(h.vllm_config(inductor_compile_config={
            "fallback_by_default": True, "post_grad_custom_post_pass": attn_res_stream_pass}),
            "eagle3", declared)
        with set_current_vllm_config(config):
            keys.append(attn_res_stream_pass.uuid())
        model = h.compile_k3(cfg, config)
        if ok:
            _, taps = h.run(model, config, ids)
            assert_taps_close(taps, h.ground_truth(model, ids), torch.float32)
        else:
            with pytest.raises(AuxCaptureError, match=(
                    r"declares capture ids \[0, 2\] \(eagle_aux_hidden_state_layer_ids .* in "
                    r"the drafter config vLLM serves \(eagle3: speculative_config")):
                h.run(model, config, ids)
    assert keys[0] != keys[1]
    # A method whose drafter reads no aux hidden states declares nothing.
    with set_current_vllm_config(_served(h.vllm_config(), "ngram", (0,))):
        from kimi_passes.vllm import served_drafter
        assert served_drafter() is None


@pytest.mark.vllm
def test_vllm_adapter_checks_the_served_drafters_declaration(monkeypatch, caplog):
    """The fixed-stream pass against a served drafter whose checkpoint declares the other
    stream: refused naming both and the A/B switch; with the switch, served and warned
    once. The declaration is read from the drafter's config.json (the harness's folder)."""
    import json
    import logging
    import types

    import helpers.vllm_harness as h
    from vllm.config import set_current_vllm_config

    from kimi_passes.config.stream import AB_VAR, StreamConflict
    from kimi_passes.vllm import attn_res_stream_pass

    monkeypatch.delenv(AB_VAR, raising=False)
    declared = {**eagle(0, 1, 2), "aux_hidden_stream": "prefix"}
    hf = types.SimpleNamespace(to_dict=lambda: declared)
    config = h.vllm_config()
    object.__setattr__(config, "speculative_config", h.speculative_config("eagle3", hf))
    path = f"{config.speculative_config.draft_model_config.model}/config.json"
    assert json.loads(open(path).read())["aux_hidden_stream"] == "prefix"
    with set_current_vllm_config(config):
        with pytest.raises(StreamConflict, match=(
                r"this KimiVllmPass serves 'attn_res' asks for 'attn_res', the eagle3 "
                rf"drafter's config {path}: aux_hidden_stream = 'prefix'.*\${AB_VAR}=1")):
            attn_res_stream_pass.uuid()
        monkeypatch.setenv(AB_VAR, "1")
        with caplog.at_level(logging.WARNING, logger="vllm.kimi_passes"):
            attn_res_stream_pass.uuid()
            attn_res_stream_pass.uuid()
    warnings = [r.getMessage() for r in caplog.records if "A/B run" in r.getMessage()]
    assert len(warnings) == 1 and "declares 'prefix'" in warnings[0], warnings
