"""Chunked Triton kernel of the AttnRes op family, for rows too wide to keep in registers.

The row kernel (``ops/triton_kernels.py``) holds a whole row of each source in registers;
the offline build (``tools/kernel_build``) shows that to fit without spills only up to
``BLOCK_H = 8192`` when the rows are 16-byte aligned (vector loads) and up to 4096 when they
are not (one address per element). Wider rows run this kernel instead, which loops over the
row in ``CHUNK``-wide pieces and keeps only a chunk live:

1. prefix update and block write, chunk by chunk, with the prefix's ``dot`` / ``ssq``;
2. each block source's ``dot`` / ``ssq`` (one read of it), its logit kept in a small
   ``[BLOCK_S]`` register vector, and the running max ``m`` (NaN-propagating);
3. the softmax weights, then per chunk the mixture over every source (a second read of each
   source, usually from L2: the row was just read), stored rounded; with an output norm its
   mean square is summed from the fp32 mixture;
4. with an output norm, ``out`` is re-read (this program's own stores) and normalised.

So a source is read twice here, not once, and the normalised output multiplies the mixture
after it was rounded to the output dtype: a fallback for widths K3-class models do not use,
spill-free at any ``H``. The slot the block write fills is not read: as in the row kernel its
value is the rounded prefix, taken from the prefix row (pass 1's own stores), and its logit
equals the prefix's bit for bit, so ``attn_res_capture``'s mixture equals ``attn_res_mix`` run
on the post-update state, bit for bit. Every element is written and re-read by the same
thread (same chunk layout in every pass); a barrier between passes makes that explicit.
"""

from __future__ import annotations

import triton.language as tl

# INTERPRETED and jit (ops/triton_mode.py) are imported from here by the other kernels.
from .triton_mode import INTERPRETED, jit  # noqa: F401
from .triton_quant import quant_rows, quant_scale, store_fp8


