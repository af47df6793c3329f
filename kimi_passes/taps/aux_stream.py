"""AuxStreamPass: every aux tap reads the pre-norm AttnRes mixture its consumer reads.

Invariant after the pass: no ``kimi.aux_tap`` node is left. In ``"attn_res"`` stream each
tap's users read the mixture its consumer (the AttnRes call that mixes against the tap's
value) computes before its output norm; in ``"prefix"`` stream, the tap's input. Unmarked
taps (``taps/capture.py``) are served the same way; markers and unmarked taps must agree.

Before (one K3 layer, capture id 3)::

    tap = kimi.aux_tap(add(prefix, pending), 3)
    af = auto_functionalized_v2(kimi.attn_res, delta=pending, ..., _all_bases=[prefix, bank])

After, fused (the consumer's kernel emits the mixture as a second output)::

    af = auto_functionalized_v2(kimi.attn_res_capture, delta=pending, ...)
    out, tap, prefix', bank' = af[0], af[1], af[2], af[3]

A consumer without an output norm returns the mixture itself (``af[0]``); with
``fuse=False`` the tap is a separate ``kimi.attn_res_mix`` read of the bank. What cannot
be served is refused with ``AuxCaptureError`` at compile time, never a silent fallback
(the texts: ``taps/messages.py``). The pass manager runs it after the fusion and before
the CPU lowering. docs/design.md section 4.
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass
from typing import cast

import torch
from torch.fx import Node

from kimi_passes.config.drafter import DrafterTaps
from kimi_passes.config.stream import STREAMS
from kimi_passes.errors import AuxCaptureError
from kimi_passes.fx.base import KimiGraphPass
from kimi_passes.fx.fx_toolkit import call_function, calls_to
from kimi_passes.fx.host_key import check_host_key
from kimi_passes.fx.kimi_calls import (
    AUX_TAP,
    AttnResCall,
    attn_res_calls,
    has_cpu_kimi_call,
    mix_nodes,
    tap_args,
)
from kimi_passes.ops.conventions import cdiv
from kimi_passes.taps import messages as msg
from kimi_passes.taps.capture import (
    Capture,
    find_captures,
    replace_returned,
)
from kimi_passes.taps.consumer import find_consumers
from kimi_passes.taps.served import DrafterCheck
from kimi_passes.taps.unrouted import check_unrouted

kimi = torch.ops.kimi


@dataclass(frozen=True)
class GraphEnd:
    """Why Dynamo ended the graph: ``reason`` and ``where`` for a graph break, else None."""

    reason: str | None = None
    where: str | None = None


@dataclass
class TapRewrite:
    """What the pass did for one tap (also what the compile log reports)."""

    #: None only for an unmarked capture in a graph that names no layer (``layers.N``).
    capture_id: int | None
    consumer: str
    stream: str
    #: attn_res stream: read out of the consumer's own kernel (no second read of the
    #: bank). None in prefix stream, where nothing is mixed.
    fused: bool | None
    #: "marker" (``kimi.aux_tap``), or an unmarked capture (``taps/capture.py``): a
    #: "returned value" or a "pure attn_res call" (vLLM's flag-on capture).
    source: str = "marker"

    def how(self) -> str:
        if self.fused is None:  # prefix stream: the value as the model computed it
            how = "as computed" if self.source == "pure attn_res call" else "running prefix"
        else:
            how = "fused" if self.fused else "separate attn_res_mix read"
        return how if self.source == "marker" else f"{how}; unmarked {self.source}"


class AuxStreamPass(KimiGraphPass):
    """Rewrite ``kimi.aux_tap`` markers to the stream a drafter was trained on."""

    def __init__(self, stream: str = "attn_res", fuse: bool = True,
                 drafter: DrafterTaps | None = None):
        if stream not in STREAMS:
            raise ValueError(msg.unknown_stream(stream, STREAMS))
        self.stream = stream
        self.fuse = fuse
        #: Rewrites made by the last call (for tests, tools and the main job).
        self.last_rewrites: list[TapRewrite] = []
        #: Set by a host that compiles the model in pieces (kimi_passes.vllm): the ops
        #: the graph was split at, so that a tap cut off from its consumer is blamed on
        #: the split rather than on a pipeline stage. Not an option: it changes messages only.
        self.split_ops: tuple[str, ...] | None = None
        #: Set by ``kimi_backend`` for each Dynamo graph: why the graph ends (a graph break's
        #: reason and place), so that a tap cut off from its consumer by a break is blamed on
        #: it. None: not known (the pass installed alone). Message only, like ``split_ops``.
        self.graph_end: GraphEnd | None = None
        self.drafter = drafter

    @property
    def drafter(self) -> DrafterTaps | None:
        """The drafter's declared capture ids (``drafter_capture_ids``), checked per graph."""
        return self._drafter

    @drafter.setter
    def drafter(self, drafter: DrafterTaps | None) -> None:
        self._drafter = drafter
        self._check = DrafterCheck(drafter) if drafter is not None else None

    def options(self) -> dict:
        # The declared ids are part of the key: a new drafter never reuses a graph checked
        # against another (speculators #996: ids that changed and silently did nothing).
        drafter = self.drafter.key_options() if self.drafter is not None else {}
        return {"stream": self.stream, "fuse": self.fuse, **drafter}

    def run(self, graph: torch.fx.Graph) -> list[str]:
        check_host_key(self)
        check_unrouted(graph, self.stream)  # vLLM's own K3 attn_res: no captures to find
        lines = self._rewrite_taps(graph)
        if not _warned_alone and _installed_alone(self) and has_cpu_kimi_call(graph):
            _warn_alone()
        return lines

    def _rewrite_taps(self, graph: torch.fx.Graph) -> list[str]:
        taps = calls_to(graph, AUX_TAP)
        self.last_rewrites = []
        calls = attn_res_calls(graph)
        if not taps and self._check is None and not calls:
            return []
        captures = find_captures(graph, calls) if calls else None
        found = captures.found if captures is not None else []
        # A pure call that reads a capture is no output aggregation of the stage.
        pure = {p.node for p in captures.pure} if captures is not None else set()
        geometry = _Geometry([c for c in calls if c.node not in pure], mix_nodes(graph))
        _check_unique_ids(taps, geometry)
        if captures is not None and captures.ambiguous and self.stream != "prefix":
            what, consumers = captures.ambiguous[0]
            raise AuxCaptureError(msg.ambiguous(what, [c.describe() for c in consumers],
                                                geometry.stage()))
        _check_markers_agree(graph, taps, found, geometry)
        if self._check is not None:
            ids = {tap_args(tap)[1] for tap in taps}
            ids |= {c.capture_id for c in found if c.capture_id is not None}
            self._check(sorted(ids), geometry)
        if not taps and not found:
            return []
        rewrites = [self._rewrite(graph, tap, geometry) for tap in taps]
        kept: list[str] = []
        rewrites += [self._serve(graph, capture, kept) for capture in found]
        if taps or self.stream != "prefix":  # unmarked taps alone in prefix: nothing changed
            graph.eliminate_dead_code()
        self.last_rewrites = rewrites
        separate = [msg.separate_read(r.capture_id) for r in rewrites if r.fused is False]
        return [msg.summary(self.stream, rewrites), *separate, *kept]

    def _rewrite(self, graph: torch.fx.Graph, tap: Node, geometry: _Geometry) -> TapRewrite:
        value, capture_id = tap_args(tap)
        # The prefix stream needs no consumer (a boundary tap, or no AttnRes op at all, is
        # served as is: the remedy the refusals name); one that is found is still checked.
        consumer = _find_consumer(graph, tap, geometry, required=self.stream != "prefix",
                                  split_ops=self.split_ops, graph_end=self.graph_end)
        if self.stream == "prefix":
            new, fused = value, None
        elif isinstance(consumer, Node):  # an attn_res_mix already reads it
            new, fused = consumer, True
        else:
            new, fused = self._mixture(graph, consumer)
        tap.replace_all_uses_with(new)
        graph.erase_node(tap)
        if consumer is None:
            where = "no consumer in this graph"
        else:
            where = consumer.describe() if isinstance(consumer, AttnResCall) else consumer.name
        return TapRewrite(capture_id, where, self.stream, fused)

    def _serve(self, graph: torch.fx.Graph, capture: Capture, kept: list[str]) -> TapRewrite:
        """Serve an unmarked capture its stream's value (``taps/capture.py``)."""
        call, pure = capture.consumer, capture.pure
        rewrite = TapRewrite(capture.capture_id, call.describe(), self.stream,
                             None if self.stream == "prefix" else True, capture.source)
        if self.stream == "prefix":  # every value stays as computed, pure calls included
            return rewrite
        if pure is not None and not self.fuse:  # already a separate read of the bank
            rewrite.fused = False
            return rewrite
        if pure is None and call.arg("num_blocks") == 0:
            return rewrite  # a mixture over zero blocks is its prefix: the value itself
        mixture, rewrite.fused = self._mixture(graph, call)
        for path, chain in capture.slots:
            replace_returned(graph, path, _views_of(graph, mixture, chain))
            _erase_unused(graph, chain)
        if pure is not None and not _drop_pure(graph, pure):
            kept.append(msg.pure_call_kept(capture.capture_id, pure.node.name))
        return rewrite

    def _mixture(self, graph: torch.fx.Graph, call: AttnResCall) -> tuple[Node, bool]:
        """A node holding ``call``'s pre-norm mixture, and whether it came fused."""
        if call.op is kimi.attn_res_capture.default:
            return call.getitem(1), True
        if not call.has_output_norm and self.fuse:
            return call.getitem(0), True
        if self.fuse:
            return _to_capture(graph, call).getitem(1), True
        prefix = call.getitem(call.output_index("prefix"))
        blocks = call.getitem(call.output_index("blocks"))
        mix = call_function(
            graph, kimi.attn_res_mix.default,
            (prefix, blocks, call.arg("norm_weight"), call.arg("qk_weight"),
             call.arg("num_blocks"), call.arg("eps")),
            after=max(prefix, blocks), stands_for=call.node,  # the later (graph order)
        )
        return mix, False


