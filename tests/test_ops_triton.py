"""The Triton AttnRes kernel against the plain-torch reference (docs/design.md section 3).

On CPU the kernel runs under the Triton interpreter (conftest sets
TRITON_INTERPRET before triton is imported), which costs milliseconds per
program and source, so the grid below is chosen to stay small: the full flag
grid runs on one small shape, the shape grid on one flag setting.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from helpers.op import DTYPES, OP_TOL

from kimi_passes.ops import (
    AttnResArgumentError,
    attn_res_capture_triton,
    attn_res_mix_reference,
    attn_res_mix_triton,
    attn_res_reference,
    attn_res_triton,
)
from kimi_passes.ops import triton_decode as td
from kimi_passes.ops import triton_kernels as tk

EPS = 1e-6
OUT_EPS = 1e-5


@pytest.fixture(autouse=True)
def _cpu_tests_need_the_interpreter(request):
    # Compiled mode (TRITON_INTERPRET=0, for the CUDA test) cannot launch on CPU tensors.
    if not request.node.name.startswith("test_cuda_") and not tk.INTERPRETED:
        pytest.skip("CPU tests run the kernel under the Triton interpreter (TRITON_INTERPRET=1)")


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _inputs(T, NB, H, dtype, seed, *, scale=1.0, logit_scale=1.0, device="cpu"):
    """Deterministic operands: (prefix, delta, blocks, norm_w, qk_w, out_norm_w)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        # Clamped so that scale=1e4 stays finite in fp16 (prefix + delta <= 4.5e4).
        return torch.randn(*shape, generator=g).clamp_(-3.0, 3.0)

    prefix = randn(T, H) * scale
    delta = randn(T, H) * (0.5 * scale)
    blocks = randn(T, NB, H) * scale
    norm_w = 1.0 + 0.1 * randn(H)
    qk_w = randn(H) * (2.0 * logit_scale / H**0.5)
    out_norm_w = 1.0 + 0.1 * randn(H)
    return tuple(
        t.to(dtype=dtype, device=device)
        for t in (prefix, delta, blocks, norm_w, qk_w, out_norm_w)
    )


def _close(actual, expected, dtype, *, scale=1.0, msg=""):
    tol = OP_TOL[dtype]
    torch.testing.assert_close(
        actual.float(), expected.float(), atol=tol * scale, rtol=tol, equal_nan=True, msg=msg
    )


def _check_attn_res(T, NB, H, dtype, num_blocks, write_idx, with_delta, with_norm, seed,
                    *, scale=1.0, logit_scale=1.0):
    """attn_res and attn_res_capture vs the reference, in-place effects exact."""
    prefix, delta, blocks, nw, qk, onw = _inputs(
        T, NB, H, dtype, seed, scale=scale, logit_scale=logit_scale)
    delta = delta if with_delta else None
    onw = onw if with_norm else None
    args = lambda p, b: (p, delta, b, nw, qk, onw, num_blocks, write_idx, EPS, OUT_EPS)

    p_ref, b_ref = prefix.clone(), blocks.clone()
    out_ref, mix_ref = attn_res_reference(*args(p_ref, b_ref), return_mix=True)

    p_tri, b_tri = prefix.clone(), blocks.clone()
    out = attn_res_triton(*args(p_tri, b_tri))
    assert out.shape == (T, H) and out.dtype == dtype
    assert torch.equal(p_tri, p_ref), "prefix update differs from the reference"
    assert torch.equal(b_tri, b_ref), "block write differs from the reference"
    _close(out, out_ref, dtype, scale=1.0 if with_norm else scale, msg="out")

    p_cap, b_cap = prefix.clone(), blocks.clone()
    out_c, mix_c = attn_res_capture_triton(*args(p_cap, b_cap))
    assert torch.equal(p_cap, p_ref) and torch.equal(b_cap, b_ref)
    assert torch.equal(out_c, out), "capture's out must equal attn_res's out bit for bit"
    assert out_c.data_ptr() != mix_c.data_ptr() or T * H == 0, "capture outputs alias"
    _close(mix_c, mix_ref, dtype, scale=scale, msg="mixed")
    # The capture's mixture is the pure mixture of the post-update state, bit for bit.
    mix_post = attn_res_mix_triton(p_cap, b_cap, nw, qk, num_blocks, EPS)
    assert torch.equal(mix_c, mix_post), "capture's mixed differs from attn_res_mix"
    return out, mix_c


