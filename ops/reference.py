"""The plain-torch statement of the AttnRes op (docs/design.md section 3).

This is the specification the kernels are tested against, written as the design
brief states it: concatenate the sources, RMSNorm the keys, dot with the
pseudo-query, softmax over depth, weighted sum. It copies the bank on purpose;
it is a reference, not a fast path. Math runs in fp32 and casts at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attn_res_args import AttnResArgs, MixArgs


def attn_res_mix_reference(*args, **kwargs):
    """Pre-norm mixture of ``blocks[:, :num_blocks]`` and ``prefix``, in fp32
    (``kimi::attn_res_mix``'s arguments, positional or by name)."""
    a = MixArgs(*args, **kwargs)
    H = a.prefix.shape[-1]
    values = torch.cat([a.blocks[:, :a.num_blocks], a.prefix[:, None]], dim=1).float()
    keys = F.rms_norm(values, (H,), a.norm_weight.float(), a.eps)
    p = (keys @ a.qk_weight.float()).softmax(-1)
    return (p[:, None] @ values)[:, 0]


def attn_res_reference(*args, return_mix: bool = False, **kwargs):
    """Reference for ``kimi::attn_res`` (its arguments, positional or by name) with its
    in-place effects on prefix and blocks; ``return_mix``: also the pre-norm mixture."""
    a = AttnResArgs(*args, **kwargs)
    prefix = a.prefix
    if a.delta is not None:
        prefix.copy_((prefix.float() + a.delta.float()).to(prefix.dtype))
    if a.block_write_idx >= 0:
        a.blocks[:, a.block_write_idx] = prefix
    mixed = attn_res_mix_reference(*MixArgs.part_of(a))  # after the updates, in place
    out = mixed
    if a.output_norm_weight is not None:
        out = F.rms_norm(mixed, (mixed.shape[-1],), a.output_norm_weight.float(),
                         a.output_norm_eps)
    if return_mix:
        return out.to(prefix.dtype), mixed.to(prefix.dtype)
    return out.to(prefix.dtype)