#: Whether ``_warn_alone`` has warned (once per process).
_warned_alone = False


def _installed_alone(pass_: AuxStreamPass) -> bool:
    """Is ``pass_`` itself Inductor's ``post_grad_custom_post_pass`` (not run by a manager)?"""
    host = torch._inductor.config.post_grad_custom_post_pass
    return host is pass_ or (isinstance(host, (list, tuple)) and any(h is pass_ for h in host))


def _warn_alone() -> None:
    """The pass alone rewrites taps only: on CPU the kimi calls stay op calls."""
    global _warned_alone
    _warned_alone = True
    warnings.warn(msg.installed_alone(), UserWarning, stacklevel=2)


def _views_of(graph: torch.fx.Graph, value: Node, chain: list[Node]) -> Node:
    """``chain`` (views/copies, top first, of some value) redone on ``value``."""
    for node in reversed(chain):
        value = call_function(graph, node.target, (value, *node.args[1:]), node.kwargs,
                              after=value, stands_for=node)
    return value


def _erase_unused(graph: torch.fx.Graph, chain: list[Node]) -> None:
    for node in chain:  # top first: each erased node frees the one below it
        if not node.users:
            graph.erase_node(node)


def _drop_pure(graph: torch.fx.Graph, pure: AttnResCall) -> bool:
    """Erase a pure mixing call whose mixture nobody reads any more; False if read.

    Its other outputs (the prefix and bank, unchanged: no delta, no block write) are
    replaced by the values it was given.
    """
    outputs = [u for u in pure.node.users if u.target is operator.getitem]
    if any(u.users for u in outputs if cast(int, u.args[1]) < pure.num_returns):
        return False
    for name in ("prefix", "blocks"):
        for u in outputs:
            if u.args[1] == pure.output_index(name):
                u.replace_all_uses_with(pure.base(name))
    for u in outputs:
        graph.erase_node(u)
    graph.erase_node(pure.node)
    return True


