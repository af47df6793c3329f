"""The Triton routes of ``kimi::attn_res_quant`` under the interpreter, and vLLM's AMD kernel.

Each route (row, chunked, decode) quantizes its own output: its bytes and scales equal
``fp8_quant.quantize_rows`` of the unquantized launch of the same route, bit for bit, and
its in-place effects and captured mixture equal that launch's. Against the CPU path the
bytes and scales are equal on every row whose unquantized outputs are equal (16-bit rows
mostly are; the mixtures' fp32 arithmetic differs between paths by rounding).

vLLM's AMD K3 kernel (``vllm/models/kimi_k3/amd/ops/attn_res.py``), read from the installed
vLLM as ``python -m tools.kernel_build --vllm-peer`` does and launched by its own ``attn_res`` with
``QUANT_MAX`` per FP8 dtype, runs under the interpreter beside the op. The interpreter's
fp32 -> bf16 and fp32 -> fp8 conversions are not a GPU's (bf16 truncates; fp8 rounds ties
away from zero and truncates subnormals), so for these tests they round to nearest even,
through torch, as the hardware conversions do (``gpu_rounding``); the op's kernels round by
bits and do not depend on it. The claims: the op's quant of vLLM's own unquantized output is
vLLM's quant, bit for bit; and the op's bytes and scales equal vLLM's on every row whose
unquantized outputs agree. Rows whose outputs differ (the two mixtures sum in different
orders) are counted; ``KIMI_PASSES_LONG_QUANT=1`` runs the random sweep (T = 1 to 300, K3's
H = 7168 among the widths) and prints the counts.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers.fp8 import assert_rows_agree, bits, gpu_rounding, vllm_amd
from helpers.op import clone_args, make_args

from kimi_passes import ops
from kimi_passes.ops.attn_res_args import AttnResQuantArgs
from kimi_passes.ops.fp8_quant import FP8_MAX, quantize_rows

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit"),
              pytest.mark.usefixtures("one_thread")]

OPS = torch.ops.kimi
FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
LONG = os.environ.get("KIMI_PASSES_LONG_QUANT") == "1"


def forms(qd):
    """The quants the op reproduces: vLLM's AMD kernel's, QuantFP8's with scale_ub, and
    (e4m3fn only, to keep the interpreted runs few) vLLM's CUDA op's (values divided)."""
    cuda_op = [dict(ops.quant_fp8_constants(qd), divide_values=True)] if qd == FN else []
    return [{}, dict(ops.quant_fp8_constants(qd), scale_ub=torch.tensor([1.5])), *cuda_op]


ROUTE_CASES = [
    # (T, H, NB, nb, write, dtype, delta, onorm, route); H = 9000 takes the chunked kernel
    (5, 100, 4, 3, 1, BF16, True, True, "row"),
    (4, 64, 3, 2, -1, F32, False, False, "row"),
    (3, 96, 5, 5, -1, F16, True, True, "decode"),
    (2, 9000, 3, 2, 1, BF16, True, True, "row"),
    (2, 9000, 3, 2, -1, F32, False, False, "row"),
    (2, 2048, 2, 2, 0, BF16, True, False, "decode"),
    (1, 2048, 3, 2, -1, F32, True, True, "decode"),
]


@pytest.mark.parametrize("qd", [FN, FNUZ], ids=str)
@pytest.mark.parametrize("case", ROUTE_CASES, ids=str)
def test_each_route_quantizes_its_own_output(case, qd):
    T, H, NB, nb, write, dtype, delta, onorm, route = case
    args = make_args(T, H, NB, nb, write, dtype, delta=delta, onorm=onorm, seed=H + T,
                     scale=4.0)
    plain = clone_args(args)
    out, mixed = ops.attn_res_capture_triton(*plain, route=route)
    cpu_out = OPS.attn_res(*clone_args(args))
    for extra in forms(qd):
        got_args = clone_args(args)
        data, scale, got_mixed = ops.attn_res_quant_capture_triton(*got_args, qd, route=route,
                                                                   **extra)
        q = AttnResQuantArgs.from_args(*args, qd, **extra)
        want_data, want_scale = quantize_rows(out, q)
        assert data.dtype == qd and data.shape == (T, H) and scale.shape == (T, 1)
        assert torch.equal(bits(data), bits(want_data)) and torch.equal(scale, want_scale)
        assert torch.equal(got_mixed, mixed)
        assert torch.equal(got_args[0], plain[0]) and torch.equal(got_args[2], plain[2])
        d2, s2 = ops.attn_res_quant_triton(*clone_args(args), qd, route=route, **extra)
        assert torch.equal(bits(d2), bits(data)) and torch.equal(s2, scale)
        cpu_data, cpu_scale = OPS.attn_res_quant(*clone_args(args), qd, **extra)
        assert_rows_agree(data, scale, cpu_data, cpu_scale, (out == cpu_out).all(1),
                          f"{route} vs the CPU path")


def test_k3_width_bf16_every_route_against_the_cpu_path():
    """K3's H = 7168, bf16, delta, write and output norm: row and decode routes against the
    CPU path, both fp8 dtypes: rows whose bf16 outputs agree agree bit for bit; elsewhere a
    byte is at most one fp8 step off and a scale at most one bf16 step (2^-8 relative)."""
    args = make_args(2, 7168, 9, 8, 8, BF16, delta=True, onorm=True, seed=3)
    cpu_out = OPS.attn_res(*clone_args(args))
    for qd in (FN, FNUZ):
        want_data, want_scale = OPS.attn_res_quant(*clone_args(args), qd)
        for route in ("row", "decode"):
            agree = (ops.attn_res_triton(*clone_args(args), route=route) == cpu_out).all(1)
            data, scale = ops.attn_res_quant_triton(*clone_args(args), qd, route=route)
            assert_rows_agree(data, scale, want_data, want_scale, agree, route)
            steps = (bits(data).int() - bits(want_data).int()).abs()
            assert int(steps.max()) <= 1, route
            assert float(((scale - want_scale).abs() / want_scale).max()) <= 2.0 ** -8, route


def test_zero_rows_take_the_floor_on_every_route():
    args = make_args(3, 2048, 2, 1, -1, BF16, delta=False, onorm=False)
    args[0][1] = 0.0
    args[2][1] = 0.0
    for route in ("row", "decode"):
        _, scale = ops.attn_res_quant_triton(*clone_args(args), FN, route=route)
        assert scale[1, 0] == torch.tensor(1e-10) * torch.tensor(1 / 448.0)


# --------------------------------------------------------------------------- vLLM's AMD kernel

@pytest.fixture(name="gpu_rounding")
def gpu_rounding_fixture():
    with gpu_rounding():
        yield


@pytest.fixture(name="vllm_amd")
def vllm_amd_fixture():
    return vllm_amd()


def vllm_case(vllm_amd, case, stats=None):
    """One case against vLLM's AMD kernel: every path of the op (CPU, row, decode)."""
    T, H, NB, nb, write, dtype, delta, onorm, qd, seed, scale = case
    args = make_args(T, H, NB, nb, write, dtype, delta=delta, onorm=onorm, seed=seed,
                     scale=scale)
    vllm_amd.QUANT_MAX = FP8_MAX[qd]
    v_args = clone_args(args)
    v_data, v_scale = vllm_amd.attn_res(*v_args, quant_dtype=qd)
    v_out = vllm_amd.attn_res(*clone_args(args))
    assert v_data.dtype == qd and v_scale.shape == (T, 1)
    # The op's quant of vLLM's own output is vLLM's quant.
    q_data, q_scale = quantize_rows(v_out, AttnResQuantArgs.from_args(*args, qd))
    assert torch.equal(bits(q_data), bits(v_data)) and torch.equal(q_scale, v_scale), case
    paths = {"cpu": (lambda a: OPS.attn_res_quant(*a, qd), lambda a: OPS.attn_res(*a)),
             **{route: (lambda a, r=route: ops.attn_res_quant_triton(*a, qd, route=r),
                        lambda a, r=route: ops.attn_res_triton(*a, route=r))
                for route in ("row", "decode")}}
    for name, (quant, plain) in paths.items():
        o_args = clone_args(args)
        data, scale = quant(o_args)
        assert torch.equal(o_args[0], v_args[0]) and torch.equal(o_args[2], v_args[2]), name
        agree = (plain(clone_args(args)) == v_out).all(1)
        assert_rows_agree(data, scale, v_data, v_scale, agree, f"{name} vs vLLM, {case}")
        if stats is not None:
            differ = (bits(data) != bits(v_data)).any(1) | (scale != v_scale).any(1)
            s = stats.setdefault((name, dtype), [0, 0, 0, 0])
            s[0] += T
            s[1] += int((~agree).sum())
            s[2] += int(differ.sum())
            s[3] += int((bits(data) != bits(v_data)).sum())


