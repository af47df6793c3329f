"""What a tap reads: the model-side marker and the aux-stream rewrite.

- ``marker``: ``aux_tap(x, capture_id)``, the marker model code puts on a tap;
- ``stream``: which stream a compile serves (argument, environment, drafter config);
- ``drafter``: which capture ids a drafter config declares, in every shipped spelling;
- ``served``: the per-graph check that a graph taps exactly the declared ids it owns;
- ``consumer``: the AttnRes calls of a post-grad graph, and which one reads a tap's value;
- ``aux_stream``: ``AuxStreamPass``, which rewrites every marker to its stream's value or
  refuses at compile time (docs/design.md section 4).
"""

from kimi_passes.taps.aux_stream import AuxStreamPass, TapRewrite
from kimi_passes.taps.drafter import DrafterTaps, drafter_capture_ids
from kimi_passes.taps.marker import aux_tap
from kimi_passes.taps.stream import STREAMS, resolve_aux_stream

__all__ = ["STREAMS", "AuxStreamPass", "DrafterTaps", "TapRewrite", "aux_tap",
           "drafter_capture_ids", "resolve_aux_stream"]
