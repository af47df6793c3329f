"""Triton kernel of ``kimi::attn_res_mix_backward`` (registered in ``mix.py``; the math is
in ``backward.py``).

A program owns a strided set of token rows (``row = pid, pid + G, ...``) and, per row,
reads each source twice:

1. pass 1 over the sources (``blocks[row, :num_blocks]``, then the prefix): the forward's
   two row reductions and ``<g, v>`` in one pass, with an online softmax (running max,
   sum, and ``s = sum_j e_j <g, v_j>``), so ``<g, out> = s / l`` is known when it ends;
2. pass 2 re-reads each source, recomputes its logit and ``<g, v>`` and stores ``dv_j``
   and/or adds ``a_j v_j`` to the program's fp32 ``dw`` accumulator.

The program's ``dw`` row goes to a ``[G, H]`` fp32 buffer that torch sums over ``G``:
deterministic, no atomics (``G = T`` with no weight gradient). Slots ``>= num_blocks`` of
``dblocks`` are zero-filled by torch. Rows too wide for registers (``launch_config``;
``tools/kernel_build`` finds where the row kernel would spill) run
``_mix_bwd_chunked_kernel``: the same two passes over ``CHUNK``-wide pieces, the
per-source scalars in ``[BLOCK_S]`` register vectors (an exact softmax, not online).

Mode: as the forward kernel's (``triton_mode.py``). Dtypes: the forward's (fp32, bf16,
fp16); math is fp32. ``launch_backward`` takes a record ``mix.validate_mix_backward`` passed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .attn_res_args import MixBackwardArgs
from .checks import AttnResArgumentError
from .triton_chunked import jit

INTERPRETED = not isinstance(tl.sum, JITFunction)

# Programs when a weight gradient is reduced: enough to fill an H200 (132 SMs) twice.
_DW_PROGRAMS = 256


def _mix_bwd_kernel(
    g_ptr,
    prefix_ptr,
    blocks_ptr,
    norm_w_ptr,
    qk_w_ptr,
    dprefix_ptr,
    dblocks_ptr,
    dw_ptr,
    T,
    H,
    num_blocks,
    stride_g,
    stride_p,
    stride_bt,
    stride_bn,
    stride_dp,
    stride_dbt,
    stride_dbn,
    eps,
    WRITE_DPREFIX: tl.constexpr,
    WRITE_DBLOCKS: tl.constexpr,
    NEED_DW: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    hmask = cols < H
    w = tl.load(norm_w_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
    w = w * tl.load(qk_w_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
    slot = tl.cast(stride_bn, tl.int64)
    dslot = tl.cast(stride_dbn, tl.int64)
    dw_acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    n_src = num_blocks + 1  # source j < num_blocks is blocks[row, j]; j == num_blocks the prefix
    for row32 in range(pid, T, n_prog):
        row = tl.cast(row32, tl.int64)  # 64-bit offsets: T * row stride can pass 2**31
        g = tl.load(g_ptr + row * stride_g + cols, mask=hmask, other=0.0).to(tl.float32)
        b_row = blocks_ptr + row * stride_bt
        p_row = prefix_ptr + row * stride_p
        # Pass 1: online softmax over the logits, carrying s = sum_j e_j <g, v_j>.
        m = tl.full((), float("-inf"), tl.float32)
        l = tl.full((), 0.0, tl.float32)  # noqa: E741
        s = tl.full((), 0.0, tl.float32)
        for j in range(0, n_src):
            # Masks through a column limit (the interpreter mis-types vector & scalar masks);
            # exactly one of the two loads is live.
            lim_b = tl.where(j < num_blocks, H, 0)
            lim_p = tl.where(j == num_blocks, H, 0)
            v = tl.load(b_row + j * slot + cols, mask=cols < lim_b, other=0.0).to(tl.float32)
            v += tl.load(p_row + cols, mask=cols < lim_p, other=0.0).to(tl.float32)
            dot = tl.sum(v * w, axis=0)
            ssq = tl.sum(v * v, axis=0)
            gv = tl.sum(v * g, axis=0)
            logit = dot * tl.rsqrt(ssq / H + eps)
            m_new = tl.maximum(m, logit, propagate_nan=tl.PropagateNan.ALL)
            alpha = tl.exp(m - m_new)
            e = tl.exp(logit - m_new)
            l = l * alpha + e  # noqa: E741
            s = s * alpha + e * gv
            m = m_new
        inv_l = 1.0 / l
        g_out = s * inv_l
        # Pass 2: dv_j = p_j g + a_j w - c_j v_j; dw += a_j v_j.
        for j in range(0, n_src):
            lim_b = tl.where(j < num_blocks, H, 0)
            lim_p = tl.where(j == num_blocks, H, 0)
            v = tl.load(b_row + j * slot + cols, mask=cols < lim_b, other=0.0).to(tl.float32)
            v += tl.load(p_row + cols, mask=cols < lim_p, other=0.0).to(tl.float32)
            dot = tl.sum(v * w, axis=0)
            ssq = tl.sum(v * v, axis=0)
            gv = tl.sum(v * g, axis=0)
            r = tl.rsqrt(ssq / H + eps)
            logit = dot * r
            p = tl.exp(logit - m) * inv_l
            a = p * (gv - g_out) * r
            if NEED_DW:
                dw_acc += a * v
            if WRITE_DPREFIX or WRITE_DBLOCKS:
                c = a * logit * r / H
                dv = p * g + a * w - c * v
                if WRITE_DBLOCKS:
                    tl.store(dblocks_ptr + row * stride_dbt + j * dslot + cols,
                             dv.to(dblocks_ptr.dtype.element_ty), mask=cols < lim_b)
                if WRITE_DPREFIX:
                    tl.store(dprefix_ptr + row * stride_dp + cols,
                             dv.to(dprefix_ptr.dtype.element_ty), mask=cols < lim_p)
    if NEED_DW:
        tl.store(dw_ptr + pid * H + cols, dw_acc, mask=hmask)


def _mix_bwd_chunked_kernel(
    g_ptr,
    prefix_ptr,
    blocks_ptr,
    norm_w_ptr,
    qk_w_ptr,
    dprefix_ptr,
    dblocks_ptr,
    dw_ptr,
    T,
    H,
    num_blocks,
    stride_g,
    stride_p,
    stride_bt,
    stride_bn,
    stride_dp,
    stride_dbt,
    stride_dbn,
    eps,
    WRITE_DPREFIX: tl.constexpr,
    WRITE_DBLOCKS: tl.constexpr,
    NEED_DW: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    lanes = tl.arange(0, CHUNK)
    sidx = tl.arange(0, BLOCK_S)
    slot = tl.cast(stride_bn, tl.int64)
    dslot = tl.cast(stride_dbn, tl.int64)
    dw_row = dw_ptr + tl.cast(pid, tl.int64) * H
    n_src = num_blocks + 1  # source j < num_blocks is blocks[row, j]; j == num_blocks the prefix
    for row32 in range(pid, T, n_prog):
        row = tl.cast(row32, tl.int64)
        g_row = g_ptr + row * stride_g
        b_row = blocks_ptr + row * stride_bt
        p_row = prefix_ptr + row * stride_p
        # Pass 1: each source's logit, rsqrt and <g, v>, its row sums taken chunk by chunk.
        logits = tl.zeros((BLOCK_S,), dtype=tl.float32)
        rs = tl.zeros((BLOCK_S,), dtype=tl.float32)
        gvs = tl.zeros((BLOCK_S,), dtype=tl.float32)
        m = tl.full((), float("-inf"), tl.float32)
        for j in range(0, n_src):
            lim_b = tl.where(j < num_blocks, H, 0)
            lim_p = tl.where(j == num_blocks, H, 0)
            dot = tl.full((), 0.0, tl.float32)
            ssq = tl.full((), 0.0, tl.float32)
            gv = tl.full((), 0.0, tl.float32)
            for c in range(0, H, CHUNK):
                cols = c + lanes
                hmask = cols < H
                v = tl.load(b_row + j * slot + cols, mask=cols < lim_b, other=0.0)
                v = v.to(tl.float32)
                v += tl.load(p_row + cols, mask=cols < lim_p, other=0.0).to(tl.float32)
                w = tl.load(norm_w_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
                w = w * tl.load(qk_w_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
                g = tl.load(g_row + cols, mask=hmask, other=0.0).to(tl.float32)
                dot += tl.sum(v * w, axis=0)
                ssq += tl.sum(v * v, axis=0)
                gv += tl.sum(v * g, axis=0)
            r = tl.rsqrt(ssq / H + eps)
            logit = dot * r
            logits = tl.where(sidx == j, logit, logits)
            rs = tl.where(sidx == j, r, rs)
            gvs = tl.where(sidx == j, gv, gvs)
            m = tl.maximum(m, logit, propagate_nan=tl.PropagateNan.ALL)
        e = tl.where(sidx < n_src, tl.exp(logits - m), 0.0)
        p = e * (1.0 / tl.sum(e, axis=0))
        g_out = tl.sum(p * gvs, axis=0)
        a = p * (gvs - g_out) * rs
        cf = a * logits * rs / H
        # Pass 2: chunk by chunk, every source's dv_j = p_j g + a_j w - c_j v_j and the
        # chunk's dw = sum_j a_j v_j.
        for c in range(0, H, CHUNK):
            cols = c + lanes
            hmask = cols < H
            g = tl.load(g_row + cols, mask=hmask, other=0.0).to(tl.float32)
            w = tl.load(norm_w_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
            w = w * tl.load(qk_w_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
            dw_c = tl.zeros((CHUNK,), dtype=tl.float32)
            for j in range(0, n_src):
                lim_b = tl.where(j < num_blocks, H, 0)
                lim_p = tl.where(j == num_blocks, H, 0)
                v = tl.load(b_row + j * slot + cols, mask=cols < lim_b, other=0.0)
                v = v.to(tl.float32)
                v += tl.load(p_row + cols, mask=cols < lim_p, other=0.0).to(tl.float32)
                a_j = tl.sum(tl.where(sidx == j, a, 0.0), axis=0)
                if NEED_DW:
                    dw_c += a_j * v
                if WRITE_DPREFIX or WRITE_DBLOCKS:
                    p_j = tl.sum(tl.where(sidx == j, p, 0.0), axis=0)
                    c_j = tl.sum(tl.where(sidx == j, cf, 0.0), axis=0)
                    dv = p_j * g + a_j * w - c_j * v
                    if WRITE_DBLOCKS:
                        tl.store(dblocks_ptr + row * stride_dbt + j * dslot + cols,
                                 dv.to(dblocks_ptr.dtype.element_ty), mask=cols < lim_b)
                    if WRITE_DPREFIX:
                        tl.store(dprefix_ptr + row * stride_dp + cols,
                                 dv.to(dprefix_ptr.dtype.element_ty), mask=cols < lim_p)
            if NEED_DW:
                acc = tl.load(dw_row + cols, mask=hmask, other=0.0)
                tl.store(dw_row + cols, acc + dw_c, mask=hmask)


_KERNEL = jit(_mix_bwd_kernel)
CHUNKED_KERNEL = jit(_mix_bwd_chunked_kernel)


# Warps of the row kernel by BLOCK_H, chosen on the offline build (tools/kernel_build,
# every gradient set, dtype and target): the row kernel keeps g, w and the dw accumulator
# live next to a source row, more than the forward, and the forward's 16 elements a thread
# spill at 2048 and 4096. 8 elements a thread up to 2048; 4 at 4096 (16 warps spill 16 B
# with triton 3.9's ptxas, 32 do not); 16 at 8192 (32 warps would cap a thread at 64
# registers and spill; 16 warps leave 128).
_WARPS = {4096: 32, 8192: 16}


def _num_warps(block_h: int) -> int:
    return _WARPS.get(block_h, min(8, max(4, block_h // 256)))


# Widest BLOCK_H the row kernel holds in registers without spilling, by the offline build:
# as the forward, 8192 for 16-byte-aligned rows (vector loads) and 4096 for others (an
# address and a predicate per element). Wider rows run the chunked kernel, 8 elements per
# thread (CHUNK = 2048 spills at H = 8190 with unaligned loads).
MAX_ROW_ALIGNED = 8192
MAX_ROW_UNALIGNED = 4096
CHUNK = 1024
CHUNK_WARPS = 4
MAX_THREADS = 1024  # a program's threads, CUDA and HIP alike


def launch_config(H: int, dtype: torch.dtype, aligned: bool = True, slots: int = 8,
                  warp_size: int = 32):
    """``(kernel, constexprs and num_warps)`` of a backward launch at row width ``H``
    (``aligned`` and ``slots`` as in ``triton_kernels.launch_config``). ``warp_size``: 64 on
    AMD CDNA (MI300), whose wavefronts are twice as wide: a program stays within 1024 threads
    (32 warps of 64 would be 2048, which no HIP launch accepts)."""
    block_h = triton.next_power_of_2(H)
    if block_h > (MAX_ROW_ALIGNED if aligned else MAX_ROW_UNALIGNED):
        return CHUNKED_KERNEL, dict(CHUNK=CHUNK, BLOCK_S=triton.next_power_of_2(slots + 1),
                                    num_warps=CHUNK_WARPS)
    return _KERNEL, dict(BLOCK_H=block_h,
                         num_warps=min(_num_warps(block_h), MAX_THREADS // warp_size))


def launch_backward(b: MixBackwardArgs):
    """``kimi::attn_res_mix_backward`` of the checked record ``b`` (``mix.py``) on the
    tensors' device: ``(dprefix, dblocks, dw)``."""
    for name, t in zip(b._fields, b.tensors, strict=False):  # the tensors are the first fields
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise AttnResArgumentError(
                f"kimi attn_res_mix_backward (triton): {name} must have a unit-stride last "
                f"dimension, got stride {tuple(t.stride())} for shape {tuple(t.shape)}")
    grad, prefix, blocks, num_blocks = b.grad, b.prefix, b.blocks, b.num_blocks
    if prefix.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            "kimi attn_res_mix_backward (triton): CPU tensors need the Triton interpreter; "
            "set TRITON_INTERPRET=1 before triton is first imported")
    need_prefix, need_blocks, need_weights = b.need_prefix, b.need_blocks, b.need_weights
    T, H = prefix.shape
    empty = prefix.new_empty((0,))
    dprefix = torch.empty_like(prefix) if need_prefix else None
    dblocks = None
    if need_blocks:
        dblocks = torch.empty_like(blocks, memory_format=torch.contiguous_format)
        dblocks[:, num_blocks:].zero_()
    dw = None
    if need_weights:
        dw = torch.zeros(H, dtype=torch.float32, device=prefix.device)
    if T > 0 and H > 0 and (need_prefix or need_blocks or need_weights):
        n_prog = min(T, _DW_PROGRAMS) if need_weights else T
        args = (
            grad, prefix, blocks, b.norm_weight, b.qk_weight,
            dprefix if dprefix is not None else prefix,
            dblocks if dblocks is not None else blocks,
            prefix,  # dw_ptr: the partial-sum buffer, below, when a weight gradient is asked for
            T, H, num_blocks,
            grad.stride(0), prefix.stride(0), blocks.stride(0), blocks.stride(1),
            dprefix.stride(0) if dprefix is not None else 0,
            dblocks.stride(0) if dblocks is not None else 0,
            dblocks.stride(1) if dblocks is not None else 0,
            float(b.eps),
        )
        # Triton specialises a pointer on 16-byte alignment and an int on divisibility by 16.
        aligned = all(t.data_ptr() % 16 == 0 for t in args[:7]) and all(
            n % 16 == 0 for n in (H, *args[11:18]))
        kernel, cfg = launch_config(H, prefix.dtype, aligned, blocks.shape[1],
                                    warp_size=64 if torch.version.hip else 32)
        # The chunked kernel adds each row's dw to its program's row: it starts at zero.
        partial = None
        if need_weights:
            alloc = torch.zeros if kernel is CHUNKED_KERNEL else torch.empty
            partial = alloc((n_prog, H), dtype=torch.float32, device=prefix.device)
            args = (*args[:7], partial, *args[8:])
        flags = dict(WRITE_DPREFIX=need_prefix, WRITE_DBLOCKS=need_blocks,
                     NEED_DW=need_weights, **cfg)
        if INTERPRETED:
            kernel[(n_prog,)](*args, **flags)
        else:
            with torch.cuda.device(prefix.device):
                kernel[(n_prog,)](*args, **flags)
        if partial is not None:
            torch.sum(partial, dim=0, out=dw)
    return tuple(empty.clone() if t is None else t for t in (dprefix, dblocks, dw))
