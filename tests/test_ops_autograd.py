"""Autograd of the AttnRes ops.

- the backward math (``ops/backward.py``) passes ``torch.autograd.gradcheck`` in fp64:
  the ops take the forward's dtypes only (fp32/bf16/fp16), so gradcheck runs the
  backward op's CPU math directly, wrapped in a test ``autograd.Function`` whose forward
  is the fp64 statement of the mixture;
- ``kimi.attn_res_mix`` / ``attn_res_mix_list`` gradients against autograd through an
  fp64 plain-torch mixture, per dtype (tolerances relative to the largest gradient);
- the Triton backward kernel (interpreted on CPU) against the CPU backward op;
- ``torch.library.opcheck`` with inputs that require grad (autograd registration, fake
  kernels, AOT dispatch) for the mixtures and the backward ops;
- no gradient work for tensors that do not require grad;
- the mutating ops: ``attn_res_differentiable`` (eager and ``torch.compile``), the raw
  op's refusal, and ``K3Model(trainable=True)`` gradients with ``mixing="op"`` against
  ``mixing="torch"``.
"""

from __future__ import annotations

import pytest
import torch
from helpers.op import DTYPES, OP_TOL, OPCHECK_UTILS
from torch.utils._python_dispatch import TorchDispatchMode

from kimi_passes.bench import rel_err
from kimi_passes.graphs.k3 import K3Config, K3Model
from kimi_passes.ops import AttnResArgumentError, attn_res_reference, backward
from kimi_passes.ops import triton_backward as tb
from kimi_passes.ops.attn_res_args import MixBackwardArgs, MixListBackwardArgs
from kimi_passes.ops.differentiable import (
    attn_res_capture_differentiable,
    attn_res_differentiable,
)
from kimi_passes.ops.mix import attn_res_mix_backward_triton

OPS = torch.ops.kimi
EPS = 1e-6
# Max |grad - fp64 truth| / max |fp64 truth|, per input dtype. Gradients are rounded to the
# input dtype once (bf16: 2^-9 relative, fp16: 2^-12) on top of fp32 accumulation.
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit")]


# --------------------------------------------------------------------------- helpers


def mix64(sources, norm_weight, qk_weight, eps):
    """The mixture of a list of ``[*, H]`` sources, in fp64 plain torch (the spec)."""
    v = torch.stack([s.double() for s in sources], dim=-2)
    w = qk_weight.double() if norm_weight is None else norm_weight.double() * qk_weight.double()
    keys_dot = (v @ w) * torch.rsqrt(v.square().mean(-1) + eps)
    return (keys_dot.softmax(-1).unsqueeze(-1) * v).sum(-2)


def mix_inputs(T, H, NB, dtype, seed=0, qk_scale=2.0):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randn(T, H, generator=g).to(dtype)
    blocks = torch.randn(T, NB, H, generator=g).to(dtype)
    nw = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    qk = (torch.randn(H, generator=g) * qk_scale / H**0.5).to(dtype)
    grad = torch.randn(T, H, generator=g).to(dtype)
    return prefix, blocks, nw, qk, grad


def leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


class _Mix64(torch.autograd.Function):
    """fp64 forward of the spec; backward = the backward op's CPU math (the thing tested)."""

    @staticmethod
    def forward(ctx, prefix, blocks, nw, qk, nb, eps):
        ctx.save_for_backward(prefix, blocks, nw, qk)
        ctx.nb, ctx.eps = nb, eps
        return mix64([blocks[:, j] for j in range(nb)] + [prefix], nw, qk, eps)

    @staticmethod
    def backward(ctx, grad):
        prefix, blocks, nw, qk = ctx.saved_tensors
        dp, db, dw = backward.attn_res_mix_backward_cpu(MixBackwardArgs(
            grad, prefix, blocks, nw, qk, ctx.nb, ctx.eps, True, True, True))
        dnw, dqk = backward.split_weight_grad(dw, nw, qk, True, True)
        return dp, db, dnw, dqk, None, None


