"""The plain-torch statement of the AttnRes op (docs/design.md section 3).

This is the specification the kernels are tested against, written as the design
brief states it: concatenate the sources, RMSNorm the keys, dot with the
pseudo-query, softmax over depth, weighted sum. It copies the bank on purpose;
it is a reference, not a fast path. Math runs in fp32 and casts at the end. Beside it:
``op_args``, seeded arguments to call it with, and ``rel_err``, the one error metric
tolerances are stated in (the benches, the tests, the GPU check).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attn_res_args import AttnResArgs, MixArgs

#: The RMSNorm eps of ``op_args``'s calls (K3's).
EPS = 1e-6


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


def op_args(T: int, H: int, nb: int, *, dtype=torch.float32, device="cpu",
            slots: int | None = None, delta: float | None = None, write: int = -1,
            output_norm: bool = False, eps: float = EPS, seed: int = 0) -> AttnResArgs:
    """Seeded ``kimi::attn_res`` arguments: ``[T, H]`` sources, a bank of ``slots`` slots
    (default ``nb + 1``: room for a block write), ``delta`` the delta's scale (None: no
    delta), RMSNorm weights near 1 and a query of scale ``2 / sqrt(H)``."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * scale + shift).to(dtype=dtype, device=device)

    return AttnResArgs(
        prefix=rnd(T, H), delta=None if delta is None else rnd(T, H, scale=delta),
        blocks=rnd(T, nb + 1 if slots is None else slots, H),
        norm_weight=rnd(H, scale=0.1, shift=1.0), qk_weight=rnd(H, scale=2.0 / H**0.5),
        output_norm_weight=rnd(H, scale=0.1, shift=1.0) if output_norm else None,
        num_blocks=nb, block_write_idx=write, eps=eps, output_norm_eps=eps)


def rel_err(got, want) -> float:
    """Max abs error of ``got`` against ``want`` over the max abs of ``want`` (the absolute
    error where ``want`` is all zeros), in float64: the formula the tests' tolerances are
    stated in, and the one the tests and benches compute. Two Nones (an unused gradient)
    are 0."""
    if got is None or want is None:
        if (got is None) != (want is None):
            raise ValueError("rel_err: a tensor is None on one side only (a gradient one "
                             "backend computes and the other does not)")
        return 0.0
    got, want = got.detach().double(), want.detach().double()
    err, scale = float((got - want).abs().max()), float(want.abs().max())
    return err / scale if scale else err
