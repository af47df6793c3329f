"""Triton kernel of ``kimi::attn_res_mix_backward`` (the math is in ``backward.py``).

A program owns a strided set of token rows (``row = pid, pid + G, ...``) and, per row,
reads each source twice:

1. pass 1 over the sources (``blocks[row, :num_blocks]``, then the prefix): both row
   reductions of the forward (``<v, w>``, ``sum v^2``) and ``<g, v>`` in one pass, with
   an online softmax (running max ``m``, sum ``l``, and ``s = sum_j e_j <g, v_j>``), so
   ``<g, out> = s / l`` is known when the pass ends and no per-source state is kept;
2. pass 2 re-reads each source, recomputes its logit and ``<g, v>`` (compute, no extra
   memory traffic) and stores ``dv_j`` and/or adds ``a_j v_j`` to the program's fp32
   ``dw`` accumulator.

The program's ``dw`` row goes to a ``[G, H]`` fp32 buffer that torch sums over ``G``:
deterministic, no atomics. With no weight gradient asked for, ``G = T`` (a row per
program). Slots ``>= num_blocks`` of ``dblocks`` are zero-filled by torch.

Mode: like the forward kernel, the kernel is built in the mode ``triton.language`` was
imported in (interpreter on CPU under ``TRITON_INTERPRET=1``, compiled on a GPU). Dtypes:
the forward's (fp32, bf16, fp16; ``validate_mix`` refuses others); math is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .validate import AttnResArgumentError, check_grad, validate_mix

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


with triton.knobs.runtime.scope():
    triton.knobs.runtime.interpret = INTERPRETED
    _KERNEL = triton.jit(_mix_bwd_kernel)


def _num_warps(block_h: int) -> int:
    """16 elements per thread, 4 to 32 warps (as the forward kernel)."""
    return min(32, max(4, block_h // 512))


def attn_res_mix_backward_triton(grad, prefix, blocks, norm_weight, qk_weight, num_blocks, eps,
                                 need_prefix, need_blocks, need_weights):
    """``kimi::attn_res_mix_backward`` on the tensors' device: ``(dprefix, dblocks, dw)``."""
    validate_mix(prefix, blocks, norm_weight, qk_weight, num_blocks, eps)
    check_grad("attn_res_mix_backward", grad, prefix)
    for name, t in (("grad", grad), ("prefix", prefix), ("blocks", blocks),
                    ("norm_weight", norm_weight), ("qk_weight", qk_weight)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise AttnResArgumentError(
                f"kimi attn_res_mix_backward (triton): {name} must have a unit-stride last "
                f"dimension, got stride {tuple(t.stride())} for shape {tuple(t.shape)}")
    if prefix.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            "kimi attn_res_mix_backward (triton): CPU tensors need the Triton interpreter; "
            "set TRITON_INTERPRET=1 before triton is first imported")
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
        partial = (torch.empty((n_prog, H), dtype=torch.float32, device=prefix.device)
                   if need_weights else None)
        block_h = triton.next_power_of_2(H)
        args = (
            grad, prefix, blocks, norm_weight, qk_weight,
            dprefix if dprefix is not None else prefix,
            dblocks if dblocks is not None else blocks,
            partial if partial is not None else prefix,
            T, H, num_blocks,
            grad.stride(0), prefix.stride(0), blocks.stride(0), blocks.stride(1),
            dprefix.stride(0) if dprefix is not None else 0,
            dblocks.stride(0) if dblocks is not None else 0,
            dblocks.stride(1) if dblocks is not None else 0,
            float(eps),
        )
        flags = dict(WRITE_DPREFIX=need_prefix, WRITE_DBLOCKS=need_blocks,
                     NEED_DW=need_weights, BLOCK_H=block_h, num_warps=_num_warps(block_h))
        if INTERPRETED:
            _KERNEL[(n_prog,)](*args, **flags)
        else:
            with torch.cuda.device(prefix.device):
                _KERNEL[(n_prog,)](*args, **flags)
        if partial is not None:
            torch.sum(partial, dim=0, out=dw)
    return tuple(empty.clone() if t is None else t for t in (dprefix, dblocks, dw))