class _MixList64(torch.autograd.Function):
    @staticmethod
    def forward(ctx, nw, qk, *sources):
        ctx.save_for_backward(nw, qk, *sources)
        return mix64(sources, nw, qk, EPS)

    @staticmethod
    def backward(ctx, grad):
        nw, qk, *sources = ctx.saved_tensors
        ds, dw = backward.attn_res_mix_list_backward_torch(MixListBackwardArgs(
            grad, sources, nw, qk, EPS, True, True))
        dnw, dqk = backward.split_weight_grad(dw, nw, qk, nw is not None, True)
        return (dnw, dqk, *ds)


# --------------------------------------------------------------------------- fp64 gradcheck


@pytest.mark.parametrize("nb", [0, 1, 3])
@pytest.mark.parametrize("chunk_bytes", [None, 64])
def test_gradcheck_fp64(monkeypatch, nb, chunk_bytes):
    if chunk_bytes is not None:  # several row chunks (one row each)
        monkeypatch.setattr(backward, "_CHUNK_BYTES", chunk_bytes)
    prefix, blocks, nw, qk, _ = leaves(*mix_inputs(4, 6, 3, torch.float64))
    assert torch.autograd.gradcheck(_Mix64.apply, (prefix, blocks, nw, qk, nb, EPS))


@pytest.mark.parametrize("with_norm", [True, False])
def test_gradcheck_fp64_list(with_norm):
    g = torch.Generator().manual_seed(1)
    sources = [torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3)]
    nw = (1 + 0.1 * torch.randn(5, generator=g, dtype=torch.float64)).requires_grad_()
    qk = torch.randn(5, generator=g, dtype=torch.float64).requires_grad_()
    if not with_norm:
        def fn(qk, *s):
            return _MixList64.apply(None, qk, *s)
        assert torch.autograd.gradcheck(fn, (qk, *sources))
    else:
        assert torch.autograd.gradcheck(_MixList64.apply, (nw, qk, *sources))


# --------------------------------------------------------------------------- op gradients


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,H,NB,nb", [(5, 16, 4, 3), (7, 100, 3, 3), (3, 32, 2, 0),
                                       (4, 8, 5, 2)])
def test_mix_grads_match_fp64(dtype, T, H, NB, nb):
    prefix, blocks, nw, qk, grad = mix_inputs(T, H, NB, dtype)
    ins = leaves(prefix, blocks, nw, qk)
    got = torch.autograd.grad(OPS.attn_res_mix(*ins, nb, EPS), ins, grad)
    p64, b64, nw64, qk64 = leaves(*(t.double() for t in (prefix, blocks, nw, qk)))
    ref = mix64([b64[:, j] for j in range(nb)] + [p64], nw64, qk64, EPS)
    want = torch.autograd.grad(ref, (p64, b64, nw64, qk64), grad.double(), allow_unused=True)
    want = [torch.zeros_like(t) if w is None else w for w, t in zip(want, (p64, b64), strict=False)
            ] + list(want[2:])
    for name, g_, w_ in zip(("prefix", "blocks", "norm_weight", "qk_weight"), got, want,
                            strict=True):
        assert g_.dtype == dtype, name
        assert rel_err(g_, w_) < GRAD_TOL[dtype], (name, rel_err(g_, w_))
    assert not got[1][:, nb:].any()  # slots the mixture does not read get zero


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_mix_list_grads_match_fp64(dtype, with_norm, out_dtype):
    g = torch.Generator().manual_seed(2)
    sources = leaves(*(torch.randn(2, 5, 24, generator=g).to(dtype) for _ in range(4)))
    # Weights in fp32 while the sources are low precision: the op allows any float dtype.
    nw = leaves(1 + 0.1 * torch.randn(24, generator=g))[0] if with_norm else None
    qk = leaves(torch.randn(24, generator=g) * 0.4)[0]
    out = OPS.attn_res_mix_list(sources, nw, qk, EPS, out_dtype)
    assert out.dtype == (out_dtype or dtype)
    grad = torch.randn(out.shape, generator=g).to(out.dtype)
    ins = sources + [qk] + ([nw] if with_norm else [])
    got = torch.autograd.grad(out, ins, grad)
    ins64 = leaves(*(t.double() for t in ins))
    ref = mix64(ins64[:4], ins64[5] if with_norm else None, ins64[4], EPS)
    want = torch.autograd.grad(ref, ins64, grad.double())
    for i, (g_, w_, t) in enumerate(zip(got, want, ins, strict=True)):
        assert g_.dtype == t.dtype, i
        assert rel_err(g_, w_) < GRAD_TOL[dtype], (i, rel_err(g_, w_))


