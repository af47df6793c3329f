"""Decode-shape Triton path of the AttnRes op family: each row split over several programs.

The row kernel (``triton_kernels.py``) runs one program per token row, so a decode step of
T = 1..64 tokens runs on 1..64 SMs, each pulling a whole row of every source through one
SM. Here a row is cut into ``n_splits`` column slices of ``SLICE`` elements, and a grid of
``(T, n_splits)`` programs runs in two or three launches:

A. ``_decode_stats_kernel``: per slice, the in-place effects (prefix update, block write)
   and, per source, the partial ``<v, norm_w * qk_w>`` and ``<v, v>`` into an fp32
   workspace ``stats[T, n_splits, 2, BLOCK_S]``; block sources are loaded ``SRC_TILE`` at
   a time as one tile. The slot the block write fills is not read: its partials are the
   prefix's.
B. ``_decode_mix_kernel``: every program of a row sums the row's partials in split order
   (the same in every program, so they agree bit for bit), takes the softmax over depth
   and mixes its slice, reading each source a second time (from L2). It stores ``mixed``
   and, without an output norm, ``out``; with one, the fp32 mixture slice and its partial
   sum of squares.
C. ``_decode_norm_kernel`` (output norm only): ``out`` from the row's mean square.

The in-place effects equal the row kernel's bit for bit; the outputs agree with it to
rounding (the sums are split). A capture's mixture equals ``attn_res_mix`` on the
post-update state bit for bit. When it runs (``takes_decode``): ``T <= DECODE_MAX_T`` and
``H >= DECODE_MIN_H``; docs/design.md section 3 ("The decode-shape launch").
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .triton_chunked import INTERPRETED, jit, load_updated_prefix, rounded, store_rounded
from .triton_quant import (
    fp8_target,
    quant_flags,
    quant_rows,
    quant_scalars,
    quant_scale,
    store_fp8,
)

# The switch: rows per call at or below which a row is split, and the narrowest row split.
DECODE_MAX_T = 64
DECODE_MIN_H = 2048
# Slice width: H / 16 rounded up to a power of two, within [256, 1024] elements (8 to 16
# slices a row at H = 2048..16384; 14 at 7168). A tile holds DECODE_TILE elements: 32 a
# thread at 4 warps, so a [SRC_TILE, SLICE] tile is 16 x 256, 8 x 512 or 4 x 1024 sources.
DECODE_MIN_SLICE = 256
DECODE_MAX_SLICE = 1024
DECODE_TILE = 4096
DECODE_WARPS = 4


def takes_decode(T: int, H: int) -> bool:
    """Whether ``launch`` (route ``auto``) splits rows of this call over programs."""
    return 0 < T <= DECODE_MAX_T and H >= DECODE_MIN_H


class DecodeLaunch(NamedTuple):
    """The decode path's launch at one row width: the grid's second dimension, the warps,
    and the constexprs each of its kernels takes (A: ``stats``, B: ``mix``, C: ``norm``)."""

    n_splits: int
    num_warps: int
    stats: dict
    mix: dict
    norm: dict
    quant: dict


def decode_config(H: int, slots: int) -> DecodeLaunch:
    """Launch constants of the decode path at row width ``H`` with a bank of ``slots``."""
    slice_ = triton.next_power_of_2(-(-H // 16))
    slice_ = min(DECODE_MAX_SLICE, max(DECODE_MIN_SLICE, slice_))
    n_splits = -(-H // slice_)
    tile = dict(SLICE=slice_, BLOCK_S=triton.next_power_of_2(slots + 1),
                SRC_TILE=max(1, min(DECODE_TILE // slice_, triton.next_power_of_2(max(slots, 1)))))
    splits_p2 = triton.next_power_of_2(n_splits)
    return DecodeLaunch(n_splits, DECODE_WARPS, stats=tile, mix=dict(tile, SPLITS_P2=splits_p2),
                        norm=dict(SLICE=slice_, SPLITS_P2=splits_p2),
                        quant=dict(SLICE=slice_, SPLITS_P2=splits_p2))


@jit
def _row_slice(H, SLICE: tl.constexpr):
    """This program's row (int64), slice index, columns and column mask."""
    split = tl.program_id(1)
    cols = split * SLICE + tl.arange(0, SLICE)
    return tl.program_id(0).to(tl.int64), split, cols, cols < H


