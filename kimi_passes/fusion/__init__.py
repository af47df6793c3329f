"""AttnRes mixing written in plain torch becomes one kimi op (``AttnResFusionPass``).

- ``attn_res_fusion``: the pass and the candidate search over softmaxes;
- recognising a mixture: ``values`` (abstract values and sizes), ``axes`` (how views move
  the named axes), ``state`` (one candidate's evaluation state and the checks the rules
  share), ``rules`` (op -> rule), ``evaluator`` (the driver), ``sources`` (splitting the
  stacked root into its sources);
- ``rewrite``: emitting ``kimi.attn_res_mix`` / ``attn_res_mix_list`` in place of a site;
- ``grad_anchor``: inputs a fused site stops reading keep a (zero) gradient.
"""

from kimi_passes.fusion.attn_res_fusion import (
    DEBUG_ENV,
    AttnResFusionPass,
    FusedSite,
    NearMiss,
    NoMatch,
    debug_enabled,
)

__all__ = ["DEBUG_ENV", "AttnResFusionPass", "FusedSite", "NearMiss", "NoMatch", "debug_enabled"]