# --------------------------------------------------------------------------- Triton kernel


TRITON_CASES = [
    # (T, H, NB, nb, dtype, blocks row padding)
    (5, 16, 4, 3, torch.float32, 0),
    (4, 100, 3, 3, torch.float32, 1),
    (3, 32, 2, 0, torch.float32, 0),
    (6, 64, 5, 2, torch.bfloat16, 0),
    (3, 48, 3, 2, torch.float16, 2),
]


@pytest.mark.parametrize("route", ["row", "chunked"])
@pytest.mark.parametrize("case", TRITON_CASES, ids=str)
@pytest.mark.parametrize("needs", [(True, True, True), (True, False, False),
                                   (False, True, False), (False, False, True)], ids=str)
def test_triton_backward_matches_cpu(monkeypatch, case, needs, route):
    """Both kernels: ``chunked`` routes every width to the chunked kernel, with chunks
    narrower than the rows (H = 100: four chunks, the last partial; H = 16: one)."""
    T, H, NB, nb, dtype, pad = case
    monkeypatch.setattr(tb, "_DW_PROGRAMS", 2)  # several rows per program
    if route == "chunked":
        monkeypatch.setattr(tb, "MAX_ROW_ALIGNED", 8)
        monkeypatch.setattr(tb, "MAX_ROW_UNALIGNED", 8)
        monkeypatch.setattr(tb, "CHUNK", 32)
    want_kernel = tb.CHUNKED_KERNEL if route == "chunked" else tb._KERNEL
    assert tb.launch_config(H, dtype, H % 16 == 0, NB)[0] is want_kernel
    prefix, blocks, nw, qk, grad = mix_inputs(T, H, NB + pad, dtype, seed=3)
    blocks = blocks[:, :NB]  # a strided view: row stride (NB + pad) * H
    got = attn_res_mix_backward_triton(grad, prefix, blocks, nw, qk, nb, EPS, *needs)
    want = OPS.attn_res_mix_backward(grad, prefix, blocks, nw, qk, nb, EPS, *needs)
    for name, need, g_, w_ in zip(("dprefix", "dblocks", "dw"), needs, got, want, strict=True):
        assert g_.shape == w_.shape and g_.dtype == w_.dtype, name
        if need:
            # The interpreter rounds fp32 -> bf16 by truncation: one bf16 ulp apart.
            tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
            assert rel_err(g_, w_) < tol, (name, rel_err(g_, w_))
        else:
            assert g_.numel() == 0, name


@pytest.mark.parametrize("H", [2048, 4096, 8192, 8190, 16384])
def test_triton_backward_launch_fits_a_program_on_cuda_and_hip(H):
    """At most 1024 threads a program: 32-wide warps on CUDA, 64-wide wavefronts on AMD
    CDNA (tools/kernel_build builds these launches for gfx942 too)."""
    for warp_size in (32, 64):
        _, cfg = tb.launch_config(H, torch.bfloat16, H % 16 == 0, 8, warp_size=warp_size)
        assert cfg["num_warps"] * warp_size <= 1024, (H, warp_size, cfg)
    assert tb.launch_config(4096, torch.bfloat16)[1]["num_warps"] == 32  # CUDA: 4 a thread
    assert tb.launch_config(4096, torch.bfloat16, warp_size=64)[1]["num_warps"] == 16


