"""The registered CPU ops ``torch.ops.kimi.{attn_res, attn_res_capture, attn_res_mix, aux_tap}``.

Numerics are checked against ``ops/reference.py`` (docs/design.md section 3) run on clones, so the
in-place effects on ``prefix`` and ``blocks`` can be compared exactly.
"""

from __future__ import annotations

import random
import re

import pytest
import torch
from helpers.op import (
    DTYPES,
    EPS,
    ONORM_EPS,
    OP_TOL,
    clone_args,
    make_args,
    mix_args,
    opcheck,
)
from torch._subclasses.fake_tensor import FakeTensorMode

import kimi_passes
from kimi_passes import ops as kimi_ops

AttnResArgumentError = kimi_ops.AttnResArgumentError
attn_res_reference = kimi_ops.attn_res_reference
attn_res_mix_reference = kimi_ops.attn_res_mix_reference

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit"),
              pytest.mark.usefixtures("one_thread")]

OPS = torch.ops.kimi


# --------------------------------------------------------------------------- helpers


def assert_close(actual, expected, dtype, scale=1.0, tol=None):
    assert actual.dtype == expected.dtype == dtype
    assert actual.shape == expected.shape
    tol = OP_TOL[dtype] if tol is None else max(tol, OP_TOL[dtype])
    torch.testing.assert_close(
        actual.float() / scale, expected.float() / scale, atol=tol, rtol=tol, equal_nan=True
    )


def tensors(args):
    return [a for a in args if isinstance(a, torch.Tensor)]