# --- every flag combination, every dtype, one small shape --------------------------------

FLAG_GRID = list(itertools.product(DTYPES, (True, False), (-1, 1), (True, False)))


@pytest.mark.parametrize(
    "dtype,with_delta,write_idx,with_norm",
    FLAG_GRID,
    ids=[f"{_dt(d)}-delta{int(a)}-w{w}-norm{int(n)}" for d, a, w, n in FLAG_GRID],
)
def test_flags_match_reference(dtype, with_delta, write_idx, with_norm):
    # num_blocks=3 of NB=5: a middle count; write_idx=1 lands inside the sources.
    _check_attn_res(7, 5, 100, dtype, 3, write_idx, with_delta, with_norm, seed=11)


# --- num_blocks at its edges, write slot inside / outside the sources --------------------

EDGE_GRID = list(itertools.product(DTYPES, ((0, -1), (0, 2), (5, 4), (5, 0), (3, 4))))


@pytest.mark.parametrize(
    "dtype,nb_w", EDGE_GRID, ids=[f"{_dt(d)}-nb{n}-w{w}" for d, (n, w) in EDGE_GRID]
)
def test_num_blocks_edges(dtype, nb_w):
    num_blocks, write_idx = nb_w
    _check_attn_res(7, 5, 48, dtype, num_blocks, write_idx, True, True, seed=23)


def test_zero_blocks_mixture_is_prefix():
    prefix, delta, blocks, nw, qk, onw = _inputs(7, 3, 48, torch.bfloat16, seed=5)
    p = prefix.clone()
    out, mixed = attn_res_capture_triton(p, delta, blocks, nw, qk, None, 0, 1, EPS, OUT_EPS)
    assert torch.equal(mixed, p) and torch.equal(out, p)
    assert torch.equal(attn_res_mix_triton(p, blocks, nw, qk, 0, EPS), p)


# --- shapes: T in {0, 1, 7, 64}, H in {16, 48, 100, 128} -----------------------------------

SHAPE_GRID = [
    (T, H, dtype)
    for (T, H), dtype in zip(
        itertools.product((0, 1, 7), (16, 48, 100, 128)), itertools.cycle(DTYPES)
    )
] + [(64, 100, torch.float32), (64, 16, torch.bfloat16)]


@pytest.mark.parametrize(
    "T,H,dtype", SHAPE_GRID, ids=[f"T{T}-H{H}-{_dt(d)}" for T, H, d in SHAPE_GRID]
)
def test_shapes_match_reference(T, H, dtype):
    NB = 9
    _check_attn_res(T, NB, H, dtype, 4, 6, True, True, seed=T * 1000 + H)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_all_nine_blocks(dtype):
    _check_attn_res(7, 9, 128, dtype, 9, 8, True, True, seed=99)


# --- attn_res_mix -----------------------------------------------------------------------

MIX_GRID = list(itertools.product(DTYPES, (0, 2, 6)))


@pytest.mark.parametrize("dtype,num_blocks", MIX_GRID,
                         ids=[f"{_dt(d)}-nb{n}" for d, n in MIX_GRID])
def test_mix_matches_reference_and_does_not_mutate(dtype, num_blocks):
    prefix, _, blocks, nw, qk, _ = _inputs(7, 6, 100, dtype, seed=num_blocks + 3)
    p0, b0 = prefix.clone(), blocks.clone()
    mixed = attn_res_mix_triton(prefix, blocks, nw, qk, num_blocks, EPS)
    assert torch.equal(prefix, p0) and torch.equal(blocks, b0)
    assert mixed.data_ptr() != prefix.data_ptr()
    expected = attn_res_mix_reference(prefix, blocks, nw, qk, num_blocks, EPS).to(dtype)
    _close(mixed, expected, dtype)