def test_triton_backward_empty_rows():
    prefix, blocks, nw, qk, grad = mix_inputs(0, 16, 2, torch.float32)
    dp, db, dw = attn_res_mix_backward_triton(grad, prefix, blocks, nw, qk, 2, EPS,
                                                 True, True, True)
    assert dp.shape == (0, 16) and db.shape == (0, 2, 16) and dw.shape == (16,)
    assert not dw.any()


# --------------------------------------------------------------------------- opcheck


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nb", [0, 2])
def test_opcheck_mix_with_grad(dtype, nb):
    prefix, blocks, nw, qk, grad = mix_inputs(3, 16, 3, dtype)
    torch.library.opcheck(OPS.attn_res_mix.default, (*leaves(prefix, blocks, nw, qk), nb, EPS),
                          test_utils=OPCHECK_UTILS)
    # Some inputs requiring grad, some not.
    torch.library.opcheck(OPS.attn_res_mix.default,
                          (prefix, *leaves(blocks), nw, *leaves(qk), nb, EPS),
                          test_utils=OPCHECK_UTILS)
    for needs in ((True, True, True), (False, True, False)):
        torch.library.opcheck(OPS.attn_res_mix_backward.default,
                              (grad, prefix, blocks, nw, qk, nb, EPS, *needs),
                              test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_opcheck_mix_list_with_grad(with_norm, out_dtype):
    g = torch.Generator().manual_seed(4)
    sources = [torch.randn(2, 3, 16, generator=g, dtype=torch.bfloat16) for _ in range(3)]
    nw = (1 + 0.1 * torch.randn(16, generator=g)) if with_norm else None
    qk = torch.randn(16, generator=g)
    args = (leaves(*sources), *leaves(*(t for t in (nw,) if t is not None)), qk, EPS)
    if not with_norm:
        args = (args[0], None, *args[1:])
    torch.library.opcheck(OPS.attn_res_mix_list.default, (*args, out_dtype),
                          test_utils=OPCHECK_UTILS)
    grad = torch.randn(2, 3, 16, generator=g).to(out_dtype or torch.bfloat16)
    torch.library.opcheck(OPS.attn_res_mix_list_backward.default,
                          (grad, sources, nw, qk, EPS, True, True), test_utils=OPCHECK_UTILS)


# --------------------------------------------------------------------------- skipped work


class _RecordBackwardCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (OPS.attn_res_mix_backward.default, OPS.attn_res_mix_list_backward.default):
            self.calls.append(args[-3:] if func is OPS.attn_res_mix_backward.default
                              else args[-2:])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("grad_of,needs", [
    ("prefix", (True, False, False)),
    ("blocks", (False, True, False)),
    ("qk", (False, False, True)),
    ("prefix,norm_weight", (True, False, True)),
])
def test_backward_asks_only_for_needed_grads(grad_of, needs):
    prefix, blocks, nw, qk, grad = mix_inputs(3, 16, 3, torch.float32)
    named = {"prefix": prefix, "blocks": blocks, "norm_weight": nw, "qk": qk}
    for name in grad_of.split(","):
        named[name] = named[name].clone().requires_grad_()
    out = OPS.attn_res_mix(named["prefix"], named["blocks"], named["norm_weight"], named["qk"],
                           2, EPS)
    with _RecordBackwardCalls() as rec:
        out.backward(grad)
    assert rec.calls == [needs]
    for name, t in named.items():
        assert (t.grad is not None) == (name in grad_of.split(",")), name


def test_backward_op_returns_empty_for_unneeded():
    prefix, blocks, nw, qk, grad = mix_inputs(3, 16, 3, torch.float32)
    dp, db, dw = OPS.attn_res_mix_backward(grad, prefix, blocks, nw, qk, 2, EPS,
                                           False, False, True)
    assert dp.numel() == 0 and db.numel() == 0 and dw.shape == (16,)
    ds, dw = OPS.attn_res_mix_list_backward(grad, [prefix, prefix], nw, qk, EPS, True, False)
    assert len(ds) == 2 and dw.numel() == 0


def test_mix_list_sources_grad_only_when_asked():
    qk = torch.randn(16, requires_grad=True)
    sources = [torch.randn(3, 16) for _ in range(2)]
    out = OPS.attn_res_mix_list(sources, None, qk, EPS)
    with _RecordBackwardCalls() as rec:
        out.sum().backward()
    assert rec.calls == [(False, True)] and qk.grad is not None


# --------------------------------------------------------------------------- mutating ops

ATTN_RES_CASES = [
    # (NB, nb, block_write_idx, delta, output norm)
    (4, 2, -1, True, True),
    (4, 3, 1, True, True),  # the written slot is mixed
    (4, 2, 3, False, True),  # written past the mixed slots
    (3, 3, 0, False, False),
    (2, 0, -1, True, False),
]


def attn_res_args(case, dtype, T=5, H=24, seed=5):
    NB, nb, write, has_delta, onorm = case
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    return [rnd(T, H), rnd(T, H) if has_delta else None, rnd(T, NB, H),
            (1 + 0.1 * torch.randn(H, generator=g)).to(dtype), rnd(H, s=2.0 / H**0.5),
            (1 + 0.1 * torch.randn(H, generator=g)).to(dtype) if onorm else None,
            nb, write, EPS, 1e-5]


def _clone(args, grad_of=()):
    """Clones of ``args``; those at ``grad_of`` become leaves that require grad."""
    out = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            a = a.detach().clone().requires_grad_(i in grad_of)
        out.append(a)
    return out


def _run_with_state_loss(fn, args, grads, capture=False):
    """Run ``fn`` on non-leaf copies of prefix and blocks (they are updated in place);
    returns the leaves and a loss reading the output(s) and both in-place results."""
    leaf = _clone(args, grad_of=range(6))
    call = list(leaf)
    call[0], call[2] = leaf[0] * 1, leaf[2] * 1  # non-leaf: in-place updates are allowed
    res = fn(*call)
    outs = res if capture else (res,)
    loss = sum((o.float() * g).sum() for o, g in zip(outs, grads[:len(outs)], strict=True))
    loss = loss + (call[0].float() * grads[-2]).sum() + (call[2].float() * grads[-1]).sum()
    return [t for t in leaf if isinstance(t, torch.Tensor)], loss, outs, call


def _reference_capture(*args):
    return attn_res_reference(*args, return_mix=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ATTN_RES_CASES, ids=str)
def test_differentiable_matches_op_forward(dtype, case):
    args = attn_res_args(case, dtype)
    op_args = _clone(args)
    want_out, want_mix = OPS.attn_res_capture(*op_args)
    got_args = _clone(args, grad_of=(4,))  # qk_weight requires grad: the training path
    got_out, got_mix = attn_res_capture_differentiable(*got_args)
    assert got_out.grad_fn is not None and got_out.dtype == dtype
    assert rel_err(got_out.detach(), want_out) < OP_TOL[dtype]
    assert rel_err(got_mix.detach(), want_mix) < OP_TOL[dtype]
    assert torch.equal(got_args[0].detach(), op_args[0])  # prefix += delta, bit for bit
    assert torch.equal(got_args[2].detach(), op_args[2])  # the block write
    assert got_out.data_ptr() != got_mix.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ATTN_RES_CASES, ids=str)
