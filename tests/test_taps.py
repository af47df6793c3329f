"""AuxStreamPass + kimi_backend on the reference K3.

Caches are off (the passes must run on every compile) and the compiles use Inductor's
``fallback_by_default`` (the ``aten_fallback`` fixture, as the goldens do): the post-grad
graph and the passes are those of a full compile, and no C++ kernel is built. The tests
marked ``codegen`` compile to C++ kernels: one geometry of each matrix, each stream, each
capture choice (fused, separate read), and v1 against v2 functionalization.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from helpers.k3 import (
    assert_taps_close,
    compile_model,
    compiled_ground_truth,
    inference_model,
    small_config,
    token_ids,
)
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

from kimi_passes import AuxCaptureError, AuxStreamPass, kimi_backend, make_kimi_backend
from kimi_passes.config.stream import StreamConflict

GEOMETRIES = [(1, 1), (2, 1), (2, 2), (3, 2), (5, 1), (5, 2), (5, 3), (5, 4), (8, 1), (8, 2),
              (8, 3), (8, 4)]
#: The geometry of the fp32 matrix compiled to C++ kernels: a partial last block, 2 writes
#: (README's main-job commands compile the 4- and 8-layer K3 to C++ as well).
CODEGEN = (3, 2)

pytestmark = pytest.mark.usefixtures("caches_off", "aten_fallback")


def geometries(grid, codegen=CODEGEN):
    return [pytest.param(L, S, marks=[pytest.mark.codegen] if (L, S) == codegen else [],
                         id=f"{L}-{S}" + ("-codegen" if (L, S) == codegen else ""))
            for L, S in grid]


def taps_for(L, S):
    """0, every block-write layer and L."""
    return sorted({0, L, *range(S, L, S)})


@pytest.mark.parametrize("L,S", geometries(GEOMETRIES))
@torch.no_grad()
def test_taps_match_ground_truth_fp32(L, S):
    cfg = small_config(L, S, taps_for(L, S))
    model = inference_model(cfg)
    ids = token_ids(cfg)
    want_hidden, want = model.ground_truth(ids)
    backend = make_kimi_backend()
    hidden, got = compile_model(model, backend)(ids)
    assert_taps_close(got, want, torch.float32, f"L={L} S={S}")
    torch.testing.assert_close(hidden, want_hidden, atol=1e-5, rtol=1e-5)
    assert [r.capture_id for r in backend.aux_pass.last_rewrites] == list(cfg.aux_layer_ids)
    assert all(r.fused for r in backend.aux_pass.last_rewrites)


# bf16 codegen of every kimi op is tests/test_lowering.py's dtype matrix.
@pytest.mark.heavy
@pytest.mark.parametrize("L,S", geometries([(2, 1), (5, 2), (8, 3)], codegen=None))
@torch.no_grad()
def test_taps_match_ground_truth_bf16(L, S):
    cfg = small_config(L, S, taps_for(L, S), dtype=torch.bfloat16)
    model = inference_model(cfg)
    ids = token_ids(cfg)
    _, want = compiled_ground_truth(model, ids)
    _, got = compile_model(model)(ids)
    assert all(t.dtype == torch.bfloat16 for t in got)
    assert_taps_close(got, want, torch.bfloat16, f"L={L} S={S}")


@torch.no_grad()
def test_prefix_stream_reads_the_running_prefix():
    cfg = small_config(5, 2, (0, 2, 3, 5))
    model = inference_model(cfg)
    ids = token_ids(cfg)
    _, legacy = model(ids)  # eager aux_tap is the identity: the prefix stream
    _, mixed = model.ground_truth(ids)
    _, got = compile_model(model, make_kimi_backend(aux_stream="prefix"))(ids)
    assert_taps_close(got, legacy, torch.float32)
    # The two streams really differ past capture id 0 (else this test proves nothing).
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(legacy[1:], mixed[1:], strict=True))


@pytest.mark.codegen
@torch.no_grad()
def test_separate_read_matches_fused():
    # Capture ids 0, a layer inside a block (1), a block write (2), L=3 after a partial block.
    cfg = small_config(3, 2, (0, 1, 2, 3))
    model = inference_model(cfg)
    ids = token_ids(cfg)
    _, want = model.ground_truth(ids)
    backend = make_kimi_backend(fuse_capture=False)
    _, got = compile_model(model, backend)(ids)
    assert_taps_close(got, want, torch.float32)
    assert not any(r.fused for r in backend.aux_pass.last_rewrites)


@torch.no_grad()
def test_dynamic_tokens_compile_once():
    cfg = small_config(4, 2, (0, 2, 4))
    model = inference_model(cfg)
    compiled = compile_model(model)
    for i, T in enumerate((5, 9, 17)):
        ids = token_ids(cfg, T, seed=T)
        if i == 0:
            torch._dynamo.mark_dynamic(ids, 0)
            _, got = compiled(ids)
        else:
            with torch.compiler.set_stance("fail_on_recompile"):
                _, got = compiled(ids)
        _, want = model.ground_truth(ids)
        assert_taps_close(got, want, torch.float32, f"T={T}")


@torch.no_grad()
def test_pipeline_final_stage_matches_single_stage():
    cfg = small_config(6, 2, (0, 3, 4, 6))
    whole = inference_model(cfg)
    ids = token_ids(cfg)
    _, want = whole.ground_truth(ids)
    first, last = inference_model(cfg, 0, 3), inference_model(cfg, 3)
    first.load_state_dict(whole.state_dict(), strict=False)
    last.load_state_dict(whole.state_dict(), strict=False)
    assert first.capture_ids == (0, 3) and last.capture_ids == (3, 4, 6)
    # The first stage taps its end (3): refused. Compile it without that tap.
    with pytest.raises(AuxCaptureError, match=r"capture id 3 .*layers \[0, 3\)"):
        compile_model(first)(ids)
    # The remedy the error names: tap 3 only on the stage that owns layer 3.
    first = inference_model(cfg, 0, 3, capture_ids=(0,))
    (bundle, taps0) = compile_model(first)(ids)
    hidden, taps1 = compile_model(last)(*bundle)
    # Capture id 3 is the final stage's first layer: its prefix is the incoming hidden.
    assert_taps_close(taps0 + taps1, [want[0], want[1], want[2], want[3]], torch.float32)


@torch.no_grad()
def test_boundary_tap_refused_at_compile_time_naming_id_stage_and_remedy():
    cfg = small_config(4, 2, (1, 2))
    stage = inference_model(cfg, 0, 2)
    with pytest.raises(AuxCaptureError) as info:
        compile_model(stage)(token_ids(cfg))
    msg = str(info.value)
    assert "capture id 2" in msg and "[0, 2)" in msg and "Remedy" in msg
    # The prefix stream is the knowing choice: it compiles.
    compile_model(stage, make_kimi_backend(aux_stream="prefix"))(token_ids(cfg))


@torch.no_grad()
def test_stream_switch_with_fx_cache_on_gives_each_streams_values(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    cfg = small_config(4, 2, (0, 2, 4))
    model = inference_model(cfg)
    ids = token_ids(cfg)
    _, legacy = model(ids)
    _, mixed = model.ground_truth(ids)
    counters.clear()
    with inductor_config.patch(force_disable_caches=False, fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=True):  # as users have them
        for stream, want in (("attn_res", mixed), ("prefix", legacy), ("attn_res", mixed)):
            _, got = compile_model(model, make_kimi_backend(aux_stream=stream))(ids)
            assert_taps_close(got, want, torch.float32, stream)
    assert counters["inductor"]["fxgraph_cache_bypass"] == 0
    assert counters["inductor"]["fxgraph_cache_miss"] == 2
    assert counters["inductor"]["fxgraph_cache_hit"] == 1


def test_uuid_covers_every_option():
    ids = {AuxStreamPass(s, fuse=f).uuid() for s in ("attn_res", "prefix") for f in (True, False)}
    assert len(ids) == 4
    assert make_kimi_backend("prefix").passes.uuid() != make_kimi_backend("attn_res").passes.uuid()


def _kimi_calls(code: str) -> int:
    return len(re.findall(r"torch\.ops\.kimi\.attn_res(?:_capture|_mix)?\.default\(", code))


@torch.no_grad()
def test_generated_code_has_no_marker_and_no_extra_mixing_kernels():
    """Counted on the op calls (``lower_kimi_ops=False``, the shape CUDA compiles to); on
    CPU by default every call is generated code (tests/test_lowering.py)."""
    ids_cfg = small_config(4, 2, (0, 2, 3, 4))
    model = inference_model(ids_cfg)
    ids = token_ids(ids_cfg)
    ops = make_kimi_backend(lower_kimi_ops=False)
    _, (code_taps,) = run_and_get_code(compile_model(model, ops), ids)
    no_taps = inference_model(small_config(4, 2, ()))
    _, (code_plain,) = run_and_get_code(compile_model(no_taps, ops), ids)
    for stream in ("prefix",):
        _, (code_prefix,) = run_and_get_code(
            compile_model(model, make_kimi_backend(aux_stream=stream)), ids)
        # The prefix stream reads what the layers already compute: no kimi call added.
        assert "aux_tap" not in code_prefix and _kimi_calls(code_prefix) == 2 * 4 + 1
    assert "aux_tap" not in code_taps
    assert _kimi_calls(code_taps) == _kimi_calls(code_plain) == 2 * 4 + 1
    # The separate-read capture is the one that adds mixing kernels (one per mixed tap).
    _, (code_sep,) = run_and_get_code(
        compile_model(model, make_kimi_backend(fuse_capture=False, lower_kimi_ops=False)), ids)
    assert _kimi_calls(code_sep) == 2 * 4 + 1 + 4


_CODE_COUNTS = {"buffers": r"empty_strided_cpu\(", "clones": r"clone",
                "capture": r"kimi\.attn_res_capture\.default\(", "mix": r"attn_res_mix"}


@pytest.mark.codegen
@torch.no_grad()
def test_fused_capture_on_auto_functionalized_v1():
    """vLLM's default functionalization (v1): the consumer's kernel emits the mixture.

    Counted on the op calls (``lower_kimi_ops=False``). v1 and v2 compile to the same code
    shape (the same buffers, clones and kimi calls:
    attn_res_capture for the two normed consumers, no attn_res_mix, so one extra [T, H]
    write per tap and no second read of the bank) and bit-identical taps.
    """
    cfg = small_config(3, 2, (0, 2, 3))
    model = inference_model(cfg)
    ids = token_ids(cfg)
    taps, shape = {}, {}
    for v2 in (False, True):
        with inductor_config.patch(enable_auto_functionalized_v2=v2):
            (_, taps[v2]), (code,) = run_and_get_code(
                compile_model(model, make_kimi_backend(lower_kimi_ops=False)), ids)
        shape[v2] = {k: len(re.findall(p, code)) for k, p in _CODE_COUNTS.items()}
        assert _kimi_calls(code) == 2 * 3 + 1
    assert shape[False] == shape[True]
    assert (shape[False]["capture"], shape[False]["mix"]) == (2, 0)
    for a, b in zip(taps[False], taps[True], strict=True):
        assert torch.equal(a, b)
    assert_taps_close(taps[False], model.ground_truth(ids)[1], torch.float32)


@torch.no_grad()
def test_backend_by_name_with_options():
    cfg = small_config(3, 2, (1, 3))
    model = inference_model(cfg)
    ids = token_ids(cfg)
    _, legacy = model(ids)
    _, mixed = model.ground_truth(ids)
    for options, want in (({"aux_stream": "prefix"}, legacy), ({}, mixed)):
        torch._dynamo.reset()
        got = torch.compile(model, backend="kimi", options=options, fullgraph=True)(ids)[1]
        assert_taps_close(got, want, torch.float32, str(options))


def test_stream_resolution_order(monkeypatch, tmp_path, caplog):
    """The argument wins; the variable and the drafter's declaration must agree, unless
    the A/B switch asks for the variable's stream, warned; else the declaration; else
    attn_res."""
    monkeypatch.delenv("KIMI_PASSES_AUX_STREAM", raising=False)
    monkeypatch.delenv("KIMI_PASSES_AUX_STREAM_AB", raising=False)
    draft = tmp_path / "config.json"
    draft.write_text(json.dumps({"aux_hidden_stream": "prefix"}))
    assert make_kimi_backend().aux_stream == "attn_res"
    assert make_kimi_backend(draft_config=str(draft)).aux_stream == "prefix"
    assert make_kimi_backend(draft_config=str(tmp_path)).aux_stream == "prefix"
    assert make_kimi_backend(draft_config={"aux_hidden_stream": "attn_res"}).aux_stream == (
        "attn_res")
    monkeypatch.setenv("KIMI_PASSES_AUX_STREAM", "attn_res")
    assert make_kimi_backend().aux_stream == "attn_res"
    assert make_kimi_backend(draft_config={"aux_hidden_stream": "attn_res"}).aux_stream == (
        "attn_res")
    with pytest.raises(StreamConflict, match=(
            r"\$KIMI_PASSES_AUX_STREAM=attn_res asks for 'attn_res', the drafter config "
            r".*config\.json: aux_hidden_stream = 'prefix' asks for 'prefix'.*"
            r"set \$KIMI_PASSES_AUX_STREAM_AB=1")):
        make_kimi_backend(draft_config=str(draft))
    assert make_kimi_backend("prefix", draft_config=str(draft)).aux_stream == "prefix"
    assert make_kimi_backend("attn_res", draft_config=str(draft)).aux_stream == "attn_res"
    assert not caplog.records  # the argument wins unwarned
    monkeypatch.setenv("KIMI_PASSES_AUX_STREAM_AB", "1")
    with caplog.at_level(logging.WARNING, logger="kimi_passes.config.stream"):
        assert make_kimi_backend(draft_config=str(draft)).aux_stream == "attn_res"
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("kimi_passes: A/B run ($KIMI_PASSES_AUX_STREAM_AB=1): serving "
                              "the attn_res stream ($KIMI_PASSES_AUX_STREAM=attn_res)"), warning
    assert f"declares 'prefix' (the drafter config {draft}: aux_hidden_stream" in warning
    monkeypatch.setenv("KIMI_PASSES_AUX_STREAM_AB", "yes")
    with pytest.raises(ValueError, match=r"KIMI_PASSES_AUX_STREAM_AB='yes': set it to 1"):
        make_kimi_backend()
    monkeypatch.delenv("KIMI_PASSES_AUX_STREAM_AB")
    monkeypatch.setenv("KIMI_PASSES_AUX_STREAM", "post_norm")
    with pytest.raises(ValueError, match=r"unknown aux stream 'post_norm' from \$KIMI_PASSES"):
        make_kimi_backend()
    with pytest.raises(ValueError, match="unknown aux stream 'bogus' from the aux_stream arg"):
        make_kimi_backend("bogus")


@torch.no_grad()
@pytest.mark.filterwarnings("ignore:kimi_passes. AuxStreamPass installed alone")  # test_lowering
def test_pass_alone_as_post_grad_custom_post_pass():
    cfg = small_config(3, 1, (0, 2, 3))
    model = inference_model(cfg)
    ids = token_ids(cfg)
    _, want = model.ground_truth(ids)
    aux = AuxStreamPass("attn_res")
    with inductor_config.patch(post_grad_custom_post_pass=aux):
        _, got = compile_model(model, "inductor")(ids)
    assert_taps_close(got, want, torch.float32)
    assert [r.capture_id for r in aux.last_rewrites] == [0, 2, 3]


@torch.no_grad()
def test_logs_once_per_compiled_graph_and_nothing_in_forward(caplog):
    cfg = small_config(3, 1, (1, 3))
    model = inference_model(cfg)
    ids = token_ids(cfg)
    compiled = compile_model(model)
    with caplog.at_level(logging.INFO, logger="kimi_passes"):
        compiled(ids)
        compiled(ids)
        compiled(ids)
    lines = [r.getMessage() for r in caplog.records
             if r.name == "kimi_passes" and r.getMessage().startswith("AuxStreamPass")]
    assert len(lines) == 1, lines
    assert "id 1 <- layer 1" in lines[0] and "id 3 <- output aggregation" in lines[0]
    assert "fused" in lines[0]


@torch.no_grad()
def test_separate_read_is_said_in_the_log(caplog):
    cfg = small_config(2, 1, (1,))
    with caplog.at_level(logging.INFO, logger="kimi_passes"):
        compile_model(inference_model(cfg), make_kimi_backend(fuse_capture=False))(
            token_ids(cfg))
    assert any("separate attn_res_mix read" in r.getMessage() for r in caplog.records)


@torch.no_grad()
@pytest.mark.parametrize("backend", ["function", "instance"])
def test_torch_compile_mode_reaches_inductor(backend):
    """``mode="reduce-overhead"`` is accepted and sets Inductor's CUDA graphs, as for Inductor.

    On CPU Inductor then skips the CUDA graph and says so in its counters: the skip is the
    evidence the mode's options arrived (without them nothing is attempted).
    """
    cfg = small_config(2, 1, (0, 1, 2))
    model = inference_model(cfg)
    ids = token_ids(cfg)
    _, mixed = model.ground_truth(ids)
    counters.clear()
    fn = make_kimi_backend() if backend == "instance" else kimi_backend
    got = compile_model(model, fn, mode="reduce-overhead")(ids)[1]
    assert_taps_close(got, mixed, torch.float32)
    assert counters["inductor"]["cudagraph_skips"] >= 1


def test_unknown_compile_mode_is_named():
    cfg = small_config(1, 1, (0,))
    model = inference_model(cfg)
    with pytest.raises(Exception, match="unknown torch.compile mode 'bogus'"):
        compile_model(model, make_kimi_backend(), mode="bogus")(token_ids(cfg))
