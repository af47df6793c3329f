"""Dynamic per-token FP8 quantization of an AttnRes output: the quant of ``kimi::attn_res_quant``.

Per row of the op's output, rounded to the sources' dtype first (what the unfused graph
stores and its quant then reads), in fp32 (docs/design.md, "FP8 output quant")::

    y     = out.to(prefix.dtype).float()
    amax  = max |y|                        (per row)
    amax  = min(amax, scale_ub)            (when scale_ub is given)
    amax  = max(amax, amax_floor)
    scale = amax / qmax  if divide  else  amax * (1 / qmax)     (1 / qmax rounded to fp32)
    scale = max(scale, scale_floor)
    data  = clamp(y / scale  if divide_values  else  y * (1 / scale), -qmax, qmax)
            .to(quant_dtype)                                             (round to nearest even)

``qmax`` is ``quant_max`` where positive, else vLLM's ``get_fp8_min_max()`` bound for the
dtype: 448 for ``float8_e4m3fn``, 224 for ``float8_e4m3fnuz`` (the platform bound vLLM uses
on ROCm, not the dtype's 240). The defaults (``amax_floor=1e-10``, ``scale_floor=0``,
``divide=False``) are vLLM's AMD K3 kernel's quant; ``amax_floor=0``,
``scale_floor=1 / (qmax * 512)``, ``divide=True`` (with or without ``scale_ub``) are vLLM's
``QuantFP8`` per-token native form; those with ``divide_values=True`` are vLLM's CUDA op
``_C::dynamic_per_token_scaled_fp8_quant`` (its kernel divides each value by the scale).
``quantize_rows`` is that statement in torch: the CPU
path and the CPU lowering run it; the Triton kernels compute the same operations in the
same order (``ops/triton_quant.py``).
"""

from __future__ import annotations

import torch

from .attn_res_args import AttnResQuantArgs

#: The fp8 dtypes the op quantizes to, and vLLM's bound for each (``get_fp8_min_max``).
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 224.0}
#: vLLM's ``QuantFP8`` floor on the scale: ``1 / (qmax * 512)``.
QUANT_FP8_SCALE_FLOOR_FACTOR = 512.0


def quant_max(q: AttnResQuantArgs) -> float:
    """The clamp bound ``qmax`` of a call (``quant_max`` where positive, else vLLM's)."""
    return q.quant_max if q.quant_max > 0 else FP8_MAX[q.quant_dtype]


def quant_fp8_constants(quant_dtype: torch.dtype, qmax: float | None = None) -> dict:
    """The quant fields that make ``attn_res_quant`` vLLM's ``QuantFP8`` per-token native
    form with bound ``qmax`` (default: vLLM's for the dtype); pass ``scale_ub`` apart (and
    ``divide_values=True`` for vLLM's CUDA op, whose scale is the same)."""
    qmax = FP8_MAX[quant_dtype] if qmax is None else qmax
    return dict(quant_max=qmax, amax_floor=0.0,
                scale_floor=1.0 / (qmax * QUANT_FP8_SCALE_FLOOR_FACTOR), divide=True)


def quantize_rows(out: torch.Tensor, q: AttnResQuantArgs,
                  amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` of ``out`` (``[T, H]`` in the sources' dtype) by ``q``'s quant fields:
    ``data`` ``[T, H]`` in ``q.quant_dtype``, ``scale`` fp32 ``[T, 1]`` (module docstring).
    ``amax``: the rows' ``max |out|`` (fp32 ``[T, 1]``) where the caller has it already.
    Plain torch, so the CPU lowering traces it as it stands."""
    qmax = quant_max(q)
    y = out.float()
    if amax is None:
        # A row of no elements has amax 0 (the kernels' start value): it takes the floors.
        amax = (y.abs().amax(-1, keepdim=True) if y.shape[-1]
                else y.new_zeros((y.shape[0], 1)))
    if q.scale_ub is not None:
        amax = amax.clamp(max=q.scale_ub.float())
    amax = amax.clamp(min=q.amax_floor)
    scale = amax / qmax if q.divide else amax * (1.0 / qmax)
    scale = scale.clamp(min=q.scale_floor)
    scaled = y / scale if q.divide_values else y * scale.reciprocal()
    data = scaled.clamp(-qmax, qmax).to(q.quant_dtype)
    return data.contiguous(), scale  # contiguous whatever out's layout (the fake's)