def _check_markers_agree(graph: torch.fx.Graph, taps: list[Node], found: list[Capture],
                         geometry: _Geometry) -> None:
    """Markers and unmarked captures of one graph must name the same ids for one consumer."""
    if not taps or not found:
        return
    by_call: dict[Node, tuple[int, Node]] = {}
    by_id: dict[int, tuple[Node, list]] = {}
    for tap in taps:
        value, k = tap_args(tap)
        consumers = find_consumers(graph, value, geometry.calls, geometry.mixes)
        by_id[k] = (tap, consumers)
        for c in consumers:
            if isinstance(c, AttnResCall):
                by_call[c.node] = (k, tap)
    for capture in found:
        marked = by_call.get(capture.consumer.node)
        if marked is not None and marked[0] != capture.capture_id:
            raise AuxCaptureError(_contradiction(marked[1], marked[0], capture, geometry))
        if capture.capture_id in by_id:
            tap, consumers = by_id[capture.capture_id]
            calls = [c.node for c in consumers if isinstance(c, AttnResCall)]
            if calls and capture.consumer.node not in calls:
                raise AuxCaptureError(_contradiction(tap, capture.capture_id, capture, geometry))


def _contradiction(tap: Node, k: int, capture: Capture, geometry: _Geometry) -> str:
    return msg.contradiction(tap.name, k, capture.describe(), capture.capture_id,
                             geometry.stage())


