"""Dynamic per-token FP8 quant fused into the AttnRes op that feeds it (``FuseQuantPass``).

- ``recognise``: the per-token quants vLLM writes (``QuantFP8``'s native form, the AMD
  kernel's formula, vLLM's CUDA op), found in a post-grad graph with their parameters;
- ``fuse``: the pass, an ``attn_res`` / ``attn_res_capture`` call whose output only a quant
  reads becomes ``attn_res_quant`` / ``attn_res_quant_capture``.
"""

from kimi_passes.quant.fuse import FuseQuantPass, QuantFusion
from kimi_passes.quant.recognise import QuantParams, QuantSite, find_quants

__all__ = ["FuseQuantPass", "QuantFusion", "QuantParams", "QuantSite", "find_quants"]
