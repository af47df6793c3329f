"""CUDA checks: the kimi ops dispatch to the Triton kernel on CUDA, and kimi_backend
compiles the tiny K3 on CUDA with taps equal to the ground truth.

Every test is skipped without CUDA (``tools/gpu_check.sh`` runs them on a lent GPU, by
their ``gpu_check`` shard mark). Written for torch >= 2.11 and triton >= 3.6.
"""

from __future__ import annotations

import pytest
import torch
from helpers.op import DTYPES, EPS, clone_args, mix_args, opcheck
from helpers.op import make_args as _make_args

import kimi_passes
from kimi_passes.bench import rel_err
from kimi_passes.ops import (
    attn_res_capture_triton,
    attn_res_mix_reference,
    attn_res_mix_triton,
    attn_res_reference,
    attn_res_triton,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

OPS = torch.ops.kimi
DEV = "cuda"
# fp32 1e-4, not the op tolerance's 1e-5 (helpers.op.OP_TOL, which the CPU path and the
# interpreted kernel meet): the compiled kernel's exp and rsqrt are the GPU's approximate
# instructions, and its reductions run in another order, over rows up to K3's H=7168.
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}

# (T, H, NB, nb, write, delta, onorm): power-of-two and ragged H, nb = 0, a write past the
# read range (the model's block boundary) and one inside it, K3's width.
CASES = [
    (7, 64, 4, 3, -1, False, False),
    (7, 64, 4, 3, 3, True, True),
    (5, 100, 4, 2, 1, True, False),
    (5, 100, 4, 0, -1, True, True),
    (3, 7168, 9, 8, 8, True, True),
    (33, 1024, 9, 9, -1, False, False),
]


def make_args(*args, **kw):
    return _make_args(*args, **kw, device=DEV)


def close(actual, expected, dtype):
    assert actual.dtype == expected.dtype == dtype and actual.device == expected.device
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.gpu_check("ops")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_attn_res_matches_reference(case, dtype):
    T, H, NB, nb, write, delta, onorm = case
    args = make_args(T, H, NB, nb, write, dtype, delta=delta, onorm=onorm)
    mine, ref = clone_args(args), clone_args(args)
    out = OPS.attn_res(*mine)
    expected = attn_res_reference(*ref)
    close(out, expected, dtype)
    # In-place effects: prefix <- round(prefix + delta), blocks[:, write] <- prefix.
    assert torch.equal(mine[0], ref[0])
    assert torch.equal(mine[2], ref[2])


def _check_capture(args, dtype):
    """``attn_res_capture`` on ``args`` against the reference: both outputs, both effects."""
    mine, ref = clone_args(args), clone_args(args)
    out, mixed = OPS.attn_res_capture(*mine)
    exp_out, exp_mixed = attn_res_reference(*ref, return_mix=True)
    close(out, exp_out, dtype)
    close(mixed, exp_mixed, dtype)
    assert torch.equal(mine[0], ref[0]) and torch.equal(mine[2], ref[2])
    return out, mixed


@pytest.mark.gpu_check("ops")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_capture_and_mix_match_reference(case, dtype):
    T, H, NB, nb, write, delta, onorm = case
    args = make_args(T, H, NB, nb, write, dtype, delta=delta, onorm=onorm)
    out, mixed = _check_capture(args, dtype)
    assert out.data_ptr() != mixed.data_ptr()
    prefix, _, blocks, nw, qk, *_ = clone_args(args)
    pure = OPS.attn_res_mix(prefix, blocks, nw, qk, nb, EPS)
    expected = attn_res_mix_reference(prefix, blocks, nw, qk, nb, EPS).to(dtype)
    close(pure, expected, dtype)


@pytest.mark.gpu_check("ops")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_dispatches_to_triton(dtype):
    """The registered CUDA kernel is the Triton kernel: bit-identical results."""
    args = make_args(9, 384, 5, 4, 4, dtype, delta=True, onorm=True)
    a, b = clone_args(args), clone_args(args)
    assert torch.equal(OPS.attn_res(*a), attn_res_triton(*b))
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
    a, b = clone_args(args), clone_args(args)
    for x, y in zip(OPS.attn_res_capture(*a), attn_res_capture_triton(*b), strict=True):
        assert torch.equal(x, y)
    prefix, _, blocks, nw, qk, *_ = args
    assert torch.equal(OPS.attn_res_mix(prefix, blocks, nw, qk, 4, EPS),
                       attn_res_mix_triton(prefix, blocks, nw, qk, 4, EPS))