# --- numerical stress ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_large_magnitude_sources(dtype):
    out, mixed = _check_attn_res(7, 6, 100, dtype, 6, 2, True, True, seed=7, scale=1e4)
    assert torch.isfinite(out).all() and torch.isfinite(mixed).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_sharp_softmax_large_logits(dtype):
    # Logits of order 100: exp() overflows fp32 unless the running max is subtracted.
    prefix, _, blocks, nw, qk, _ = _inputs(7, 6, 48, dtype, 8, scale=1e4, logit_scale=30.0)
    values = torch.cat([blocks, prefix[:, None]], 1).float()
    logits = F.rms_norm(values, (48,), nw.float(), EPS) @ qk.float()
    assert logits.amax() > 89.0  # exp(89) > fp32 max
    out, mixed = _check_attn_res(7, 6, 48, dtype, 6, -1, False, False, seed=8,
                                 scale=1e4, logit_scale=30.0)
    assert torch.isfinite(out).all() and torch.isfinite(mixed).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_nan_in_a_block_source_propagates(dtype):
    T, NB, H, nb = 7, 5, 48, 4
    prefix, delta, blocks, nw, qk, onw = _inputs(T, NB, H, dtype, seed=13)
    blocks[2, 1, 5] = float("nan")  # a source of row 2
    blocks[4, 3, 0] = float("nan")  # a source of row 4 (the last one mixed)
    blocks[5, 4, 7] = float("nan")  # slot 4 >= num_blocks: not a source of row 5
    launches = {
        "attn_res": lambda p, b: [attn_res_triton(p, delta, b, nw, qk, onw, nb, -1, EPS,
                                                  OUT_EPS)],
        # The write to slot 0 overwrites no NaN: rows 2 and 4 keep theirs.
        "capture": lambda p, b: list(attn_res_capture_triton(p, delta, b, nw, qk, None, nb, 0,
                                                             EPS, OUT_EPS)),
        "mix": lambda p, b: [attn_res_mix_triton(p, b, nw, qk, nb, EPS)],
    }
    for name, launch in launches.items():
        for o in launch(prefix.clone(), blocks.clone()):
            assert torch.isnan(o[[2, 4]]).all(), name
            assert torch.isfinite(o[[0, 1, 3, 5, 6]]).all(), name
    # And the finite rows still match the reference.
    p_ref, b_ref = prefix.clone(), blocks.clone()
    out_ref = attn_res_reference(p_ref, delta, b_ref, nw, qk, onw, nb, -1, EPS, OUT_EPS)
    p, b = prefix.clone(), blocks.clone()
    out = attn_res_triton(p, delta, b, nw, qk, onw, nb, -1, EPS, OUT_EPS)
    _close(out, out_ref, dtype)


def test_nan_in_prefix_propagates():
    prefix, delta, blocks, nw, qk, onw = _inputs(3, 4, 16, torch.float32, seed=17)
    delta[1, 3] = float("nan")
    out = attn_res_triton(prefix, delta, blocks, nw, qk, onw, 4, 2, EPS, OUT_EPS)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2]]).all()
    assert torch.isnan(blocks[1, 2, 3])  # the written slot carries the NaN prefix


# --- layouts and argument checks -----------------------------------------------------------

def test_arbitrary_row_strides():
    T, NB, H, dtype = 5, 4, 48, torch.bfloat16
    prefix, delta, blocks, nw, qk, onw = _inputs(T, NB, H, dtype, seed=29)
    # prefix / delta: rows of a wider buffer; blocks: an NB-major bank seen as [T, NB, H].
    p_big = torch.zeros(T, H + 16, dtype=dtype)
    p_big[:, 8:8 + H] = prefix
    d_big = torch.zeros(T, 2 * H, dtype=dtype)
    d_big[:, :H] = delta
    bank = torch.zeros(NB + 1, T, H, dtype=dtype)
    bank[1:] = blocks.transpose(0, 1)
    p_view, d_view, b_view = p_big[:, 8:8 + H], d_big[:, :H], bank[1:].transpose(0, 1)
    assert not p_view.is_contiguous() and not b_view.is_contiguous()

    p_ref, b_ref = prefix.clone(), blocks.clone()
    out_ref, mix_ref = attn_res_reference(p_ref, delta, b_ref, nw, qk, onw, 3, 1, EPS,
                                          OUT_EPS, return_mix=True)
    out, mixed = attn_res_capture_triton(p_view, d_view, b_view, nw, qk, onw, 3, 1, EPS,
                                         OUT_EPS)
    assert torch.equal(p_view, p_ref) and torch.equal(b_view, b_ref)
    assert torch.equal(bank[0], torch.zeros_like(bank[0]))  # nothing written outside the view
    assert not p_big[:, :8].any() and not p_big[:, 8 + H:].any()
    _close(out, out_ref, dtype)
    _close(mixed, mix_ref, dtype)


