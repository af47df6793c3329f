"""Shared helpers for the op tests: dtypes, the op tolerance, seeded tensors and arguments,
opcheck.

Fixtures live in conftest.py; this module holds plain values and functions.
"""

from __future__ import annotations

import torch

# The op tolerance (atol = rtol) per dtype, the benches' too: one number, in the package.
# Tests with another error budget keep their own (the taps fuzz's compiled-model drift, the
# fusion fuzz's bf16 rounding of keys and probabilities, the compiled CUDA kernel's fp32).
from kimi_passes.bench.harness import OP_TOL as OP_TOL

#: Every dtype the ops take.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

EPS = 1e-6
ONORM_EPS = 1e-5


def rnd(*shape, dtype=torch.float32, seed=0, scale=1.0) -> torch.Tensor:
    """A normal tensor of ``shape`` times ``scale`` in ``dtype``, from its own generator
    seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def make_args(T, H, NB, nb, write, dtype, *, delta, onorm, seed=0, scale=1.0, qk_scale=2.0,
              device="cpu"):
    """Positional args of ``kimi::attn_res``, seeded; logits are O(qk_scale) for unit sources.

    ``[prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks,
    block_write_idx, eps, output_norm_eps]``; ``delta`` / ``output_norm_weight`` are None
    unless asked for.
    """
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dtype=dtype, device=device)

    prefix = rnd(T, H, s=scale)
    blocks = rnd(T, NB, H, s=scale)
    d = rnd(T, H, s=scale) if delta else None
    norm_weight = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype=dtype, device=device)
    qk_weight = rnd(H, s=qk_scale / H**0.5)
    onw = ((1 + 0.1 * torch.randn(H, generator=g)).to(dtype=dtype, device=device)
           if onorm else None)
    return [prefix, d, blocks, norm_weight, qk_weight, onw, nb, write, EPS, ONORM_EPS]


def clone_args(args):
    """A copy of an argument list: tensors cloned (the ops update some in place)."""
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def mix_args(args):
    """``kimi::attn_res_mix``'s arguments from ``kimi::attn_res``'s."""
    prefix, _, blocks, nw, qk, _, nb, _, eps, _ = args
    return [prefix, blocks, nw, qk, nb, eps]


def _opcheck_utils() -> list[str]:
    """opcheck's default utils, plus test_aot_dispatch_static where this torch has it."""
    utils = ["test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_dynamic"]
    try:
        from torch.testing._internal.optests.generate_tests import ALL_TEST_UTILS
    except ImportError:
        return utils
    return utils + [u for u in ("test_aot_dispatch_static",) if u in ALL_TEST_UTILS]


#: What ``opcheck`` runs on every kimi op.
OPCHECK_UTILS = _opcheck_utils()


def opcheck(op, args) -> None:
    """``torch.library.opcheck(op, args)`` running ``OPCHECK_UTILS``."""
    torch.library.opcheck(op, tuple(args), test_utils=OPCHECK_UTILS)