@jit
def round_bf16_rtne(y):
    """fp32 -> bf16, round to nearest even, by bit manipulation (interpreter only)."""
    u = y.to(tl.uint32, bitcast=True)
    u = tl.where(y != y, 0x7FC00000, u + 0x7FFF + ((u >> 16) & 1))
    return (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@jit
def rounded(y, ptrs, BF16_SOFT_RTNE: tl.constexpr):
    """fp32 ``y`` in the pointers' dtype (bf16 rounded to nearest even by bits under the
    interpreter, ``BF16_SOFT_RTNE``)."""
    if BF16_SOFT_RTNE:
        y = round_bf16_rtne(y)
    return y.to(ptrs.dtype.element_ty)


@jit
def store_rounded(ptrs, y, mask, BF16_SOFT_RTNE: tl.constexpr):
    """Store fp32 ``y`` in the pointers' dtype, rounded once."""
    tl.store(ptrs, rounded(y, ptrs, BF16_SOFT_RTNE), mask=mask)


@jit
def add_delta_in_place(x, p_ptrs, d_ptrs, mask, BF16_SOFT_RTNE: tl.constexpr):
    """``round(x + delta)`` for the prefix ``x`` loaded from ``p_ptrs`` (the sum in fp32,
    rounded once to the prefix's dtype), stored back in place and returned."""
    d = tl.load(d_ptrs, mask=mask, other=0.0)
    x = rounded(x.to(tl.float32) + d.to(tl.float32), p_ptrs, BF16_SOFT_RTNE)
    tl.store(p_ptrs, x, mask=mask)
    return x


@jit
def load_updated_prefix(p_ptrs, d_ptrs, mask, HAS_DELTA: tl.constexpr,
                        BF16_SOFT_RTNE: tl.constexpr):
    """The prefix at ``p_ptrs``; with a delta, updated in place (``add_delta_in_place``)."""
    x = tl.load(p_ptrs, mask=mask, other=0.0)
    if HAS_DELTA:
        x = add_delta_in_place(x, p_ptrs, d_ptrs, mask, BF16_SOFT_RTNE)
    return x


def _attn_res_chunked_kernel(
    prefix_ptr,
    delta_ptr,
    blocks_ptr,
    norm_w_ptr,
    qk_w_ptr,
    out_norm_w_ptr,
    out_ptr,
    mix_ptr,
    q_ptr,
    scale_ptr,
    scale_ub_ptr,
    H,
    num_blocks,
    skip_idx,
    stride_p,
    stride_d,
    stride_bt,
    stride_bn,
    stride_o,
    stride_m,
    stride_q,
    eps,
    out_eps,
    qmax,
    inv_qmax,
    amax_floor,
    scale_floor,
    HAS_DELTA: tl.constexpr,
    DO_WRITE: tl.constexpr,
    HAS_OUT_NORM: tl.constexpr,
    WRITE_OUT: tl.constexpr,
    WRITE_MIX: tl.constexpr,
    BF16_SOFT_RTNE: tl.constexpr,
    QUANT: tl.constexpr,
    HAS_SCALE_UB: tl.constexpr,
    DIVIDE: tl.constexpr,
    DIVIDE_VALUES: tl.constexpr,
    FP8_SOFT_RTNE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_S: tl.constexpr,
    LAUNCH_PDL: tl.constexpr = False,
):
    if LAUNCH_PDL:  # as the row kernel (triton_kernels.pdl_launch)
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    slot_stride = tl.cast(stride_bn, tl.int64)
    lanes = tl.arange(0, CHUNK)
    sidx = tl.arange(0, BLOCK_S)
    b_row = blocks_ptr + row * stride_bt
    p_row = prefix_ptr + row * stride_p

    # Pass 1: the in-place effects and the prefix's reductions.
    dot = tl.full((), 0.0, tl.float32)
    ssq = tl.full((), 0.0, tl.float32)
    for c in range(0, H, CHUNK):
        cols = c + lanes
        hmask = cols < H
        x = load_updated_prefix(p_row + cols, delta_ptr + row * stride_d + cols, hmask,
                                HAS_DELTA, BF16_SOFT_RTNE)
        if DO_WRITE:
            tl.store(b_row + skip_idx * slot_stride + cols, x, mask=hmask)
        w = tl.load(norm_w_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
        w = w * tl.load(qk_w_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
        xf = x.to(tl.float32)
        d0, s0 = tl.split(tl.sum(tl.join(xf * w, xf * xf), axis=0))
        dot += d0
        ssq += s0
    logit0 = dot * tl.rsqrt(ssq / H + eps)
    logits = tl.where(sidx == 0, logit0, 0.0)
    m = logit0

    # Pass 2: each block's logit (the written slot's is the prefix's, without a read).
    for j in range(0, num_blocks):
        lim = tl.where(j != skip_idx, H, 0)
        dot = tl.full((), 0.0, tl.float32)
        ssq = tl.full((), 0.0, tl.float32)
        for c in range(0, H, CHUNK):
            cols = c + lanes
            v = tl.load(b_row + j * slot_stride + cols, mask=cols < lim, other=0.0)
            v = v.to(tl.float32)
            w = tl.load(norm_w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
            w = w * tl.load(qk_w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
            d0, s0 = tl.split(tl.sum(tl.join(v * w, v * v), axis=0))
            dot += d0
            ssq += s0
        logit = tl.where(j == skip_idx, logit0, dot * tl.rsqrt(ssq / H + eps))
        logits = tl.where(sidx == j + 1, logit, logits)
        m = tl.maximum(m, logit, propagate_nan=tl.PropagateNan.ALL)
    p = tl.where(sidx <= num_blocks, tl.exp(logits - m), 0.0)
    inv_l = 1.0 / tl.sum(p, axis=0)

    # Pass 3: the mixture, chunk by chunk, over every source.
    if LAUNCH_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.debug_barrier()
    ms = tl.full((), 0.0, tl.float32)
    amax = tl.full((), 0.0, tl.float32)
    for c in range(0, H, CHUNK):
        cols = c + lanes
        hmask = cols < H
        xf = tl.load(p_row + cols, mask=hmask, other=0.0).to(tl.float32)
        acc = tl.sum(tl.where(sidx == 0, p, 0.0), axis=0) * xf
        for j in range(0, num_blocks):
            lim = tl.where(j != skip_idx, H, 0)
            v = tl.load(b_row + j * slot_stride + cols, mask=cols < lim, other=0.0)
            v = tl.where(j == skip_idx, xf, v.to(tl.float32))
            acc += tl.sum(tl.where(sidx == j + 1, p, 0.0), axis=0) * v
        mixed = acc * inv_l
        if WRITE_MIX:
            store_rounded(mix_ptr + row * stride_m + cols, mixed, hmask, BF16_SOFT_RTNE)
        if WRITE_OUT:
            if HAS_OUT_NORM:
                ms += tl.sum(mixed * mixed, axis=0)
            o_ptrs = out_ptr + row * stride_o + cols
            y = rounded(mixed, o_ptrs, BF16_SOFT_RTNE)
            tl.store(o_ptrs, y, mask=hmask)
            if QUANT and not HAS_OUT_NORM:
                amax = tl.maximum(amax, tl.max(tl.where(hmask, tl.abs(y.to(tl.float32)), 0.0),
                                               axis=0))

    # Pass 4: the output norm over the stored (rounded) mixture.
    if WRITE_OUT:
        if HAS_OUT_NORM:
            tl.debug_barrier()
            scale = tl.rsqrt(ms / H + out_eps)
            for c in range(0, H, CHUNK):
                cols = c + lanes
                hmask = cols < H
                o_ptrs = out_ptr + row * stride_o + cols
                y = tl.load(o_ptrs, mask=hmask, other=0.0).to(tl.float32)
                ow = tl.load(out_norm_w_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
                y = rounded(y * scale * ow, o_ptrs, BF16_SOFT_RTNE)
                tl.store(o_ptrs, y, mask=hmask)
                if QUANT:
                    amax = tl.maximum(amax, tl.max(tl.where(hmask, tl.abs(y.to(tl.float32)),
                                                            0.0), axis=0))

    # Pass 5 (quant): ``out`` is a scratch row in the sources' dtype; quantize it into q.
    if QUANT:
        tl.debug_barrier()
        qscale = quant_scale(amax, scale_ub_ptr, amax_floor, scale_floor, qmax, inv_qmax,
                             HAS_SCALE_UB, DIVIDE)
        for c in range(0, H, CHUNK):
            cols = c + lanes
            hmask = cols < H
            y = tl.load(out_ptr + row * stride_o + cols, mask=hmask, other=0.0).to(tl.float32)
            store_fp8(q_ptr + row * stride_q + cols,
                      quant_rows(y, qscale, qmax, DIVIDE_VALUES), hmask, FP8_SOFT_RTNE)
        tl.store(scale_ptr + row, qscale)


CHUNKED_KERNEL = jit(_attn_res_chunked_kernel)
