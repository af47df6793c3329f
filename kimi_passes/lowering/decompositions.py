"""The kimi ops as plain ATen statements that Inductor compiles into generated code.

Each function is the op's math (docs/design.md section 3) written for Inductor, not for
eager: no stacked copy of the sources (each source is read where it lies, twice: once
for its logit, once for the weighted sum; the bank's slots as one strided view), the
logits as reductions over H, the softmax written out over the sources (no softmax op, no
cat of the logits: ``mixture``), fp32 accumulation and
one rounding to the output dtype. Inductor fuses them with the neighbouring ops (the
prefix add, the block write, the output norm, the next sublayer).

The pure ops' statements take the op's arguments as the op does (positional or by name)
and build its record (``ops/attn_res_args.py``); its tensors are the traced values. The
mutating ops are given in functional form (what ``auto_functionalized`` returns: the op's
outputs, then the new prefix and bank); the block write is a ``select_scatter`` whose
input bank is dead after it, so Inductor's reinplacing turns it back into a slot write.
"""

from __future__ import annotations

import torch

from kimi_passes.ops.attn_res_args import (
    AttnResArgs,
    AttnResQuantArgs,
    MixArgs,
    MixBackwardArgs,
    MixListArgs,
    MixListBackwardArgs,
)
from kimi_passes.ops.fp8_quant import quantize_rows
from kimi_passes.ops.mix_list import folded_query


def _inv_rms(v: torch.Tensor, eps: float) -> torch.Tensor:
    """``rsqrt(mean(v^2) + eps)`` over the last dim."""
    return torch.rsqrt(v.square().mean(-1) + eps)


def _logits(v: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``<v, w> * rsqrt(mean(v^2) + eps)`` over the last dim (fp32 ``v``)."""
    return (v * w).sum(-1) * _inv_rms(v, eps)


def mixture(bank: torch.Tensor | None, extras: list[torch.Tensor], w: torch.Tensor,
            eps: float) -> torch.Tensor:
    """Pre-norm mixture (fp32) of ``bank``'s slots (``[T, n, H]``, a view: read in place)
    then each of ``extras`` (``[T, H]``), with the folded query ``w`` (fp32).

    The softmax is written out over the sources, ``sum_j e_j v_j / sum_j e_j`` with
    ``e_j = exp(logit_j - max_j logit_j)``: every step past the logits' reductions is a
    pointwise op on ``[T, 1]`` values that Inductor inlines into the weighted sum, so a
    site allocates only the reductions' outputs (an ``aten._softmax`` over a ``cat`` of
    the logits costs a buffer for the cat, the max, the exponentials and their sum, and at
    T = 1..8 those allocations cost more than the arithmetic; docs/design.md section 9).
    """
    values = [e.float() for e in extras]
    logits = [_logits(v.unsqueeze(-2), w, eps) for v in values]  # each [T, 1]
    m = None
    if bank is not None:
        bank = bank.float()
        bank_logits = _logits(bank, w, eps)  # [T, n]: one reduction over the bank
        m = bank_logits.amax(-1, keepdim=True)
    for logit in logits:
        m = logit if m is None else torch.maximum(m, logit)
    assert m is not None  # no source at all: the ops' checks refuse it before
    num = den = None
    if bank is not None:
        e = torch.exp(bank_logits - m)
        num, den = (e.unsqueeze(-1) * bank).sum(-2), e.sum(-1, keepdim=True)
    for logit, v in zip(logits, values, strict=True):
        e = torch.exp(logit - m)
        num = e * v if num is None else num + e * v
        den = e if den is None else den + e
    assert num is not None and den is not None
    return num / den


def output_norm(mixed: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the fp32 mixture with ``weight`` (fp32 result)."""
    return mixed * _inv_rms(mixed, eps).unsqueeze(-1) * weight.float()


