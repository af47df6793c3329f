"""``DrafterCheck``: a compiled graph taps exactly the capture ids its drafter declares.

Invariant, per graph the aux-stream pass rewrites (raised as ``AuxCaptureError`` before
any rewrite): every tap's capture id is declared (capture id ``num_layers`` excepted for
formats that hand the drafter the final state separately), every declared id whose
consumer this graph holds is tapped, and on the graph holding the output aggregation no
declared id exceeds ``num_layers``.

Which declared ids a graph must tap: capture id k is read by layer k's first AttnRes call
(its pre-attention mixing), so a graph owns k when it holds that call. A graph is a
contiguous stretch of the forward (a whole model, a pipeline stage, one piece of vLLM's
split at attention, or one side of a graph break), so it holds layer k's first call when
it also holds an earlier call (k is inside its layer range), or both of layer k's calls,
and it owns ``num_layers`` when it holds the output aggregation. Left: the first layer of
a graph holding only one of its calls (the first piece of a split stage). The check keeps
that id pending and settles it when the next graph shows the layer's other call: the
pass sees graphs in execution order (Dynamo and vLLM compile them so), and the earlier
graph then held the pre-attention call. A graph served from Inductor's cache is not seen;
the declared ids are in the pass's cache key, so a cached graph passed this check.
"""

from __future__ import annotations

from collections import Counter

from kimi_passes.config.drafter import DrafterTaps
from kimi_passes.errors import AuxCaptureError
from kimi_passes.taps import messages as msg


class DrafterCheck:
    """Per-graph check of the taps against ``drafter``; holds what crosses graphs."""

    def __init__(self, drafter: DrafterTaps):
        self.drafter = drafter
        self.declared = set(drafter.capture_ids)
        #: Capture ids tapped in a graph this check has seen.
        self.served: set[int] = set()
        #: Declared ids whose pre-attention call may have been in an earlier graph, untapped.
        self.pending: set[int] = set()

    def __call__(self, tapped: list[int], geometry) -> None:
        layers = Counter(c.layer for c in geometry.calls if c.layer is not None)
        first, last = geometry.first_layer, geometry.last_layer
        num_layers = last + 1 if geometry.has_output_aggregation and last is not None else None
        owned: set[int] = set()
        if first is not None:
            owned |= set(range(first + 1, last + 1))
            if layers[first] >= 2:
                owned.add(first)
        if num_layers is not None:
            owned.add(num_layers)
        here = set(tapped)
        missing = sorted((self.declared & owned) - here)
        earlier = []  # declared, read in the graph compiled before this one, not tapped there
        if first is not None and layers[first] == 1 and first not in here:
            if first in self.pending:  # the earlier graph held its pre-attention call
                self.pending.discard(first)
                if first not in self.served:
                    earlier = [first]
            elif first in self.declared:
                self.pending.add(first)
        exempt = {num_layers} if self.drafter.final_state_separate else set()
        extra = sorted(here - self.declared - exempt)
        if missing or extra or earlier:
            holds = msg.graph_holds(first, last, geometry.has_output_aggregation)
            raise AuxCaptureError(msg.not_served(self.drafter, missing, earlier, extra, here,
                                                 exempt, holds))
        if num_layers is not None:
            beyond = sorted(k for k in self.declared if k > num_layers)
            if beyond:
                raise AuxCaptureError(msg.beyond_num_layers(self.drafter, beyond, num_layers,
                                                            geometry.stage()))
        self.served |= here