def _strided_last(t: torch.Tensor) -> torch.Tensor:
    """Same values, last dimension with stride 2."""
    big = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    big[..., ::2] = t
    return big[..., ::2]


@pytest.mark.parametrize("bad", ["prefix", "delta", "blocks", "norm_weight", "qk_weight",
                                 "output_norm_weight"])
def test_non_unit_stride_last_dim_rejected(bad):
    prefix, delta, blocks, nw, qk, onw = _inputs(3, 2, 16, torch.float32, seed=31)
    kw = dict(prefix=prefix, delta=delta, blocks=blocks, norm_weight=nw, qk_weight=qk,
              output_norm_weight=onw)
    kw[bad] = _strided_last(kw[bad])
    p0, b0 = kw["prefix"].clone(), kw["blocks"].clone()
    for launch in (attn_res_triton, attn_res_capture_triton):
        with pytest.raises(AttnResArgumentError, match=bad):
            launch(**kw, num_blocks=2, block_write_idx=1, eps=EPS, output_norm_eps=OUT_EPS)
        assert torch.equal(kw["prefix"], p0) and torch.equal(kw["blocks"], b0)
    if bad not in ("delta", "output_norm_weight"):
        del kw["delta"], kw["output_norm_weight"]
        with pytest.raises(AttnResArgumentError, match=bad):
            attn_res_mix_triton(**kw, num_blocks=2, eps=EPS)


def test_validation_runs_first():
    prefix, delta, blocks, nw, qk, onw = _inputs(3, 2, 16, torch.float32, seed=37)
    with pytest.raises(AttnResArgumentError, match="num_blocks"):
        attn_res_triton(prefix, delta, blocks, nw, qk, onw, 3, -1, EPS, OUT_EPS)
    with pytest.raises(AttnResArgumentError, match="block_write_idx"):
        attn_res_capture_triton(prefix, delta, blocks, nw, qk, onw, 2, 2, EPS, OUT_EPS)
    with pytest.raises(AttnResArgumentError, match="dtype"):
        attn_res_mix_triton(prefix, blocks.double(), nw, qk, 1, EPS)


def test_empty_tokens():
    prefix, delta, blocks, nw, qk, onw = _inputs(0, 3, 100, torch.bfloat16, seed=41)
    out = attn_res_triton(prefix, delta, blocks, nw, qk, onw, 3, 0, EPS, OUT_EPS)
    out_c, mix_c = attn_res_capture_triton(prefix, delta, blocks, nw, qk, None, 3, 0, EPS,
                                           OUT_EPS)
    mix = attn_res_mix_triton(prefix, blocks, nw, qk, 3, EPS)
    for t in (out, out_c, mix_c, mix):
        assert t.shape == (0, 100) and t.dtype == torch.bfloat16


# --- dispatch and device selection ---------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_cpu_op_dispatch_agrees_with_triton(dtype):
    prefix, delta, blocks, nw, qk, onw = _inputs(7, 5, 100, dtype, seed=43)
    args = lambda p, b: (p, delta, b, nw, qk, onw, 4, 2, EPS, OUT_EPS)

    p_op, b_op = prefix.clone(), blocks.clone()
    out_op = torch.ops.kimi.attn_res(*args(p_op, b_op))
    p_tri, b_tri = prefix.clone(), blocks.clone()
    out_tri = attn_res_triton(*args(p_tri, b_tri))
    assert torch.equal(p_op, p_tri) and torch.equal(b_op, b_tri)
    _close(out_tri, out_op, dtype)

    out_c_op, mix_c_op = torch.ops.kimi.attn_res_capture(*args(prefix.clone(), blocks.clone()))
    out_c_tri, mix_c_tri = attn_res_capture_triton(*args(prefix.clone(), blocks.clone()))
    _close(out_c_tri, out_c_op, dtype)
    _close(mix_c_tri, mix_c_op, dtype)

    mix_op = torch.ops.kimi.attn_res_mix(prefix, blocks, nw, qk, 5, EPS)
    _close(attn_res_mix_triton(prefix, blocks, nw, qk, 5, EPS), mix_op, dtype)


