"""The truth the vLLM K3 tests hold every aux state to, and the one comparison.

``FlagOnTruth``: the installed NVIDIA code's own aux states with vLLM's flag on
(``VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1``) for the same weights and tokens, computed once a
process per (dtype, T). fp32: eager. Other dtypes: compiled by plain Inductor, one dynamic
compile for every token count: Inductor rounds the stand-ins' bf16 math differently from
eager, and that drift, not the tap, would be measured (docs/testing.md, "Tolerances").
``assert_aux``: aux states against it at the op's tolerance.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

import kimi_passes.graphs.vllm_k3 as h
from helpers.op import OP_TOL


class FlagOnTruth:
    """``truth(dtype, T)``: ``spec``'s model with captures ``capture`` (see the module
    docstring); ``ts``: the token counts one compiled truth serves. ``kernels(T)``: vLLM's
    own ``attn_res`` (NVIDIA, ROCm) to run at token count T (eager only); None: as
    installed when the truth is computed."""

    def __init__(self, spec: h.Spec, capture: Sequence[int], ts: Sequence[int],
                 kernels: Callable[[int], tuple] | None = None):
        self.spec, self.capture, self.ts, self.kernels = spec, tuple(capture), tuple(ts), kernels
        self._aux: dict = {}

    def __call__(self, dtype: torch.dtype, T: int) -> list[torch.Tensor]:
        if (dtype, T) not in self._aux:
            if dtype == torch.float32:
                self._eager(T)
            else:
                self._compiled(dtype)
        return self._aux[dtype, T]

    def _model(self, dtype: torch.dtype):
        return h.build(self.spec, h.weights(self.spec, dtype), self.capture)

    def _eager(self, T: int) -> None:
        own = (h.with_own_attn_res(*self.kernels(T)) if self.kernels is not None
               else contextlib.nullcontext())
        with own, h.flag(True):
            out = h.call(self._model(torch.float32), h.token_ids(self.spec, T))
        self._aux[torch.float32, T] = h.aux_of(out)

    def _compiled(self, dtype: torch.dtype) -> None:
        if self.kernels is not None:
            raise ValueError("FlagOnTruth: a compiled truth runs the kernels as installed "
                             "(one compile for every T); build it without kernels=")
        torch._dynamo.reset()
        with h.flag(True), torch.fx.experimental._config.patch(backed_size_oblivious=True):
            model = torch.compile(self._model(dtype), backend="inductor", fullgraph=True)
            for t in self.ts:
                out = h.call(model, h.token_ids(self.spec, t), dynamic=True)
                self._aux[dtype, t] = h.aux_of(out)
        torch._dynamo.reset()


def assert_aux(got, want, dtype: torch.dtype, what: str) -> None:
    """Aux states ``got`` equal ``want`` at the op's tolerance (``OP_TOL``), one by one."""
    assert len(got) == len(want), f"{what}: {len(got)} aux states, want {len(want)}"
    tol = OP_TOL[dtype]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape, f"{what}: aux {i} has shape {tuple(g.shape)}"
        torch.testing.assert_close(
            g, w, atol=tol, rtol=tol,
            msg=lambda m, i=i: f"{what}: aux {i} is not vLLM's flag-on value: {m}")
