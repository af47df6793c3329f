"""CPU path of the AttnRes ops: reads each source in place, no copy of the bank.

The plain-torch statement concatenates the sources (a full copy of the bank) and
then runs RMSNorm, two matmuls and a softmax over that copy. Here the key norms
and the query dots are read straight off the ``blocks`` view with batched
reductions, and the weighted sum is one batched matmul over the same view.
Low-precision inputs are upcast a chunk of rows at a time so the fp32 copy stays
in cache and accumulation is fp32 throughout.
"""

from __future__ import annotations

import torch

# Rows per chunk are sized so one chunk's fp32 upcast is about this many bytes.
_CHUNK_BYTES = 4 << 20


def _mix_rows(prefix32, src32, w, eps):
    """fp32 mixture for a row range. prefix32 [C,H], src32 [C,nb,H] (or None)."""
    H = prefix32.shape[-1]
    lp = (prefix32 @ w) * torch.rsqrt(prefix32.square().sum(-1) / H + eps)
    if src32 is None:
        return prefix32
    lb = (src32 @ w) * torch.rsqrt(torch.linalg.vector_norm(src32, dim=-1).square() / H + eps)
    p = torch.cat([lb, lp[:, None]], dim=1).softmax(-1)
    mixed = torch.bmm(p[:, None, :-1], src32)[:, 0]
    return mixed.add_(prefix32 * p[:, -1:])


def mix_cpu(prefix, blocks, norm_weight, qk_weight, num_blocks, eps) -> torch.Tensor:
    """fp32 pre-norm mixture of ``blocks[:, :num_blocks]`` then ``prefix``."""
    T, H = prefix.shape
    if num_blocks == 0 or T == 0:
        # A single source gets softmax weight 1: the mixture is the prefix itself.
        return prefix.float()
    w = norm_weight.float() * qk_weight.float()
    src = blocks[:, :num_blocks]
    if prefix.dtype == torch.float32:
        return _mix_rows(prefix, src, w, eps)
    out = torch.empty((T, H), dtype=torch.float32, device=prefix.device)
    rows = max(1, _CHUNK_BYTES // ((num_blocks + 1) * H * 4))
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        out[t0:t1] = _mix_rows(prefix[t0:t1].float(), src[t0:t1].float(), w, eps)
    return out


def _rms_norm32(x32, weight, eps):
    return x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps) * weight.float()


def attn_res_cpu(
    prefix,
    delta,
    blocks,
    norm_weight,
    qk_weight,
    output_norm_weight,
    num_blocks,
    block_write_idx,
    eps,
    output_norm_eps,
):
    """Returns ``(out, mixed)``; mutates prefix (delta) and blocks (write) in place."""
    if delta is not None:
        if prefix.dtype == torch.float32:
            prefix.add_(delta)
        else:
            prefix.copy_(prefix.float().add_(delta.float()))
    if block_write_idx >= 0:
        blocks[:, block_write_idx].copy_(prefix)
    mixed32 = mix_cpu(prefix, blocks, norm_weight, qk_weight, num_blocks, eps)
    mixed = mixed32.to(prefix.dtype)
    if mixed is prefix:
        # The nb == 0 fp32 mixture is the prefix itself; an op may not return an alias.
        mixed = mixed.clone()
    if output_norm_weight is None:
        return mixed, mixed
    out = _rms_norm32(mixed32, output_norm_weight, output_norm_eps).to(prefix.dtype)
    return out, mixed
