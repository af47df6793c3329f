"""FP8 quant comparisons against vLLM's AMD K3 kernel, shared by the tests that make them.

vLLM's AMD K3 kernel (``vllm/models/kimi_k3/amd/ops/attn_res.py``) is loaded as the
benchmarks and ``python -m tools.kernel_build --vllm-peer`` load it (``vllm_amd``:
``kimi_passes.vllm.peer.load_peer("amd")``): its launcher ``attn_res`` takes the FP8
bound from the module global ``QUANT_MAX`` a caller sets, where vLLM's reads its platform.
Under the interpreter its fp32 -> bf16 / fp16 / fp8 conversions are not a GPU's (bf16
truncates; fp8 rounds ties away from zero and truncates subnormals), so ``gpu_rounding``
rounds them to nearest even, through torch, as the hardware does.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import numpy as np
import torch

_TO_TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8e4nv": torch.float8_e4m3fn,
             "fp8e4b8": torch.float8_e4m3fnuz}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def assert_rows_agree(data, scale, want_data, want_scale, agree: torch.Tensor, what: str):
    """Equal bytes and scales on the rows ``agree`` selects."""
    bad = (bits(data) != bits(want_data)).any(1) | (scale != want_scale).any(1)
    assert not (bad & agree).any(), (
        f"{what}: rows {torch.nonzero(bad & agree).flatten().tolist()} differ although "
        f"their unquantized outputs are equal")


@contextlib.contextmanager
def gpu_rounding():
    """The interpreter's fp32 -> bf16 / fp16 / fp8 conversions rounded to nearest even (a
    GPU's conversion; torch's), for the kernels that convert with ``.to``."""
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(values, src, dst, rounding_mode):
        target = _TO_TORCH.get(getattr(dst, "name", ""))
        if getattr(src, "name", "") != "fp32" or target is None:
            return original(values, src, dst, rounding_mode)
        x = torch.from_numpy(np.ascontiguousarray(values).view(np.float32).copy())
        y = x.to(target)
        raw = y.view(torch.uint8) if y.element_size() == 1 else y.view(torch.int16)
        return raw.numpy().view(np.uint8 if y.element_size() == 1 else np.uint16).reshape(
            np.shape(values))

    with mock.patch.object(interpreter, "_convert_float", convert):
        yield


def vllm_amd():
    """vLLM's AMD K3 module (kernel and launcher), loaded once a process by
    ``kimi_passes.vllm.peer``; the test skips where vLLM is neither installed nor
    prepared."""
    import pytest

    from kimi_passes.vllm.peer import PeerError, load_peer

    try:
        return load_peer("amd").module
    except PeerError as e:
        pytest.skip(str(e))
