"""What a compile is asked to do, resolved before any graph is seen (no torch, no passes).

- ``checkpoint``: a drafter checkpoint's config.json, read where it ships, and the aux stream
  it declares;
- ``stream``: which aux stream is served, one rule for every route (argument, variables,
  the drafter's declaration, the A/B switch);
- ``drafter``: which capture ids a drafter config declares, in every shipped spelling;
- ``pass_config``: ``KimiPassConfig``, every option of the kimi passes as one frozen record.
"""

from kimi_passes.config.drafter import DrafterTaps, drafter_capture_ids
from kimi_passes.config.pass_config import OPTIONS, KimiPassConfig
from kimi_passes.config.stream import ENV_VAR, STREAMS, resolve_aux_stream

__all__ = ["ENV_VAR", "OPTIONS", "STREAMS", "DrafterTaps", "KimiPassConfig",
           "drafter_capture_ids", "resolve_aux_stream"]
