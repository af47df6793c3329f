"""A tiny Kimi K3 with Block AttnRes wiring (docs/design.md section 2), for tests and goldens.

One decoder layer ``i`` (block size ``S``; ``pending`` is layer ``i-1``'s MLP output)::

    tap i: aux_tap(prefix + pending, i)     (taken before the call below mutates prefix)
    x = attn_res(prefix, pending, bank, self_attention_res_*, output_norm=input_layernorm,
                 num_blocks=cdiv(i,S), block_write_idx=i//S if i%S == 0 else -1)
    attn_out = self_attn(x)      # a write layer restarts prefix = attn_out; else delta
    h = attn_res(prefix, delta, bank, mlp_res_*, output_norm=post_attention_layernorm,
                 num_blocks=cdiv(i,S) + (i%S == 0), block_write_idx=-1)
    pending = mlp(h)

The last stage ends with the output aggregation ``attn_res(prefix, pending, bank,
output_attn_res_*, no out norm, cdiv(L,S))`` (capture id ``L`` is tapped right before
it) and the final ``norm``. A non-final stage hands on ``(prefix + pending, bank)``.

Every stage carries (and clones) the whole model's bank, ``NB = cdiv(L, S)`` slots, so
stages compose functionally and bit for bit: each call sees the values at the strides
of the one-stage model (the CPU op's key dots take another kernel path at another row
stride). ``K3Config(fp8_inputs=torch.float8_e4m3fn)`` quantizes and dequantizes what
attention and the MLP read per token (``fp8_per_token``), the graph ``FuseQuantPass``
fuses. Parameters are seeded per layer from ``(config.seed, layer index)``, so layer
``i`` has the same weights whatever the stage split; names follow the K3 checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kimi_passes.errors import AuxCaptureError
from kimi_passes.ops.conventions import cdiv
from kimi_passes.ops.differentiable import attn_res_differentiable
from kimi_passes.taps.marker import aux_tap


@dataclass(frozen=True)
class K3Config:
    num_layers: int = 4
    hidden_size: int = 64
    attn_res_block_size: int = 2
    num_heads: int = 4
    intermediate_size: int = 128
    vocab_size: int = 128
    eps: float = 1e-6
    # Capture ids (what layer k reads); the default covers 0, a block-write layer and L.
    aux_layer_ids: tuple[int, ...] = (0, 2, 3, 4)
    seed: int = 0
    dtype: torch.dtype = torch.float32
    # FP8 projections: each decoder layer's AttnRes outputs (what attention and the MLP
    # read) quantized per token to this fp8 dtype (``fp8_per_token``) and dequantized, as
    # an FP8 checkpoint's linear layers read their input; None: no quant.
    fp8_inputs: torch.dtype | None = None

    def __post_init__(self):
        L, S = self.num_layers, self.attn_res_block_size
        if L < 1 or S < 1 or self.hidden_size % self.num_heads:
            raise ValueError(f"K3Config: bad geometry L={L}, S={S}, H={self.hidden_size}, "
                             f"heads={self.num_heads} (H must divide by heads)")
        ids = self.aux_layer_ids
        if len(set(ids)) != len(ids) or any(not 0 <= k <= L for k in ids):
            raise ValueError(f"K3Config: aux_layer_ids {ids} must be distinct capture ids "
                             f"in [0, {L}] (capture id k = what layer k reads)")

    @classmethod
    def tiny(cls) -> K3Config:
        """4 layers, 2 blocks of 2 layers, H=64: taps 0, 2 (a block write), 3 and L=4."""
        return cls()

    @classmethod
    def k3_geometry(cls) -> K3Config:
        """K3's depth (L=93, S=8, 12 blocks) at a toy width; EAGLE3 taps, a write layer, L."""
        return cls(num_layers=93, hidden_size=32, attn_res_block_size=8, num_heads=2,
                   intermediate_size=64, vocab_size=128, aux_layer_ids=(2, 46, 88, 90, 93))


def attn_res_torch(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight,
                   num_blocks: int, block_write_idx: int, eps: float, output_norm_eps: float):
    """``kimi::attn_res`` (docs/design.md section 3) in plain torch ops, fp32 math.

    A second statement of the op, written apart from ``ops/``: the in-place delta and
    block write, then RMSNorm'd keys scored against the pseudo-query, a softmax over
    depth and the weighted sum of the raw sources.
    """
    if delta is not None:
        prefix.copy_(prefix.float() + delta.float())  # copy_ rounds to prefix.dtype
    if block_write_idx >= 0:
        blocks[:, block_write_idx].copy_(prefix)
    H = prefix.shape[-1]
    values = torch.cat([blocks[:, :num_blocks], prefix[:, None]], dim=1).float()  # [T,n+1,H]
    keys = F.rms_norm(values, (H,), norm_weight.float(), eps)
    p = torch.einsum("tnh,h->tn", keys, qk_weight.float()).softmax(-1)
    mixed = torch.einsum("tn,tnh->th", p, values)
    if output_norm_weight is not None:
        mixed = F.rms_norm(mixed, (H,), output_norm_weight.float(), output_norm_eps)
    return mixed.to(prefix.dtype)


