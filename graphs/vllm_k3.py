"""vLLM's own Kimi K3 forward code (0.33.0, 0.34.0), as installed, on small stand-ins.

vLLM's code objects run unmodified: NVIDIA (``vllm/models/kimi_k3/nvidia/model.py``)
``KimiLinearModel.forward`` and the methods it calls, ROCm (``amd/linear.py``) the same,
vLLM's ``EagleModelMixin`` (capture ids, the PP aux packing) and ``IntermediateTensors``.
``build`` makes the modules with ``object.__new__`` plus the attributes those methods read
(their ``__init__`` builds GPU kernels, TP/EP groups and CUDA streams), and puts stand-ins
only where vLLM's code cannot run without a GPU or a distributed group: ``Attention`` for
MLA/KDA (a causal running mean), ``Mlp`` for the MoE, ``nn.Embedding``, ``Weights`` for
the norm and AttnRes projection holders (the AttnRes path reads ``weight`` and
``variance_epsilon``), ``Stage`` for the PP group. vLLM's ``attn_res`` is whatever the
modules hold: the route users get (``kimi_passes.vllm.k3.route``), vLLM's own kernel
(``vllm_kernel``, ``own_attn_res``: its installed source, interpreted without a GPU), or
``kimi_own`` standing in for it where the interpreter is too slow.

Imports vLLM when called, not when imported (``kimi_passes.graphs`` does not import it).
The caller picks vLLM's platform: on a machine without a GPU, ``VLLM_TARGET_DEVICE=cpu``
and ``TRITON_INTERPRET=1`` before vLLM is first imported. Used by the vLLM K3 tests
(tests/test_vllm_k3*.py) and the GPU tool (tools/gpu/vllm_k3.py); docs/testing.md says
what each stand-in replaces and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import types
from bisect import bisect_right
from unittest import mock

import torch
from torch import nn

from kimi_passes.ops.conventions import cdiv

FLAG = "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM"


@dataclasses.dataclass(frozen=True)
class Spec:
    """The K3 shape: ``num_layers`` layers, AttnRes blocks of ``block_size`` layers."""

    num_layers: int = 6
    hidden: int = 64
    block_size: int = 2
    vocab: int = 97
    inner: int = 96
    eps: float = 1e-6
    seed: int = 0


class Weights(nn.Module):
    """A norm's or an AttnRes projection's weight (what vLLM's attn_res path reads)."""

    def __init__(self, weight: torch.Tensor, eps: float | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        if eps is not None:
            self.variance_epsilon = eps


class Attention(nn.Module):
    """Stand-in for vLLM's MLA/KDA layer: a causal running mean, token-mixing like attention."""

    def __init__(self, w_in: torch.Tensor, w_out: torch.Tensor):
        super().__init__()
        self.w_in = nn.Parameter(w_in, requires_grad=False)
        self.w_out = nn.Parameter(w_out, requires_grad=False)

    def forward(self, hidden_states, positions):
        v = torch.tanh(hidden_states @ self.w_in)
        count = torch.arange(1, v.shape[0] + 1, device=v.device, dtype=v.dtype)
        return (v.cumsum(0) / count[:, None]) @ self.w_out


class Mlp(nn.Module):
    """Stand-in for vLLM's MoE / MLP: a SiLU MLP."""

    def __init__(self, w_up: torch.Tensor, w_down: torch.Tensor):
        super().__init__()
        self.w_up = nn.Parameter(w_up, requires_grad=False)
        self.w_down = nn.Parameter(w_down, requires_grad=False)

    def forward(self, x):
        return torch.nn.functional.silu(x @ self.w_up) @ self.w_down


@dataclasses.dataclass(frozen=True)
class Stage:
    """Stand-in for vLLM's PP group: what the K3 code and the mixin read of it."""

    is_first_rank: bool = True
    is_last_rank: bool = True
    world_size: int = 1


_stage = types.SimpleNamespace(current=Stage())


def _get_pp_group() -> Stage:
    return _stage.current


def vllm_modules():
    """vLLM's two K3 modules (imported once; about 12 CPU-seconds)."""
    import vllm.models.kimi_k3.amd.linear as amd
    import vllm.models.kimi_k3.nvidia.model as nvidia

    return nvidia, amd


@contextlib.contextmanager
def stage(s: Stage):
    """Run (or compile) vLLM's code as PP stage ``s``: ``get_pp_group`` answers ``s`` in the
    two K3 modules and in ``vllm.distributed.parallel_state`` (which the mixin reads)."""
    import vllm.distributed.parallel_state as ps

    nvidia, amd = vllm_modules()
    before = _stage.current
    _stage.current = s
    with mock.patch.object(nvidia, "get_pp_group", _get_pp_group), \
            mock.patch.object(amd, "get_pp_group", _get_pp_group), \
            mock.patch.object(ps, "get_pp_group", _get_pp_group), \
            mock.patch.object(ps, "model_parallel_is_initialized", lambda: True):
        try:
            yield
        finally:
            _stage.current = before


@contextlib.contextmanager
def flag(on: bool):
    """vLLM's ``VLLM_KIMI_K3_AUX_ATTN_RES_STREAM`` for the duration."""
    with mock.patch.dict(os.environ, {FLAG: "1" if on else "0"}):
        yield


def weights(spec: Spec, dtype=torch.float32, device="cpu") -> dict[str, torch.Tensor]:
    """One set of K3 weights by name, shared by the NVIDIA and the ROCm models."""
    g = torch.Generator(device).manual_seed(spec.seed)
    H, inner = spec.hidden, spec.inner

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    def norm():
        return (1 + 0.2 * torch.randn(H, generator=g, device=device)).to(dtype)

    w = {"embed": rand(spec.vocab, H), "out_norm": norm(), "out_proj": rand(1, H)}
    for i in range(spec.num_layers):
        w |= {f"{i}.sa_norm": norm(), f"{i}.sa_proj": rand(1, H), f"{i}.mlp_norm": norm(),
              f"{i}.mlp_proj": rand(1, H), f"{i}.in_norm": norm(), f"{i}.post_norm": norm(),
              f"{i}.attn_in": rand(H, H, scale=H ** -0.5),
              f"{i}.attn_out": rand(H, H, scale=H ** -0.5),
              f"{i}.up": rand(H, inner, scale=H ** -0.5),
              f"{i}.down": rand(inner, H, scale=inner ** -0.5)}
    return w


def _layer(cls, spec: Spec, w, i: int, amd: bool):
    layer = object.__new__(cls)
    nn.Module.__init__(layer)
    layer.hidden_size = spec.hidden
    layer.layer_idx = i
    if amd:
        layer.use_attn_residuals = True
    else:
        layer.use_attn_res = True
        layer.use_sequence_parallel = False
    layer.attn_res_block_size = spec.block_size
    layer.is_block_write_layer = i % spec.block_size == 0
    layer.block_write_idx = i // spec.block_size
    layer.prev_valid_blocks = cdiv(i, spec.block_size)
    layer.self_attn = Attention(w[f"{i}.attn_in"], w[f"{i}.attn_out"])
    layer.mlp = Mlp(w[f"{i}.up"], w[f"{i}.down"])
    layer.input_layernorm = Weights(w[f"{i}.in_norm"], spec.eps)
    layer.post_attention_layernorm = Weights(w[f"{i}.post_norm"], spec.eps)
    layer.self_attention_res_norm = Weights(w[f"{i}.sa_norm"], spec.eps)
    layer.mlp_res_norm = Weights(w[f"{i}.mlp_norm"], spec.eps)
    layer.self_attention_res_proj = Weights(w[f"{i}.sa_proj"])
    layer.mlp_res_proj = Weights(w[f"{i}.mlp_proj"])
    return layer


def build(spec: Spec, w, capture_ids, *, amd: bool = False, start: int = 0,
          end: int | None = None, pp: Stage = Stage()):
    """vLLM's ``KimiLinearModel`` (NVIDIA, or ROCm with ``amd``) for layers ``[start, end)``.

    Capture ids are set through vLLM's own ``_set_aux_hidden_state_layers`` (with the
    flag as the environment has it: vLLM refuses a flag-on capture at a non-final
    stage's end there), then the mixin's PP slot layout as vLLM computes it on a
    ``world_size > 1`` group.
    """
    from vllm.model_executor.models.utils import PPMissingLayer

    nvidia, amd_mod = vllm_modules()
    mod = amd_mod if amd else nvidia
    end = spec.num_layers if end is None else end
    model = object.__new__(mod.KimiLinearModel)
    nn.Module.__init__(model)
    model.config = types.SimpleNamespace(attn_res_block_size=spec.block_size,
                                         hidden_size=spec.hidden)
    model.vocab_size = spec.vocab
    model.start_layer, model.end_layer = start, end
    model.layers = nn.ModuleList(
        _layer(mod.KimiDecoderLayer, spec, w, i, amd) if start <= i < end else PPMissingLayer()
        for i in range(spec.num_layers))
    model.embed_tokens = nn.Embedding.from_pretrained(w["embed"]) if pp.is_first_rank \
        else PPMissingLayer()
    if pp.is_last_rank:
        model.output_attn_res_norm = Weights(w["out_norm"], spec.eps)
        model.output_attn_res_proj = Weights(w["out_proj"])
    else:
        model.output_attn_res_norm = PPMissingLayer()
        model.output_attn_res_proj = PPMissingLayer()
    if not amd:
        model.attn_res_block_size = spec.block_size
        model.use_attn_res = True
        model.use_sequence_parallel = False
        model.num_attn_res_blocks = cdiv(end, spec.block_size)
    model.requires_grad_(False).eval()
    with stage(dataclasses.replace(pp, world_size=1)):
        model._set_aux_hidden_state_layers(tuple(capture_ids))
    if pp.world_size > 1:  # the mixin's slot layout (its _cache_aux_pp_layout)
        ids = model.aux_hidden_state_layers
        model._aux_slot_base_cached = 0 if pp.is_first_rank else bisect_right(ids, start)
        model._aux_upstream_total_cached = model._aux_slot_base_cached if pp.is_last_rank else 0
    return model


def token_ids(spec: Spec, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, spec.vocab, (T,), generator=torch.Generator().manual_seed(seed))


def call(model, ids, *, pp: Stage = Stage(), carry=None, dynamic: bool = False):
    """One forward as vLLM's runner calls it: ``(hidden, aux)`` or ``IntermediateTensors``.

    ``dynamic``: the token count is marked dynamic (on every input that has it), so one
    compile serves every T (with ``backed_size_oblivious``, T = 1 too).
    """
    positions = torch.arange(ids.shape[0], device=ids.device)
    if dynamic:
        for t in (ids, positions, *(carry.tensors.values() if carry is not None else ())):
            torch._dynamo.mark_dynamic(t, 0)
    with stage(pp), torch.no_grad():
        return model(ids, positions, carry)


def aux_of(out) -> list[torch.Tensor]:
    """The aux states a forward returned (the last stage's list, or a carry's entries)."""
    if isinstance(out, tuple):
        return list(out[1])
    return [v for k, v in out.tensors.items() if k.startswith("aux_hidden_states_")]


def vllm_attn_res():
    """vLLM's NVIDIA ``attn_res``, its installed source unchanged, as the benchmarks load it
    (``kimi_passes.vllm.peer``: run with stand-ins for vLLM's imports, interpreted
    where Triton does not compile for a GPU)."""
    from kimi_passes.vllm.peer import load_peer

    return load_peer("nvidia").attn_res


def own_attn_res():
    """vLLM's own NVIDIA ``attn_res``: as vLLM imports it where its Triton is real (a GPU),
    else from its installed source (``vllm_attn_res``, interpreted): without a GPU
    ``vllm.triton_utils`` hands out placeholders, so the source runs with ``triton``
    imported directly (its one changed line)."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        import vllm.models.kimi_k3.nvidia.ops.attn_res as own

        return own.attn_res
    return vllm_attn_res()


@contextlib.contextmanager
def vllm_kernel():
    """vLLM's own NVIDIA ``attn_res`` (its Triton kernel) in the NVIDIA model."""
    nvidia, _ = vllm_modules()
    with mock.patch.object(nvidia, "attn_res", own_attn_res()):
        yield


# ----------------------------------------------- the eager route (k3.eager), as vLLM runs K3

def kimi_own(*args, quant_dtype=None, **kwargs):
    """Stand-in for vLLM's own ``attn_res`` (NVIDIA or ROCm signature) where its interpreted
    kernel is too slow here (T = 300: ~7 s a call): ``kimi::attn_res`` (``_quant``), the same
    arithmetic (tests/test_vllm_k3.py checks it against vLLM's kernel)."""
    from kimi_passes.ops.attn_res_args import AttnResArgs

    a = AttnResArgs(*args, **kwargs)
    if quant_dtype is None:
        return torch.ops.kimi.attn_res(*a)
    return torch.ops.kimi.attn_res_quant(*a, quant_dtype)


def vllm_amd_attn_res():
    """vLLM's ROCm ``attn_res`` from its installed source (interpreted where Triton does not
    compile for a GPU), as the benchmarks load it (``kimi_passes.vllm.peer``)."""
    from kimi_passes.vllm.peer import load_peer

    return load_peer("amd").attn_res


def as_vllms(fn, own):
    """``fn`` standing in for vLLM's ``own`` ``attn_res``: called as ``fn``, with ``own``'s
    signature (what the route checks at ``register``, ``kimi_passes.vllm.k3.surface``)."""

    @functools.wraps(fn)
    def stand_in(*args, **kwargs):
        return fn(*args, **kwargs)

    stand_in.__signature__ = inspect.signature(own)  # type: ignore[attr-defined]
    return stand_in


@contextlib.contextmanager
def with_own_attn_res(nvidia_fn, amd_fn):
    """vLLM's own ``attn_res`` in the K3 modules, before the plugin routes them: what the
    eager route runs at every call that is not a capture's consumer (``as_vllms``)."""
    import sys

    nvidia, amd = vllm_modules()
    ops = sys.modules["vllm.models.kimi_k3.nvidia.ops"]
    with mock.patch.object(nvidia, "attn_res", as_vllms(nvidia_fn, nvidia.attn_res)), \
            mock.patch.object(ops, "attn_res", as_vllms(nvidia_fn, ops.attn_res)), \
            mock.patch.object(amd, "attn_res", as_vllms(amd_fn, amd.attn_res)):
        yield


class Calls(torch.utils._python_dispatch.TorchDispatchMode):
    """The AttnRes calls of one forward: kimi ops (by name) and vLLM's own ``attn_res``
    (``own``, a counting wrapper: its Triton launch is no torch op)."""

    def __init__(self):
        super().__init__()
        self.kimi: list[str] = []
        self.own: list[str] = []
        self._in_own = False  # a stand-in's own kimi op is vLLM's call, counted once

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "kimi" and not self._in_own:
            self.kimi.append(func._opname)
        return func(*args, **(kwargs or {}))

    def wrap(self, fn):
        """``fn`` counted: each call recorded as ``pure`` (no delta, no output norm: vLLM's
        flag-on capture mixing) or ``site``."""

        def counted(*args, **kwargs):
            from kimi_passes.ops.attn_res_args import AttnResArgs

            a = AttnResArgs(*args, **{k: v for k, v in kwargs.items() if k != "quant_dtype"})
            pure = a.delta is None and a.output_norm_weight is None
            self.own.append("pure" if pure else "site")
            self._in_own = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._in_own = False

        return counted
