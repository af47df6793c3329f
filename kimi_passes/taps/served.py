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

from kimi_passes.config.drafter import PLUS_ONE, DrafterTaps
from kimi_passes.errors import AuxCaptureError


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
            raise AuxCaptureError(self._message(missing, earlier, extra, here, exempt, geometry))
        if num_layers is not None:
            beyond = sorted(k for k in self.declared if k > num_layers)
            if beyond:
                raise AuxCaptureError(
                    f"the drafter declares capture ids {beyond} ({self.drafter.describe()}) "
                    f"but the model has num_layers={num_layers} (the {geometry.stage()}): "
                    f"capture ids run from 0 (the embedding) to {num_layers} (what the final "
                    "norm reads). The drafter was trained on another target model: serve it "
                    "with that model, or use a drafter trained on this one")
        self.served |= here

    def _message(self, missing, earlier, extra, here, exempt, geometry) -> str:
        d = self.drafter
        parts = []
        if missing:
            parts.append(f"declared but not tapped: {missing} (this graph holds the AttnRes "
                         "call that reads each of them)")
        if earlier:
            parts.append(f"declared but not tapped: {earlier} (read by the graph compiled "
                         "just before this one, which did not tap it)")
        if extra:
            parts.append(f"tapped but not declared: {extra}")
        hint = _shift_hint(d, missing, sorted(here - exempt))
        final = (f" ({d.format} drafters take capture id num_layers separately: a tap there "
                 "need not be declared.)") if d.final_state_separate else ""
        return (
            f"the compiled graph does not serve the drafter's inputs: the drafter declares "
            f"capture ids {list(d.capture_ids)} ({d.describe()}); this graph "
            f"({_holds(geometry)}) taps {sorted(here)}: " + "; ".join(parts) + "." + hint +
            final + " A drafter fed other layers than it was trained on runs and silently "
            "loses acceptance. Remedy: give the model the drafter's capture ids as its aux "
            "layer ids (vLLM sets them from the drafter config), or serve the drafter trained "
            "on this model's taps")


def _holds(geometry) -> str:
    """What a graph holds, in words (a whole stage, a piece of a split, a fragment)."""
    if geometry.first_layer is None:
        return ("the output aggregation" if geometry.has_output_aggregation
                else "no AttnRes call with a layer index")
    span = (f"layer {geometry.first_layer}" if geometry.first_layer == geometry.last_layer
            else f"layers {geometry.first_layer} to {geometry.last_layer}")
    tail = " and the output aggregation" if geometry.has_output_aggregation else ""
    return f"AttnRes calls of {span}{tail}"


def _shift_hint(d: DrafterTaps, missing: list[int], taps: list[int]) -> str:
    """Name an off-by-one: the graph's taps are the declared ids shifted by one."""
    if not missing:
        return ""
    for shift in (-1, 1):
        shifted = sorted(k + shift for k in d.capture_ids)
        if taps and all(k in shifted for k in taps) and sorted(taps) != sorted(d.capture_ids):
            if shift == 1:
                why = "the model was given capture ids + 1: a layer id list converted twice"
            elif d.convention == PLUS_ONE:
                why = (f"{d.key} holds layer ids, capture id = layer id + 1, and the model "
                       "was given the layer ids as capture ids")
            else:
                why = ("the model was given layer ids (capture id - 1) where the drafter "
                       "names capture ids")
            return f" The taps are the declared ids {shift:+d}: off by one ({why})."
    return ""