@jit
def _block_tile(b_row, j, cols, H, num_blocks, skip_idx, slot_stride):
    """Block sources ``j`` (a vector) of a row's slice, fp32: zeros past ``num_blocks`` and
    for the written slot (not read; its value is the prefix's)."""
    # A column limit per source (vector against vector: see the row kernel's masks).
    lim = tl.where((j != skip_idx) & (j < num_blocks), H, 0)
    return tl.load(b_row + j[:, None].to(tl.int64) * slot_stride + cols[None, :],
                   mask=cols[None, :] < lim[:, None], other=0.0).to(tl.float32)


def _decode_stats_kernel(
    prefix_ptr,
    delta_ptr,
    blocks_ptr,
    norm_w_ptr,
    qk_w_ptr,
    stats_ptr,
    H,
    num_blocks,
    skip_idx,
    n_splits,
    stride_p,
    stride_d,
    stride_bt,
    stride_bn,
    HAS_DELTA: tl.constexpr,
    DO_WRITE: tl.constexpr,
    BF16_SOFT_RTNE: tl.constexpr,
    SLICE: tl.constexpr,
    SRC_TILE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    LAUNCH_PDL: tl.constexpr = False,
):
    if LAUNCH_PDL:  # as the row kernel (triton_kernels.pdl_launch)
        tl.extra.cuda.gdc_wait()
    row, split, cols, hmask = _row_slice(H, SLICE)
    slot_stride = tl.cast(stride_bn, tl.int64)
    b_row = blocks_ptr + row * stride_bt

    w = tl.load(norm_w_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
    w = w * tl.load(qk_w_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
    x = load_updated_prefix(prefix_ptr + row * stride_p + cols,
                            delta_ptr + row * stride_d + cols, hmask, HAS_DELTA, BF16_SOFT_RTNE)
    if DO_WRITE:
        tl.store(b_row + skip_idx * slot_stride + cols, x, mask=hmask)

    xf = x.to(tl.float32)
    dot0, ssq0 = tl.split(tl.sum(tl.join(xf * w, xf * xf), axis=0))
    st = stats_ptr + (row * n_splits + split) * (2 * BLOCK_S)
    tl.store(st, dot0)
    tl.store(st + BLOCK_S, ssq0)

    tj = tl.arange(0, SRC_TILE)
    for j0 in range(0, num_blocks, SRC_TILE):
        j = j0 + tj
        v = _block_tile(b_row, j, cols, H, num_blocks, skip_idx, slot_stride)
        dot, ssq = tl.split(tl.sum(tl.join(v * w[None, :], v * v), axis=1))
        # The written slot holds the rounded prefix: its partial sums are the prefix's.
        dot = tl.where(j == skip_idx, dot0, dot)
        ssq = tl.where(j == skip_idx, ssq0, ssq)
        tl.store(st + 1 + j, dot, mask=j < num_blocks)
        tl.store(st + BLOCK_S + 1 + j, ssq, mask=j < num_blocks)
    if LAUNCH_PDL:
        tl.extra.cuda.gdc_launch_dependents()


def _decode_mix_kernel(
    prefix_ptr,
    blocks_ptr,
    stats_ptr,
    out_ptr,
    mix_ptr,
    part_ptr,
    ms_ptr,
    amax_ptr,
    H,
    num_blocks,
    skip_idx,
    n_splits,
    stride_p,
    stride_bt,
    stride_bn,
    stride_o,
    stride_m,
    eps,
    HAS_OUT_NORM: tl.constexpr,
    WRITE_OUT: tl.constexpr,
    WRITE_MIX: tl.constexpr,
    BF16_SOFT_RTNE: tl.constexpr,
    QUANT: tl.constexpr,
    SLICE: tl.constexpr,
    SRC_TILE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    LAUNCH_PDL: tl.constexpr = False,
):
    if LAUNCH_PDL:  # waits for launch A's stores (its whole grid)
        tl.extra.cuda.gdc_wait()
    row, split, cols, hmask = _row_slice(H, SLICE)
    slot_stride = tl.cast(stride_bn, tl.int64)
    b_row = blocks_ptr + row * stride_bt

    # The row's partial sums, summed over the splits in one fixed order.
    sp = tl.arange(0, SPLITS_P2)
    sidx = tl.arange(0, BLOCK_S)
    slim = tl.where(sp < n_splits, num_blocks + 1, 0)
    smask = sidx[None, :] < slim[:, None]
    offs = (row * n_splits + sp[:, None]) * (2 * BLOCK_S) + sidx[None, :]
    dot = tl.sum(tl.load(stats_ptr + offs, mask=smask, other=0.0), axis=0)
    ssq = tl.sum(tl.load(stats_ptr + offs + BLOCK_S, mask=smask, other=0.0), axis=0)
    valid = sidx <= num_blocks
    logit = dot * tl.rsqrt(ssq / H + eps)
    # A NaN logit reaches every weight through the sum (whether or not the max keeps it).
    m = tl.max(tl.where(valid, logit, float("-inf")), axis=0)
    p = tl.where(valid, tl.exp(logit - m), 0.0)
    p = p * (1.0 / tl.sum(p, axis=0))

    xf = tl.load(prefix_ptr + row * stride_p + cols, mask=hmask, other=0.0).to(tl.float32)
    acc = tl.sum(tl.where(sidx == 0, p, 0.0), axis=0) * xf
    tj = tl.arange(0, SRC_TILE)
    for j0 in range(0, num_blocks, SRC_TILE):
        j = j0 + tj
        v = _block_tile(b_row, j, cols, H, num_blocks, skip_idx, slot_stride)
        v = tl.where((j == skip_idx)[:, None], xf[None, :], v)
        pj = tl.sum(tl.where(sidx[None, :] == (j + 1)[:, None], p[None, :], 0.0), axis=1)
        acc += tl.sum(pj[:, None] * v, axis=0)
    if LAUNCH_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    if WRITE_MIX:
        store_rounded(mix_ptr + row * stride_m + cols, acc, hmask, BF16_SOFT_RTNE)
    if WRITE_OUT:
        if HAS_OUT_NORM:  # launch C normalises the fp32 mixture by the whole row's mean square
            tl.store(part_ptr + row * H + cols, acc, mask=hmask)
            tl.store(ms_ptr + row * n_splits + split, tl.sum(acc * acc, axis=0))
        else:
            _store_out(out_ptr + row * stride_o + cols, acc, hmask, amax_ptr + row * n_splits
                       + split, BF16_SOFT_RTNE, QUANT)


def _decode_norm_kernel(
    out_norm_w_ptr,
    out_ptr,
    part_ptr,
    ms_ptr,
    amax_ptr,
    H,
    n_splits,
    stride_o,
    out_eps,
    BF16_SOFT_RTNE: tl.constexpr,
    QUANT: tl.constexpr,
    SLICE: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    LAUNCH_PDL: tl.constexpr = False,
):
    if LAUNCH_PDL:  # waits for launch B's stores
        tl.extra.cuda.gdc_wait()
    row, split, cols, hmask = _row_slice(H, SLICE)
    sp = tl.arange(0, SPLITS_P2)
    ms = tl.sum(tl.load(ms_ptr + row * n_splits + sp, mask=sp < n_splits, other=0.0), axis=0)
    mixed = tl.load(part_ptr + row * H + cols, mask=hmask, other=0.0)
    ow = tl.load(out_norm_w_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
    if LAUNCH_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    _store_out(out_ptr + row * stride_o + cols, mixed * tl.rsqrt(ms / H + out_eps) * ow, hmask,
               amax_ptr + row * n_splits + split, BF16_SOFT_RTNE, QUANT)


@jit
def _store_out(ptrs, y, mask, amax_ptr, BF16_SOFT_RTNE: tl.constexpr, QUANT: tl.constexpr):
    """Store the output slice rounded; for a quant, also the slice's max |rounded value|."""
    y = rounded(y, ptrs, BF16_SOFT_RTNE)
    tl.store(ptrs, y, mask=mask)
    if QUANT:
        tl.store(amax_ptr, tl.max(tl.where(mask, tl.abs(y.to(tl.float32)), 0.0), axis=0))


def _decode_quant_kernel(
    out_ptr,
    q_ptr,
    scale_ptr,
    scale_ub_ptr,
    amax_ptr,
    H,
    n_splits,
    stride_o,
    stride_q,
    qmax,
    inv_qmax,
    amax_floor,
    scale_floor,
    HAS_SCALE_UB: tl.constexpr,
    DIVIDE: tl.constexpr,
    DIVIDE_VALUES: tl.constexpr,
    FP8_SOFT_RTNE: tl.constexpr,
    SLICE: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    LAUNCH_PDL: tl.constexpr = False,
):
    if LAUNCH_PDL:  # waits for launch B's (or C's) stores
        tl.extra.cuda.gdc_wait()
    row, split, cols, hmask = _row_slice(H, SLICE)
    sp = tl.arange(0, SPLITS_P2)
    amax = tl.max(tl.load(amax_ptr + row * n_splits + sp, mask=sp < n_splits, other=0.0),
                  axis=0)
    scale = quant_scale(amax, scale_ub_ptr, amax_floor, scale_floor, qmax, inv_qmax,
                        HAS_SCALE_UB, DIVIDE)
    y = tl.load(out_ptr + row * stride_o + cols, mask=hmask, other=0.0).to(tl.float32)
    if LAUNCH_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    store_fp8(q_ptr + row * stride_q + cols, quant_rows(y, scale, qmax, DIVIDE_VALUES), hmask,
              FP8_SOFT_RTNE)
    if split == 0:
        tl.store(scale_ptr + row, scale)


STATS_KERNEL = jit(_decode_stats_kernel)
MIX_KERNEL = jit(_decode_mix_kernel)
NORM_KERNEL = jit(_decode_norm_kernel)
QUANT_KERNEL = jit(_decode_quant_kernel)


def launch_decode(a, out, mixed, skip_idx: int, pdl: bool, quant=None) -> None:
    """Run the decode path for the record ``a`` (``AttnResArgs``): ``out`` / ``mixed`` are the
    outputs to store (None: not stored); ``skip_idx`` the written slot, else num_blocks.
    ``quant`` (``triton_quant.QuantOut``): the output is staged rounded in a scratch
    buffer, with each slice's max |value|, and launch D quantizes it."""
    prefix, delta, blocks = a.prefix, a.delta, a.blocks
    T, H = prefix.shape
    cfg = decode_config(H, blocks.shape[1])
    dev = prefix.device
    stats = torch.empty(T * cfg.n_splits * 2 * cfg.stats["BLOCK_S"], dtype=torch.float32,
                        device=dev)
    if quant is not None:
        out = torch.empty((T, H), dtype=prefix.dtype, device=dev)
    norm = out is not None and a.output_norm_weight is not None
    part = torch.empty(T * H, dtype=torch.float32, device=dev) if norm else stats
    ms = torch.empty(T * cfg.n_splits, dtype=torch.float32, device=dev) if norm else stats
    amax = (torch.empty(T * cfg.n_splits, dtype=torch.float32, device=dev)
            if quant is not None else stats)
    extra = dict(LAUNCH_PDL=True, launch_pdl=True) if pdl else {}
    grid = (T, cfg.n_splits)
    common = dict(BF16_SOFT_RTNE=INTERPRETED and prefix.dtype == torch.bfloat16,
                  num_warps=cfg.num_warps, **extra)
    STATS_KERNEL[grid](
        prefix, delta if delta is not None else prefix, blocks, a.norm_weight, a.qk_weight,
        stats, H, a.num_blocks, skip_idx, cfg.n_splits, prefix.stride(0),
        delta.stride(0) if delta is not None else 0, blocks.stride(0), blocks.stride(1),
        HAS_DELTA=delta is not None, DO_WRITE=a.block_write_idx >= 0, **cfg.stats, **common)
    MIX_KERNEL[grid](
        prefix, blocks, stats, out if out is not None else prefix,
        mixed if mixed is not None else prefix, part, ms, amax, H, a.num_blocks, skip_idx,
        cfg.n_splits, prefix.stride(0), blocks.stride(0), blocks.stride(1),
        out.stride(0) if out is not None else 0, mixed.stride(0) if mixed is not None else 0,
        float(a.eps), HAS_OUT_NORM=norm, WRITE_OUT=out is not None,
        WRITE_MIX=mixed is not None, QUANT=quant is not None, **cfg.mix, **common)
    if norm:
        NORM_KERNEL[grid](
            a.output_norm_weight, out, part, ms, amax, H, cfg.n_splits, out.stride(0),
            float(a.output_norm_eps), QUANT=quant is not None, **cfg.norm, **common)
    if quant is not None:
        flags = quant_flags(quant)
        QUANT_KERNEL[grid](
            out, fp8_target(quant.data), quant.scale,
            quant.q.scale_ub if quant.q.scale_ub is not None else quant.scale, amax, H,
            cfg.n_splits, out.stride(0), quant.data.stride(0), *quant_scalars(quant),
            HAS_SCALE_UB=flags["HAS_SCALE_UB"], DIVIDE=flags["DIVIDE"],
            DIVIDE_VALUES=flags["DIVIDE_VALUES"],
            FP8_SOFT_RTNE=flags["FP8_SOFT_RTNE"], **cfg.quant, num_warps=cfg.num_warps, **extra)
