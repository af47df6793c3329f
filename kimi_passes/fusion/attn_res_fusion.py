"""AttnResFusionPass: AttnRes mixing written in plain torch becomes one kimi op.

A model that states Block AttnRes in plain PyTorch (``torch.stack``/``torch.cat`` the
sources, RMSNorm the keys, dot with a pseudo-query, softmax over depth, weighted sum
of the raw sources) makes Inductor materialise the stacked copy of every source and
run half a dozen kernels per mixing site. This post-grad pass finds those sites and
replaces each with ``kimi.attn_res_mix`` (sources ``bank[:, :k]`` then a ``[T, H]``
prefix) or ``kimi.attn_res_mix_list`` (any list of sources), which read each source in
place. The aux-stream pass then finds ``attn_res_mix`` consumers of aux taps as usual.

Where the parts live: this module holds the pass and the candidate search (steps 1-2
below); ``evaluator`` (with ``state``, ``rules``, ``axes`` and ``values``) recognises a
plain-torch mixture (step 3); ``sources`` splits the stacked root into its sources (step
4); ``rewrite`` emits the kimi op; ``grad_anchor`` keeps inputs' gradients in training.

Why a hand-written evaluator and not Inductor's pattern matcher
(``register_replacement`` / ``PatternMatcherPass``): a replacement pattern is one traced
graph, matched by op structure only. ``gen_pattern`` makes every int and float argument,
and every list of them, a wildcard (view sizes, reduction and softmax dims, permute
orders, eps, a 1/H literal), while a traced ``cat`` keeps the fixed-length list of
sources it was traced with. So each spelling of a site needs its own traced pattern, and
what makes it an AttnRes mixture would still be checked in an ``extra_check`` per
pattern: the reductions run over the hidden axis and the softmax over the source axis,
the views and permutes carry those axes through, the sum of squares is the mean, the
weighted sum reads the exact sources the keys came from. The spellings multiply: the
fuzz's generator (tests/fusion_programs.py) alone draws 5 gathers (stack or cat on two
layouts, a bank slice and a prefix) x 4 norms x 3 weight placements x 5 query dots x 4
softmaxes x 2 temperatures x 3 key casts x 2 probability dtypes x 4 weighted sums, about
6 x 10^4 combinations per source count, before the spellings it does not draw (``mv`` in
training graphs, ``sum * (1/H)``, a cast of the output). Lowering folds many of them
into one post-grad graph (stack and cat, einsum and matmul), but by a rough count
thousands of patterns remain, times each source count, times the training (joint)
graphs. Tracing one AttnRes site costs about 70 ms with ``fwd_only`` and 280 ms with
``joint_fwd_bwd`` (measured on the CPU dev box): a thousand patterns is over a minute at
first compile, unless they are generated and checked in for each torch release the way
Inductor ships its 30 SDPA spellings (x training/inference x fp32/half) pre-serialized
in ``torch/_inductor/fx_passes/serialized_patterns``; and no pattern says "any number of
sources" or "the source axis anywhere". The hand-written evaluator costs one walk per
softmax and candidate root over the nodes between the stacked sources and the weighted
sum (the whole pass takes about 26 ms on the tiny K3 graph: 620 nodes, 9 sites), covers
any source count and axis layout with one set of rules, and says why a softmax was not
fused. Its price: about 1,700 lines in ``kimi_passes/fusion`` to maintain (an op a new
torch release decomposes differently must be taught to ``rules.HANDLERS``), and
soundness that is ours to show, hence the random-program fuzz against plain Inductor,
near misses included (tests/fusion_programs.py and
tests/test_fusion_vs_inductor_fuzz.py, about 700 lines), on top of the goldens.

How a site is recognised:

1. Every softmax is a candidate: ``aten._softmax`` or its decomposition
   ``div(exp(sub(x, amax(x, d))), sum(exp(..), d))`` (the stabilising ``amax`` is optional).
2. Its output is followed through views and casts to the ``mul``/``bmm``/``mm`` that
   combines it with another tensor (the weighted sum). That tensor is followed back
   through views and casts; each tensor on the way is a candidate *root* ``R``: the
   stacked sources.
3. The nodes between ``R`` and the weighted sum are evaluated symbolically, in graph
   order. Each axis of ``R`` gets a name (size-1 axes are dropped); views, permutes,
   squeezes and casts move the names around, and every op must map one abstract value
   to another: raw sources ``V``, ``V^2``, its mean over the hidden axis (the last axis
   of ``R``), ``+ eps``, ``rsqrt``, products of these with weight vectors that vary only
   along the hidden axis, the contraction over the hidden axis (mul+sum, ``bmm``,
   ``mm``, ``addmm`` of ``Linear(H, 1)``), softmax over one named axis (the source axis
   ``n``), and the product of the probabilities with the *exact* raw sources summed over
   ``n``. Any other op, an axis mismatch, a second softmax, or a rounded copy of the
   values in the weighted sum rejects the candidate, with the reason recorded.
4. ``R`` is split into its sources along ``n``: the pieces of a ``cat`` (a
   ``bank[:, a:b]`` slice counts as ``b - a`` sources), the inputs of a lowered
   ``stack`` (``cat`` + ``view``), or ``R``'s own slices.

Precision: the fused ops accumulate in fp32. Casts to a lower precision on the key,
logit or probability path (e.g. bf16 keys, a bf16 softmax) are approximations the
fused op does not repeat, so its result is at least as accurate; a cast on the path of
the values that are summed is not accepted. Output dtype follows the replaced node.

Which op: ``attn_res_mix(prefix, bank, norm_weight, qk_weight, k, eps)`` when the
sources are ``bank[:, :k]`` (``k`` may be 0: an empty view) followed by one ``[T, H]``
prefix, every tensor and weight in one dtype. RMSNorm without a weight passes a ones
vector made in the graph, so taps on such sites still find their consumer. The op
returns the sources' dtype; a site that wants its mixture wider (bf16 sources mixed in
fp32, as K3's ``attn_res_torch`` does before its fp32 output norm) gets it only if every
use casts back anyway or an ``aux_tap`` reads that site (the aux-stream pass reads
``attn_res_mix`` consumers; the output norm then sees the mixture rounded once to bf16).
Otherwise ``attn_res_mix_list(sources, norm_weight?, qk_weight, eps, out_dtype)``, which
keeps the wide dtype. Tensors outside the matched region (the weights) are peeled
through views and widening casts.

Dynamic shapes: sizes are ints or SymInts (``meta["val"]`` shapes), multiplied as
SymInts and compared with ``statically_known_true(a == b)`` (``values.same_size``): an
equality the shape environment cannot prove is a mismatch, and no guard is installed.
Inductor's passes use ``V.graph.sizevars``, which does not exist yet when post-grad
custom passes run (before ``GraphLowering``), nor ever on the pre-autograd path. Sizes
the rewrite needs are read off the sources with ``sym_size``. The number of sources must
be static. The one float tolerance is ``rules._is_mean``'s, for a model that writes 1/H
as a literal.

``last_fused`` counts the sites fused by the last call (``last_sites`` describes them);
an INFO line on logger ``kimi_passes`` says the same. With ``KIMI_PASSES_FUSION_DEBUG=1``
(or ``TORCHINDUCTOR_PATTERN_MATCH_DEBUG`` set) each softmax that was not fused is logged
at INFO with the check that failed (``last_misses``).
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
from kimi_passes.passes.base import KimiGraphPass, logger
from kimi_passes.passes.fx_toolkit import CASTS, calls_to
from kimi_passes.taps.consumer import AUX_TAP

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

    _instance: AttnResFusionPass | None = None

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

    @classmethod
    def instance(cls) -> AttnResFusionPass:
        """A process-wide instance (for stacks that install one pass object once)."""
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

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
