"""Training entry points for the mutating ops: ``attn_res_differentiable`` and
``attn_res_capture_differentiable``.

``kimi::attn_res`` / ``attn_res_capture`` stay inference ops: torch refuses
``register_autograd`` on an op that mutates its inputs, and a backward through one raises
"no autograd formula exists", naming these functions (``attn_res_ops.py``). These two functions
take the same arguments (positional or by name) and have the same effects:

- when no tensor argument requires grad (or grad mode is off) they call the op itself,
  so inference (eager or ``torch.compile``) traces the very same ``kimi.attn_res`` node;
- otherwise they run the op's functional parts, each of which autograd (and AOTAutograd,
  under ``torch.compile``) differentiates: ``prefix + delta`` rounded once to the dtype
  and copied into ``prefix``; the block write ``blocks[:, i] = prefix``; the mixture
  through ``kimi.attn_res_mix`` (its own backward op); the output RMSNorm in fp32.

The mixture reads a copy of the ``num_blocks`` bank slots it mixes (and of the prefix
when there is no delta): its autograd keeps its inputs for the backward, and the caller
goes on updating ``prefix`` and ``blocks`` in place, which autograd's version check
would (rightly) refuse for a saved view. That copy is what plain-torch autograd saves as
well (the ``torch.cat`` of the sources). Like any in-place op, ``prefix`` and ``blocks``
may not be leaves that require grad.

Numerics: fp32 matches the op to rounding; in bf16/fp16 with an output norm the mixture
is rounded to the dtype before the norm (the fused op normalizes it in fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attn_res_args import AttnResArgs, MixArgs
from .attn_res_ops import validate_sources


def _wants_grad(a: AttnResArgs) -> bool:
    return torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in a.tensors)


def _attn_res_parts(a: AttnResArgs):
    """``(out, mixed)`` of ``kimi::attn_res_capture``, from differentiable parts."""
    validate_sources(a)
    prefix, blocks, num_blocks = a.prefix, a.blocks, a.num_blocks
    if a.delta is not None:
        x = (prefix.float() + a.delta.float()).to(prefix.dtype)  # fp32 add, one rounding
        prefix.copy_(x)
    else:
        x = prefix.clone()  # the mixture keeps x; prefix may change in place later
    if a.block_write_idx >= 0:
        blocks[:, a.block_write_idx].copy_(x)
    bank = blocks[:, :num_blocks].clone()  # later bank writes must not reach the saved slots
    mixed = torch.ops.kimi.attn_res_mix(*MixArgs.part_of(a, prefix=x, blocks=bank))
    if a.output_norm_weight is None:
        return mixed, mixed
    out = F.rms_norm(mixed.float(), mixed.shape[-1:], a.output_norm_weight.float(),
                     a.output_norm_eps)
    return out.to(prefix.dtype), mixed


def attn_res_differentiable(*args, **kwargs):
    """``kimi::attn_res`` that autograd can differentiate (see the module docstring)."""
    a = AttnResArgs(*args, **kwargs)
    if not _wants_grad(a):
        return torch.ops.kimi.attn_res(*a)
    return _attn_res_parts(a)[0]


def attn_res_capture_differentiable(*args, **kwargs):
    """``kimi::attn_res_capture`` that autograd can differentiate: ``(out, mixed)``."""
    a = AttnResArgs(*args, **kwargs)
    if not _wants_grad(a):
        return torch.ops.kimi.attn_res_capture(*a)
    out, mixed = _attn_res_parts(a)
    return out, (mixed.clone() if out is mixed else mixed)  # two buffers, as the op