@pytest.mark.gpu_check("quant")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", [1, 8, 64, 65])
def test_decode_route_at_k3_shapes(T, dtype):
    """K3's width at decode sizes: the route auto takes (the decode path up to T = 64, the
    row kernel above) and the forced row route agree with the reference and each other, with
    the same in-place effects; the capture's mixture is attn_res_mix's on the new state."""
    from kimi_passes.ops import triton_decode

    assert triton_decode.takes_decode(T, 7168) == (T <= 64)
    for nb, write, onorm in ((8, 7, True), (5, 2, False), (0, -1, True)):
        args = make_args(T, 7168, 8, nb, write, dtype, delta=True, onorm=onorm)
        ref = clone_args(args)
        exp_out, exp_mixed = attn_res_reference(*ref, return_mix=True)
        got = {}
        for route in ("auto", "row"):
            a = clone_args(args)
            out, mixed = attn_res_capture_triton(*a, route=route)
            assert torch.equal(a[0], ref[0]) and torch.equal(a[2], ref[2]), route
            close(out, exp_out, dtype)
            close(mixed, exp_mixed, dtype)
            prefix, _, blocks, nw, qk, *_ = a
            assert torch.equal(mixed, attn_res_mix_triton(prefix, blocks, nw, qk, nb, EPS,
                                                          route=route)), route
            got[route] = out, mixed
        close(got["auto"][0], got["row"][0], dtype)
        close(got["auto"][1], got["row"][1], dtype)


@pytest.mark.gpu_check("ops")
def test_strided_bank_view():
    """A bank that is a view with a padded row stride reads the right sources."""
    dtype = torch.bfloat16
    args = make_args(6, 256, 4, 3, -1, dtype, delta=False, onorm=True)
    wide = torch.zeros(6, 6, 256, dtype=dtype, device=DEV)
    wide[:, :4] = args[2]
    view = wide[:, :4]
    a = clone_args(args)
    a[2] = view
    close(OPS.attn_res(*a), attn_res_reference(*clone_args(args)), dtype)


