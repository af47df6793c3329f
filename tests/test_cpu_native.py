"""The small-shape CPU kernel (``ops/cpu_rows.c`` via ``ops/cpu_native.py``) and the lean
registration of the mutating ops: where the C kernel is built and reused, what happens
without a compiler, which calls it serves, and that ``kimi.attn_res``'s in-place effects
are still seen by autograd. Its numerics are tests/test_ops.py's, run on both CPU paths
(the ``cpu_path`` fixture)."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from helpers.op import clone_args, make_args

from kimi_passes.ops import cpu_native
from kimi_passes.ops.attn_res_args import AttnResArgs

OPS = torch.ops.kimi


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A process that has not loaded the C kernel yet, with an empty cache directory."""
    monkeypatch.setenv("KIMI_PASSES_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_native, "_LIB", None)
    monkeypatch.setattr(cpu_native, "_FAILED", None)
    monkeypatch.setattr(cpu_native, "ENABLED", True)
    return tmp_path


def _call(args):
    a = clone_args(args)
    out = OPS.attn_res(*a)
    return out, a[0], a[2]


def test_the_kernel_is_built_once_into_the_cache_and_reused(fresh_build):
    args = make_args(8, 64, 5, 4, 4, torch.bfloat16, delta=True, onorm=True)
    _call(args)
    path = cpu_native.library_path()
    assert path.parent == fresh_build and path.exists()
    assert [p.name for p in fresh_build.iterdir()] == [path.name]  # no temporary left
    built = path.stat().st_mtime_ns
    cpu_native._LIB = None  # as a new process: finds the build, does not compile again
    _call(args)
    assert path.stat().st_mtime_ns == built and cpu_native._LIB is not None


def test_without_a_compiler_it_warns_once_and_the_torch_path_serves(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", str(fresh_build / "no-such-cc"))
    args = make_args(8, 64, 5, 4, 4, torch.float32, delta=True, onorm=True)
    with pytest.warns(cpu_native.KimiNativeWarning) as seen:
        got = _call(args)
    (w,) = seen
    msg = str(w.message)
    assert "no-such-cc" in msg and "Install a C compiler (or set CC)" in msg, msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call is quiet
        again = _call(args)
    monkeypatch.setattr(cpu_native, "ENABLED", False)
    want = _call(args)
    for g, a, b in zip(got, again, want, strict=True):
        assert torch.equal(g, b) and torch.equal(a, b)


def test_which_calls_the_c_kernel_serves(monkeypatch):
    def serves(T, H, nb, threads, dtype=torch.float32, strided=False):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        meta = dict(dtype=dtype, device="meta")  # shapes and strides only
        prefix = torch.empty(H, T, **meta).t() if strided else torch.empty(T, H, **meta)
        blocks, w = torch.empty(T, nb + 1, H, **meta), torch.empty(H, **meta)
        a = AttnResArgs(prefix, None, blocks, w, w, None, nb, -1, 1e-6, 1e-6)
        return cpu_native.serves(a, 1)

    assert serves(4096, 7168, 8, threads=1)  # one thread: every size
    assert serves(8, 7168, 8, threads=2)  # 8 * 7168 * 10 * 2 elements <= 2^21
    assert not serves(64, 7168, 8, threads=2)
    assert serves(32, 512, 4, threads=16) and not serves(32, 512, 4, threads=64)
    assert not serves(8, 512, 4, threads=1, strided=True)  # rows must be contiguous
    assert not serves(8, 512, 4, threads=1, dtype=torch.float64)


def test_the_avx2_copy_and_the_baseline_give_the_same_bits(monkeypatch, tmp_path):
    """The library picks its row loop at load time (the AVX2 copy where the CPU has AVX2):
    both copies give the same bits, so a result does not depend on the machine. On a CPU
    without AVX2 both sides are the baseline."""
    monkeypatch.setattr(cpu_native, "ENABLED", True)
    picked = cpu_native._load()
    assert picked is not None, cpu_native._FAILED
    cpu_native.build(tmp_path / "baseline.so", ("-DKIMI_ROWS_BASELINE",))
    baseline = cpu_native.open_library(tmp_path / "baseline.so")
    cases = itertools.product((torch.float32, torch.bfloat16, torch.float16),
                              ((1, 512), (8, 512), (3, 1000), (5, 13)),
                              ((4, 3, 2), (4, 2, 2), (4, 4, -1), (2, 0, 0)),
                              ((False, False), (True, True), (True, False)))
    for n, (dtype, (T, H), (NB, nb, write), (delta, onorm)) in enumerate(cases):
        args = make_args(T, H, NB, nb, write, dtype, delta=delta, onorm=onorm, seed=n)
        got = []
        for lib in (picked, baseline):
            monkeypatch.setattr(cpu_native, "_LIB", lib)
            a = clone_args(args)
            out, mixed = OPS.attn_res_capture(*a)
            got.append([t.view(torch.int32 if dtype == torch.float32 else torch.int16)
                        for t in (out, mixed, a[0], a[2])])
        for x, y in zip(*got, strict=True):
            assert torch.equal(x, y), (dtype, T, H, NB, nb, write, delta, onorm)


@pytest.mark.parametrize("cpu_path", ["c", "torch"], indirect=True)
def test_a_written_tensor_whose_rows_share_memory_is_refused(cpu_path):
    """An expanded prefix (one row seen T times) cannot take the delta add; the C kernel
    declines it and torch's error names the problem, as on the torch path."""
    args = make_args(8, 64, 5, 4, 4, torch.float32, delta=True, onorm=False)
    args[0] = args[0][:1].expand(8, 64)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        OPS.attn_res(*args)


@pytest.mark.parametrize("cpu_path", ["c", "torch"], indirect=True)
def test_autograd_sees_the_ops_in_place_updates(cpu_path):
    """The op writes ``prefix`` (delta) and ``blocks`` (block write) in place: their version
    counters move, so a value autograd saved before the call is refused, not misused."""
    args = make_args(8, 64, 5, 4, 4, torch.float32, delta=True, onorm=True)
    prefix, blocks = args[0], args[2]
    versions = prefix._version, blocks._version
    OPS.attn_res(*args)
    assert prefix._version > versions[0] and blocks._version > versions[1]

    w = torch.ones(64, requires_grad=True)
    saved = (w * prefix).sum() + (w * blocks).sum()  # saves prefix and blocks for dL/dw
    OPS.attn_res_capture(*args)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()