def fp8_per_token(y: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn):
    """vLLM's AMD K3 kernel's per-token FP8 quant of ``y`` ``[T, H]``, in plain torch:
    ``(data, scale)`` with ``scale = max(amax, 1e-10) * (1 / qmax)`` fp32 ``[T, 1]`` and
    ``qmax`` vLLM's bound (448 for float8_e4m3fn, 224 for float8_e4m3fnuz)."""
    qmax = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 224.0}[dtype]
    yf = y.float()
    scale = yf.abs().amax(-1, keepdim=True).clamp(min=1e-10) * (1.0 / qmax)
    return (yf * (1.0 / scale)).clamp(-qmax, qmax).to(dtype), scale


def fp8_round_trip(y: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``y`` as an FP8 linear layer reads it: quantized per token and dequantized (no quant
    when ``dtype`` is None)."""
    if dtype is None:
        return y
    data, scale = fp8_per_token(y, dtype)
    return (data.float() * scale).to(y.dtype)


#: A mixing: "op", "torch", or a callable with ``kimi::attn_res``'s signature and effects.
Mixing = str | Callable[..., torch.Tensor]


def attn_res(mixing: Mixing, *args):
    """``kimi::attn_res`` (``mixing="op"``), its plain-torch statement (``"torch"``), or
    ``mixing(*args)`` (a callable with the op's signature, e.g. vLLM's ``attn_res``).

    ``"op"`` goes through ``attn_res_differentiable``: the op itself unless a tensor
    requires grad (a trainable model), then the op's differentiable parts.
    """
    if callable(mixing):
        return mixing(*args)
    if mixing == "op":
        return attn_res_differentiable(*args)
    return attn_res_torch(*args)


def attn_res_read(mixing: Mixing, x, bank, norm_weight, qk_weight, num_blocks: int,
                  eps: float):
    """The pre-norm mixture a consumer reads, without its side effects (ground truth)."""
    if callable(mixing):
        return mixing(x, None, bank, norm_weight, qk_weight, None, num_blocks, -1, eps, eps)
    if mixing == "op":
        return torch.ops.kimi.attn_res_mix(x, bank, norm_weight, qk_weight, num_blocks, eps)
    return attn_res_torch(x, None, bank, norm_weight, qk_weight, None, num_blocks, -1, eps, eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x.float(), x.shape[-1:], self.weight.float(), self.eps).to(x.dtype)


class Attention(nn.Module):
    """Causal multi-head self-attention; the T tokens are one sequence."""

    def __init__(self, cfg: K3Config):
        super().__init__()
        H = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(H, H, bias=False) for _ in range(4))

    def forward(self, x):
        T, H = x.shape
        q, k, v = (p(x).view(T, self.num_heads, -1).transpose(0, 1)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(0, 1).reshape(T, H))


class MLP(nn.Module):
    def __init__(self, cfg: K3Config):
        super().__init__()
        H, ff = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(H, ff, bias=False)
        self.up_proj = nn.Linear(H, ff, bias=False)
        self.down_proj = nn.Linear(ff, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: K3Config, layer_idx: int, mixing: Mixing):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.eps
        self.layer_idx, self.block_size, self.eps, self.mixing = (
            layer_idx, cfg.attn_res_block_size, eps, mixing)
        self.fp8_inputs = cfg.fp8_inputs
        self.self_attention_res_norm = RMSNorm(H, eps)
        self.self_attention_res_proj = nn.Linear(H, 1, bias=False)
        self.mlp_res_norm = RMSNorm(H, eps)
        self.mlp_res_proj = nn.Linear(H, 1, bias=False)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, prefix, pending, bank):
        """Returns ``(mlp_out, prefix, bank)``; ``prefix`` and ``bank`` change in place."""
        i, S, eps = self.layer_idx, self.block_size, self.eps
        is_write = i % S == 0
        prev_valid = cdiv(i, S)
        x = attn_res(self.mixing, prefix, pending, bank, self.self_attention_res_norm.weight,
                     self.self_attention_res_proj.weight.view(-1), self.input_layernorm.weight,
                     prev_valid, i // S if is_write else -1, eps, eps)
        # attn_out is a fresh tensor: safe to own as the new prefix.
        attn_out = self.self_attn(fp8_round_trip(x, self.fp8_inputs))
        if is_write:
            prefix, delta = attn_out, None
        else:
            delta = attn_out
        h = attn_res(self.mixing, prefix, delta, bank, self.mlp_res_norm.weight,
                     self.mlp_res_proj.weight.view(-1), self.post_attention_layernorm.weight,
                     prev_valid + int(is_write), -1, eps, eps)
        return self.mlp(fp8_round_trip(h, self.fp8_inputs)), prefix, bank


def _init_params(modules: dict[str, nn.Module], seed: int, tag: int, H: int) -> None:
    """Deterministic init of one unit (embedding, a layer, the output head) from (seed, tag),
    drawn on the device the unit's parameters are on (CPU: the goldens' numbers)."""
    device = next(nn.ModuleDict(modules).parameters()).device
    g = torch.Generator(device).manual_seed(seed * 1_000_003 + tag)
    with torch.no_grad():
        for name, p in nn.ModuleDict(modules).named_parameters():
            r = torch.randn(p.shape, generator=g, device=device)
            if name.endswith("res_proj.weight"):
                # Non-zero pseudo-queries: logits of std ~2, so mixtures are far from uniform.
                r = r * (2.0 / math.sqrt(H))
            elif name.endswith("norm.weight"):
                r = 1.0 + 0.1 * r
            elif p.dim() == 2 and "embed" not in name:
                r = r / math.sqrt(p.shape[1])
            p.copy_(r)


class K3Model(nn.Module):
    """Layers ``[start_layer, end_layer)`` of a K3-wired AttnRes model (one PP stage).

    ``forward(input_ids)`` on the first stage, ``forward(hidden, bank)`` on a later one.
    Returns ``(hidden, aux)`` on the last stage (``hidden`` final-normed ``[T,H]``) and
    ``((prefix + pending, bank), aux)`` on a non-final stage; ``aux`` lists the taps
    of ``self.capture_ids`` (config order), each ``[T,H]``, marked with ``aux_tap``.
    By default a stage taps every configured id in ``[start, end]``; a stage boundary
    is then tapped on both sides and refused on the earlier one. ``capture_ids=`` picks
    a stage's own subset (e.g. leave the boundary to the stage that owns that layer).
    ``ground_truth(...)`` is the same run with each tap computed model-side as the
    consumer's pre-norm mixture, like vLLM's fix. ``trainable=True`` leaves the
    parameters requiring grad (default: frozen, an inference model).

    ``mixing``: ``"op"``, ``"torch"`` or a callable with ``kimi::attn_res``'s signature
    that every AttnRes call goes through. ``tap``: how ``forward`` reads tap ``k``, called
    as ``tap(k, prefix, pending, bank, norm_weight, qk_weight, num_blocks, eps)`` right
    before its consumer's call (default: ``aux_tap(prefix + pending, k)``). Built under
    ``torch.device(...)``, the parameters are drawn there.
    """

    def __init__(self, config: K3Config, start_layer: int = 0, end_layer: int | None = None,
                 mixing: Mixing = "op", capture_ids: tuple[int, ...] | None = None,
                 trainable: bool = False, tap: Callable[..., torch.Tensor] | None = None):
        super().__init__()
        L = config.num_layers
        end_layer = L if end_layer is None else end_layer
        if not 0 <= start_layer < end_layer <= L:
            raise ValueError(f"K3Model: stage layers [{start_layer}, {end_layer}) must be a "
                             f"non-empty range inside [0, {L})")
        if not callable(mixing) and mixing not in ("op", "torch"):
            raise ValueError(f"K3Model: mixing={mixing!r} must be 'op', 'torch' or a callable "
                             "with kimi::attn_res's signature")
        self.config, self.mixing, self.tap = config, mixing, tap
        self.start, self.end = start_layer, end_layer
        self.is_first, self.is_last = start_layer == 0, end_layer == L
        self.bank_slots = cdiv(L, config.attn_res_block_size)  # NB, the same on every stage
        visible = tuple(k for k in config.aux_layer_ids if self.start <= k <= self.end)
        if capture_ids is not None:
            capture_ids = tuple(capture_ids)
            if any(k not in visible for k in capture_ids) or len(set(capture_ids)) != len(
                    capture_ids):
                raise ValueError(
                    f"K3Model: capture_ids {capture_ids} must be distinct ids from the config's "
                    f"aux_layer_ids that stage [{start_layer}, {end_layer}] can see: {visible}")
        self.capture_ids = visible if capture_ids is None else capture_ids
        H, seed = config.hidden_size, config.seed
        if self.is_first:
            self.embed_tokens = nn.Embedding(config.vocab_size, H)
            _init_params({"embed_tokens": self.embed_tokens}, seed, 0, H)
        self.layers = nn.ModuleDict()
        for i in range(start_layer, end_layer):
            self.layers[str(i)] = DecoderLayer(config, i, mixing)
            _init_params({"layer": self.layers[str(i)]}, seed, 2 + i, H)
        if self.is_last:
            self.output_attn_res_norm = RMSNorm(H, config.eps)
            self.output_attn_res_proj = nn.Linear(H, 1, bias=False)
            self.norm = RMSNorm(H, config.eps)
            _init_params({"output_attn_res_norm": self.output_attn_res_norm,
                          "output_attn_res_proj": self.output_attn_res_proj,
                          "norm": self.norm}, seed, 1, H)
        # Inference by default, so compiled graphs are inference graphs; ``trainable=True``
        # keeps the parameters' requires_grad (both mixings are differentiable).
        self.to(config.dtype).requires_grad_(trainable)

    def forward(self, x, bank=None):
        return self._run(x, bank, "prefix")

    def ground_truth(self, x, bank=None):
        """Eager reference taps: each reads its consumer's pre-norm mixture (docs/design.md 4).

        The mixture is read with ``torch.ops.kimi.attn_res_mix`` (``mixing="op"``) or
        with ``attn_res_torch`` minus delta, write and output norm (``"torch"``). Shares
        no code with any compiler pass.
        """
        if not self.is_last and self.end in self.capture_ids:
            raise AuxCaptureError(
                f"capture id {self.end} is the end of the stage owning layers "
                f"[{self.start}, {self.end}) of {self.config.num_layers}: its consumer "
                f"(layer {self.end}'s pre-attention AttnRes) runs on the next pipeline "
                f"stage, so its mixture cannot be read here. Capture it on the stage that "
                f"owns layer {self.end}, or move the stage boundary; never the prefix.")
        return self._run(x, bank, "attn_res")

    def _run(self, x, bank, stream: str):
        cfg = self.config
        S, eps, H = cfg.attn_res_block_size, cfg.eps, cfg.hidden_size
        if self.is_first:
            if bank is not None or x.dim() != 1:
                raise ValueError("K3Model: the first stage takes input_ids [T] and no bank")
            prefix = self.embed_tokens(x)  # a fresh tensor: the op may update it in place
            bank = prefix.new_zeros(prefix.shape[0], self.bank_slots, H)
        else:
            NB = self.bank_slots
            if bank is None or x.dim() != 2 or tuple(bank.shape) != (x.shape[0], NB, H):
                raise ValueError(
                    f"K3Model: stage [{self.start}, {self.end}) takes hidden [T, {H}] and "
                    f"the previous stage's bank [T, {NB}, {H}] (NB = cdiv(L, S))")
            prefix, bank = x.clone(), bank.clone()  # never mutate the caller's tensors
        pending = None
        taps = {}
        for i in range(self.start, self.end):
            layer = self.layers[str(i)]
            if i in self.capture_ids:
                taps[i] = self._tap(i, prefix, pending, bank, layer.self_attention_res_norm,
                                    layer.self_attention_res_proj, cdiv(i, S), stream)
            pending, prefix, bank = layer(prefix, pending, bank)
        if self.is_last:
            L = cfg.num_layers
            if L in self.capture_ids:
                taps[L] = self._tap(L, prefix, pending, bank, self.output_attn_res_norm,
                                    self.output_attn_res_proj, cdiv(L, S), stream)
            out = attn_res(self.mixing, prefix, pending, bank, self.output_attn_res_norm.weight,
                           self.output_attn_res_proj.weight.view(-1), None, cdiv(L, S), -1,
                           eps, eps)
            result = self.norm(out)
        else:
            hidden = prefix + pending
            if self.end in self.capture_ids:  # no consumer on this stage: the pass refuses
                taps[self.end] = aux_tap(hidden, self.end)
            result = (hidden, bank)
        return result, [taps[k] for k in self.capture_ids]

    def _tap(self, k, prefix, pending, bank, res_norm, res_proj, num_blocks, stream):
        """Tap ``k``, read before its consumer ``attn_res(prefix, pending, bank, ...)``."""
        if stream == "prefix" and self.tap is not None:
            return self.tap(k, prefix, pending, bank, res_norm.weight, res_proj.weight.view(-1),
                            num_blocks, self.config.eps)
        x = prefix if pending is None else prefix + pending
        if stream == "attn_res":
            return attn_res_read(self.mixing, x, bank, res_norm.weight, res_proj.weight.view(-1),
                                 num_blocks, self.config.eps)
        tap = aux_tap(x, k)
        if pending is None and not torch.compiler.is_compiling():
            tap = tap.clone()  # eager aux_tap is the identity; the op updates prefix in place
        return tap
