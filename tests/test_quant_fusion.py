"""FuseQuantPass: an AttnRes output read only by a per-token FP8 quant is quantized in the op.

Each form the pass recognises (vLLM's ``QuantFP8`` native form, called from vLLM itself,
with and without ``scale_ub``; the AMD kernel's formula in plain torch, for both fp8
dtypes) is compiled twice by ``kimi_backend``, with ``fuse_quant`` on and off: the fused
graph holds one ``attn_res_quant`` and no quant, the unfused one none, and the fp8 bytes
and the scales are equal. Where the output has another reader nothing is fused. vLLM's
CUDA quant op does not load on CPU: a stand-in of the same schema and the CUDA kernel's
formula, registered under a test namespace, is recognised by name (the pass's lookup name
patched to it) and fused with ``divide_values=True`` (it divides by the scale where the
other forms multiply by its reciprocal; without the flag some bytes differ, shown on one
case).

Compiles use Inductor's ``fallback_by_default`` (every op an ATen call) except one, which
runs Inductor's generated C++ for the unfused quant.
"""

from __future__ import annotations

import pytest
import torch
from helpers.op import rnd

from kimi_passes import make_kimi_backend
from kimi_passes.debug.graph_text import kimi_op_counts
from kimi_passes.debug.recording import GraphRecorder
from kimi_passes.graphs.k3 import fp8_per_token
from kimi_passes.quant import FuseQuantPass, recognise
from kimi_passes.taps.marker import aux_tap

pytestmark = pytest.mark.usefixtures("caches_off", "one_thread")

FAST = {"fallback_by_default": True}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 224.0}
#: Inductor's CPU codegen rounds a bf16 store before a quant reads it under
#: ``emulate_precision_casts`` (measured on torch 2.14.0; not on 2.11.0).
INDUCTOR_EMULATES_CASTS = torch.torch_version.TorchVersion(torch.__version__) >= "2.14"


def site_inputs(T=6, H=64, nb=3, dtype=torch.bfloat16, seed=0):
    """A pre-attention site: prefix, delta, bank, norm, pseudo-query, output norm."""
    return [rnd(T, H, dtype=dtype, seed=seed), rnd(T, H, dtype=dtype, seed=seed + 1),
            rnd(T, nb, H, dtype=dtype, seed=seed + 2), 1 + 0.1 * rnd(H, dtype=dtype, seed=3),
            rnd(H, dtype=dtype, seed=4, scale=0.3), 1 + 0.1 * rnd(H, dtype=dtype, seed=5)]


def attn_res(prefix, delta, bank, nw, qk, onw, nb=2):
    return torch.ops.kimi.attn_res(prefix, delta, bank, nw, qk, onw, nb, -1, 1e-6, 1e-6)


def amd_quant(y, dtype=torch.float8_e4m3fn):
    """vLLM's AMD K3 kernel's quant written in plain torch."""
    return fp8_per_token(y, dtype)


def compile_both(fn, args, v2=True, fast=True, dynamic=False, **options):
    """``fn`` compiled with fuse_quant on and off: {True: (outputs, recorder), False: ...};
    each compile gets its own copy of ``args`` (the op updates the prefix in place)."""
    out = {}
    for fuse in (True, False):
        rec = GraphRecorder(make_kimi_backend(fuse_quant=fuse, **(FAST if fast else {}),
                                              **options))
        torch._dynamo.reset()
        with torch._inductor.config.patch(enable_auto_functionalized_v2=v2), torch.no_grad():
            res = torch.compile(fn, backend=rec, fullgraph=True, dynamic=dynamic or None)(*[
                a.clone() if isinstance(a, torch.Tensor) else a for a in args])
        out[fuse] = (res, rec)
    return out


