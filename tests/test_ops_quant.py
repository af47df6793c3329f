"""``kimi::attn_res_quant`` / ``attn_res_quant_capture``: the per-token FP8 quant of the output.

The CPU path against the quant spelled out here in numpy (fp32 arithmetic, the fp8 rounding
torch's), the in-place effects against ``kimi::attn_res``, vLLM's ``QuantFP8`` native form
against the op called with its constants, ``opcheck`` and the argument checks on every path.
The Triton routes and vLLM's AMD kernel: tests/test_ops_quant_triton.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from helpers.op import clone_args, make_args, opcheck
from torch._subclasses.fake_tensor import FakeTensorMode

from kimi_passes.ops import AttnResArgumentError, quant_fp8_constants

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit"),
              pytest.mark.usefixtures("one_thread")]

OPS = torch.ops.kimi
FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
F32, BF16 = torch.float32, torch.bfloat16


def spelled_out(out: torch.Tensor, quant_dtype, quant_max=0.0, amax_floor=1e-10,
                scale_floor=0.0, divide=False, scale_ub=None, divide_values=False):
    """The quant of docs/design.md in numpy fp32, the last rounding torch's (RTNE)."""
    qmax = np.float32(quant_max if quant_max > 0 else {FN: 448.0, FNUZ: 224.0}[quant_dtype])
    y = out.float().numpy()
    amax = np.abs(y).max(axis=-1, keepdims=True)
    if scale_ub is not None:
        amax = np.minimum(amax, np.float32(scale_ub.item()))
    amax = np.maximum(amax, np.float32(amax_floor))
    scale = amax / qmax if divide else amax * np.float32(1.0 / float(qmax))
    scale = np.maximum(scale, np.float32(scale_floor)).astype(np.float32)
    v = y / scale if divide_values else y * (np.float32(1.0) / scale)
    v = np.clip(v, -qmax, qmax).astype(np.float32)
    return torch.from_numpy(v).to(quant_dtype), torch.from_numpy(scale)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


CASES = [
    # (T, H, NB, nb, write, dtype, delta, onorm, quant_dtype)
    (5, 16, 4, 3, -1, F32, False, False, FN),
    (5, 16, 4, 3, 1, F32, True, True, FNUZ),
    (6, 100, 9, 8, 8, BF16, True, True, FN),
    (6, 100, 9, 8, 8, BF16, True, True, FNUZ),
    (3, 32, 2, 0, 0, torch.float16, False, True, FN),
    (4, 64, 3, 2, -1, BF16, True, False, FNUZ),
]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("quant", ["amd", "quant_fp8", "quant_fp8_ub", "qmax", "cuda_op"])
def test_cpu_path_is_the_spelled_out_quant_of_attn_res(case, quant):
    T, H, NB, nb, write, dtype, delta, onorm, qd = case
    args = make_args(T, H, NB, nb, write, dtype, delta=delta, onorm=onorm, seed=T + H)
    extra = {"amd": {}, "qmax": dict(quant_max=100.0),
             "quant_fp8": quant_fp8_constants(qd),
             "quant_fp8_ub": dict(quant_fp8_constants(qd), scale_ub=torch.tensor([0.5])),
             "cuda_op": dict(quant_fp8_constants(qd), scale_ub=torch.tensor([0.5]),
                             divide_values=True)}[quant]
    want_args = clone_args(args)
    want_out, want_mixed = OPS.attn_res_capture(*want_args)
    got_args = clone_args(args)
    data, scale, mixed = OPS.attn_res_quant_capture(*got_args, qd, **extra)
    want_data, want_scale = spelled_out(want_out, qd, **extra)
    assert data.dtype == qd and data.shape == (T, H) and data.is_contiguous()
    assert scale.dtype == F32 and scale.shape == (T, 1)
    assert torch.equal(bits(data), bits(want_data))
    assert torch.equal(scale, want_scale)
    assert torch.equal(mixed, want_mixed)
    for got, want in zip(got_args[:3], want_args[:3], strict=True):  # prefix, delta, blocks
        assert got is None or torch.equal(got, want)
    # The plain op: the same bytes, scales and in-place effects.
    plain_args = clone_args(args)
    d2, s2 = OPS.attn_res_quant(*plain_args, qd, **extra)
    assert torch.equal(bits(d2), bits(data)) and torch.equal(s2, scale)
    assert torch.equal(plain_args[0], got_args[0]) and torch.equal(plain_args[2], got_args[2])


