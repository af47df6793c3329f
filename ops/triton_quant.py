"""The FP8 quant epilogue of the Triton routes of ``kimi::attn_res_quant`` (``fp8_quant.py``).

``quant_scale`` is the per-row scale from the row's ``amax`` and ``quant_rows`` the scaled,
clamped values, the operations of ``fp8_quant.quantize_rows`` in its order: the constants
arrive as fp32 kernel arguments (``1 / qmax`` rounded to fp32 on the host, as torch rounds
a Python scalar), and the divisions are ``div_rn`` (IEEE, as torch's; a plain ``/`` may
compile to an approximate division). ``store_fp8`` stores fp32 values as fp8, rounded to
nearest even: on a GPU by the hardware conversion; under the interpreter, whose fp32 -> fp8
conversion rounds ties away from zero and truncates subnormals, by bit manipulation
(``FP8_SOFT_RTNE``, as ``BF16_SOFT_RTNE`` for bf16), so the interpreter's bytes are torch's;
the same for e4m3fnuz on NVIDIA GPUs, where Triton has no such type (``soft_fp8_mode``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton.language as tl

from .attn_res_args import AttnResQuantArgs
from .fp8_quant import quant_max
from .triton_mode import INTERPRETED, jit


@jit
def quant_scale(amax, scale_ub_ptr, amax_floor, scale_floor, qmax, inv_qmax,
                HAS_SCALE_UB: tl.constexpr, DIVIDE: tl.constexpr):
    """The row's scale from its ``amax`` (fp32 scalars in, fp32 scalar out)."""
    if HAS_SCALE_UB:
        amax = tl.minimum(amax, tl.load(scale_ub_ptr))
    amax = tl.maximum(amax, amax_floor)
    if DIVIDE:
        scale = tl.div_rn(amax, qmax)
    else:
        scale = amax * inv_qmax
    return tl.maximum(scale, scale_floor)


@jit
def quant_rows(y, scale, qmax, DIVIDE_VALUES: tl.constexpr):
    """``clamp(y * (1 / scale), -qmax, qmax)``, or ``clamp(y / scale, ...)`` when
    ``DIVIDE_VALUES``, in fp32 (``y`` the rounded output)."""
    if DIVIDE_VALUES:
        v = tl.div_rn(y, scale)
    else:
        v = y * tl.div_rn(tl.full((), 1.0, tl.float32), scale)
    return tl.minimum(tl.maximum(v, -qmax), qmax)


@jit
def soft_fp8(v, FNUZ: tl.constexpr):
    """The fp8 byte (uint8) of fp32 ``v`` (``|v|`` within the dtype's range), rounded to
    nearest even: e4m3fn (exponent bias 7, NaN 0x7F) or e4m3fnuz (bias 8, NaN 0x80, no -0)."""
    BIAS: tl.constexpr = 8 if FNUZ else 7
    u = v.to(tl.uint32, bitcast=True)
    sign = (u >> 31).to(tl.int32)
    a = tl.abs(v)
    ua = a.to(tl.uint32, bitcast=True)
    r = ua + 0x7FFFF + ((ua >> 20) & 1)  # round to 3 mantissa bits, ties to even
    normal = ((((r >> 23).to(tl.int32) - 127 + BIAS) << 3) | ((r >> 20) & 7).to(tl.int32))
    # Below the smallest normal (2^(1 - BIAS)) the step is 2^(-2 - BIAS): a * 2^(BIAS + 2)
    # is exact, and adding and removing 2^23 rounds it to an integer, ties to even.
    t = a * (2.0 ** (BIAS + 2))
    sub = ((t + 8388608.0) - 8388608.0).to(tl.int32)
    byte = tl.where(a < 2.0 ** (1 - BIAS), sub, normal)
    if FNUZ:
        byte = tl.where(byte == 0, 0, byte | (sign << 7))
        byte = tl.where(v != v, 0x80, byte)
    else:
        byte = byte | (sign << 7)
        byte = tl.where(v != v, 0x7F | (sign << 7), byte)
    return byte.to(tl.uint8)


@jit
def store_fp8(ptrs, v, mask, FP8_SOFT_RTNE: tl.constexpr):
    """Store fp32 ``v`` as fp8, rounded to nearest even: by the hardware conversion
    (``FP8_SOFT_RTNE`` 0, fp8 pointers), or by bits into the bytes at uint8 pointers (1:
    e4m3fn, 2: e4m3fnuz; ``soft_fp8_mode``)."""
    if FP8_SOFT_RTNE:
        tl.store(ptrs, soft_fp8(v, FP8_SOFT_RTNE == 2), mask=mask)
    else:
        tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


class QuantOut(NamedTuple):
    """A quant launch's record and outputs: ``data`` (fp8 ``[T, H]``), ``scale`` (fp32
    ``[T, 1]``)."""

    q: AttnResQuantArgs
    data: torch.Tensor
    scale: torch.Tensor


def quant_scalars(quant: QuantOut | None) -> tuple[float, float, float, float]:
    """``(qmax, 1 / qmax, amax_floor, scale_floor)``, rounded to fp32 as kernel arguments."""
    if quant is None:
        return 0.0, 0.0, 0.0, 0.0
    qmax = quant_max(quant.q)
    return qmax, 1.0 / qmax, float(quant.q.amax_floor), float(quant.q.scale_floor)


def quant_flags(quant: QuantOut | None) -> dict:
    """The quant epilogue's constexprs (every forward kernel takes them)."""
    return dict(QUANT=quant is not None,
                HAS_SCALE_UB=quant is not None and quant.q.scale_ub is not None,
                DIVIDE=quant is not None and bool(quant.q.divide),
                DIVIDE_VALUES=quant is not None and bool(quant.q.divide_values),
                FP8_SOFT_RTNE=0 if quant is None else soft_fp8_mode(quant.data))


def soft_fp8_mode(data: torch.Tensor) -> int:
    """How the kernels store ``data``'s fp8 bytes: 0 by the hardware conversion; 1 / 2 by
    bits (e4m3fn / e4m3fnuz), under the interpreter (whose conversion is not round to
    nearest even) and for e4m3fnuz on NVIDIA GPUs (Triton has no e4m3fnuz type there)."""
    fnuz = data.dtype == torch.float8_e4m3fnuz
    if INTERPRETED or (fnuz and data.is_cuda and torch.version.hip is None):
        return 2 if fnuz else 1
    return 0


def fp8_target(data: torch.Tensor) -> torch.Tensor:
    """The tensor the kernels store ``data``'s bytes into: a uint8 view when they store by
    bits (``soft_fp8_mode``), else ``data``."""
    return data.view(torch.uint8) if soft_fp8_mode(data) else data