def _to_capture(graph: torch.fx.Graph, call: AttnResCall) -> AttnResCall:
    """Swap ``call`` for ``kimi.attn_res_capture``, keeping every reader of its outputs."""
    old = call.node
    # v1 and v2 both return (op outputs..., new values of the mutated bases): the op's
    # kwargs carry over as they are (attn_res_capture takes attn_res's arguments) and
    # every output after the first moves one place for the extra mixture output.
    new = call_function(graph, old.target, (kimi.attn_res_capture.default,), old.kwargs,
                        before=old, stands_for=old)
    for user in list(old.users):
        index = cast(int, user.args[1])
        user.args = (new, index if index == 0 else index + 1)
    graph.erase_node(old)
    call.node = new  # in place: the geometry's list of calls stays current
    return call


class _Geometry:
    """What the graph says about the stage: its layers and the block size S."""

    def __init__(self, calls: list[AttnResCall], mixes: list[Node]):
        self.calls, self.mixes = calls, mixes
        self.has_attn_res = bool(calls) or bool(mixes)
        # The first AttnRes call of each layer is its pre-attention mixing.
        self._first: dict[int | None, AttnResCall] = {}
        for c in calls:
            self._first.setdefault(c.layer, c)
        layers = sorted({c.layer for c in calls if c.layer is not None})
        self.first_layer = layers[0] if layers else None
        self.last_layer = layers[-1] if layers else None
        self.has_output_aggregation = any(c.layer is None for c in calls)
        # S from a block write past slot 0: layer i writes slot i // S.
        self.block_size = None
        for c in calls:
            w = c.arg("block_write_idx")
            if c.layer is not None and w is not None and w > 0 and c.layer % w == 0:
                self.block_size = c.layer // w
                break

    def stage(self) -> str:
        if self.first_layer is None or self.last_layer is None:
            return "a graph whose AttnRes calls carry no layer index"
        end = self.last_layer + 1
        kind = "final stage" if self.has_output_aggregation else "non-final stage"
        return f"pipeline {kind} owning layers [{self.first_layer}, {end})"

    def pre_attention(self, call: AttnResCall) -> bool:
        """Is ``call`` the first AttnRes call of its layer (the pre-attention mixing)?"""
        return self._first.get(call.layer) is call