def test_mode_is_fixed_when_triton_is_imported(monkeypatch):
    # triton.jit reads TRITON_INTERPRET when it decorates, not at launch: the kernel was
    # built in the mode triton.language was imported in, and a later change of the
    # variable does not matter.
    assert tk.INTERPRETED
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    prefix, delta, blocks, nw, qk, onw = _inputs(2, 3, 48, torch.float32, seed=47)
    p_ref, b_ref = prefix.clone(), blocks.clone()
    out_ref = attn_res_reference(p_ref, delta, b_ref, nw, qk, onw, 3, 0, EPS, OUT_EPS)
    out = attn_res_triton(prefix, delta, blocks, nw, qk, onw, 3, 0, EPS, OUT_EPS)
    assert torch.equal(prefix, p_ref) and torch.equal(blocks, b_ref)
    _close(out, out_ref, torch.float32)


@pytest.mark.gpu_check("wide")
@pytest.mark.skipif(not torch.cuda.is_available() or tk.INTERPRETED,
                    reason="needs a CUDA device and the compiled kernel (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("H", [100, 7168])
def test_cuda_kernel_matches_reference(dtype, H):
    T, NB = 256, 8
    prefix, delta, blocks, nw, qk, onw = _inputs(T, NB, H, dtype, seed=H, device="cuda")
    for num_blocks, write_idx, norm in ((8, 7, onw), (5, 2, None), (0, -1, onw)):
        args = lambda p, b, nb=num_blocks, w=write_idx, n=norm: (
            p, delta, b, nw, qk, n, nb, w, EPS, OUT_EPS)
        p_ref, b_ref = prefix.clone(), blocks.clone()
        out_ref, mix_ref = attn_res_reference(*args(p_ref, b_ref), return_mix=True)
        p, b = prefix.clone(), blocks.clone()
        out, mixed = attn_res_capture_triton(*args(p, b))
        torch.cuda.synchronize()
        assert torch.equal(p, p_ref) and torch.equal(b, b_ref)
        _close(out, out_ref, dtype)
        _close(mixed, mix_ref, dtype)
        assert torch.equal(mixed, attn_res_mix_triton(p, b, nw, qk, num_blocks, EPS))


# --- the chunked kernel (rows wider than the register file holds) ------------------------

@pytest.fixture
def chunked(monkeypatch):
    """Route every width to the chunked kernel, with chunks narrower than the rows."""
    monkeypatch.setattr(tk, "MAX_ROW_ALIGNED", 8)
    monkeypatch.setattr(tk, "MAX_ROW_UNALIGNED", 8)
    monkeypatch.setattr(tk, "CHUNK", 32)


CHUNKED_GRID = [(torch.float32, 4, 6, True, True), (torch.bfloat16, 9, 8, True, True),
                (torch.float16, 3, 1, False, True), (torch.bfloat16, 0, -1, True, False),
                (torch.float32, 5, -1, False, False)]


@pytest.mark.parametrize("dtype,num_blocks,write_idx,with_delta,with_norm", CHUNKED_GRID,
                         ids=[f"{_dt(c[0])}-nb{c[1]}-w{c[2]}" for c in CHUNKED_GRID])
def test_chunked_kernel_matches_reference(chunked, dtype, num_blocks, write_idx, with_delta,
                                          with_norm):
    assert tk.launch_config(100, dtype)[0] is tk.CHUNKED_KERNEL
    _check_attn_res(3, 9, 100, dtype, num_blocks, write_idx, with_delta, with_norm,
                    seed=num_blocks + 17)


def test_chunked_kernel_propagates_nan(chunked):
    prefix, delta, blocks, nw, qk, onw = _inputs(2, 4, 100, torch.float32, seed=5)
    blocks[0, 2, 70] = float("nan")
    out, mixed = attn_res_capture_triton(prefix, delta, blocks, nw, qk, onw, 4, -1, EPS,
                                         OUT_EPS)
    assert mixed[0].isnan().all() and out[0].isnan().all()
    assert not mixed[1].isnan().any() and not out[1].isnan().any()


def test_wide_unaligned_rows_take_the_chunked_kernel():
    # Rows the register file cannot hold without spilling (tools/kernel_build).
    assert tk.launch_config(7168, torch.bfloat16)[0] is tk._KERNEL
    assert tk.launch_config(8192, torch.float32)[0] is tk._KERNEL
    assert tk.launch_config(8190, torch.bfloat16, aligned=False)[0] is tk.CHUNKED_KERNEL
    assert tk.launch_config(16384, torch.bfloat16)[0] is tk.CHUNKED_KERNEL


# --- vLLM's K3 kernel, the peer tools/gpu_check.sh times against ---------------------------


def _vllm_peer():
    """vLLM's NVIDIA K3 kernel as the op benchmark loads it (``kimi_passes.vllm.peer``:
    an installed vLLM or a prepared copy, never a copy in the repository); the test skips
    where there is neither."""
    from kimi_passes.vllm.peer import PeerError, load_peer

    try:
        return load_peer("nvidia")
    except PeerError as e:
        pytest.skip(str(e))


# (dtype, num_blocks, block_write_idx, delta, output norm): vLLM's source tiles of 4 (nb = 3),
# one source a tile (nb <= 1), the pure read gpu_check's headline "read" variant times.
PEER_GRID = [(torch.float32, 3, 2, True, True), (torch.bfloat16, 3, -1, True, True),
             (torch.float32, 1, 1, True, False), (torch.bfloat16, 0, 0, True, True),
             (torch.float32, 3, -1, False, False)]


@pytest.mark.vllm_kernel_file
@pytest.mark.parametrize("dtype,num_blocks,write_idx,with_delta,with_norm", PEER_GRID,
                         ids=[f"{_dt(c[0])}-nb{c[1]}-w{c[2]}-d{int(c[3])}-n{int(c[4])}"
                              for c in PEER_GRID])
def test_vllm_k3_kernel_agrees_with_the_op(dtype, num_blocks, write_idx, with_delta,
                                           with_norm):
    """The benchmark peer computes what ``kimi::attn_res`` computes (output and in-place
    effects), so gpu_check.sh's timing compares like with like. Both run interpreted."""
    peer = _vllm_peer()
    prefix, delta, blocks, nw, qk, onw = _inputs(5, 4, 48, dtype, seed=7)
    args = [prefix, delta if with_delta else None, blocks, nw, qk, onw if with_norm else None,
            num_blocks, write_idx, EPS, OUT_EPS]
    ours = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    theirs = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    got = peer.attn_res(*theirs)
    want = attn_res_triton(*ours)
    tol = OP_TOL[dtype]

    def msg(m: str) -> str:
        return f"{peer.source}: {m}"

    torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=msg)
    # The in-place effects: the prefix update (one rounding; the interpreter's bf16 casts
    # differ by one ulp at most) and the block write.
    torch.testing.assert_close(theirs[0], ours[0], atol=tol, rtol=tol, msg=msg)
    torch.testing.assert_close(theirs[2], ours[2], atol=tol, rtol=tol, msg=msg)