def _realized(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a buffer of its own (an identity ``as_strided``, which Inductor realizes).

    The new prefix is also copied back into the prefix input. Left unrealized, Inductor
    inlines ``prefix + delta`` into the mixture's kernels, which then read the input the
    copy-back overwrites; torch 2.13's CPU outer-loop fusion then fails on the ordering
    dependency that creates (``KeyError`` in ``get_read_expr``, bf16 with an output norm).
    """
    return torch.as_strided(x, x.shape, x.stride())


def attn_res_mix(*args, **kwargs):
    """``kimi.attn_res_mix``: the mixture of ``blocks[:, :num_blocks]`` then ``prefix``."""
    a = MixArgs(*args, **kwargs)
    bank = a.blocks[:, :a.num_blocks] if a.num_blocks else None
    w = folded_query(a.norm_weight, a.qk_weight)
    return mixture(bank, [a.prefix], w, a.eps).to(a.prefix.dtype)


def attn_res_mix_list(*args, **kwargs):
    """``kimi.attn_res_mix_list``: the mixture of a list of sources."""
    a = MixListArgs(*args, **kwargs)
    mixed = mixture(None, list(a.sources), folded_query(a.norm_weight, a.qk_weight), a.eps)
    return mixed.to(a.out_dtype or a.sources[0].dtype)


def attn_res(*args, capture: bool, **kwargs):
    """``kimi.attn_res`` / ``attn_res_capture`` in functional form (its arguments as the op
    takes them, positional or by name).

    Returns ``(out, prefix', blocks')``, or ``(out, mixed, prefix', blocks')`` when
    ``capture``: the outputs ``auto_functionalized`` gives, in that order.
    """
    a = AttnResArgs(*args, **kwargs)
    dtype = a.prefix.dtype
    out, mixed, x, new_blocks = _attn_res_fp32(a)
    if capture:
        return out.to(dtype), mixed.to(dtype), x, new_blocks
    return out.to(dtype), x, new_blocks


def _attn_res_fp32(a: AttnResArgs):
    """``attn_res``'s ``(out, mixed, prefix', blocks')`` with ``out`` and ``mixed`` in fp32
    (before the rounding to the sources' dtype)."""
    prefix, delta, blocks = a.prefix, a.delta, a.blocks
    dtype = prefix.dtype
    x = prefix if delta is None else _realized((prefix.float() + delta.float()).to(dtype))
    # The bank is read after the write, from the written bank only: the old one is dead
    # after the select_scatter, which Inductor's reinplacing then makes a slot write.
    new_blocks = blocks if a.block_write_idx < 0 else torch.select_scatter(
        blocks, x, 1, a.block_write_idx)
    bank = new_blocks[:, :a.num_blocks] if a.num_blocks else None
    mixed = mixture(bank, [x], folded_query(a.norm_weight, a.qk_weight), a.eps)
    out = mixed if a.output_norm_weight is None else output_norm(
        mixed, a.output_norm_weight, a.output_norm_eps)
    return out, mixed, x, new_blocks


def _rounded_bf16(v: torch.Tensor) -> torch.Tensor:
    """fp32 ``v`` rounded to bf16, nearest even, as fp32: ``v.to(bf16).float()`` bit for bit.

    Inductor's C++ backend skips a ``to(bf16).to(float)`` round trip inside a kernel (it
    reuses the fp32 value a bf16 store was made from, unless ``emulate_precision_casts``).
    The rounding is written on the fp32 bits instead, in int32 arithmetic: add ``0x7FFF``
    plus the lowest kept bit, clear the low 16 bits. A finite value past bf16's largest
    carries into the exponent and becomes inf, as the cast's; inf stays inf; a NaN is passed
    through (the addition could carry a NaN's payload into inf).
    """
    bits = v.view(torch.int32)
    lsb = torch.bitwise_and(torch.bitwise_right_shift(bits, 16), 1)
    rounded = torch.bitwise_and(bits + (0x7FFF + lsb), -0x10000).view(torch.float32)
    return torch.where(v != v, v, rounded)  # v != v: NaN (isnan is not vectorised)


def _rounded_amax(stored: torch.Tensor) -> torch.Tensor:
    """``max |stored|`` per row, fp32 ``[T, 1]``, of the 16-bit output ``stored``.

    Inside one kernel Inductor may hand the reduction the fp32 value the output was
    rounded from (above). Rounding to nearest is monotonic and symmetric, so the largest
    rounded magnitude is the rounded largest magnitude (a NaN stays NaN, a value past the
    dtype's largest rounds to inf either way): the row maxima are rounded once more, on
    their bits (bf16) or through a bitcast (fp16), which no kernel can skip. Either way
    the result is the maxima of the stored values; only ``T`` values are rounded.
    """
    amax = stored.float().abs().amax(-1, keepdim=True)
    if stored.dtype == torch.bfloat16:
        return _rounded_bf16(amax)
    return amax.to(stored.dtype).view(torch.int16).view(stored.dtype).float()


def attn_res_quant(*tensors, capture: bool, **const):
    """``kimi.attn_res_quant`` / ``attn_res_quant_capture`` in functional form: ``attn_res``'s
    statement, its output (rounded to the sources' dtype) quantized by the CPU path's own
    statement (``fp8_quant.quantize_rows``). ``tensors``: the record's tensors (the
    mixture's, then ``scale_ub``: the traced inputs); ``const``: its other fields by name.

    Returns ``(data, scale, prefix', blocks')``, or ``(data, scale, mixed, prefix',
    blocks')`` when ``capture``.
    """
    *mixture_tensors, scale_ub = tensors
    q = AttnResQuantArgs.from_args(*mixture_tensors, scale_ub=scale_ub, **const)
    prefix = q.base.prefix
    out, mixed, x, new_blocks = _attn_res_fp32(q.base)
    if prefix.dtype == torch.float32 or not out.shape[-1]:
        data, scale = quantize_rows(out, q)
    else:
        # The 16-bit output, a buffer of its own. The quant's loop reads it after the
        # row maxima's reduction, which reads it too, so the two loops cannot be one
        # (Inductor fuses no loops across a reduction they both depend on) and the
        # quant loads the stored values; the maxima are made exact by _rounded_amax.
        stored = _realized(out.to(prefix.dtype))
        data, scale = quantize_rows(stored, q, amax=_rounded_amax(stored))
    if capture:
        return data, scale, mixed.to(prefix.dtype), x, new_blocks
    return data, scale, x, new_blocks


def attn_res_mix_backward(*args, **kwargs):
    """``kimi.attn_res_mix_backward``: ``(dprefix, dblocks, dw)`` (``ops/mix.py``).

    Per row, sources ``v_j``, ``r_j = rsqrt(mean(v_j^2) + eps)``, ``logit_j = <v_j, w> r_j``,
    ``p = softmax(logit)``; ``a_j = p_j (<g, v_j> - <g, out>) r_j``;
    ``dv_j = p_j g + a_j w - (a_j logit_j r_j / H) v_j``; ``dw = sum a_j v_j``. An output
    not asked for is an empty ``[0]`` tensor; ``dblocks`` has zeros past ``num_blocks``.
    """
    b = MixBackwardArgs(*args, **kwargs)
    prefix, blocks, num_blocks, eps = b.prefix, b.blocks, b.num_blocks, b.eps
    dtype, H = prefix.dtype, prefix.shape[-1]
    w = folded_query(b.norm_weight, b.qk_weight)
    g, x = b.grad.float(), prefix.float()
    bank = blocks[:, :num_blocks].float() if num_blocks else None
    parts_r, parts_l, parts_gv = [], [], []
    if bank is not None:
        r_b = _inv_rms(bank, eps)
        parts_r.append(r_b)
        parts_l.append((bank * w).sum(-1) * r_b)
        parts_gv.append((bank * g.unsqueeze(-2)).sum(-1))
    r_x = _inv_rms(x, eps).unsqueeze(-1)
    parts_r.append(r_x)
    parts_l.append((x * w).sum(-1, keepdim=True) * r_x)
    parts_gv.append((x * g).sum(-1, keepdim=True))
    r, logit, gv = (torch.cat(t, dim=-1) for t in (parts_r, parts_l, parts_gv))
    p = torch.softmax(logit, dim=-1)
    g_out = (p * gv).sum(-1, keepdim=True)
    a = (gv - g_out) * p * r
    c = a * logit * r / -H
    n = num_blocks
    empty = prefix.new_empty((0,))
    dprefix = empty
    if b.need_prefix:
        dprefix = (p[:, n:] * g + a[:, n:] * w + c[:, n:] * x).to(dtype)
    dblocks = empty
    if b.need_blocks:
        dblocks = torch.zeros(blocks.shape, dtype=dtype, device=blocks.device)
        if bank is not None:
            dbank = (p[:, :n, None] * g.unsqueeze(-2) + a[:, :n, None] * w
                     + c[:, :n, None] * bank)
            dblocks = torch.slice_scatter(dblocks, dbank.to(dtype), 1, 0, n)
    dw = empty
    if b.need_weights:
        dw = (a[:, n:] * x).sum(0)
        if bank is not None:
            dw = dw + (a[:, :n, None] * bank).sum((0, 1))
    return dprefix, dblocks, dw


def attn_res_mix_list_backward(*args, **kwargs):
    """``kimi.attn_res_mix_list_backward``: ``(dsources, dw)`` (``ops/mix_list.py``).

    ``attn_res_mix_backward``'s formulas, one term per source (each read where it lies);
    ``dsources`` is ``[]`` when not asked for, ``dw`` an empty ``[0]`` tensor.
    """
    b = MixListBackwardArgs(*args, **kwargs)
    sources, eps = b.sources, b.eps
    H = b.grad.shape[-1]
    w = folded_query(b.norm_weight, b.qk_weight)
    g = b.grad.float()
    values = [s.float() for s in sources]
    r = torch.stack([_inv_rms(v, eps) for v in values], dim=-1)
    logit = torch.stack([(v * w).sum(-1) for v in values], dim=-1) * r
    gv = torch.stack([(v * g).sum(-1) for v in values], dim=-1)
    p = torch.softmax(logit, dim=-1)
    a = (gv - (p * gv).sum(-1, keepdim=True)) * p * r
    c = a * logit * r / -H
    dsources = []
    if b.need_sources:
        dsources = [(p[..., j, None] * g + a[..., j, None] * w + c[..., j, None] * v).to(s.dtype)
                    for j, (v, s) in enumerate(zip(values, sources, strict=True))]
    dw = sources[0].new_empty((0,))
    if b.need_weights:
        terms = [(a[..., j, None] * v).reshape(-1, H).sum(0) for j, v in enumerate(values)]
        dw = terms[0]
        for term in terms[1:]:  # in source order, as sum() adds them
            dw = dw + term
    return dsources, dw