@pytest.mark.gpu_check("ops")
@pytest.mark.parametrize("case", [CASES[1], CASES[3], (6, 100, 9, 8, 8, True, True)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck_cuda(case, dtype):
    T, H, NB, nb, write, delta, onorm = case
    args = make_args(T, H, NB, nb, write, dtype, delta=delta, onorm=onorm)
    opcheck(OPS.attn_res.default, clone_args(args))
    opcheck(OPS.attn_res_capture.default, clone_args(args))
    opcheck(OPS.attn_res_mix.default, mix_args(clone_args(args)))


@pytest.mark.gpu_check("compiled")
@pytest.mark.parametrize("stream,fuse", [("attn_res", True), ("attn_res", False),
                                         ("prefix", True)])
def test_k3_tiny_compiled_on_cuda(stream, fuse, monkeypatch):
    """kimi_backend on CUDA: attn_res taps equal the eager ground truth; prefix taps the prefix."""
    # Inductor's own Triton kernels must be compiled, not interpreted (the test conftest
    # sets TRITON_INTERPRET=1 for the CPU runs of the kimi kernel).
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from kimi_passes.graphs import K3Config, K3Model

    torch._dynamo.reset()
    cfg = K3Config.tiny()
    ids = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    ids = ids.to(DEV)
    model = K3Model(cfg).to(DEV)
    with torch.no_grad():
        hidden_ref, truth = model.ground_truth(ids)
        _, legacy = model(ids)
        backend = kimi_passes.make_kimi_backend(aux_stream=stream, fuse_capture=fuse)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        hidden, taps = compiled(ids)
    assert len(backend.aux_pass.last_rewrites) == len(cfg.aux_layer_ids)
    # Inductor's matmuls and the eager ones may round differently: a wrong stream is O(1) off.
    torch.testing.assert_close(hidden, hidden_ref, atol=1e-3, rtol=1e-3)
    expected = truth if stream == "attn_res" else legacy
    assert len(taps) == len(expected)
    for k, got, want in zip(cfg.aux_layer_ids, taps, expected, strict=True):
        assert got.device.type == "cuda"
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3, msg=f"capture id {k}")
    if stream == "attn_res":
        hows = {r.how() for r in backend.aux_pass.last_rewrites}
        assert hows == ({"fused"} if fuse else {"separate attn_res_mix read"})


@pytest.mark.gpu_check("graphs")
def test_k3_tiny_cuda_graphs_replay_with_new_inputs(monkeypatch):
    """kimi_backend under ``mode="reduce-overhead"`` (CUDA graphs): several replays with
    new inputs of one shape, each tap equal to the ground truth of its inputs.
    """
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from torch._dynamo.utils import counters

    from kimi_passes.graphs import K3Config, K3Model

    torch._dynamo.reset()
    counters.clear()
    cfg = K3Config.tiny()
    model = K3Model(cfg).to(DEV)
    backend = kimi_passes.make_kimi_backend(aux_stream="attn_res")
    compiled = torch.compile(model, backend=backend, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for step in range(5):
            ids = torch.randint(0, cfg.vocab_size, (12,), generator=g).to(DEV)
            torch.compiler.cudagraph_mark_step_begin()
            hidden, taps = compiled(ids)
            # Graph outputs live in the graph's pool: copy them before the next replay.
            hidden, taps = hidden.clone(), [t.clone() for t in taps]
            hidden_ref, truth = model.ground_truth(ids)
            torch.testing.assert_close(hidden, hidden_ref, atol=1e-3, rtol=1e-3)
            for k, got, want in zip(cfg.aux_layer_ids, taps, truth, strict=True):
                torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3,
                                           msg=f"replay {step}, capture id {k}")
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    assert len(backend.aux_pass.last_rewrites) == len(cfg.aux_layer_ids)


@pytest.mark.gpu_check("quant")
@pytest.mark.vllm
@pytest.mark.parametrize("ub", [None, 0.5])
def test_vllm_c_per_token_quant_is_the_op_with_divide_values_cuda(ub):
    """vLLM's CUDA op ``_C::dynamic_per_token_scaled_fp8_quant`` of ``attn_res``'s output
    against ``attn_res_quant`` with its constants and ``divide_values=True`` (what
    FuseQuantPass fuses it to): the same fp8 bytes and scales (K3's width, bf16)."""
    from vllm import _custom_ops as vllm_ops

    from kimi_passes.ops import quant_fp8_constants

    if not hasattr(torch.ops._C, "dynamic_per_token_scaled_fp8_quant"):
        pytest.skip("vLLM's _C extension has no dynamic_per_token_scaled_fp8_quant here")
    args = make_args(64, 7168, 9, 8, 8, torch.bfloat16, delta=True, onorm=True)
    out = OPS.attn_res(*clone_args(args))
    scale_ub = None if ub is None else torch.tensor([ub], device=DEV)
    want, want_scale = vllm_ops.scaled_fp8_quant(out, scale_ub=scale_ub,
                                                 use_per_token_if_dynamic=True)
    data, scale = OPS.attn_res_quant(*clone_args(args), want.dtype,
                                     **quant_fp8_constants(want.dtype), scale_ub=scale_ub,
                                     divide_values=True)
    assert torch.equal(scale, want_scale.view(-1, 1))
    assert torch.equal(data.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.gpu_check("quant")
@pytest.mark.parametrize("route", ["row", "decode"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_quant_is_the_quant_of_the_routes_output_cuda(case, dtype, route):
    """The compiled quant epilogue (the GPU's fp8 conversion, ``div_rn``): bytes and scales
    equal ``fp8_quant.quantize_rows`` (torch on the GPU) of the same route's unquantized
    output, bit for bit, in both fp8 dtypes and both quant forms; in-place effects and the
    captured mixture as that launch's."""
    from kimi_passes.ops import attn_res_quant_capture_triton, quant_fp8_constants
    from kimi_passes.ops.attn_res_args import AttnResQuantArgs
    from kimi_passes.ops.fp8_quant import quantize_rows

    T, H, NB, nb, write, delta, onorm = case
    args = make_args(T, H, NB, nb, write, dtype, delta=delta, onorm=onorm)
    plain = clone_args(args)
    out, mixed = attn_res_capture_triton(*plain, route=route)
    for qd in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        for extra in ({}, dict(quant_fp8_constants(qd), scale_ub=torch.ones(1, device=DEV)),
                      dict(quant_fp8_constants(qd), divide_values=True)):
            got = clone_args(args)
            data, scale, got_mixed = attn_res_quant_capture_triton(*got, qd, route=route,
                                                                   **extra)
            want = quantize_rows(out, AttnResQuantArgs.from_args(*args, qd, **extra))
            assert torch.equal(data.view(torch.uint8), want[0].view(torch.uint8)), (qd, extra)
            assert torch.equal(scale, want[1]), (qd, extra)
            assert torch.equal(got_mixed, mixed)
            assert torch.equal(got[0], plain[0]) and torch.equal(got[2], plain[2])
            d2, s2 = OPS.attn_res_quant(*clone_args(args), qd, **extra)  # CUDA dispatch
            assert d2.device.type == "cuda" and d2.dtype == qd and s2.shape == (T, 1)


# ------------------------------------------ the backward and the chunked kernels on the GPU
# ops/triton_backward.py (attn_res_mix's gradient on CUDA) and ops/triton_chunked.py (rows
# wider than the row kernel holds: next_power_of_2(H) > 8192) run nowhere else compiled.

#: Max |grad - fp64 truth| / max |fp64 truth|: the CPU tests' (test_ops_autograd.GRAD_TOL),
#: fp32 at the compiled kernel's 1e-4 (TOL above: approximate exp and rsqrt).
GRAD_TOL = {torch.float32: 1e-4, torch.bfloat16: 8e-3}


def _mix64(prefix, blocks, nw, qk, nb, eps):
    """The mixture (docs/design.md section 3) in fp64 plain torch: autograd's truth."""
    v = torch.cat([blocks[:, :nb], prefix[:, None]], 1)
    logits = (v @ (nw * qk)) * torch.rsqrt(v.square().mean(-1) + eps)
    return (logits.softmax(-1)[..., None] * v).sum(1)


def _check_mix_forward_backward(T, H, NB, nb, dtype, seed):
    """attn_res_mix on DEV (forward and autograd's backward: the kimi kernels) against the
    fp32 reference forward and autograd through the fp64 mixture on the CPU."""
    g = torch.Generator().manual_seed(seed)
    host = [torch.randn(T, H, generator=g), torch.randn(T, NB, H, generator=g),
            1 + 0.1 * torch.randn(H, generator=g), torch.randn(H, generator=g) * 2 / H**0.5]
    host = [t.to(dtype) for t in host]
    grad = torch.randn(T, H, generator=g).to(dtype)
    ins = [t.to(DEV).requires_grad_() for t in host]
    out = OPS.attn_res_mix(*ins, nb, EPS)
    with torch.no_grad():
        expected = attn_res_mix_reference(*ins, nb, EPS).to(dtype)
    close(out.detach(), expected, dtype)
    got = torch.autograd.grad(out, ins, grad.to(DEV))
    ins64 = [t.double().requires_grad_() for t in host]
    want = torch.autograd.grad(_mix64(*ins64, nb, EPS), ins64, grad.double())
    for name, g_, w_ in zip(("prefix", "blocks", "norm_weight", "qk_weight"), got, want,
                            strict=True):
        assert g_.device.type == DEV and g_.dtype == dtype, name
        err = rel_err(g_.cpu(), w_)
        assert err < GRAD_TOL[dtype], (name, err)
    assert not got[1][:, nb:].any()  # slots the mixture does not read get zero


@pytest.mark.gpu_check("wide")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T", [8, 96])
def test_mix_forward_and_backward_at_k3_width_cuda(T, dtype):
    """K3's width (H=7168, 8 of 9 slots): the forward's decode path (T=8) and row kernel
    (T=96), the backward's row kernel."""
    from kimi_passes.ops import triton_backward, triton_decode

    assert triton_decode.takes_decode(T, 7168) == (T <= 64)
    assert triton_backward.launch_config(7168, dtype)[0] is triton_backward._KERNEL
    _check_mix_forward_backward(T, 7168, 9, 8, dtype, seed=T)


@pytest.mark.gpu_check("wide")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chunked_kernels_above_8192_cuda(dtype):
    """H=10240 (aligned; next_power_of_2 = 16384 > 8192): the chunked forward (attn_res with
    delta, a block write and the output norm; the capture's mixture) and the chunked
    backward against the reference, with the reference's in-place effects."""
    from kimi_passes.ops import triton_backward, triton_kernels

    T, H, NB, nb = 80, 10240, 5, 4  # T > 64: not the decode path
    assert triton_kernels.launch_config(H, dtype)[0] is triton_kernels.CHUNKED_KERNEL
    assert triton_backward.launch_config(H, dtype)[0] is triton_backward.CHUNKED_KERNEL
    _check_capture(make_args(T, H, NB, nb, 2, dtype, delta=True, onorm=True, seed=H), dtype)
    _check_mix_forward_backward(T, H, NB, nb, dtype, seed=H + 1)
