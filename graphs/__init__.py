"""Model graphs the passes are tested on: a tiny Kimi K3 with Block AttnRes wiring."""

from .k3 import K3Config, K3Model, attn_res_torch, fp8_per_token

__all__ = ["K3Config", "K3Model", "attn_res_torch", "fp8_per_token"]
