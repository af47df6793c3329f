"""The ``kimi`` AttnRes op family: registrations, CPU path, Triton kernels, reference.

Importing this package registers every op, one module per family, each module holding
its ops' checks, kernels, fake kernels and autograd (``library.register``):
``attn_res_ops.py`` (``attn_res``, ``attn_res_capture``, ``attn_res_quant``,
``attn_res_quant_capture``), ``mix.py`` (``attn_res_mix``, ``attn_res_mix_backward``),
``mix_list.py`` (``attn_res_mix_list``, ``attn_res_mix_list_backward``), ``aux_tap.py``.
The ``*_triton`` names are those modules' CUDA kernels, callable on any device the
Triton build serves; triton itself is imported at their first launch, not here.
"""

from .attn_res_ops import (
    attn_res,
    attn_res_capture,
    attn_res_capture_triton,
    attn_res_quant,
    attn_res_quant_capture,
    attn_res_quant_capture_triton,
    attn_res_quant_triton,
    attn_res_triton,
)
from .aux_tap import aux_tap_op
from .checks import AttnResArgumentError
from .differentiable import attn_res_capture_differentiable, attn_res_differentiable
from .fp8_quant import quant_fp8_constants
from .mix import attn_res_mix, attn_res_mix_triton
from .mix_list import attn_res_mix_list  # noqa: F401  (registers kimi::attn_res_mix_list)
from .reference import attn_res_mix_reference, attn_res_reference

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
