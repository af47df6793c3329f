"""Replacing a recognised plain-torch mixture with ``kimi.attn_res_mix`` / ``attn_res_mix_list``.

``rewrite(graph, match, tapped)`` emits the fused op right before the node holding the
mixture, lays its result out like that node and hands every use over to it (the old
nodes are left to dead-code elimination). Which op, and in which dtype, is described in
``kimi_passes.fusion``'s docstring.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import NamedTuple, cast

import torch
from torch.fx import Graph, Node

from kimi_passes.fusion.axes import VIEWS
from kimi_passes.fusion.sources import SourceRun
from kimi_passes.fusion.values import (
    NoMatch,
    numel,
    same_shape,
    same_size,
    shape_of,
    static_int,
)
from kimi_passes.fx.fx_toolkit import (
    CASTS,
    call_function,
    dtype_of,
    is_lossless,
    root,
    same_sum,
)

aten = torch.ops.aten
prims = torch.ops.prims
kimi = torch.ops.kimi

# Views a weight vector is peeled through: those that keep every element.
_VECTOR_VIEWS = VIEWS - {aten._unsafe_view.default, aten.expand.default, aten.select.int,
                         aten.slice.Tensor}


@dataclass
class MixtureMatch:
    """A recognised mixing site: what the rewrite needs to know."""

    softmax: Node
    root: Node
    out: Node  # the node holding the mixture (replaced)
    out_dims: tuple
    axes: list  # root axis names
    source_dim: int | None  # root dim of the source axis (None: one source, size-1 axis)
    eps: float
    weights: tuple
    coefficient: float
    sizes: dict
    sources: list[SourceRun]
    region: tuple = ()  # the replaced nodes (root to mixture)


@dataclass
class FusedSite:
    """One fused mixing site (what ``last_sites`` and the INFO log report)."""

    node: str  # the node now holding the mixture
    op: str
    num_sources: int
    replaced: str

    def __str__(self) -> str:
        return f"{self.replaced} -> {self.op} ({self.num_sources} sources)"


class _Emitter:
    """Inserts nodes before ``before`` (through ``fx_toolkit.call_function``) and sizes."""

    def __init__(self, graph: Graph, before: Node, size_sources: list[Node],
                 differentiable: bool = False):
        self.graph, self.before = graph, before
        #: Graphs AOTAutograd will differentiate cast with ``_to_copy`` (prims have no
        #: autograd formula); post-grad graphs with ``convert_element_type``, as Inductor.
        self.differentiable = differentiable
        #: Tensors whose dims give symbolic sizes (``sym_size``) under dynamic shapes.
        self.size_sources = size_sources
        #: (SymInt, its ``sym_size`` node) emitted so far. A list: SymInts do not hash,
        #: and two of them are the same size when ``same_size`` proves it.
        self._syms: list[tuple[torch.SymInt, Node]] = []

    def __call__(self, target, *args, **kwargs) -> Node:
        return call_function(self.graph, target, args, kwargs, before=self.before)

    def cast(self, x: Node, dtype: torch.dtype) -> Node:
        if self.differentiable:
            return self(aten._to_copy.default, x, dtype=dtype)
        return self(prims.convert_element_type.default, x, dtype)

    def size(self, *factors):
        """A size argument: the product of ``factors`` (ints or SymInts)."""
        static, nodes = 1, []
        for f in factors:
            n = static_int(f)
            if n is not None:
                static *= n
            else:
                nodes.append(self._sym(f))
        if not nodes:
            return static
        out = nodes[0]
        for node in nodes[1:]:
            out = self(operator.mul, out, node)
        return out if static == 1 else self(operator.mul, out, static)

    def _sym(self, size: torch.SymInt) -> Node:
        """A ``sym_size`` node of a size source whose dim is ``size``."""
        for known, node in self._syms:
            if same_size(known, size):
                return node
        for t in self.size_sources:
            for d, s in enumerate(shape_of(t)):
                if same_size(s, size):
                    node = self(aten.sym_size.int, t, d)
                    self._syms.append((size, node))
                    return node
        raise NoMatch(f"no tensor at hand carries the symbolic size {size}")


def _peel_vector(node: Node, H) -> Node:
    """The cleanest node holding the same H values: through views and lossless casts."""
    best = node
    while node.op == "call_function" and isinstance(node.args[0] if node.args else None, Node):
        t = node.target
        x = cast(Node, node.args[0])  # a Node: the loop's condition
        if t in CASTS:
            if not is_lossless(dtype_of(x), dtype_of(node)):
                break
        elif t not in _VECTOR_VIEWS:
            break
        if not same_size(numel(x), H):
            break
        node = x
        if len(shape_of(node)) == 1:
            best = node
    return best if len(shape_of(best)) == 1 else node


def with_replacements(m: MixtureMatch, replaced: dict[Node, Node]) -> MixtureMatch:
    """``m`` with its sources and weights read through ``replaced`` (old -> new node)."""
    if not replaced:
        return m
    return replace(m, sources=[replace(r, tensor=replaced.get(r.tensor, r.tensor))
                               for r in m.sources],
                   weights=tuple(replaced.get(w, w) for w in m.weights))


class Rewritten(NamedTuple):
    """What ``rewrite`` did: ``old``'s uses now read ``new``; ``fused`` is the kimi op."""

    site: FusedSite
    fused: Node
    old: Node
    new: Node