def test_pdl_is_opt_in_and_never_on_cpu(monkeypatch):
    monkeypatch.setenv("KIMI_PASSES_PDL", "1")
    assert not tk.pdl_launch(torch.device("cpu"))  # the interpreter, CPU tensors
    monkeypatch.setenv("KIMI_PASSES_PDL", "0")
    assert not tk.pdl_launch(torch.device("cpu"))


# --- the decode path (rows split over programs: ops/triton_decode.py) --------------------

@pytest.fixture
def decode(monkeypatch):
    """Route every call to the decode path, with slices and source tiles narrow enough that
    a 100-wide row of 9 slots is cut into 4 slices and its sources read 2 to a tile."""
    monkeypatch.setenv("KIMI_PASSES_TRITON_ROUTE", "decode")
    monkeypatch.setattr(td, "DECODE_MIN_SLICE", 32)
    monkeypatch.setattr(td, "DECODE_TILE", 64)
    cfg = td.decode_config(100, 9)
    assert cfg.n_splits == 4 and cfg.stats["SRC_TILE"] == 2


DECODE_GRID = [(torch.float32, 4, 6, True, True), (torch.bfloat16, 9, 8, True, True),
               (torch.float16, 3, 1, False, True), (torch.bfloat16, 0, -1, True, False),
               (torch.float32, 5, -1, False, False), (torch.float16, 9, 0, True, False)]


