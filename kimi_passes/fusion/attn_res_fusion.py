"""AttnResFusionPass: AttnRes mixing written in plain torch becomes one kimi op.

Invariant: every recognised mixing site (sources stacked or concatenated, RMSNorm keys, a
dot with one pseudo-query, softmax over the source axis, weighted sum of the raw sources)
is one ``kimi.attn_res_mix`` or ``kimi.attn_res_mix_list`` call, at least as accurate as
the replaced nodes (fp32 accumulation), in the replaced node's dtype; every other softmax
is left as it was, with the failed check recorded (``last_misses``).

Before and after, for a site over ``bank[:, :k]`` and a prefix::

    v = cat([bank[:, :k], prefix[:, None]], 1)         # [T, k+1, H]
    r = rsqrt(mean(v * v, -1, keepdim) + eps)
    logit = (v * r * norm_w) @ qk_w                      # or einsum / mul+sum / Linear(H, 1)
    out = sum(softmax(logit, 1)[..., None] * v, 1)       # or bmm / einsum
  ->
    out = kimi.attn_res_mix(prefix, bank, norm_w, qk_w, k, eps)

How: each softmax is a candidate; the tensor its weighted sum combines it with is a
candidate root, whose nodes ``evaluator`` evaluates symbolically (``rules``, ``axes``,
``values``); ``sources`` splits the root into sources, ``rewrite`` emits the op and
``grad_anchor`` keeps inputs' gradients in training graphs. Sources that are not
``bank[:, :k]`` plus one prefix in one dtype become ``attn_res_mix_list``. With
``KIMI_PASSES_FUSION_DEBUG=1`` each softmax left alone is logged with its reason.
Algorithm, refusals and costs: docs/design.md section 8.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import cast

import torch
from torch.fx import Graph, Node

from kimi_passes.fusion.axes import VIEWS
from kimi_passes.fusion.evaluator import MixtureEvaluator
from kimi_passes.fusion.grad_anchor import keep_gradients, leaf_inputs
from kimi_passes.fusion.rewrite import FusedSite, MixtureMatch, rewrite, with_replacements
from kimi_passes.fusion.rules import SOFTMAX_OPS
from kimi_passes.fusion.sources import split_sources
from kimi_passes.fusion.values import MixtureValue, NoMatch
from kimi_passes.fx.base import KimiGraphPass, logger
from kimi_passes.fx.fx_toolkit import CASTS, calls_to
from kimi_passes.fx.kimi_calls import AUX_TAP

aten = torch.ops.aten

DEBUG_ENV = "KIMI_PASSES_FUSION_DEBUG"

# The ops that combine the probabilities with the values (the weighted sum).
_COMBINE = {aten.mul.Tensor, aten.bmm.default, aten.mm.default}


@dataclass
class NearMiss:
    """A softmax that was not fused, and why (one reason per root tried)."""

    softmax: str
    reasons: list = field(default_factory=list)

    def __str__(self) -> str:
        return f"softmax {self.softmax} not fused: " + "; ".join(self.reasons)


def debug_enabled() -> bool:
    flag = os.environ.get(DEBUG_ENV, "")
    return flag not in ("", "0", "false", "False") or bool(
        os.environ.get("TORCHINDUCTOR_PATTERN_MATCH_DEBUG"))


class AttnResFusionPass(KimiGraphPass):
    """Replace plain-torch AttnRes mixing with ``kimi.attn_res_mix`` / ``attn_res_mix_list``."""

    def __init__(self, debug: bool | None = None, differentiable: bool = False):
        #: None: follow $KIMI_PASSES_FUSION_DEBUG / $TORCHINDUCTOR_PATTERN_MATCH_DEBUG.
        #: Only changes logging, never the graph: not part of the cache key.
        self.debug = debug
        #: The graph will be differentiated by AOTAutograd (``pre_autograd``): emit casts
        #: with autograd formulas and keep the gradient of inputs a site stops reading.
        self.differentiable = differentiable
        #: Sites fused by the last call, what they became, and the softmaxes left alone.
        self.last_fused = 0
        self.last_sites: list[FusedSite] = []
        self.last_misses: list[NearMiss] = []

    def options(self) -> dict:
        return {"differentiable": self.differentiable}

    def run(self, graph: Graph) -> list[str]:
        self.last_fused, self.last_sites, self.last_misses = 0, [], []
        softmaxes = _softmax_nodes(graph)
        if not softmaxes:
            return []
        matches: list[MixtureMatch] = []
        taken: set[Node] = set()
        for s in softmaxes:
            try:
                m = _match(s)
            except NoMatch as e:
                self.last_misses.append(NearMiss(s.name, [str(e)]))
                continue
            if isinstance(m, NearMiss):
                self.last_misses.append(m)
            elif m.out not in taken:
                taken.add(m.out)
                matches.append(m)
        tapped = [n.args[0] for n in calls_to(graph, AUX_TAP)]
        anchors: list[tuple[Node, set[Node]]] = []
        replaced: dict[Node, Node] = {}
        mutating = _mutating_nodes(graph) if matches else []
        for m in matches:
            mutation = next((x for x in mutating if m.root < x < m.out), None)
            if mutation is not None:
                self.last_misses.append(NearMiss(m.softmax.name, [
                    f"{mutation.name} ({mutation.target}) mutates a tensor between the "
                    f"stacked sources {m.root.name} and the weighted sum {m.out.name}: the "
                    "fused op, reading at the weighted sum, could see other values"]))
                continue
            leaves = leaf_inputs(m.region) if self.differentiable else set()
            # A site whose source is an earlier site's mixture reads that site's kimi op.
            m = with_replacements(m, replaced)
            try:
                done = rewrite(graph, m, tapped, self.differentiable)
            except NoMatch as e:
                self.last_misses.append(NearMiss(m.softmax.name, [f"rewrite: {e}"]))
                continue
            replaced[done.old] = done.new
            self.last_sites.append(done.site)
            if leaves:
                anchors.append((done.fused, leaves))
        self.last_fused = len(self.last_sites)
        if self.last_fused:
            graph.eliminate_dead_code()
            if self.differentiable:
                keep_gradients(graph, anchors)
        lines = [f"AttnResFusionPass: fused {self.last_fused} AttnRes mixing site(s)" + (
            (": " + "; ".join(str(s) for s in self.last_sites)) if self.last_sites else "")]
        if self.debug if self.debug is not None else debug_enabled():
            lines += [f"AttnResFusionPass: {miss}" for miss in self.last_misses]
        return lines


# -- finding candidates ---------------------------------------------------------------------


def _softmax_nodes(graph: Graph) -> list[Node]:
    """``aten._softmax`` (and spellings), or ``div(exp(x), sum(exp(x), d))``, in graph order."""
    decomposed = [
        n for n in calls_to(graph, aten.div.Tensor)
        if len(n.args) == 2 and isinstance(n.args[0], Node) and isinstance(n.args[1], Node)
        and n.args[0].target is aten.exp.default
        and n.args[1].target is aten.sum.dim_IntList and n.args[1].args[0] is n.args[0]]
    return sorted(calls_to(graph, *SOFTMAX_OPS) + decomposed)  # nodes compare in graph order


def _mutating_nodes(graph: Graph) -> list[Node]:
    """Calls of mutating ATen ops, in graph order. Post-grad graphs have none inside their
    mixing sites (functional); a graph traced for training may have some."""
    return [n for n in graph.nodes if n.op == "call_function" and isinstance(
        n.target, torch._ops.OpOverload) and n.target._schema.is_mutable]


def _is_pass_through(n: Node) -> bool:
    return n.op == "call_function" and (n.target in VIEWS or n.target in CASTS)


def _combiners(p: Node) -> list[tuple[Node, Node]]:
    """(combining node, the operand on the probability side) reached through views."""
    found, stack, seen = [], [p], set()
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if _is_pass_through(u):
                stack.append(u)
            elif u.op == "call_function" and u.target in _COMBINE:
                found.append((u, n))
    return found


def _roots(w: Node, prob_side: Node) -> list[Node]:
    """Candidate roots: the other operand of ``w`` and what it views/casts, deepest first."""
    others = [a for a in w.args[:2] if isinstance(a, Node) and a is not prob_side]
    if not others:
        return []
    chain, n = [], others[0]
    while True:
        chain.append(n)
        if not _is_pass_through(n) or not isinstance(n.args[0], Node):
            break
        n = n.args[0]
    return chain[::-1]


def _match(softmax: Node) -> MixtureMatch | NearMiss:
    """The first candidate root over which ``softmax`` is an AttnRes mixture, or why none."""
    combiners = _combiners(softmax)
    if not combiners:
        raise NoMatch("its output reaches no mul/bmm/mm (no weighted sum)")
    miss = NearMiss(softmax.name)
    for w, prob_side in combiners:
        roots = _roots(w, prob_side)
        for root in roots:
            try:
                ev = MixtureEvaluator(root, softmax, w)
                out, val = ev.run()
                source_dim = None if ev.source_axis == () else next(
                    i for i, d in enumerate(ev.values[root].dims) if d == ev.source_axis)
                sources = split_sources(root, source_dim)
            except NoMatch as e:
                miss.reasons.append(f"[{w.name} over root {root.name}] {e}")
                continue
            except Exception as e:  # a matcher bug must not fail the compile: say so, loudly
                logger.warning("AttnResFusionPass: matcher error on softmax %s over root %s "
                               "(site left unfused): %r", softmax.name, root.name, e)
                miss.reasons.append(f"[{w.name} over root {root.name}] matcher error: {e!r}")
                continue
            # A run that returns found the logits, with their eps (check_logits).
            lg = cast(MixtureValue, ev.logits)
            eps = cast(float, lg.rsqrt_eps)
            return MixtureMatch(softmax, root, out, val.dims, ev.axes, source_dim, eps,
                                lg.weights, lg.coefficient, ev.sizes, sources,
                                tuple(ev.values))
        if not roots:
            miss.reasons.append(f"[{w.name}] no other operand")
    return miss


__all__ = ["AttnResFusionPass", "FusedSite", "NearMiss", "NoMatch", "debug_enabled"]