def rewrite(graph: Graph, m: MixtureMatch, tapped: list,
            differentiable: bool = False) -> Rewritten:
    """Replace the mixture ``m`` with one kimi op; ``tapped``: the values aux taps read;
    ``differentiable``: the graph is traced for AOTAutograd (casts it can differentiate)."""
    out = m.out
    # The root and the mixture hold tensors (the match read their shapes): dtypes, not None.
    src_dtype = cast(torch.dtype, dtype_of(m.root))
    out_dtype = cast(torch.dtype, dtype_of(out))
    users = list(out.users)
    if (out_dtype != src_dtype and len(users) == 1 and users[0].target in CASTS
            and dtype_of(users[0]) == src_dtype):
        out = users[0]  # the mixture is cast straight back: absorb the cast
        out_dtype = src_dtype
    runs = m.sources
    H = m.sizes[m.axes[-1]]
    emit = _Emitter(graph, out, [r.tensor for r in runs], differentiable)

    vecs, scalars = _weights(emit, m, H)
    bank_prefix = _bank_prefix(m, vecs, scalars, src_dtype)
    # attn_res_mix returns the sources' dtype. A site that wants its mixture wider uses it
    # only when every use rounds back anyway, or when an aux tap reads the site (the
    # aux-stream pass finds attn_res_mix consumers; the output norm then sees the mixture
    # rounded once to the sources' dtype); otherwise attn_res_mix_list keeps it wide.
    widen = out_dtype != src_dtype
    mix_form = bank_prefix and (
        not widen or _recast_only(out, src_dtype)
        or any(same_sum(root(runs[-1].tensor), root(v)) for v in tapped))
    if mix_form:
        mixed, src_shape, op, count = _emit_mix(emit, m, runs, vecs, H, src_dtype)
        fused = mixed
        if widen:
            mixed = emit.cast(mixed, out_dtype)
    else:
        mixed, src_shape, op, count = _emit_mix_list(emit, m, runs, vecs, scalars, H,
                                                     src_dtype, out_dtype)
        fused = mixed

    # The mixture's axes, in the sources' order, mapped onto the replaced node's layout.
    src_axes = [a for a in m.axes if m.source_dim is None or a != f"a{m.source_dim}"]
    new = _relayout(emit, mixed, src_shape, src_axes, m.out_dims, shape_of(out), m.sizes)
    out.replace_all_uses_with(new)
    return Rewritten(FusedSite(mixed.name, op, count, out.name), fused, out, new)


def _weights(emit: _Emitter, m: MixtureMatch, H) -> tuple[list[Node], list[Node]]:
    """The weights: vectors over H (peeled to 1-D) and scalar factors."""
    vecs: list[Node] = []
    scalars: list[Node] = []
    for v in m.weights:
        (vecs if same_size(numel(v), H) else scalars).append(v)
    vecs = [_peel_vector(v, H) for v in vecs]
    vecs = [v if len(shape_of(v)) == 1 else emit(aten.reshape.default, v, [emit.size(H)])
            for v in vecs]
    if not vecs:
        raise NoMatch("no pseudo-query vector")
    return vecs, scalars