def _check_unique_ids(taps: list[Node], geometry: _Geometry) -> None:
    seen: dict[int, Node] = {}
    for tap in taps:
        k = tap_args(tap)[1]
        if k in seen:
            raise AuxCaptureError(msg.duplicate_id(k, seen[k].name, tap.name, geometry.stage()))
        seen[k] = tap


def _find_consumer(graph: torch.fx.Graph, tap: Node, geometry: _Geometry, required=True,
                   split_ops=None, graph_end: GraphEnd | None = None):
    value, k = tap_args(tap)
    found = find_consumers(graph, value, geometry.calls, geometry.mixes)
    if not required and (not geometry.has_attn_res or not found):
        return None
    if not found and split_ops is not None:
        _refuse_split(k, split_ops, geometry)
    broke = graph_end is not None and graph_end.reason is not None
    if not found and (broke or not geometry.has_attn_res and _passes_through(tap)):
        known = graph_end if graph_end is not None else GraphEnd()
        raise AuxCaptureError(msg.graph_break(k, known.reason, known.where))
    # Without the graph's end from Dynamo (the pass installed alone), a break is possible.
    maybe_break = "" if graph_end is not None else msg.MAYBE_BREAK
    if not geometry.has_attn_res:
        raise AuxCaptureError(msg.no_attn_res(k, maybe_break))
    if not found:
        end = geometry.last_layer + 1 if geometry.last_layer is not None else "?"
        raise AuxCaptureError(msg.next_stage(k, geometry.stage(), end, maybe_break))
    if len(found) > 1:
        names = [f.describe() if isinstance(f, AttnResCall) else f.name for f in found]
        raise AuxCaptureError(msg.many_consumers(k, names, geometry.stage()))
    consumer = found[0]
    if isinstance(consumer, AttnResCall):
        _check_consumer(k, consumer, geometry)
    return consumer


def _passes_through(tap: Node) -> bool:
    """Does the graph only hand the tap on (nothing in it reads the tapped value)?

    What Dynamo compiles when a graph break in the caller cut the model between the tap
    and its consumer: a graph holding the marker alone. A model that truly has no AttnRes
    op reads the tapped value in its next layer.
    """
    value = tap_args(tap)[0]
    readers = [u for u in value.users if u is not tap] if isinstance(value, Node) else []
    return all(u.op == "output" for u in [*tap.users, *readers])


def _check_consumer(k: int, call: AttnResCall, geometry: _Geometry) -> None:
    nb = call.arg("num_blocks")
    where = geometry.stage()
    if call.layer is not None and (call.layer != k or not geometry.pre_attention(call)):
        role = "pre-attention" if geometry.pre_attention(call) else "pre-MLP"
        raise AuxCaptureError(msg.wrong_layer(k, call.layer, role, where))
    if call.layer is None and geometry.last_layer is not None and k != geometry.last_layer + 1:
        raise AuxCaptureError(msg.wrong_aggregation_id(k, where, geometry.last_layer + 1))
    S = geometry.block_size
    if S is not None and nb != cdiv(k, S):
        raise AuxCaptureError(msg.wrong_num_blocks(k, call.describe(), where, S, cdiv(k, S), nb))


def _refuse_split(k: int, split_ops: tuple[str, ...], geometry: _Geometry) -> None:
    """No consumer in one piece of a graph split at ``split_ops`` (vLLM piecewise)."""
    kimi_ops = [op for op in split_ops if op.split(".")[0].startswith("kimi::")]
    if kimi_ops:
        raise AuxCaptureError(msg.split_at_kimi_ops(k, split_ops, kimi_ops))
    if geometry.first_layer is not None and geometry.last_layer is not None:
        holds = f"AttnRes calls of layers [{geometry.first_layer}, {geometry.last_layer + 1})"
    else:
        holds = "AttnRes calls" if geometry.has_attn_res else "no AttnRes op"
    raise AuxCaptureError(msg.split_piece(k, holds, split_ops))
