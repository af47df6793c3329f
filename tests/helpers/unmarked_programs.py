"""Small K3 forwards written the way vLLM 0.33.0's K3 code taps aux states: no marker.

``VllmLikeK3`` follows ``vllm/models/kimi_k3/nvidia/model.py`` (``KimiLinearModel.forward``,
``_capture_aux_hidden_stream``, ``KimiDecoderLayer._pre_attn_norm`` / ``_post_attn_norm``)
with ``torch.ops.kimi.attn_res`` as its ``attn_res``, a linear layer for attention and one
for the MLP. The aux states are a returned list:

- capture id 0 (first stage): the embedding itself;
- flag off (vLLM's default): capture k is ``prefix_sum + pending`` (``order="delta_first"``:
  ``pending + prefix_sum``, the operand order of ``amd/linear.py``'s forward);
- flag on (``VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1``): capture k is a separate pure call
  ``attn_res(prefix_sum + pending, None, bank, <layer k's self_attention_res weights, or
  the output_attn_res ones at k = L>, None, num_blocks, -1, eps, 0.0)``.

A non-final stage (``end < num_layers``) returns its carry ``pending + prefix_sum`` and
the bank with the aux list, as vLLM's ``IntermediateTensors``. ``markers`` maps a capture
id to the id a ``kimi_passes.aux_tap`` marker on the same legacy value declares (returned
after the unmarked list). Tests do not import vLLM here.
"""

from __future__ import annotations

import torch
from torch import nn

import kimi_passes
from kimi_passes.ops.conventions import cdiv

kimi = torch.ops.kimi
EPS = 1e-6


def _weights(generator, shape, around):
    return nn.Parameter(torch.randn(*shape, generator=generator) * 0.5 + around)


class Layer(nn.Module):
    """One K3 decoder layer as vLLM's ``KimiDecoderLayer`` wires AttnRes."""

    def __init__(self, i: int, hidden: int, block_size: int, generator):
        super().__init__()
        H = hidden
        self.self_attention_res_norm = _weights(generator, (H,), 1.0)
        self.self_attention_res_proj = _weights(generator, (1, H), 0.0)
        self.mlp_res_norm = _weights(generator, (H,), 1.0)
        self.mlp_res_proj = _weights(generator, (1, H), 0.0)
        self.input_layernorm = _weights(generator, (H,), 1.0)
        self.post_attention_layernorm = _weights(generator, (H,), 1.0)
        self.self_attn = nn.Parameter(torch.randn(H, H, generator=generator) / H ** 0.5)
        self.mlp = nn.Parameter(torch.randn(H, H, generator=generator) / H ** 0.5)
        self.is_block_write_layer = i % block_size == 0
        self.block_write_idx = i // block_size
        self.prev_valid_blocks = cdiv(i, block_size)

    def forward(self, pending, prefix_sum, bank):
        h = kimi.attn_res(prefix_sum, pending, bank, self.self_attention_res_norm,
                          self.self_attention_res_proj.squeeze(0), self.input_layernorm,
                          self.prev_valid_blocks,
                          self.block_write_idx if self.is_block_write_layer else -1, EPS, EPS)
        h = h @ self.self_attn.T
        if self.is_block_write_layer:
            prefix_sum, delta = h, None
        else:
            delta = h
        h = kimi.attn_res(prefix_sum, delta, bank, self.mlp_res_norm,
                          self.mlp_res_proj.squeeze(0), self.post_attention_layernorm,
                          self.prev_valid_blocks + self.is_block_write_layer, -1, EPS, EPS)
        return torch.tanh(h @ self.mlp.T), prefix_sum, bank


class VllmLikeK3(nn.Module):
    """The model (or one pipeline stage ``[start, end)``) with vLLM's unmarked capture."""

    def __init__(self, num_layers=5, block_size=2, hidden=16, taps=(0, 1, 2, 3, 5),
                 flag=False, order="prefix_first", start=0, end=None, markers=None,
                 dtype=torch.float32, vocab=64, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.num_layers, self.taps, self.flag, self.order = num_layers, tuple(taps), flag, order
        self.start, self.end = start, num_layers if end is None else end
        self.markers = dict(markers or {})
        self.num_attn_res_blocks = cdiv(num_layers, block_size)
        self.embed_tokens = nn.Parameter(torch.randn(vocab, hidden, generator=g))
        self.layers = nn.ModuleList(Layer(i, hidden, block_size, g) for i in range(num_layers))
        self.output_attn_res_norm = _weights(g, (hidden,), 1.0)
        self.output_attn_res_proj = _weights(g, (1, hidden), 0.0)
        self.to(dtype).requires_grad_(False)

    def _capture(self, k, prefix_sum, pending, bank):
        """vLLM's ``_capture_aux_hidden_stream`` (capture id k = layer_idx + 1)."""
        prefix = prefix_sum + pending if self.order == "prefix_first" else pending + prefix_sum
        if not self.flag:
            return prefix
        if k < self.end:
            consumer = self.layers[k]
            norm, proj = consumer.self_attention_res_norm, consumer.self_attention_res_proj
            num_blocks = consumer.prev_valid_blocks
        else:
            norm, proj = self.output_attn_res_norm, self.output_attn_res_proj
            num_blocks = self.num_attn_res_blocks
        return kimi.attn_res(prefix, None, bank, norm, proj.squeeze(0), None, num_blocks, -1,
                             EPS, 0.0)

    def forward(self, ids=None, hidden=None, bank_in=None):
        hidden_states = self.embed_tokens[ids] if hidden is None else hidden
        aux, marked = [], []
        if self.start == 0 and 0 in self.taps:
            aux.append(hidden_states)
        bank = hidden_states.new_empty(hidden_states.size(0), self.num_attn_res_blocks,
                                       hidden_states.size(1))
        if bank_in is not None:
            bank[:, :bank_in.size(1)].copy_(bank_in)
        prefix_sum, pending = hidden_states, None
        for i in range(self.start, self.end):
            pending, prefix_sum, bank = self.layers[i](pending, prefix_sum, bank)
            if i + 1 in self.taps:
                aux.append(self._capture(i + 1, prefix_sum, pending, bank))
            if i + 1 in self.markers:
                marked.append(kimi_passes.aux_tap(prefix_sum + pending, self.markers[i + 1]))
        if self.end < self.num_layers:  # a non-final stage: vLLM's IntermediateTensors
            return pending + prefix_sum, bank, aux
        out = kimi.attn_res(prefix_sum, pending, bank, self.output_attn_res_norm,
                            self.output_attn_res_proj.squeeze(0), None,
                            self.num_attn_res_blocks, -1, EPS, 0.0)
        return (out, aux, marked) if self.markers else (out, aux)
