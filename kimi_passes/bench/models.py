"""The models ``bench decode`` and ``bench fusion`` compile: the reference K3 (or its wiring
alone), one mixing site, plain-torch K3-wired stacks and the ``attn-res`` package's
transformer. Each is seeded: every backend compiles the same weights.
"""

from __future__ import annotations

from typing import cast

import torch

from kimi_passes.bench.harness import op_args
from kimi_passes.graphs.k3 import K3Config, K3Model, attn_res_torch


def k3_config(L: int = 8, H: int = 512) -> K3Config:
    """A reference K3 of ``L`` layers, width ``H``, blocks of 2, taps at 2, L/2 and L."""
    return K3Config(num_layers=L, hidden_size=H, attn_res_block_size=2, num_heads=8,
                    intermediate_size=2 * H, vocab_size=1024, aux_layer_ids=(2, L // 2, L))


def _cheap(self, x):
    return x * torch.sigmoid(x)


def wiring_only(model: K3Model) -> K3Model:
    """``model`` with every sublayer (attention, MLP) an elementwise op: the wiring alone."""
    for layer in model.layers.values():  # DecoderLayer: its sublayers are modules
        attn, mlp = cast(torch.nn.Module, layer.self_attn), cast(torch.nn.Module, layer.mlp)
        attn.forward = _cheap.__get__(attn)
        mlp.forward = _cheap.__get__(mlp)
    return model


class Site(torch.nn.Module):
    """One pure mixing site in plain torch: ``bank[:, :nb]`` and a prefix."""

    def __init__(self, H: int = 1024, nb: int = 8):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.nb = nb
        self.norm_weight = torch.nn.Parameter(1 + 0.1 * torch.randn(H, generator=g))
        self.qk_weight = torch.nn.Parameter(torch.randn(H, generator=g) / H ** 0.5)

    def forward(self, prefix, bank):
        return attn_res_torch(prefix, None, bank, self.norm_weight, self.qk_weight, None,
                              self.nb, -1, 1e-6, 1e-6)

    @staticmethod
    def inputs(T: int, H: int = 1024, nb: int = 8, seed: int = 0):
        """Seeded ``(prefix, bank)`` of ``T`` tokens: the op's argument builder's
        (``harness.op_args``), the bank of ``nb`` slots."""
        a = op_args(T, H, nb, slots=nb, seed=seed)
        return a.prefix, a.blocks


class WiredStack(torch.nn.Module):
    """A plain-torch K3-wired stack: ``L`` layers of two sublayers, a block every ``S``
    layers; every sublayer and the output read a mixture of the completed blocks and the
    block in progress (docs/design.md section 2), written as a new user writes it."""

    SUBLAYERS = ("tanh", "silu", "linear")

    def __init__(self, L: int, H: int, S: int, sublayer: str, dtype: torch.dtype):
        super().__init__()
        if sublayer not in self.SUBLAYERS:
            raise ValueError(f"WiredStack: sublayer {sublayer!r}; choose from {self.SUBLAYERS}")
        g = torch.Generator().manual_seed(0)
        n = 2 * L + 1
        self.L, self.S, self.sublayer = L, S, sublayer
        self.norm = torch.nn.Parameter(1 + 0.1 * torch.randn(n, H, generator=g))
        self.query = torch.nn.Parameter(torch.randn(n, H, generator=g) / H ** 0.5)
        self.scale = torch.nn.Parameter(torch.randn(2 * L, H, generator=g))
        self.proj = (torch.nn.Parameter(torch.randn(2 * L, H, H, generator=g) / H ** 0.5)
                     if sublayer == "linear" else None)
        self.to(dtype)

    def mix(self, sources: list[torch.Tensor], i: int) -> torch.Tensor:
        v = torch.stack(sources)  # [n, T, H]
        keys = torch.nn.functional.rms_norm(v, (v.shape[-1],), self.norm[i], 1e-6)
        p = (keys * self.query[i]).sum(-1).softmax(0)
        return (p.unsqueeze(-1) * v).sum(0)

    def sub(self, h: torch.Tensor, i: int) -> torch.Tensor:
        if self.proj is not None:
            return torch.tanh(h @ self.proj[i])
        h = h * self.scale[i]
        return torch.tanh(h) if self.sublayer == "tanh" else torch.nn.functional.silu(h)

    def forward(self, x):
        blocks, partial, i = [x], None, 0
        for layer in range(self.L):
            for _ in range(2):
                out = self.sub(self.mix(blocks + ([] if partial is None else [partial]), i), i)
                partial = out if partial is None else partial + out
                i += 1
            if (layer + 1) % self.S == 0:
                blocks.append(partial)
                partial = None
        return self.mix(blocks + ([] if partial is None else [partial]), i)


def parse_stack(spec: str) -> tuple[int, int, int, str, torch.dtype]:
    """``L8-H512-S2-tanh-float32`` -> (8, 512, 2, "tanh", torch.float32)."""
    try:
        L, H, S, sublayer, dtype = spec.split("-")
        if (L[0], H[0], S[0]) != ("L", "H", "S"):
            raise ValueError
        return int(L[1:]), int(H[1:]), int(S[1:]), sublayer, getattr(torch, dtype)
    except (ValueError, AttributeError, IndexError):
        raise ValueError(f"stack spec {spec!r}: write L<layers>-H<hidden>-S<block>-"
                         "<sublayer>-<dtype>, e.g. L8-H512-S2-tanh-float32") from None


def attn_res_transformer(d: int = 256, layers: int = 8, blocks: int = 4, max_seq_len=2048,
                         train: bool = False):
    """The ``attn-res`` package's Block AttnRes transformer (frozen unless ``train``), its
    pseudo-queries drawn (zero at init: every mixture would be uniform)."""
    from attn_res import AttnResMode, AttnResOperator, AttnResTransformer, TransformerConfig

    cfg = TransformerConfig(d_model=d, n_layers=layers, n_heads=8, n_kv_heads=2,
                            vocab_size=1024, max_seq_len=max_seq_len, n_blocks=blocks,
                            attn_res_mode=AttnResMode.BLOCK)
    torch.manual_seed(0)
    model = AttnResTransformer(cfg).eval().requires_grad_(train)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, AttnResOperator):
                m.pseudo_query.normal_()
    return model


def first_tensor(out):
    """A model's main output: the first tensor of nested tuples, or ``.logits``."""
    while isinstance(out, (tuple, list)):
        out = out[0]
    if hasattr(out, "logits"):
        out = out.logits
    return out
