"""``kimi::attn_res_mix`` (the pure pre-norm mixture) and ``kimi::attn_res_mix_backward``.

Their whole registration: checks, CPU kernels (``cpu.mix_cpu``, ``backward.py``), CUDA
kernels (the Triton launches, public as ``kimi_passes.ops.attn_res_mix_triton``), fake
kernels and the mixture's autograd, whose backward calls the backward op.

``attn_res_mix(prefix, blocks, norm_weight, qk_weight, num_blocks, eps)`` is
``attn_res`` with no delta, no block write and no output norm (``MixArgs``; its kernels
take it as ``AttnResArgs.mix``, so its checks are ``attn_res``'s): a pure read of
``blocks[:, :num_blocks]`` then ``prefix``. ``attn_res_mix_backward(grad, <the forward's
arguments>, need_prefix, need_blocks, need_weights)`` returns ``(dprefix, dblocks, dw)``:
an empty ``[0]`` tensor for each not asked for, ``dblocks`` zero past ``num_blocks``, ``dw``
the fp32 gradient of ``norm_weight * qk_weight`` (math: ``backward.py``).
"""

from __future__ import annotations

import torch

from .attn_res_args import AttnResArgs, MixArgs, MixBackwardArgs, record_signature
from .attn_res_ops import new_like_prefix, validate_sources
from .backward import attn_res_mix_backward_cpu, split_weight_grad
from .checks import check_grad
from .cpu import mix_cpu
from .library import below_autograd, register


def validate_mix_backward(b: MixBackwardArgs) -> None:
    """``kimi::attn_res_mix_backward``'s checks: its forward's (``validate_sources``), and
    ``grad`` against the forward's output."""
    validate_sources(AttnResArgs.mix(*b.forward))
    check_grad("attn_res_mix_backward", b.grad, b.prefix)


# --------------------------------------------------------------------------- kernels
# The dispatcher hands kernels the schema's arguments positionally; the Triton launches
# take them as the op does (positional or by name).


@record_signature(MixArgs, returns=torch.Tensor)
def attn_res_mix(*args) -> torch.Tensor:
    a = AttnResArgs.mix(*args)
    validate_sources(a)
    return mix_cpu(a)


def attn_res_mix_triton(*args, route: str | None = None, **kwargs) -> torch.Tensor:
    """``kimi::attn_res_mix`` on the tensors' device (Triton): the mixture, a pure read."""
    from .triton_kernels import launch

    a = AttnResArgs.mix(*args, **kwargs)
    validate_sources(a)
    mixed = new_like_prefix(a)
    launch(a, None, mixed, route)
    return mixed


def _attn_res_mix_fake(*args):
    a = AttnResArgs.mix(*args)
    validate_sources(a)
    return torch.empty_like(a.prefix)


@record_signature(MixBackwardArgs, returns=tuple[torch.Tensor, torch.Tensor, torch.Tensor])
def attn_res_mix_backward(*args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b = MixBackwardArgs(*args)
    validate_mix_backward(b)
    return attn_res_mix_backward_cpu(b)


def attn_res_mix_backward_triton(*args, **kwargs):
    """``kimi::attn_res_mix_backward`` on the tensors' device (Triton)."""
    from .triton_backward import launch_backward

    b = MixBackwardArgs(*args, **kwargs)
    validate_mix_backward(b)
    return launch_backward(b)


def _attn_res_mix_backward_fake(*args):
    b = MixBackwardArgs(*args)
    validate_mix_backward(b)
    prefix = b.prefix
    empty = prefix.new_empty((0,))
    return (torch.empty_like(prefix) if b.need_prefix else empty,
            torch.empty_like(b.blocks, memory_format=torch.contiguous_format)
            if b.need_blocks else empty.clone(),
            prefix.new_empty(prefix.shape[-1:], dtype=torch.float32)
            if b.need_weights else empty.clone())


# --------------------------------------------------------------------------- autograd


class _MixFunction(torch.autograd.Function):
    """``attn_res_mix``'s autograd, what ``torch.library.register_autograd`` would build, in
    a kernel of our own (``library.register``) so that a call recording no gradient runs
    the CPU kernel with one boxing, not two (``library.below_autograd``). The dispatch
    keyset rides last: ``needs_input_grad`` then lines up with the op's arguments."""

    @staticmethod
    def forward(ctx, *args_and_keyset):
        *args, keyset = args_and_keyset
        out = below_autograd(torch.ops.kimi.attn_res_mix.default, keyset, args)
        a = MixArgs(*args)
        ctx.save_for_backward(*a.tensors)
        ctx.others = a[len(a.tensors):]  # the fields after the tensors
        return out

    @staticmethod
    def backward(ctx, grad):
        a = MixArgs(*ctx.saved_tensors, *ctx.others)
        need = dict(zip(MixArgs._fields, ctx.needs_input_grad, strict=False))
        need_nw, need_qk = need["norm_weight"], need["qk_weight"]
        dprefix, dblocks, dw = torch.ops.kimi.attn_res_mix_backward(*MixBackwardArgs.of(
            grad, a, need_prefix=need["prefix"], need_blocks=need["blocks"],
            need_weights=need_nw or need_qk))
        dnw, dqk = split_weight_grad(dw, a.norm_weight, a.qk_weight, need_nw, need_qk)
        grads = {"prefix": dprefix if need["prefix"] else None,
                 "blocks": dblocks if need["blocks"] else None,
                 "norm_weight": dnw, "qk_weight": dqk}
        return (*(grads.get(name) for name in MixArgs._fields), None)


attn_res_mix = register(attn_res_mix, fake=_attn_res_mix_fake, cuda=attn_res_mix_triton,
                        record=lambda op, keyset, *args: _MixFunction.apply(*args, keyset))
attn_res_mix_backward = register(attn_res_mix_backward, fake=_attn_res_mix_backward_fake,
                                 cuda=attn_res_mix_backward_triton)