VLLM_CASES = [
    # (T, H, NB, nb, write, dtype, delta, onorm, quant dtype, seed, scale)
    (2, 7168, 9, 8, 8, BF16, True, True, FN, 1, 1.0),
    (1, 7168, 9, 4, -1, BF16, False, True, FNUZ, 2, 3.0),
    (7, 256, 5, 4, 2, BF16, True, False, FNUZ, 3, 0.5),
    (5, 100, 3, 0, -1, F32, False, False, FN, 4, 2.0),
    (6, 64, 4, 3, 3, F16, True, True, FN, 5, 1.0),
]


@pytest.mark.vllm
@pytest.mark.vllm_kernel_file
@pytest.mark.usefixtures("gpu_rounding")
@pytest.mark.parametrize("case", VLLM_CASES, ids=str)
def test_vllm_amd_kernel_agrees_with_the_op(vllm_amd, case):
    vllm_case(vllm_amd, case)


def random_cases(n: int, seed: int = 20261204):
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(n):
        H = int(rng.choice([64, 100, 256, 1000, 2048, 7168]))
        T = int(rng.integers(1, 301)) if H < 2048 else int(rng.integers(1, 9))
        dtype = BF16 if H == 7168 else [BF16, F32, F16][int(rng.integers(0, 3))]
        NB = int(rng.integers(1, 10))
        cases.append((T, H, NB, int(rng.integers(0, NB + 1)), int(rng.integers(-1, NB)),
                      dtype, bool(rng.integers(0, 2)), bool(rng.integers(0, 2)),
                      [FN, FNUZ][int(rng.integers(0, 2))], i, float(rng.uniform(0.1, 10))))
    return cases


@pytest.mark.vllm
@pytest.mark.vllm_kernel_file
@pytest.mark.heavy
@pytest.mark.skipif(not LONG, reason="long profile: KIMI_PASSES_LONG_QUANT=1")
@pytest.mark.usefixtures("gpu_rounding")
def test_vllm_amd_kernel_random_sweep(vllm_amd, capsys):
    stats: dict = {}
    for case in random_cases(int(os.environ.get("KIMI_PASSES_LONG_QUANT_CASES", "40"))):
        vllm_case(vllm_amd, case, stats)
        with capsys.disabled():  # as it goes: a long run stopped early still reports
            print("\ncase (T, H, NB, nb, write, dtype, delta, onorm, quant, seed, scale):",
                  case, flush=True)
            print("path, dtype: rows, rows whose unquantized output differs from vLLM's, "
                  "rows whose bytes or scale differ, bytes that differ (running totals)")
            for (name, dtype), (rows, unq, q, b) in sorted(stats.items(), key=str):
                print(f"{name:>6} {str(dtype):>15}: {rows} {unq} {q} {b}", flush=True)