def assert_exact(a, b):
    """Bit-for-bit equal values, NaN positions included."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b))
    # Zero at the NaNs on both sides, not a[~nan]: a boolean-mask gather was most of
    # this module's time.
    assert torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))


def assert_no_alias(outs, ins):
    """No output shares storage with another output or with any input."""
    ptrs = {t.untyped_storage().data_ptr() for t in ins}
    seen = set()
    for o in outs:
        p = o.untyped_storage().data_ptr()
        assert p not in ptrs, "an output aliases an input"
        assert p not in seen, "two outputs alias each other"
        seen.add(p)


def check_attn_res(args, scale=1.0, tol=None):
    """Run attn_res, attn_res_capture and attn_res_mix on copies of ``args`` and compare.

    ``scale`` is the sources' magnitude: the mixture is compared relative to it, the
    output too unless an output norm brings it back to O(1).

    Returns ``(out, mixed)`` of the capture op.
    """
    dtype = args[0].dtype
    ref_args, cap_args = clone_args(args), clone_args(args)
    ref_out, ref_mixed = attn_res_reference(*ref_args, return_mix=True)
    out = OPS.attn_res(*args)
    out_scale = scale if args[5] is None else 1.0
    assert_close(out, ref_out, dtype, out_scale, tol)
    # In-place effects are exact: prefix <- round(prefix + delta); blocks[:, idx] <- prefix.
    assert_exact(args[0], ref_args[0])
    assert_exact(args[2], ref_args[2])

    cap_out, cap_mixed = OPS.attn_res_capture(*cap_args)
    assert_exact(cap_out, out)
    assert_exact(cap_args[0], args[0])
    assert_exact(cap_args[2], args[2])
    assert_close(cap_mixed, ref_mixed, dtype, scale, tol)
    # The pure mixture read after the update equals the captured one bit for bit.
    mixed = OPS.attn_res_mix(*mix_args(cap_args))
    assert_exact(mixed, cap_mixed)
    if args[0].numel():
        assert_no_alias([out], tensors(args))
        assert_no_alias([cap_out, cap_mixed], tensors(cap_args))
        assert_no_alias([mixed], tensors(cap_args))
    return cap_out, cap_mixed


# --------------------------------------------------------------------------- numerics

# (T, H, NB, num_blocks): T in {0, 1, 7, 64, 300}, non-powers of two, NB up to 9.
SHAPES = [
    (0, 16, 3, 2),
    (1, 1, 1, 1),
    (1, 128, 9, 0),
    (7, 100, 9, 5),
    (7, 16, 2, 2),
    (64, 128, 4, 0),
    (64, 1000, 9, 9),
    (300, 1024, 9, 8),
    (300, 100, 5, 3),
]
WRITES = ("none", "unread", "read")


def write_slot(mode, NB, nb):
    """-1, a slot not read (>= nb) or a read slot (< nb, the just-written block is read)."""
    if mode == "unread" and nb < NB:
        return NB - 1
    if mode == "read" and nb > 0:
        return nb // 2
    return -1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("onorm", [False, True], ids=["no_onorm", "onorm"])
@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("delta", [False, True], ids=["no_delta", "delta"])
def test_grid(cpu_path, dtype, delta, write, onorm):
    for i, (T, H, NB, nb) in enumerate(SHAPES):
        idx = write_slot(write, NB, nb)
        args = make_args(T, H, NB, nb, idx, dtype, delta=delta, onorm=onorm, seed=i)
        out, mixed = check_attn_res(args)
        assert out.shape == mixed.shape == (T, H)


@pytest.mark.parametrize("seed", range(24))
def test_random(cpu_path, seed):
    rng = random.Random(seed)
    T = rng.choice([0, 1, 7, 64, 300])
    H = rng.choice([1, 16, 100, 128, 1024])
    NB = rng.randint(1, 9)
    nb = rng.randint(0, NB)
    idx = rng.choice([-1, rng.randrange(NB)])
    dtype = rng.choice(DTYPES)
    args = make_args(T, H, NB, nb, idx, dtype, delta=rng.random() < 0.5,
                     onorm=rng.random() < 0.5, seed=seed, qk_scale=rng.choice([0.1, 2.0, 8.0]))
    check_attn_res(args)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunk_bytes", [1, 5000, 1 << 16])
def test_cpu_path_row_chunks(monkeypatch, dtype, chunk_bytes):
    """The torch CPU path works a chunk of rows at a time; chunks of 1 row, a few rows and
    a ragged last chunk give the same results (delta add and block write per chunk too)."""
    monkeypatch.setattr(kimi_ops.cpu_native, "ENABLED", False)
    monkeypatch.setattr(kimi_ops.cpu, "_CHUNK_BYTES", chunk_bytes)
    for nb, write, onorm in [(6, 2, True), (0, 3, True), (5, 7, False)]:
        args = make_args(37, 48, 9, nb, write, dtype, delta=True, onorm=onorm, seed=nb)
        check_attn_res(args)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 100, 9, 0), (64, 128, 9, 9), (300, 1024, 9, 4)])
def test_mix_matches_reference(cpu_path, dtype, shape):
    T, H, NB, nb = shape
    args = mix_args(make_args(T, H, NB, nb, -1, dtype, delta=False, onorm=False))
    before = clone_args(args)
    mixed = OPS.attn_res_mix(*args)
    expected = attn_res_mix_reference(*before).to(dtype)
    assert_close(mixed, expected, dtype)
    assert torch.equal(args[0], before[0]) and torch.equal(args[1], before[1])  # no mutation
    assert_no_alias([mixed], tensors(args))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("onorm", [False, True], ids=["no_onorm", "onorm"])
def test_large_magnitude(cpu_path, dtype, onorm):
    """Sources x1e4 (v^2 overflows fp16: the norms must accumulate in fp32), and a large
    pseudo-query whose logits (~1e2-1e3) overflow a softmax without max subtraction.

    Logits of magnitude L carry an fp32 rounding error ~L*1e-7, amplified by the softmax:
    the huge-logit case is compared at 1e-3 (relative to the source scale).
    """
    scale = 1e4
    for qk_scale, tol in ((2.0, None), (200.0, 1e-3)):
        args = make_args(64, 1024, 9, 8, 2, dtype, delta=True, onorm=onorm, seed=3,
                         scale=scale, qk_scale=qk_scale)
        out, mixed = check_attn_res(args, scale=scale, tol=tol)
        assert torch.isfinite(out).all() and torch.isfinite(mixed).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_propagates(cpu_path, dtype):
    T, H, NB, nb = 7, 100, 9, 5
    args = make_args(T, H, NB, nb, -1, dtype, delta=True, onorm=True)
    args[2][3, 1, 17] = float("nan")  # a read block source of row 3
    args[2][5, 7, 2] = float("nan")  # slot 7 >= num_blocks: never read
    out, mixed = check_attn_res(args)
    for t in (out, mixed):
        assert torch.isnan(t[3]).all()
        rows = [r for r in range(T) if r != 3]
        assert torch.isfinite(t[rows]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("nb", [0, 3])
def test_outputs_never_alias_inputs(cpu_path, dtype, nb):
    """Also num_blocks == 0 (mixture == prefix) and fp32 with no output norm."""
    for delta, write, onorm in [(False, -1, False), (True, 1, False), (True, -1, True)]:
        args = make_args(5, 16, 4, nb, write, dtype, delta=delta, onorm=onorm)
        inputs = tensors(args)
        out = OPS.attn_res(*args)
        assert_no_alias([out], inputs)
        out, mixed = OPS.attn_res_capture(*args)
        assert_no_alias([out, mixed], inputs)
        if not onorm:
            assert torch.equal(out, mixed)
        mixed = OPS.attn_res_mix(*mix_args(args))
        assert_no_alias([mixed], inputs)
        if nb == 0:
            assert torch.equal(mixed, args[0])
    x = torch.randn(3, 16, dtype=dtype)
    assert_no_alias([OPS.aux_tap(x, 0)], [x])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("write", [-1, 1, 6])
def test_strided_views(cpu_path, dtype, write):
    """blocks a dim-1 slice of a bigger bank; prefix and delta row-strided views."""
    T, H, NB, nb = 64, 100, 7, 4
    g = torch.Generator().manual_seed(1)

    def bases():
        g.manual_seed(1)
        bank = torch.randn(T, NB + 3, H, generator=g).to(dtype)
        pbase = torch.randn(2 * T, H + 5, generator=g).to(dtype)
        dbase = torch.randn(T, 2 * H, generator=g).to(dtype)
        return bank, pbase, dbase

    def views(bank, pbase, dbase):
        return bank[:, 2 : 2 + NB], pbase[::2, 3 : 3 + H], dbase[:, H:]

    args0 = make_args(T, H, NB, nb, write, dtype, delta=True, onorm=True)
    results = []
    for op in ("ref", "attn_res", "capture"):
        bank, pbase, dbase = bases()
        blocks, prefix, delta = views(bank, pbase, dbase)
        assert not blocks.is_contiguous() and not prefix.is_contiguous()
        assert not delta.is_contiguous()
        args = [prefix, delta, blocks, *args0[3:]]
        if op == "ref":
            out = attn_res_reference(*args)
        elif op == "attn_res":
            out = OPS.attn_res(*args)
        else:
            out, mixed = OPS.attn_res_capture(*args)
            assert torch.equal(OPS.attn_res_mix(*mix_args(args)), mixed)
        results.append((out, bank, pbase, dbase))
    ref = results[0]
    for out, bank, pbase, dbase in results[1:]:
        assert_close(out, ref[0], dtype)
        # Mutations land in the base tensors, untouched elements stay untouched.
        assert torch.equal(bank, ref[1]) and torch.equal(pbase, ref[2])
        assert torch.equal(dbase, ref[3])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_tokens(cpu_path, dtype):
    for nb, write in [(0, -1), (3, 1), (4, 0)]:
        args = make_args(0, 16, 4, nb, write, dtype, delta=True, onorm=True)
        assert OPS.attn_res(*args).shape == (0, 16)
        out, mixed = OPS.attn_res_capture(*args)
        assert out.shape == mixed.shape == (0, 16)
        assert OPS.attn_res_mix(*mix_args(args)).shape == (0, 16)
    assert OPS.aux_tap(torch.empty(0, 16, dtype=dtype), 1).shape == (0, 16)


# --------------------------------------------------------------------------- opcheck

OPCHECK_CASES = [
    # (T, H, NB, nb, write, dtype, delta, onorm)
    (5, 16, 4, 3, -1, torch.float32, False, False),
    (5, 16, 4, 3, 1, torch.float32, True, True),
    (5, 16, 4, 2, 3, torch.float32, True, False),
    (5, 16, 4, 0, -1, torch.float32, False, False),
    (6, 100, 9, 8, 8, torch.bfloat16, True, True),
    (3, 32, 2, 2, 0, torch.float16, False, True),
]


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=lambda c: f"{c}")
def test_opcheck(case):
    T, H, NB, nb, write, dtype, delta, onorm = case
    args = make_args(T, H, NB, nb, write, dtype, delta=delta, onorm=onorm)
    opcheck(OPS.attn_res.default, clone_args(args))
    opcheck(OPS.attn_res_capture.default, clone_args(args))
    opcheck(OPS.attn_res_mix.default, mix_args(clone_args(args)))


@pytest.mark.parametrize("shape,dtype", [((5, 16), torch.float32), ((2, 3, 64), torch.bfloat16)])
def test_opcheck_aux_tap(shape, dtype):
    opcheck(OPS.aux_tap.default, (torch.randn(shape, dtype=dtype), 3))


# --------------------------------------------------------------------------- validation

T0, H0, NB0 = 4, 8, 3


def valid(dtype=torch.float32):
    """A valid arg list with every optional given."""
    return make_args(T0, H0, NB0, 2, 1, dtype, delta=True, onorm=True)


def rank_msg(name, rank, layout, shape):
    return re.escape(f"{name} must be {rank}-D {layout}, got shape {shape} ({len(shape)}-D)")


def h_msg(name, shape):
    return re.escape(
        f"hidden size mismatch: {name} has H={shape[-1]} (shape {shape}) but prefix has H={H0}"
    )


def t_msg(name, shape):
    return re.escape(
        f"token count mismatch: {name} has T={shape[0]} (shape {shape}) but prefix has T={T0}"
    )


def r(*shape):
    return torch.randn(*shape)


# (position to replace, new value, message regex)
ERROR_CASES = {
    # wrong rank
    "rank_prefix": (0, r(T0, 1, H0), rank_msg("prefix", 2, "[T, H]", (T0, 1, H0))),
    "rank_delta": (1, r(H0), rank_msg("delta", 2, "[T, H]", (H0,))),
    "rank_blocks": (2, r(T0, H0), rank_msg("blocks", 3, "[T, NB, H]", (T0, H0))),
    "rank_norm_weight": (3, r(1, H0), rank_msg("norm_weight", 1, "[H]", (1, H0))),
    "rank_qk_weight": (4, r(2, H0), rank_msg("qk_weight", 1, "[H]", (2, H0))),
    "rank_output_norm_weight": (5, r(()), rank_msg("output_norm_weight", 1, "[H]", ())),
    # hidden size
    "H_delta": (1, r(T0, H0 + 1), h_msg("delta", (T0, H0 + 1))),
    "H_blocks": (2, r(T0, NB0, H0 - 1), h_msg("blocks", (T0, NB0, H0 - 1))),
    "H_norm_weight": (3, r(H0 * 2), h_msg("norm_weight", (H0 * 2,))),
    "H_qk_weight": (4, r(H0 + 3), h_msg("qk_weight", (H0 + 3,))),
    "H_output_norm_weight": (5, r(1), h_msg("output_norm_weight", (1,))),
    # token count
    "T_delta": (1, r(T0 + 1, H0), t_msg("delta", (T0 + 1, H0))),
    "T_blocks": (2, r(T0 - 1, NB0, H0), t_msg("blocks", (T0 - 1, NB0, H0))),
    # dtype mismatch
    "dtype_delta": (1, r(T0, H0).half(),
                    re.escape("delta dtype torch.float16 differs from prefix dtype torch.float32")),
    "dtype_blocks": (2, r(T0, NB0, H0).bfloat16(),
                     re.escape("blocks dtype torch.bfloat16 differs from prefix dtype "
                               "torch.float32")),
    "dtype_norm_weight": (3, r(H0).double(),
                          re.escape("norm_weight dtype torch.float64 differs from prefix "
                                    "dtype torch.float32")),
    "dtype_qk_weight": (4, r(H0).half(), re.escape("qk_weight dtype torch.float16 differs")),
    "dtype_output_norm_weight": (5, r(H0).bfloat16(),
                                 re.escape("output_norm_weight dtype torch.bfloat16 differs")),
    # device mismatch (the meta device)
    "device_blocks": (2, torch.empty(T0, NB0, H0, device="meta"),
                      re.escape("blocks is on meta but prefix is on cpu")),
    "device_qk_weight": (4, torch.empty(H0, device="meta"),
                         re.escape("qk_weight is on meta but prefix is on cpu")),
    "device_prefix": (0, torch.empty(T0, H0, device="meta"),
                      re.escape("delta is on cpu but prefix is on meta")),
    # index ranges
    "num_blocks_neg": (6, -1, re.escape(f"num_blocks=-1 is outside [0, {NB0}] "
                                        f"(blocks has NB={NB0} slots)")),
    "num_blocks_big": (6, NB0 + 1, re.escape(f"num_blocks={NB0 + 1} is outside [0, {NB0}]")),
    "write_neg": (7, -2, re.escape(f"block_write_idx=-2 is outside [-1, {NB0}) "
                                   f"(blocks has NB={NB0} slots; -1 means no write)")),
    "write_big": (7, NB0, re.escape(f"block_write_idx={NB0} is outside [-1, {NB0})")),
    "eps_neg": (8, -1e-6, re.escape("eps=-1e-06 must be a non-negative float")),
    "output_norm_eps_neg": (9, -0.5,
                            re.escape("output_norm_eps=-0.5 must be a non-negative float")),
}


@pytest.mark.parametrize("name", list(ERROR_CASES))
def test_validation_errors(name):
    pos, value, msg = ERROR_CASES[name]
    for op in (OPS.attn_res, OPS.attn_res_capture):
        args = valid()
        args[pos] = value
        with pytest.raises(AttnResArgumentError, match=msg):
            op(*args)


def test_unsupported_dtype():
    args = [a.double() if isinstance(a, torch.Tensor) else a for a in valid()]
    msg = re.escape("prefix dtype torch.float64 is not supported; use one of ['torch.float32', "
                    "'torch.bfloat16', 'torch.float16']")
    for op in (OPS.attn_res, OPS.attn_res_capture):
        with pytest.raises(AttnResArgumentError, match=msg):
            op(*args)
    with pytest.raises(AttnResArgumentError, match=msg):
        OPS.attn_res_mix(*mix_args(args))


@pytest.mark.parametrize("name", ["rank_prefix", "rank_blocks", "H_blocks", "H_qk_weight",
                                  "T_blocks", "dtype_blocks", "device_blocks",
                                  "num_blocks_neg", "num_blocks_big", "eps_neg"])
def test_validation_errors_mix(name):
    pos, value, msg = ERROR_CASES[name]
    args = valid()
    args[pos] = value
    with pytest.raises(AttnResArgumentError, match=msg):
        OPS.attn_res_mix(*mix_args(args))


@pytest.mark.parametrize("capture_id", [-1, 1.5, "3", True, None])
def test_aux_tap_bad_capture_id(capture_id):
    x = torch.randn(2, 8)
    msg = re.escape(f"capture_id must be a non-negative int (vLLM capture id: what layer k "
                    f"reads), got {capture_id!r}")
    with pytest.raises(AttnResArgumentError, match=msg):
        kimi_passes.aux_tap(x, capture_id)
    if type(capture_id) is int:  # the op's schema rejects other types (and casts a bool)
        with pytest.raises(AttnResArgumentError, match=msg):
            OPS.aux_tap(x, capture_id)


def test_aux_tap_scalar_input():
    with pytest.raises(AttnResArgumentError, match="x must be a hidden-state tensor"):
        kimi_passes.aux_tap(torch.tensor(1.0), 0)
    with pytest.raises(AttnResArgumentError, match="got a 0-D tensor"):
        OPS.aux_tap(torch.tensor(1.0), 0)


def test_fake_kernel_raises_under_fake_mode():
    args = valid()
    args[4] = r(H0 + 1)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        for op in (OPS.attn_res, OPS.attn_res_capture):
            with pytest.raises(AttnResArgumentError, match=h_msg("qk_weight", (H0 + 1,))):
                op(*fake)
        with pytest.raises(AttnResArgumentError, match=h_msg("qk_weight", (H0 + 1,))):
            OPS.attn_res_mix(*mix_args(fake))
        with pytest.raises(AttnResArgumentError, match="capture_id"):
            OPS.aux_tap(fake[0], -3)
        fake[4] = mode.from_tensor(r(H0))  # and a valid call works on fakes
        assert OPS.attn_res(*fake).shape == (T0, H0)


def test_fake_kernel_raises_at_compile_time():
    """torch.compile(fullgraph=True) fails while tracing, before any backend or kernel runs."""
    compiled_graphs = []

    def backend(gm, example_inputs):
        compiled_graphs.append(gm)
        return gm

    def f(prefix, delta, blocks, nw, qk, onw):
        out = OPS.attn_res(prefix, delta, blocks, nw, qk, onw, 2, 1, EPS, ONORM_EPS)
        return out * 2

    args = valid()[:6]
    args[3] = r(H0 + 2)  # norm_weight with the wrong H
    torch._dynamo.reset()
    with pytest.raises((AttnResArgumentError, torch._dynamo.exc.TorchRuntimeError),
                       match=h_msg("norm_weight", (H0 + 2,))) as info:
        torch.compile(f, fullgraph=True, backend=backend)(*args)
    assert "AttnResArgumentError" in str(info.value) or info.type is AttnResArgumentError
    assert not compiled_graphs


@pytest.mark.parametrize("name", ["attn_res", "attn_res_capture", "attn_res_mix"])
def test_eager_cpu_call_runs_its_kernel_directly_and_a_mode_still_sees_it(name, monkeypatch):
    """A CPU call recording no gradient: the op's autograd kernel calls the CPU kernel
    itself (``ops.library.below_autograd``), no second trip through the dispatcher. With a
    dispatch mode active the call still goes through it (the mode sees the op), and both
    routes compute the same values and in-place effects."""
    from torch.utils._python_dispatch import TorchDispatchMode

    redispatched = []
    real = torch._ops.OpOverload.redispatch

    def spy(self, keyset, *args, **kwargs):
        redispatched.append(str(self))
        return real(self, keyset, *args, **kwargs)

    monkeypatch.setattr(torch._ops.OpOverload, "redispatch", spy)

    def call(args):
        return getattr(OPS, name)(*(mix_args(args) if name == "attn_res_mix" else args))

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    direct, moded = valid(), valid()
    got = call(direct)
    assert redispatched == []
    with Seen() as mode:
        want = call(moded)
    assert f"kimi.{name}.default" in mode.ops
    assert redispatched == [f"kimi.{name}.default"]
    for g, w in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want)), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for g, w in zip(direct, moded, strict=True):
        if isinstance(g, torch.Tensor):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


# --------------------------------------------------------------------------- aux_tap


def test_aux_tap_eager_identity():
    x = torch.randn(4, 16)
    assert kimi_passes.aux_tap(x, 0) is x
    assert kimi_passes.aux_tap(x, 7) is x


def test_aux_tap_compiled_no_graph_break():
    def f(x):
        return kimi_passes.aux_tap(x, 2)

    x = torch.randn(8, 32)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(f)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    torch._dynamo.reset()
    tapped = torch.compile(f, fullgraph=True)(x)  # default backend (inductor)
    assert torch.equal(tapped, x)


# --------------------------------------------------------------------------- schemas

#: The registered schemas, as users and vLLM call them. attn_res / attn_res_capture are
#: inferred from the AttnResArgs record: reordering or retyping its fields changes them.
SCHEMAS = {
    "attn_res": "kimi::attn_res(Tensor(a0!) prefix, Tensor? delta, Tensor(a2!) blocks, "
                "Tensor norm_weight, Tensor qk_weight, Tensor? output_norm_weight, "
                "SymInt num_blocks, SymInt block_write_idx, float eps, float output_norm_eps)"
                " -> Tensor",
    "attn_res_capture": "kimi::attn_res_capture(Tensor(a0!) prefix, Tensor? delta, "
                        "Tensor(a2!) blocks, Tensor norm_weight, Tensor qk_weight, "
                        "Tensor? output_norm_weight, SymInt num_blocks, SymInt block_write_idx,"
                        " float eps, float output_norm_eps) -> (Tensor, Tensor)",
    **{name: f"kimi::{name}(Tensor(a0!) prefix, Tensor? delta, Tensor(a2!) blocks, "
             "Tensor norm_weight, Tensor qk_weight, Tensor? output_norm_weight, "
             "SymInt num_blocks, SymInt block_write_idx, float eps, float output_norm_eps, "
             "ScalarType quant_dtype, float quant_max=0., float amax_floor=1e-10, "
             "float scale_floor=0., bool divide=False, Tensor? scale_ub=None, "
             "bool divide_values=False) -> "
             f"({returns})"
       for name, returns in (("attn_res_quant", "Tensor, Tensor"),
                             ("attn_res_quant_capture", "Tensor, Tensor, Tensor"))},
    "attn_res_mix": "kimi::attn_res_mix(Tensor prefix, Tensor blocks, Tensor norm_weight, "
                    "Tensor qk_weight, SymInt num_blocks, float eps) -> Tensor",
    "attn_res_mix_list": "kimi::attn_res_mix_list(Tensor[] sources, Tensor? norm_weight, "
                         "Tensor qk_weight, float eps, ScalarType? out_dtype=None) -> Tensor",
    "aux_tap": "kimi::aux_tap(Tensor x, SymInt capture_id) -> Tensor",
    "attn_res_mix_backward": "kimi::attn_res_mix_backward(Tensor grad, Tensor prefix, "
                             "Tensor blocks, Tensor norm_weight, Tensor qk_weight, "
                             "SymInt num_blocks, float eps, bool need_prefix, bool need_blocks,"
                             " bool need_weights) -> (Tensor, Tensor, Tensor)",
    "attn_res_mix_list_backward": "kimi::attn_res_mix_list_backward(Tensor grad, "
                                  "Tensor[] sources, Tensor? norm_weight, Tensor qk_weight, "
                                  "float eps, bool need_sources, bool need_weights) -> "
                                  "(Tensor[], Tensor)",
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_registered_schemas_are_unchanged(name):
    assert str(getattr(OPS, name).default._schema) == SCHEMAS[name]


def test_the_record_is_the_mutating_ops_argument_list():
    from kimi_passes.ops.attn_res_args import AttnResArgs

    for op in (OPS.attn_res, OPS.attn_res_capture):
        assert [a.name for a in op.default._schema.arguments] == list(AttnResArgs._fields)


def test_each_record_is_its_ops_argument_list():
    """Every op of the family takes one record's fields, defaults included, and each
    record's ``tensors`` are its tensor fields."""
    import typing

    from kimi_passes.ops import attn_res_args as records

    by_op = {"attn_res": records.AttnResArgs, "attn_res_capture": records.AttnResArgs,
             "attn_res_mix": records.MixArgs, "attn_res_mix_list": records.MixListArgs,
             "attn_res_mix_backward": records.MixBackwardArgs,
             "attn_res_mix_list_backward": records.MixListBackwardArgs,
             "attn_res_quant": records.AttnResQuantArgs,
             "attn_res_quant_capture": records.AttnResQuantArgs}
    for name, record in by_op.items():
        arguments = getattr(OPS, name).default._schema.arguments
        fields = records.schema_fields(record)  # a nested record (the quant's base) spelled out
        assert [a.name for a in arguments] == [p.name for p in fields], name
        assert {a.name: a.default_value for a in arguments if a.has_default_value()} == {
            p.name: p.default for p in fields if p.default is not p.empty}, name
        tensor_fields = [p.name for p in fields if "Tensor" in str(p.annotation)]
        if record is records.AttnResQuantArgs:  # scale_ub: a quant constant, last (defaulted)
            tensor_fields.remove("scale_ub")
            assert records.AttnResQuantArgs.from_args(*range(len(fields))).to_args() == (
                tuple(range(len(fields))))
            assert typing.get_type_hints(record)["base"] is records.AttnResArgs
            record = records.AttnResArgs
        n = len(tensor_fields)
        assert record._fields[:n] == tuple(tensor_fields), name  # the tensors come first
        assert len(record._make(range(len(record._fields))).tensors) == n, name


def test_the_mix_record_is_attn_res_without_its_updates():
    from kimi_passes.ops.attn_res_args import PURE_MIXTURE, AttnResArgs, MixArgs

    mix = MixArgs(*range(len(MixArgs._fields)))
    a = AttnResArgs.mix(*mix)
    assert type(a) is AttnResArgs and AttnResArgs.mix(**mix._asdict()) == a
    assert {f: getattr(a, f) for f in PURE_MIXTURE} == PURE_MIXTURE
    assert MixArgs.part_of(a) == mix