def _bank_prefix(m: MixtureMatch, vecs: list[Node], scalars: list[Node],
                 src_dtype: torch.dtype) -> bool:
    """The mixture is ``attn_res_mix``'s: a 2-D prefix, optionally after a ``[T, nb, H]``
    bank read from slot 0, all in the sources' dtype, with at most two weight vectors of
    that dtype, no scalar factor and coefficient 1."""
    runs = m.sources
    return (
        not scalars and m.coefficient == 1.0 and len(vecs) <= 2
        and all(dtype_of(v) == src_dtype for v in vecs)
        and runs[-1].single and len(shape_of(runs[-1].tensor)) == 2
        and dtype_of(runs[-1].tensor) == src_dtype
        and (len(runs) == 1 or (len(runs) == 2 and not runs[0].single
                                and runs[0].start == 0 and runs[0].dim == 1
                                and len(shape_of(runs[0].tensor)) == 3
                                and dtype_of(runs[0].tensor) == src_dtype))
    )


def _emit_mix(emit: _Emitter, m: MixtureMatch, runs, vecs, H, src_dtype):
    """``attn_res_mix(prefix, bank, norm_weight, qk_weight, k, eps)``."""
    prefix = runs[-1].tensor
    if len(runs) == 2:
        bank, nb = runs[0].tensor, runs[0].stop
    else:  # no completed blocks: an empty [T, 0, H] view of the prefix
        bank, nb = emit(aten.slice.Tensor, emit(aten.unsqueeze.default, prefix, 1), 1, 0, 0), 0
    if len(vecs) == 2:
        norm_weight, qk = vecs
    else:  # RMSNorm without a weight: a ones vector
        qk = vecs[0]
        norm_weight = emit(aten.full.default, [emit.size(H)], 1.0, dtype=src_dtype,
                           device=prefix.meta["val"].device)
    mixed = emit(kimi.attn_res_mix.default, prefix, bank, norm_weight, qk, nb, m.eps)
    return mixed, shape_of(prefix), "kimi.attn_res_mix", nb + 1


def _emit_mix_list(emit: _Emitter, m: MixtureMatch, runs, vecs, scalars, H, src_dtype,
                   out_dtype):
    """``attn_res_mix_list(sources, norm_weight?, qk_weight, eps, out_dtype)``."""
    sources = []
    for r in runs:
        if r.single:
            sources.append(r.tensor)
        else:
            sources += [emit(aten.select.int, r.tensor, r.dim, j)
                        for j in range(r.start, r.stop)]
    first = shape_of(sources[0])
    other = next((s for s in sources[1:] if not same_shape(shape_of(s), first)), None)
    if other is not None:  # (SymInts do not hash: no set of shapes)
        raise NoMatch(f"sources of different shapes {list(first)} and "
                      f"{list(shape_of(other))}")
    norm_weight = vecs[0] if len(vecs) >= 2 else None
    rest = vecs[1:] if len(vecs) >= 2 else vecs
    qk = rest[0]
    extra = rest[1:] + scalars
    if extra or m.coefficient != 1.0:
        if dtype_of(qk) != torch.float32:
            qk = emit.cast(qk, torch.float32)
        for e in extra:
            if dtype_of(e) != torch.float32:
                e = emit.cast(e, torch.float32)
            qk = emit(aten.mul.Tensor, qk, e if same_size(numel(e), H) else emit(
                aten.reshape.default, e, []))
        if m.coefficient != 1.0:
            qk = emit(aten.mul.Tensor, qk, m.coefficient)
    mixed = emit(kimi.attn_res_mix_list.default, sources, norm_weight, qk, m.eps,
                 None if out_dtype == src_dtype else out_dtype)
    return mixed, shape_of(sources[0]), "kimi.attn_res_mix_list", len(sources)


def _recast_only(node: Node, dtype: torch.dtype) -> bool:
    """Does every use of ``node`` (through views) cast it to ``dtype``?"""
    stack, seen = list(node.users), set()
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if u.op == "call_function" and u.target in CASTS and dtype_of(u) == dtype:
            continue
        if u.op == "call_function" and u.target in VIEWS:
            stack.extend(u.users)
            continue
        return False
    return bool(seen)


def _relayout(emit: _Emitter, mixed: Node, src_shape, src_axes, out_dims, out_shape,
              sizes) -> Node:
    """``mixed`` (logical axes ``src_axes``) rearranged into ``out_dims`` / ``out_shape``."""
    order = [a for d in out_dims for a in d]
    target = [emit.size(*(sizes[a] for a in d)) for d in out_dims]
    if order == src_axes:
        return mixed if same_shape(src_shape, out_shape) else emit(
            aten.reshape.default, mixed, target)
    x = mixed
    if len(src_shape) != len(src_axes):
        x = emit(aten.reshape.default, x, [emit.size(sizes[a]) for a in src_axes])
    x = emit(aten.permute.default, x, [src_axes.index(a) for a in order])
    return emit(aten.reshape.default, x, target)