def test_amd_defaults_and_clamp():
    """A row of zeros takes the floor (scale 1e-10 / 448); a scale_ub below amax clamps."""
    args = make_args(3, 16, 2, 1, -1, F32, delta=False, onorm=False)
    args[0][1] = 0.0
    args[2][1] = 0.0
    data, scale = OPS.attn_res_quant(*clone_args(args), FN)
    assert scale[1, 0] == torch.tensor(1e-10, dtype=F32) * torch.tensor(1 / 448.0, dtype=F32)
    assert torch.all(data[1].float() == 0)
    data, _ = OPS.attn_res_quant(*clone_args(args), FN, scale_ub=torch.tensor([1e-3]),
                                 **quant_fp8_constants(FN))
    assert float(data.float().abs().max()) == 448.0  # values past scale_ub * qmax saturate


@pytest.mark.vllm
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("quant_dtype", [FN, FNUZ])
def test_quant_fp8_native_of_the_output_vllm(dtype, quant_dtype, monkeypatch):
    """vLLM's ``QuantFP8(per-token).forward_native`` of ``attn_res``'s output is
    ``attn_res_quant`` with ``quant_fp8_constants`` (and ``scale_ub``), bit for bit; for
    e4m3fnuz vLLM's module constants are those of a ROCm fnuz platform (224)."""
    from helpers.vllm_harness import new_vllm_config
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization import input_quant_fp8 as qf
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    if quant_dtype is FNUZ:
        for name, value in (("_FP8_DTYPE", FNUZ), ("_FP8_MAX", 224.0), ("_FP8_MIN", -224.0),
                            ("_FP8_MIN_SCALING_FACTOR", 1.0 / (224.0 * 512.0))):
            monkeypatch.setattr(qf, name, value)
    with set_current_vllm_config(new_vllm_config()):
        quant = qf.QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN)
    args = make_args(40, 256, 5, 4, 2, dtype, delta=True, onorm=True, seed=7, scale=3.0)
    args[0][3] = 0.0  # a zero row: the scale floor
    args[1][3] = 0.0
    args[2][3] = 0.0
    out = OPS.attn_res(*clone_args(args))
    for ub in (None, torch.tensor([0.05])):
        want_data, want_scale = quant.forward_native(out, scale_ub=ub)
        data, scale = OPS.attn_res_quant(*clone_args(args), quant_dtype, scale_ub=ub,
                                         **quant_fp8_constants(quant_dtype))
        assert want_data.dtype == quant_dtype
        assert torch.equal(bits(data), bits(want_data)), ub
        assert torch.equal(scale, want_scale), ub


# --------------------------------------------------------------------------- opcheck


@pytest.mark.parametrize("case", CASES[:4], ids=str)
def test_opcheck_quant(case):
    T, H, NB, nb, write, dtype, delta, onorm, qd = case
    args = make_args(T, H, NB, nb, write, dtype, delta=delta, onorm=onorm)
    opcheck(OPS.attn_res_quant.default, [*clone_args(args), qd])
    opcheck(OPS.attn_res_quant_capture.default,
            [*clone_args(args), qd, 0.0, 0.0, 1e-6, True, torch.tensor([2.0])])


# --------------------------------------------------------------------------- argument checks