def assert_same_bytes(a, b):
    """fp8 tensors equal byte for byte, other tensors exactly equal."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        if x.dtype in FP8_MAX:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert torch.equal(x, y), f"{(x != y).sum().item()} of {x.numel()} differ"


def fusions(rec) -> list:
    return rec.backend.passes.get(FuseQuantPass).last_fusions


def quant_nodes(graph) -> int:
    """Casts to an fp8 dtype left in the graph."""
    return sum(1 for n in graph.nodes if n.op == "call_function"
               and recognise._cast_dtype(n) in recognise.FP8_DTYPES)


def check_fused(runs, op="attn_res_quant", form=None, same_bytes=True):
    (fused, rec), (unfused, urec) = runs[True], runs[False]
    if same_bytes:
        assert_same_bytes(fused, unfused)
    counts = kimi_op_counts(rec.last.after)
    assert counts[op] == 1 and counts["attn_res"] == 0, counts
    assert quant_nodes(rec.last.after) == 0
    assert [f.skipped for f in fusions(rec)] == [None]
    if form is not None:
        assert fusions(rec)[0].form == form
    assert kimi_op_counts(urec.last.after)["attn_res_quant"] == 0
    assert quant_nodes(urec.last.after) == 1
    return rec


# ------------------------------------------------------------------ the AMD formula


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_amd_formula_fuses_bit_for_bit(dtype):
    def fn(*a):
        return amd_quant(attn_res(*a), dtype)

    rec = check_fused(compile_both(fn, site_inputs(T=33)), form="AMD kernel formula")
    text = rec.last.text("kimi")
    assert f"quant_dtype=torch.{str(dtype).split('.')[-1]}" in text
    assert "divide=False" in text and "amax_floor=1e-10" in text


def test_generated_cpu_code_and_v1_give_eager_bytes():
    """Full C++ codegen (the kimi ops lowered, the quant Inductor's), on an
    ``auto_functionalized`` (v1) call, vLLM's default. The fused graph gives eager's bytes.
    Inductor's C++ backend by default quantizes the unfused graph's AttnRes output before
    rounding it to bf16 (it reuses the fp32 value of the bf16 store: Inductor's
    ``emulate_precision_casts`` is off), so fused and unfused are compared with
    ``emulate_precision_casts=True``, under which the unfused graph gives eager's bytes too
    from torch 2.14 (CI's main job). torch 2.11's C++ codegen still quantizes the fp32 value
    under that option (77 of 3840 bytes differ from eager here, CI's compatibility job):
    there only the fused graph is held to eager's bytes."""
    def fn(*a):
        return amd_quant(attn_res(*a))

    args = site_inputs(T=40, H=96)
    eager = fn(*[a.clone() for a in args])
    runs = compile_both(fn, args, v2=False, fast=False, emulate_precision_casts=True)
    check_fused(runs, same_bytes=INDUCTOR_EMULATES_CASTS)
    assert_same_bytes(runs[True][0], eager)
    rec = GraphRecorder(make_kimi_backend())
    torch._dynamo.reset()
    with torch._inductor.config.patch(enable_auto_functionalized_v2=False), torch.no_grad():
        fused = torch.compile(fn, backend=rec, fullgraph=True)(*[a.clone() for a in args])
    assert [f.skipped for f in fusions(rec)] == [None]
    assert_same_bytes(fused, eager)


def test_dynamic_tokens_fuse():
    """A graph with a dynamic token count (how vLLM compiles) fuses the same way."""
    def fn(*a):
        return amd_quant(attn_res(*a))

    rec = check_fused(compile_both(fn, site_inputs(T=7), dynamic=True))
    assert "bf16[s0, s1]" in rec.last.text("skeleton")


def test_an_output_with_another_reader_is_not_fused(caplog):
    def fn(*a):
        y = attn_res(*a)
        q, s = amd_quant(y)
        return q, s, y + 1

    runs = compile_both(fn, site_inputs())
    (fused, rec), (unfused, _) = runs[True], runs[False]
    assert_same_bytes(fused, unfused)
    assert kimi_op_counts(rec.last.after)["attn_res_quant"] == 0
    assert quant_nodes(rec.last.after) == 1
    [f] = fusions(rec)
    assert "other readers" in f.skipped


def test_two_quants_of_one_output_are_not_fused():
    def fn(*a):
        y = attn_res(*a)
        return (*amd_quant(y), *amd_quant(y, torch.float8_e4m3fnuz))

    runs = compile_both(fn, site_inputs())
    assert_same_bytes(runs[True][0], runs[False][0])
    rec = runs[True][1]
    assert kimi_op_counts(rec.last.after)["attn_res_quant"] == 0
    assert all("other readers" in f.skipped for f in fusions(rec)) and len(fusions(rec)) == 2


def test_a_floor_on_the_scale_fuses_as_the_scale_floor():
    """The floor applied to the scale rather than to the amax: the op's ``scale_floor``."""
    def fn(*a):
        yf = attn_res(*a).float()
        scale = (yf.abs().amax(-1, keepdim=True) * (1.0 / 448.0)).clamp(min=1e-10)
        return (yf * (1.0 / scale)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale

    args = site_inputs()
    args[0][:2] = 0  # all-zero rows: the floor decides their scale
    args[1][:2] = 0
    rec = check_fused(compile_both(fn, args))
    assert "amax_floor=0.0" in rec.last.text("kimi")
    assert "scale_floor=1e-10" in rec.last.text("kimi")


def test_values_divided_by_the_scale_are_left_alone():
    """``y / scale`` (the CUDA kernel's rounding) is not what the op computes: no match."""
    def fn(*a):
        yf = attn_res(*a).float()
        scale = yf.abs().amax(-1, keepdim=True).clamp(min=1e-10) * (1.0 / 448.0)
        return (yf / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale

    runs = compile_both(fn, site_inputs())
    assert fusions(runs[True][1]) == []
    assert kimi_op_counts(runs[True][1].last.after)["attn_res"] == 1


def test_a_tapped_site_fuses_as_the_capture_variant():
    """After the aux pass the call is attn_res_capture: it becomes attn_res_quant_capture,
    and the tap still reads the pre-norm mixture."""
    def fn(prefix, delta, bank, nw, qk, onw):
        tap = aux_tap(prefix + delta, 1)
        q, s = amd_quant(torch.ops.kimi.attn_res(prefix, delta, bank, nw, qk, onw, 1, -1,
                                                 1e-6, 1e-6))
        return q, s, tap

    args = site_inputs(nb=2)
    runs = compile_both(fn, args)
    check_fused(runs, op="attn_res_quant_capture")
    truth = torch.ops.kimi.attn_res_mix(args[0] + args[1], args[2], args[3], args[4], 1, 1e-6)
    torch.testing.assert_close(runs[True][0][2], truth, atol=0, rtol=0)


def traced_quant(fn, T=4, H=16):
    """``fn``'s ATen graph under Inductor's decompositions, with fake values (the shape
    torch 2.11's post-grad graph keeps; 2.13 and later drop a multiply by one first)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake", decomposition_table=select_decomp_table())(
        rnd(T, H, dtype=torch.bfloat16)).graph


def test_a_reciprocal_times_one_is_the_reciprocal():
    """``1.0 / scale`` traced as ``mul(reciprocal(scale), 1.0)`` (torch 2.11) is the AMD
    formula, the multiply among the quant's nodes; a multiply by another constant is not."""
    graph = traced_quant(lambda y: amd_quant(y))
    [site] = recognise.find_quants(graph)
    ones = [n for n in site.nodes if n.target is torch.ops.aten.mul.Tensor and 1.0 in n.args]
    assert site.form == "AMD kernel formula" and len(ones) == 1 and site.private()
    assert site.params == recognise.QuantParams(torch.float8_e4m3fn, 448.0, 1e-10, 0.0,
                                                False, None)

    def twice(y):
        yf = y.float()
        scale = yf.abs().amax(-1, keepdim=True).clamp(min=1e-10) * (1.0 / 448.0)
        return (yf * (2.0 / scale)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale

    assert recognise.find_quants(traced_quant(twice)) == []


def test_fuse_quant_off_is_in_the_cache_key():
    on, off = (make_kimi_backend(fuse_quant=f).passes.uuid() for f in (True, False))
    assert on != off
    assert not any(isinstance(p, FuseQuantPass)
                   for p in make_kimi_backend(fuse_quant=False).passes.passes)


# ------------------------------------------------------------------ vLLM's QuantFP8


@pytest.fixture(scope="module")
def quant_fp8():
    """vLLM's QuantFP8, dynamic per token, built the way vLLM builds it (under a config)."""
    from helpers.vllm_harness import new_vllm_config
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    with set_current_vllm_config(new_vllm_config()):
        return QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN)


@pytest.mark.vllm
@pytest.mark.parametrize("ub", [None, 0.75], ids=["no_ub", "scale_ub"])
def test_vllm_quant_fp8_native_fuses_bit_for_bit(quant_fp8, ub):
    def fn(*a):
        *site, scale_ub = a
        return quant_fp8.forward_native(attn_res(*site), scale_ub=scale_ub)

    scale_ub = None if ub is None else torch.tensor([ub])
    # Rows of very different sizes: some hit the scale floor, some the upper bound.
    args = site_inputs(T=24)
    args[0][:4] *= 1e-5
    rec = check_fused(compile_both(fn, [*args, scale_ub]), form="QuantFP8 native")
    text = rec.last.text("kimi")
    assert "divide=True" in text and "amax_floor=0.0" in text
    assert ("scale_ub=None" in text) == (ub is None)


@pytest.mark.vllm
def test_the_vllm_pass_runs_fuse_quant_after_the_aux_pass():
    from kimi_passes.vllm import compile_config_entries

    def passes(**options):
        entry = compile_config_entries(**options)["post_grad_custom_post_pass"]
        return [type(p).__name__ for p in entry.manager.passes]

    assert passes() == ["AttnResFusionPass", "AuxStreamPass", "FuseQuantPass"]
    assert "FuseQuantPass" not in passes(fuse_quant=False)


# ------------------------------------------------------------------ vLLM's CUDA op, a stand-in

_lib = None


def _standin():
    """``kimi_test::dynamic_per_token_scaled_fp8_quant``: the schema of vLLM's CUDA op
    (csrc/torch_bindings.cpp) and its kernel's formula (x / scale), on CPU."""
    global _lib
    if _lib is None:
        _lib = torch.library.Library("kimi_test", "FRAGMENT")
        _lib.define("dynamic_per_token_scaled_fp8_quant(Tensor! result, Tensor input, "
                    "Tensor! scale, Tensor? scale_ub) -> ()")

        def impl(result, x, scale, scale_ub):
            qmax = FP8_MAX[result.dtype]
            amax = x.float().abs().amax(-1, keepdim=True)
            if scale_ub is not None:
                amax = torch.minimum(amax, scale_ub)
            s = torch.maximum(amax / qmax, torch.tensor(1.0 / (qmax * 512.0)))
            scale.copy_(s)
            result.copy_((x.float() / s).clamp(-qmax, qmax).to(result.dtype))

        _lib.impl("dynamic_per_token_scaled_fp8_quant", impl, "CPU")
        _lib._register_fake("dynamic_per_token_scaled_fp8_quant", lambda r, x, s, u: None)
    return torch.ops.kimi_test.dynamic_per_token_scaled_fp8_quant.default


@pytest.mark.parametrize(("v2", "ub"), [(True, False), (False, True)])
def test_the_cuda_quant_op_is_fused_dividing_the_values(monkeypatch, v2, ub):
    """The CUDA op (v1 and v2 functionalization, with and without scale_ub) becomes
    attn_res_quant with its scale's constants and divide_values=True; the fused bytes and
    scales equal the unfused ones."""
    op = _standin()
    scale_ub = torch.tensor([1.5]) if ub else None
    monkeypatch.setattr(recognise, "C_PER_TOKEN_QUANT", op._schema.name)

    def fn(*a):
        y = attn_res(*a)
        out = torch.empty_like(y, dtype=torch.float8_e4m3fn)
        scale = torch.empty(y.shape[0], 1)
        op(out, y, scale, scale_ub)
        return out, scale

    runs = compile_both(fn, site_inputs(T=37, H=1024, seed=7), v2=v2)
    (fused, rec), (unfused, urec) = runs[True], runs[False]
    assert_same_bytes(fused, unfused)
    assert [(f.form, f.skipped) for f in fusions(rec)] == [("vLLM _C per-token op", None)]
    counts = kimi_op_counts(rec.last.after)
    assert counts["attn_res_quant"] == 1 and counts["attn_res"] == 0, counts
    assert op not in {n.args[0] for n in rec.last.after.nodes if n.args}
    assert op in {n.args[0] for n in urec.last.after.nodes if n.args}
    text = rec.last.text("kimi")
    assert "divide_values=True" in text and "divide=True" in text
    assert ("scale_ub=None" in text) != ub


def test_the_cuda_op_formula_needs_divide_values():
    """Why the CUDA op is fused with divide_values=True: attn_res_quant with its scale's
    constants (QuantFP8's) multiplies by 1 / scale and gives other fp8 bytes than x / scale
    on some elements; with divide_values=True every byte and scale is the op's."""
    op = _standin()
    prefix, delta, bank, nw, qk, onw = site_inputs(T=64, H=1024, seed=7)
    y = attn_res(prefix.clone(), delta, bank.clone(), nw, qk, onw)
    out, scale = torch.empty_like(y, dtype=torch.float8_e4m3fn), torch.empty(64, 1)
    op(out, y, scale, None)
    q, s = torch.ops.kimi.attn_res_quant(prefix.clone(), delta, bank.clone(), nw, qk, onw, 2, -1,
                                         1e-6, 1e-6, torch.float8_e4m3fn, 448.0, 0.0,
                                         1.0 / (448 * 512), True)
    assert torch.equal(s, scale)
    differ = (q.view(torch.uint8) != out.view(torch.uint8)).sum().item()
    assert 0 < differ < out.numel() // 1000, differ
    q, s = torch.ops.kimi.attn_res_quant(prefix.clone(), delta, bank.clone(), nw, qk, onw, 2, -1,
                                         1e-6, 1e-6, torch.float8_e4m3fn, 448.0, 0.0,
                                         1.0 / (448 * 512), True, divide_values=True)
    assert torch.equal(s, scale)
    assert torch.equal(q.view(torch.uint8), out.view(torch.uint8))


# ------------------------------------------------------------------ CUDA (tools/gpu_check.sh)


@pytest.mark.gpu_check("compiled")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T", [1, 8, 64, 300])
def test_cuda_fused_quant_gives_the_unfused_bytes(T):
    """On CUDA the fused op's Triton epilogue against Inductor's Triton kernel for the
    quant: the same fp8 bytes and scales (H=7168 bf16, both fp8 dtypes)."""
    for dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        def fn(*a, dtype=dtype):
            return amd_quant(attn_res(*a), dtype)

        args = [a.cuda() for a in site_inputs(T=T, H=7168, nb=8, seed=T)]
        runs = compile_both(fn, args, fast=False)
        check_fused(runs)
