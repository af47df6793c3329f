"""``torch.library`` registrations of the ``kimi`` op family.

All are opaque ``custom_op``s (not ``triton_op``): AOTAutograd keeps each one a
single node, so the passes can find ``kimi.attn_res`` in post-grad graphs. The
CPU kernel is the eager path in ``cpu.py``; CUDA dispatches to the Triton
kernel. Fake kernels run the same validation, so a bad model fails at compile
time.

- ``attn_res``: docs/design.md section 3; mutates ``prefix`` (delta) and ``blocks`` (write).
- ``attn_res_capture``: the same, also returning the pre-norm mixture. The
  aux-stream pass swaps a tap's consumer to it, so a tap costs one ``[T,H]`` write.
- ``attn_res_mix``: the pure pre-norm mixture, no mutation.
- ``aux_tap``: the tap marker; the aux-stream pass removes every one.

The ten arguments of ``attn_res`` and ``attn_res_capture`` are one record,
``AttnResArgs`` (``ops/attn_res_args.py``): their schemas are inferred from its fields and
every kernel takes it.
"""

from __future__ import annotations

import torch

from .attn_res_args import AttnResArgs, record_signature
from .conventions import MUTATED_ARGS
from .cpu import attn_res_cpu, mix_cpu
from .validate import validate_sources, validate_tap


@torch.library.custom_op("kimi::attn_res", mutates_args=MUTATED_ARGS, device_types="cpu")
@record_signature(returns=torch.Tensor)
def attn_res(*args) -> torch.Tensor:
    a = AttnResArgs(*args)
    validate_sources(a)
    return attn_res_cpu(a, capture=False)[0]


@torch.library.custom_op("kimi::attn_res_capture", mutates_args=MUTATED_ARGS, device_types="cpu")
@record_signature(returns=tuple[torch.Tensor, torch.Tensor])
def attn_res_capture(*args) -> tuple[torch.Tensor, torch.Tensor]:
    a = AttnResArgs(*args)
    validate_sources(a)
    out, mixed = attn_res_cpu(a)
    if out is mixed:  # no output norm: the two outputs may not alias
        mixed = mixed.clone()
    return out, mixed


@torch.library.custom_op("kimi::attn_res_mix", mutates_args=(), device_types="cpu")
def attn_res_mix(
    prefix: torch.Tensor,
    blocks: torch.Tensor,
    norm_weight: torch.Tensor,
    qk_weight: torch.Tensor,
    num_blocks: int,
    eps: float,
) -> torch.Tensor:
    a = AttnResArgs.mix(prefix, blocks, norm_weight, qk_weight, num_blocks, eps)
    validate_sources(a)
    mixed = mix_cpu(a).to(prefix.dtype)
    return mixed.clone() if mixed is prefix else mixed


@torch.library.custom_op("kimi::aux_tap", mutates_args=())
def aux_tap_op(x: torch.Tensor, capture_id: int) -> torch.Tensor:
    validate_tap(x, capture_id)
    # An op may not return its input; under kimi_backend this node never runs.
    return x.clone()


# The dispatcher hands kernels the schema's arguments positionally (it has no keyword-only
# ones), whatever form the caller used: ``*args`` is the record in schema order.


@attn_res.register_fake
def _attn_res_fake(*args):
    a = AttnResArgs(*args)
    validate_sources(a)
    return torch.empty_like(a.prefix)


@attn_res_capture.register_fake
def _attn_res_capture_fake(*args):
    a = AttnResArgs(*args)
    validate_sources(a)
    return torch.empty_like(a.prefix), torch.empty_like(a.prefix)


@attn_res_mix.register_fake
def _attn_res_mix_fake(*args):
    a = AttnResArgs.mix(*args)
    validate_sources(a)
    return torch.empty_like(a.prefix)


@aux_tap_op.register_fake
def _aux_tap_fake(x, capture_id):
    validate_tap(x, capture_id)
    return torch.empty_like(x)


def _register_cuda() -> None:
    """CUDA dispatches to the Triton kernel (imported lazily: triton is Linux-only)."""

    @attn_res.register_kernel("cuda")
    def _attn_res_cuda(*args):
        from .triton_kernels import attn_res_triton

        return attn_res_triton(*args)

    @attn_res_capture.register_kernel("cuda")
    def _attn_res_capture_cuda(*args):
        from .triton_kernels import attn_res_capture_triton

        return attn_res_capture_triton(*args)

    @attn_res_mix.register_kernel("cuda")
    def _attn_res_mix_cuda(*args):
        from .triton_kernels import attn_res_mix_triton

        return attn_res_mix_triton(*args)


_register_cuda()