@pytest.mark.parametrize("capture", [False, True], ids=["attn_res", "capture"])
def test_differentiable_grads_match_reference(dtype, case, capture):
    """Gradients of the output(s) and of the in-place results against autograd through
    ``ops/reference.py`` (fp32 math) on the same inputs."""
    args = attn_res_args(case, dtype)
    T, H = args[0].shape
    g = torch.Generator().manual_seed(6)
    grads = [torch.randn(T, H, generator=g), torch.randn(T, H, generator=g),
             torch.randn(T, H, generator=g), torch.randn(args[2].shape, generator=g)]
    fn = attn_res_capture_differentiable if capture else attn_res_differentiable
    ref = _reference_capture if capture else attn_res_reference
    got_leaves, got_loss, _, _ = _run_with_state_loss(fn, args, grads, capture)
    want_leaves, want_loss, _, _ = _run_with_state_loss(ref, _clone(args), grads, capture)
    got = torch.autograd.grad(got_loss, got_leaves)
    want = torch.autograd.grad(want_loss, want_leaves)
    tol = GRAD_TOL[dtype] if dtype == torch.float32 else OP_TOL[dtype]
    for i, (g_, w_) in enumerate(zip(got, want, strict=True)):
        assert rel_err(g_, w_) < tol, (i, rel_err(g_, w_))


