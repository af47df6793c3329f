"""The ``kimi`` AttnRes op family: registrations, CPU path, Triton kernel, reference.

Importing this package registers ``torch.ops.kimi.{attn_res, attn_res_capture,
attn_res_mix, attn_res_mix_list, attn_res_quant, attn_res_quant_capture, aux_tap}``, the
backward ops ``kimi.{attn_res_mix_backward, attn_res_mix_list_backward}`` and the autograd
formulas of the two mixtures.
"""

from . import backward as _backward  # noqa: F401  (backward ops, autograd of the mixtures)
from .differentiable import attn_res_capture_differentiable, attn_res_differentiable
from .fp8_quant import quant_fp8_constants
from .library import (
    attn_res,
    attn_res_capture,
    attn_res_mix,
    attn_res_quant,
    attn_res_quant_capture,
    aux_tap_op,
)
from .mix_list import attn_res_mix_list  # noqa: F401  (registers kimi::attn_res_mix_list)
from .reference import attn_res_mix_reference, attn_res_reference
from .validate import AttnResArgumentError


def attn_res_triton(*args, **kwargs):
    """Launch the Triton ``attn_res`` kernel on the tensors' device (CPU: TRITON_INTERPRET=1)."""
    from .triton_kernels import attn_res_triton as impl

    return impl(*args, **kwargs)


def attn_res_capture_triton(*args, **kwargs):
    """Triton ``attn_res_capture``: returns ``(out, mixed)``."""
    from .triton_kernels import attn_res_capture_triton as impl

    return impl(*args, **kwargs)


def attn_res_mix_triton(*args, **kwargs):
    """Triton ``attn_res_mix``: the pure pre-norm mixture."""
    from .triton_kernels import attn_res_mix_triton as impl

    return impl(*args, **kwargs)


def attn_res_quant_triton(*args, **kwargs):
    """Triton ``attn_res_quant``: returns ``(data, scale)``."""
    from .triton_kernels import attn_res_quant_triton as impl

    return impl(*args, **kwargs)


def attn_res_quant_capture_triton(*args, **kwargs):
    """Triton ``attn_res_quant_capture``: returns ``(data, scale, mixed)``."""
    from .triton_kernels import attn_res_quant_capture_triton as impl

    return impl(*args, **kwargs)


__all__ = [
    "AttnResArgumentError",
    "attn_res",
    "attn_res_capture",
    "attn_res_capture_differentiable",
    "attn_res_capture_triton",
    "attn_res_differentiable",
    "attn_res_mix",
    "attn_res_mix_reference",
    "attn_res_mix_triton",
    "attn_res_quant",
    "attn_res_quant_capture",
    "attn_res_quant_capture_triton",
    "attn_res_quant_triton",
    "attn_res_reference",
    "attn_res_triton",
    "aux_tap_op",
    "quant_fp8_constants",
]
