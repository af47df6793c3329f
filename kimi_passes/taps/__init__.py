"""What a tap reads: the model-side marker and the aux-stream rewrite.

- ``marker``: ``aux_tap(x, capture_id)``, the marker model code puts on a tap;
- ``served``: the per-graph check that a graph taps exactly the declared ids it owns;
- ``consumer``: which AttnRes call of a post-grad graph reads a tap's value;
- ``capture``: which returned values are taps with no marker (vLLM's K3 forward);
- ``unrouted``: vLLM's own K3 ``attn_res`` (not routed to ``kimi::attn_res``) refused under
  the attn_res stream;
- ``aux_stream``: ``AuxStreamPass``, which rewrites every marker to its stream's value or
  refuses at compile time (docs/design.md section 4).

Which stream and which drafter ids a compile serves is ``kimi_passes.config``'s; the names
are also exported here.
"""

from kimi_passes.config.drafter import DrafterTaps, drafter_capture_ids
from kimi_passes.config.stream import STREAMS, resolve_aux_stream
from kimi_passes.taps.aux_stream import AuxStreamPass, TapRewrite
from kimi_passes.taps.marker import aux_tap

__all__ = ["STREAMS", "AuxStreamPass", "DrafterTaps", "TapRewrite", "aux_tap",
           "drafter_capture_ids", "resolve_aux_stream"]