def test_differentiable_without_grad_is_the_op():
    args = attn_res_args(ATTN_RES_CASES[1], torch.float32)
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    want = OPS.attn_res(*_clone(args))
    plain, with_grad = _clone(args), _clone(args, grad_of=(3, 4, 5))
    with Record():
        got = attn_res_differentiable(*plain)
    with torch.no_grad(), Record():  # weights requiring grad under no_grad: still the op
        attn_res_differentiable(*with_grad)
    assert torch.equal(got, want)
    assert set(seen) == {OPS.attn_res.default}


@pytest.mark.parametrize("op", ["attn_res", "attn_res_capture"])
def test_mutating_op_refuses_backward(op):
    """The op itself has no autograd (torch refuses one on a mutating op): a backward
    through it raises, naming the op and ``attn_res_differentiable``, the training path."""
    args = _clone(attn_res_args(ATTN_RES_CASES[0], torch.float32), grad_of=(4,))
    out = getattr(OPS, op)(*args)
    out = out[0] if isinstance(out, tuple) else out
    with pytest.raises(RuntimeError, match=rf"kimi\.{op}\.default but no autograd formula "
                                           r"(.|\n)*attn_res_differentiable"):
        out.sum().backward()


# --------------------------------------------------------------------------- K3 training


def _k3_loss(model, ids, fn=None):
    hidden, taps = (model if fn is None else fn)(ids)
    return (hidden.float().square().mean() + sum(t.float().mean() for t in taps)), hidden


def _k3_grads(model, ids, fn=None):
    loss, hidden = _k3_loss(model, ids, fn)
    names, params = zip(*model.named_parameters(), strict=True)
    return hidden.detach(), dict(zip(names, torch.autograd.grad(loss, params), strict=True))


K3_IDS = torch.randint(0, 128, (7,), generator=torch.Generator().manual_seed(0))


def test_k3_default_is_frozen():
    assert not any(p.requires_grad for p in K3Model(K3Config.tiny()).parameters())
    assert all(p.requires_grad for p in K3Model(K3Config.tiny(), trainable=True).parameters())


#: Rounding patterns sampled for plain torch's fp32 error (0: the model as built).
ROUNDINGS = 4


def _k3_errors(mixing, seed):
    """Relative errors against fp64 of the tiny K3's hidden state and of each parameter's
    gradient, fp32, with every weight scaled by ``1 + k u`` (``k`` in -2..2 drawn from
    ``seed``; none for seed 0): the fp64 model gets the same weights, so the error is
    rounding only, and each seed rounds differently through the whole depth."""
    u = 2.0 ** -24
    model = K3Model(K3Config.tiny(), mixing=mixing, trainable=True)
    if seed:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + u * torch.randint(-2, 3, p.shape, generator=g).float())
    exact = K3Model(K3Config.tiny(), mixing="torch", trainable=True).double()
    exact.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    h, grads = _k3_grads(model, K3_IDS)
    h64, g64 = _k3_grads(exact, K3_IDS)
    return {"hidden": rel_err(h, h64), **{n: rel_err(grads[n], g64[n]) for n in grads}}, grads