@pytest.mark.parametrize("dtype,num_blocks,write_idx,with_delta,with_norm", DECODE_GRID,
                         ids=[f"{_dt(c[0])}-nb{c[1]}-w{c[2]}" for c in DECODE_GRID])
def test_decode_path_matches_reference_and_row_kernel(decode, dtype, num_blocks, write_idx,
                                                      with_delta, with_norm):
    out, mixed = _check_attn_res(3, 9, 100, dtype, num_blocks, write_idx, with_delta, with_norm,
                                 seed=num_blocks + 31)
    # The same in-place effects as the row kernel (both equal the reference's, checked above)
    # and the same outputs at the op's tolerance.
    prefix, delta, blocks, nw, qk, onw = _inputs(3, 9, 100, dtype, num_blocks + 31)
    args = (prefix, delta if with_delta else None, blocks, nw, qk, onw if with_norm else None,
            num_blocks, write_idx, EPS, OUT_EPS)
    out_row, mixed_row = attn_res_capture_triton(*args, route="row")
    _close(out, out_row, dtype, msg="out vs the row kernel")
    _close(mixed, mixed_row, dtype, msg="mixed vs the row kernel")


def test_decode_path_propagates_nan(decode):
    prefix, delta, blocks, nw, qk, onw = _inputs(3, 4, 100, torch.float32, seed=5)
    blocks[0, 2, 70] = float("nan")  # a source of row 0, in its third slice
    delta[2, 99] = float("nan")  # row 2's prefix, in its last (partial) slice
    out, mixed = attn_res_capture_triton(prefix, delta, blocks, nw, qk, onw, 4, 1, EPS,
                                         OUT_EPS)
    for o in (out, mixed):
        assert o[[0, 2]].isnan().all() and not o[1].isnan().any()


def test_decode_switch_point():
    # auto takes the decode path at T <= 64 for rows of 2048 or more, the row kernel above.
    assert td.DECODE_MAX_T == 64 and td.DECODE_MIN_H == 2048
    assert td.takes_decode(1, 2048) and td.takes_decode(64, 7168)
    assert not td.takes_decode(65, 7168) and not td.takes_decode(1, 2047)
    assert not td.takes_decode(0, 7168)
    for T in (1, 8, 64):  # K3's shape: at least min(132, 8 T) programs share a call
        assert T * td.decode_config(7168, 8).n_splits >= min(132, 8 * T)


def test_auto_route_launches_the_decode_path(monkeypatch):
    calls = []
    monkeypatch.setattr(tk, "launch_decode", lambda *a: calls.append(a) or td.launch_decode(*a))
    monkeypatch.setattr(td, "DECODE_MIN_H", 64)
    prefix, delta, blocks, nw, qk, onw = _inputs(2, 3, 100, torch.float32, seed=3)
    attn_res_triton(prefix, delta, blocks, nw, qk, onw, 3, 0, EPS, OUT_EPS)
    assert len(calls) == 1
    attn_res_triton(prefix, delta, blocks, nw, qk, onw, 3, 0, EPS, OUT_EPS, route="row")
    monkeypatch.setattr(td, "DECODE_MAX_T", 1)  # T = 2 is now above the switch
    attn_res_triton(prefix, delta, blocks, nw, qk, onw, 3, 0, EPS, OUT_EPS)
    assert len(calls) == 1


def test_unknown_route_is_refused(monkeypatch):
    monkeypatch.setenv("KIMI_PASSES_TRITON_ROUTE", "split")
    prefix, delta, blocks, nw, qk, onw = _inputs(2, 3, 16, torch.float32, seed=3)
    with pytest.raises(ValueError, match="KIMI_PASSES_TRITON_ROUTE"):
        attn_res_triton(prefix, delta, blocks, nw, qk, onw, 3, 0, EPS, OUT_EPS)