BAD = [
    ("quant_dtype int8", dict(quant_dtype=torch.int8),
     r"quant_dtype torch.int8 is not supported; use one of \['torch.float8_e4m3fn', "
     r"'torch.float8_e4m3fnuz'\]"),
    ("quant_dtype bf16", dict(quant_dtype=BF16), r"quant_dtype torch.bfloat16 is not supported"),
    ("quant_dtype e5m2", dict(quant_dtype=torch.float8_e5m2),
     r"quant_dtype torch.float8_e5m2 is not supported"),
    ("quant_max above the dtype's", dict(quant_dtype=FNUZ, quant_max=448.0),
     r"quant_max=448.0 is outside \[0, 240.0\] \(the largest torch.float8_e4m3fnuz\); pass 0"),
    ("negative quant_max", dict(quant_max=-1.0), r"quant_max=-1.0 is outside \[0, 448.0\]"),
    ("negative amax_floor", dict(amax_floor=-1.0),
     r"amax_floor=-1.0 must be a finite non-negative float"),
    ("nan scale_floor", dict(scale_floor=float("nan")),
     r"scale_floor=nan must be a finite non-negative float"),
    ("scale_ub of two", dict(scale_ub=lambda: torch.ones(2)),
     r"scale_ub must be a one-element float32 tensor on cpu \(vLLM's QuantFP8 scale_ub\), got "
     r"shape \(2,\), torch.float32 on cpu"),
    ("scale_ub bf16", dict(scale_ub=lambda: torch.ones(1, dtype=BF16)),
     r"scale_ub must be a one-element float32 tensor"),
    ("the mixture's checks", dict(num_blocks=5),
     r"num_blocks=5 is outside \[0, 2\]"),
]


def quant_call(op_name: str, over: dict, mode: str):
    def run():
        args = dict(zip(("prefix", "delta", "blocks", "norm_weight", "qk_weight",
                         "output_norm_weight", "num_blocks", "block_write_idx", "eps",
                         "output_norm_eps"),
                        make_args(3, 8, 2, 1, 0, F32, delta=True, onorm=True), strict=True))
        args["quant_dtype"] = FN
        args.update({k: v() if callable(v) else v for k, v in over.items()})
        if mode == "triton":
            from kimi_passes import ops

            return getattr(ops, op_name + "_triton")(**args)
        return getattr(OPS, op_name)(**args)

    if mode == "fake":
        with FakeTensorMode():
            return run()
    return run()


@pytest.mark.parametrize("mode", ["eager", "fake", "triton"])
@pytest.mark.parametrize("op_name", ["attn_res_quant", "attn_res_quant_capture"])
@pytest.mark.parametrize("rule,over,regex", BAD, ids=[b[0] for b in BAD])
def test_bad_quant_arguments(rule, over, regex, op_name, mode):
    with pytest.raises(AttnResArgumentError, match=rf"^kimi attn_res(_quant)?: {regex}"):
        quant_call(op_name, over, mode)


def test_quant_dtype_must_be_a_dtype():
    """The schema's ScalarType: a non-dtype is refused by the dispatcher, naming it."""
    args = make_args(3, 8, 2, 1, 0, F32, delta=True, onorm=True)
    with pytest.raises((TypeError, RuntimeError), match=re.escape("quant_dtype")):
        OPS.attn_res_quant(*args, "float8")


def test_backward_through_the_quant_ops_is_refused():
    """As the other mutating ops: no autograd formula, a loud refusal naming the remedy."""
    for op in (OPS.attn_res_quant, OPS.attn_res_quant_capture):
        args = make_args(3, 16, 2, 1, 0, F32, delta=True, onorm=True)
        args[3].requires_grad_(True)
        scale = op(*args, FN)[1]
        with pytest.raises(RuntimeError, match=r"no autograd formula exists: it mutates "
                                               r"prefix and blocks"):
            scale.sum().backward()


@pytest.mark.parametrize("shape", [(0, 16), (3, 0)], ids=str)
def test_empty_calls(shape):
    """No rows: empty outputs; rows of no elements: their scale is the floor's, on the CPU
    path, the Triton launch and the fake kernel alike."""
    from kimi_passes import ops

    T, H = shape

    def args():
        return [torch.zeros(T, H), None, torch.zeros(T, 2, H), torch.ones(H), torch.ones(H),
                None, 1, -1, 1e-6, 0.0, FN]

    floor = torch.tensor(1e-10) * torch.tensor(1 / 448.0)
    for data, scale in (OPS.attn_res_quant(*args()), ops.attn_res_quant_triton(*args())):
        assert data.shape == (T, H) and data.dtype == FN and scale.shape == (T, 1)
        assert torch.all(scale == floor)
    with FakeTensorMode():
        data, scale = OPS.attn_res_quant(*args())
        assert data.shape == (T, H) and scale.shape == (T, 1)
