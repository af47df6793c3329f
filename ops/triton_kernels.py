"""The Triton row kernel of the AttnRes op family and its launch (docs/design.md section 3).

One ``@triton.jit`` row kernel serves ``attn_res``, ``attn_res_capture``,
``attn_res_mix`` and the quant ops; constexpr flags pick the prefix update, the block
write, the output norm, the FP8 quant and which of ``out`` / ``mixed`` are stored.
``launch`` picks the route (``triton_route``): rows too wide for the row kernel run the
chunked kernel (``triton_chunked.py``), calls of at most 64 rows of H >= 2048 the decode
path (``triton_decode.py``). The op modules' CUDA kernels call ``launch`` on a checked record.

One program handles one token row and reads every source exactly once, with an online
softmax over depth (fp32 running max, sum and accumulator). The (updated, rounded) prefix
is the first source, so no ``-inf`` sentinel is needed and ``num_blocks == 0`` gives the
prefix bit for bit; the slot the block write just filled is taken from registers, not
read back. Loads run ``PREFETCH`` sources ahead (3 for 16-bit rows, 2 for fp32). ``H`` is
arbitrary (masked lanes, means over the true ``H``); the hidden dimension must be
unit-stride (checked, never silently copied). Register use and spills at each width are
what ``tools/kernel_build`` measures (``MAX_ROW_ALIGNED`` / ``MAX_ROW_UNALIGNED``).

Modes (``triton_mode.py``): the kernels are built in the mode triton.language was
imported in; with the interpreter they run on CPU tensors, compiled on GPU tensors only.
The Triton interpreter rounds fp32 -> bf16 by truncation, so interpreted bf16 stores round
to nearest-even by bit manipulation (``BF16_SOFT_RTNE``, never set for GPU launches).
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from .attn_res_args import AttnResArgs
from .checks import AttnResArgumentError
from .triton_chunked import (
    CHUNKED_KERNEL,
    INTERPRETED,
    add_delta_in_place,
    jit,
    rounded,
    store_rounded,
)
from .triton_decode import launch_decode, takes_decode
from .triton_quant import (
    QuantOut,
    fp8_target,
    quant_flags,
    quant_rows,
    quant_scalars,
    quant_scale,
    store_fp8,
)


def _attn_res_kernel(
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
    BLOCK_H: tl.constexpr,
    PREFETCH: tl.constexpr,
    LAUNCH_PDL: tl.constexpr = False,
):
    if LAUNCH_PDL:
        # Programmatic dependent launch: this grid may start before the previous kernel
        # ends; nothing is read before the previous kernel's writes are visible.
        tl.extra.cuda.gdc_wait()
    # 64-bit offsets: T * row stride and slot * slot stride can pass 2**31 elements.
    row = tl.program_id(0).to(tl.int64)
    slot_stride = tl.cast(stride_bn, tl.int64)
    cols = tl.arange(0, BLOCK_H)
    hmask = cols < H
    b_row = blocks_ptr + row * stride_bt

    # Issue every independent load up front: weights, prefix, delta, first two blocks.
    w = tl.load(norm_w_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
    w = w * tl.load(qk_w_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
    p_ptrs = prefix_ptr + row * stride_p + cols
    x = tl.load(p_ptrs, mask=hmask, other=0.0)
    # Masks combine a vector and a scalar condition through a column limit: the
    # interpreter mis-types ``vector_mask & scalar_mask`` (int32, rejected by tl.load).
    lim = tl.where((skip_idx != 0) & (num_blocks > 0), H, 0)
    v_next = tl.load(b_row + cols, mask=cols < lim, other=0.0)
    lim = tl.where((skip_idx != 1) & (num_blocks > 1), H, 0)
    v_next2 = tl.load(b_row + slot_stride + cols, mask=cols < lim, other=0.0)
    if PREFETCH == 3:
        lim = tl.where((skip_idx != 2) & (num_blocks > 2), H, 0)
        v_next3 = tl.load(b_row + 2 * slot_stride + cols, mask=cols < lim, other=0.0)

    if HAS_DELTA:  # loaded after the sources above: their loads are in flight meanwhile
        # Rounded to the storage dtype before the value is stored, written or mixed.
        x = add_delta_in_place(x, p_ptrs, delta_ptr + row * stride_d + cols, hmask,
                               BF16_SOFT_RTNE)
    if DO_WRITE:
        tl.store(b_row + skip_idx * slot_stride + cols, x, mask=hmask)

    # Source 0 is the prefix: start the online softmax from it (m = its logit,
    # l = 1, acc = prefix), so no -inf sentinel is needed and nb == 0 is exact.
    xf = x.to(tl.float32)
    dot, ssq = tl.split(tl.sum(tl.join(xf * w, xf * xf), axis=0))
    m = dot * tl.rsqrt(ssq / H + eps)
    l = tl.full((), 1.0, tl.float32)  # noqa: E741
    acc = xf

    for j in range(0, num_blocks):
        v = v_next.to(tl.float32)
        if DO_WRITE:
            # The written slot holds the rounded prefix: take it from registers.
            v = tl.where(j == skip_idx, x.to(tl.float32), v)
        # PREFETCH sources ahead stay in flight while this one is reduced.
        v_next = v_next2
        if PREFETCH == 3:
            v_next2 = v_next3
            nxt = j + 3
            lim = tl.where((nxt != skip_idx) & (nxt < num_blocks), H, 0)
            v_next3 = tl.load(b_row + nxt * slot_stride + cols, mask=cols < lim, other=0.0)
        else:
            nxt = j + 2
            lim = tl.where((nxt != skip_idx) & (nxt < num_blocks), H, 0)
            v_next2 = tl.load(b_row + nxt * slot_stride + cols, mask=cols < lim, other=0.0)
        # Both row reductions in one pass (one cross-warp exchange, not two).
        dot, ssq = tl.split(tl.sum(tl.join(v * w, v * v), axis=0))
        logit = dot * tl.rsqrt(ssq / H + eps)
        # PropagateNan.ALL: a NaN logit must reach m, not be dropped by the max.
        m_new = tl.maximum(m, logit, propagate_nan=tl.PropagateNan.ALL)
        alpha = tl.exp(m - m_new)
        p = tl.exp(logit - m_new)
        l = l * alpha + p  # noqa: E741
        acc = acc * alpha + p * v
        m = m_new

    mixed = acc * (1.0 / l)
    if LAUNCH_PDL:
        # Every source is read: the next kernel may start its prologue (its own
        # gdc_wait still waits for this grid to finish and its stores to land).
        tl.extra.cuda.gdc_launch_dependents()
    if WRITE_MIX:
        store_rounded(mix_ptr + row * stride_m + cols, mixed, hmask, BF16_SOFT_RTNE)
    if WRITE_OUT:
        y = mixed
        if HAS_OUT_NORM:
            ow = tl.load(out_norm_w_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
            ms = tl.sum(mixed * mixed, axis=0) / H
            y = mixed * tl.rsqrt(ms + out_eps) * ow
        if QUANT:
            # The output rounded to the sources' dtype (what an unfused quant reads), then
            # quantized per row (ops/triton_quant.py); ``out`` is not stored.
            yr = rounded(y, p_ptrs, BF16_SOFT_RTNE).to(tl.float32)
            amax = tl.max(tl.where(hmask, tl.abs(yr), 0.0), axis=0)
            scale = quant_scale(amax, scale_ub_ptr, amax_floor, scale_floor, qmax, inv_qmax,
                                HAS_SCALE_UB, DIVIDE)
            store_fp8(q_ptr + row * stride_q + cols,
                      quant_rows(yr, scale, qmax, DIVIDE_VALUES), hmask, FP8_SOFT_RTNE)
            tl.store(scale_ptr + row, scale)
        else:
            store_rounded(out_ptr + row * stride_o + cols, y, hmask, BF16_SOFT_RTNE)


_KERNEL = jit(_attn_res_kernel)


def _num_warps(block_h: int) -> int:
    """16 elements per thread (4 warps at least, 32 at most).

    Registers and spills at this setting are what tools/kernel_build measures; a
    BLOCK_H = 8192 program (16 warps, 512 threads) has at most 128 registers a thread.
    """
    return min(32, max(4, block_h // 512))


# Widest BLOCK_H the row kernel holds in registers without spilling, by the offline build
# (tools/kernel_build): 16-byte-aligned rows load in 16-byte vectors; other rows need an
# address and a predicate per element. Wider rows run the chunked kernel.
MAX_ROW_ALIGNED = 8192
MAX_ROW_UNALIGNED = 4096
CHUNK = 2048


def pdl_launch(device: torch.device) -> bool:
    """Programmatic dependent launch (PDL) for the forward kernels: opt-in with
    ``KIMI_PASSES_PDL=1``, on CUDA devices of compute capability 9.0 or newer (Hopper,
    Blackwell), compiled kernels only. Off by default: its effect is not timed on a GPU; HIP
    and the interpreter never take it. The kernel waits (``griddepcontrol.wait``) before its
    first load, so an early start cannot read what the previous kernel has not written."""
    if INTERPRETED or device.type != "cuda" or os.environ.get("KIMI_PASSES_PDL", "0") != "1":
        return False
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_config(H: int, dtype: torch.dtype, aligned: bool = True, slots: int = 8):
    """``(kernel, constexprs and num_warps)`` of a launch at row width ``H``.

    ``aligned``: every pointer 16-byte aligned and ``H`` and every row stride divisible by
    16, i.e. the specialisation in which Triton vectorises the row loads. ``slots``: the
    bank's slot count (the chunked kernel sizes its logit vector by it).
    """
    block_h = triton.next_power_of_2(H)
    if block_h > (MAX_ROW_ALIGNED if aligned else MAX_ROW_UNALIGNED):
        return CHUNKED_KERNEL, dict(CHUNK=CHUNK, BLOCK_S=triton.next_power_of_2(slots + 1),
                                    num_warps=_num_warps(CHUNK))
    # 16-bit sources: three rows in flight (bytes in flight per SM, see tools/kernel_build);
    # fp32 rows are twice as wide in bytes and in registers: two.
    prefetch = 3 if aligned and dtype.itemsize == 2 else 2
    return _KERNEL, dict(BLOCK_H=block_h, PREFETCH=prefetch, num_warps=_num_warps(block_h))


ROUTES = ("auto", "row", "decode")


def triton_route(route: str | None = None) -> str:
    """The launch route: ``route`` when given, else ``KIMI_PASSES_TRITON_ROUTE`` (default
    ``auto``). ``auto``: the decode path (``ops/triton_decode.py``) where ``takes_decode``
    says, else the row kernel or, for rows too wide for it, the chunked one; ``row`` and
    ``decode`` force one route at every size (benchmarks and tests compare them)."""
    route = route or os.environ.get("KIMI_PASSES_TRITON_ROUTE", "auto")
    if route not in ROUTES:
        raise ValueError(f"kimi attn_res (triton): unknown route {route!r} (from the argument "
                         f"or KIMI_PASSES_TRITON_ROUTE); use one of {ROUTES}")
    return route


def _check_unit_stride(a: AttnResArgs) -> None:
    for name, t in zip(a._fields, a.tensors, strict=False):  # the tensors are the first fields
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise AttnResArgumentError(
                f"kimi attn_res (triton): {name} must have a unit-stride last dimension, got "
                f"stride {tuple(t.stride())} for shape {tuple(t.shape)}; row strides may be "
                f"arbitrary, but the hidden dimension must be contiguous"
            )


def launch(a: AttnResArgs, out, mixed, route: str | None = None,
           quant: QuantOut | None = None) -> None:
    """Launch the route for ``a`` (a checked record: ``attn_res_ops.validate_sources``), storing
    ``out`` / ``mixed`` (None: not stored); with
    ``quant``, ``out`` is not given: the output is quantized into ``quant.data`` /
    ``quant.scale`` (the chunked and decode routes stage it in a scratch buffer)."""
    _check_unit_stride(a)
    T, H = a.prefix.shape
    if T == 0 or H == 0:
        return
    # skip_idx: the written slot (not loaded: sourced from registers), else num_blocks.
    skip_idx = a.block_write_idx if a.block_write_idx >= 0 else a.num_blocks
    if a.prefix.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            "kimi attn_res (triton): CPU tensors need the Triton interpreter; set "
            "TRITON_INTERPRET=1 before triton is first imported"
        )
    route = triton_route(route)
    pdl = pdl_launch(a.prefix.device)
    # The interpreter runs on any device (staging through host memory); compiled kernels
    # launch on the tensors' GPU.
    on_device = contextlib.nullcontext() if INTERPRETED else torch.cuda.device(a.prefix.device)
    if route == "decode" or (route == "auto" and takes_decode(T, H)):
        with on_device:
            launch_decode(a, out, mixed, skip_idx, pdl, quant)
        return
    _launch_rows(a, out, mixed, skip_idx, pdl, quant, on_device)


def _launch_rows(a: AttnResArgs, out, mixed, skip_idx: int, pdl: bool,
                 quant: QuantOut | None, on_device) -> None:
    """One program a row: the row kernel, or the chunked one for rows too wide for it
    (``launch_config``, from the rows' alignment)."""
    prefix, T, H = a.prefix, *a.prefix.shape
    data = None if quant is None else quant.data
    ptrs = [prefix, a.delta, a.blocks, a.norm_weight, a.qk_weight, a.output_norm_weight, out,
            mixed, data]
    # Triton specialises a pointer on 16-byte alignment and an int on divisibility by 16.
    strides = (prefix.stride(0), 0 if a.delta is None else a.delta.stride(0),
               a.blocks.stride(0), a.blocks.stride(1), 0 if out is None else out.stride(0),
               0 if mixed is None else mixed.stride(0), 0 if data is None else data.stride(0))
    aligned = all(t is None or t.data_ptr() % 16 == 0 for t in ptrs) and all(
        n % 16 == 0 for n in (H, *strides))
    kernel, cfg = launch_config(H, prefix.dtype, aligned, a.blocks.shape[1])
    if quant is not None and kernel is CHUNKED_KERNEL:
        # The chunked kernel stores the rounded output, then quantizes it from there.
        out = torch.empty((T, H), dtype=prefix.dtype, device=prefix.device)
    if pdl:
        cfg = dict(cfg, LAUNCH_PDL=True, launch_pdl=True)  # the constexpr, the launch attribute
    flags = dict(
        HAS_DELTA=a.delta is not None,
        DO_WRITE=a.block_write_idx >= 0,
        HAS_OUT_NORM=a.output_norm_weight is not None,
        WRITE_OUT=out is not None or quant is not None,
        WRITE_MIX=mixed is not None,
        BF16_SOFT_RTNE=INTERPRETED and prefix.dtype == torch.bfloat16,
        **quant_flags(quant),
        **cfg,
    )
    with on_device:
        kernel[(T,)](*_row_args(a, out, mixed, data, quant, strides, skip_idx), **flags)


def _row_args(a: AttnResArgs, out, mixed, data, quant: QuantOut | None, strides,
              skip_idx: int) -> tuple:
    """The kernels' positional arguments. A pointer the flags say is not read is passed the
    prefix (the kernel's signature wants a tensor there), a stride not used 0."""
    prefix = a.prefix
    return (
        prefix,
        a.delta if a.delta is not None else prefix,
        a.blocks,
        a.norm_weight,
        a.qk_weight,
        a.output_norm_weight if a.output_norm_weight is not None else a.norm_weight,
        out if out is not None else prefix,
        mixed if mixed is not None else prefix,
        fp8_target(data) if data is not None else prefix,
        quant.scale if quant is not None else prefix,
        quant.q.scale_ub if quant is not None and quant.q.scale_ub is not None else prefix,
        a.prefix.shape[1],
        a.num_blocks,
        skip_idx,
        *strides[:4],
        # the output's own stride: the chunked kernel's scratch output is not ``strides[4]``
        out.stride(0) if out is not None else 0,
        *strides[5:],
        float(a.eps),
        float(a.output_norm_eps),
        *quant_scalars(quant),
    )