def test_k3_trains_with_op_mixing(cpu_path):
    """``mixing="op"`` gradients are as accurate as ``mixing="torch"``'s, on both CPU paths.

    Both are fp32 computations of the same function that round in different orders, so
    they are compared through the fp64 value, not with each other: for the hidden state
    and every parameter, the op's error against fp64 is at most twice the largest error
    plain torch shows over ``ROUNDINGS`` rounding patterns (its weights moved by a few
    ulps, ``_k3_errors``), plus 64 u (u = 2**-24; one fp32 sum of H = 64 terms, a site's
    logit). One pattern is not enough: the gradients of layer 3's AttnRes weights go
    through a difference of nearly equal dot products, so their fp32 error moves with the
    rounding pattern (torch 2.14, seed 0: plain torch 63 u, the op on the torch path 160 u,
    on the C kernel 417 u; over 4 patterns plain torch reaches 212 u; equally accurate
    forwards: 3.5-5.5 u median against fp64 on both paths).
    """
    u = 2.0 ** -24
    op, g_op = _k3_errors("op", 0)
    plain = [_k3_errors("torch", seed)[0] for seed in range(ROUNDINGS)]
    assert op.keys() == plain[0].keys()
    for what, err in op.items():
        base = max(p[what] for p in plain)
        assert err <= 2 * base + 64 * u, (
            f"{what}: op error {err / u:.0f} u against fp64, plain torch up to {base / u:.0f} u")
    # Every AttnRes weight gets a gradient, but layer 0's first call, which mixes the
    # embedding alone (softmax over one source: its weights have no effect).
    zero = {n for n in g_op if "res_" in n and not g_op[n].abs().max() > 0}
    assert zero == {"layers.0.self_attention_res_norm.weight",
                    "layers.0.self_attention_res_proj.weight"}


def test_k3_trains_compiled():
    """Under ``torch.compile`` the training graph mixes with ``kimi.attn_res_mix`` (no
    mutating op) and differentiates it with ``kimi.attn_res_mix_backward``; the results
    equal eager's."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = {}

    def keep(kind):
        def compiler(gm, _):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)
        return compiler

    cfg = K3Config.tiny()
    model = K3Model(cfg, mixing="op", trainable=True)
    h_e, g_e = _k3_grads(model, K3_IDS)
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"))
    h_c, g_c = _k3_grads(model, K3_IDS, torch.compile(model, backend=backend, fullgraph=True))
    assert rel_err(h_c, h_e) < 1e-6
    for name in g_e:
        assert rel_err(g_c[name], g_e[name]) < 1e-6, name

    def count(gm, op):
        return sum(n.target == op for n in gm.graph.nodes)

    mixes = 2 * cfg.num_layers + 1
    assert count(graphs["fw"], OPS.attn_res_mix.default) == mixes
    assert count(graphs["bw"], OPS.attn_res_mix_backward.default) == mixes
    for kind in ("fw", "bw"):
        assert count(graphs[kind], OPS.attn_res.default) == 0



def test_backward_ops_check_grad():
    prefix, blocks, nw, qk, grad = mix_inputs(3, 16, 3, torch.float32)
    bad = torch.randn(2, 16)
    with pytest.raises(AttnResArgumentError, match=r"attn_res_mix_backward: grad has shape "
                       r"\(2, 16\).*forward output has shape \(3, 16\)"):
        OPS.attn_res_mix_backward(bad, prefix, blocks, nw, qk, 2, EPS, True, True, True)
    with pytest.raises(AttnResArgumentError, match=r"attn_res_mix_list_backward: grad has"):
        OPS.attn_res_mix_list_backward(bad, [prefix], nw, qk, EPS, True, True)
    with pytest.raises(AttnResArgumentError, match=r"attn_res_mix_backward: grad has shape"):
        attn_res_mix_backward_triton(bad, prefix, blocks, nw, qk, 2, EPS, True, True, True)
    with pytest.raises(AttnResArgumentError, match=r"num_blocks=4 is outside \[0, 3\]"):
        OPS.attn_res_mix_backward(grad, prefix, blocks, nw, qk, 4, EPS, True, True, True)
