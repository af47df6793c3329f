"""AttnResFusionPass: AttnRes mixing written in plain torch becomes one kimi op.

A model that states Block AttnRes in plain PyTorch (``torch.stack``/``torch.cat`` the
sources, RMSNorm the keys, dot with a pseudo-query, softmax over depth, weighted sum
of the raw sources) makes Inductor materialise the stacked copy of every source and
run half a dozen kernels per mixing site. This post-grad pass finds those sites and
replaces each with ``kimi.attn_res_mix`` (sources ``bank[:, :k]`` then a ``[T, H]``
prefix) or ``kimi.attn_res_mix_list`` (any list of sources), which read each source in
place. The aux-stream pass then finds ``attn_res_mix`` consumers of aux taps as usual.

How a site is recognised (a hand-written matcher, not ``register_replacement``: the
number of sources varies and so do the decompositions of einsum/matmul/Linear):

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

Dynamic shapes: symbolic sizes are compared with sympy; sizes the rewrite needs are read
off the sources with ``sym_size``. The number of sources must be static.

``last_fused`` counts the sites fused by the last call (``last_sites`` describes them);
an INFO line on logger ``kimi_passes`` says the same. With ``KIMI_PASSES_FUSION_DEBUG=1``
(or ``TORCHINDUCTOR_PATTERN_MATCH_DEBUG`` set) each softmax that was not fused is logged
at INFO with the check that failed (``last_misses``).
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field, replace

import sympy
import torch
from torch._inductor.custom_graph_pass import get_hash_for_files
from torch.fx import Graph, Node

from kimi_passes import consumer
from kimi_passes.consumer import AUX_TAP, _same_sum
from kimi_passes.consumer import root as _root_of
from kimi_passes.inductor_pass import KimiGraphPass, logger

aten = torch.ops.aten
prims = torch.ops.prims
kimi = torch.ops.kimi

DEBUG_ENV = "KIMI_PASSES_FUSION_DEBUG"

# Ops that keep the values and only move axes around (or copy).
_VIEWS = {
    aten.reshape.default, aten.view.default, aten._unsafe_view.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.permute.default, aten.transpose.int, aten.t.default, aten.expand.default,
    aten.clone.default, aten.alias.default, aten.detach.default, aten.select.int,
    aten.slice.Tensor,
}
_CASTS = {prims.convert_element_type.default, aten._to_copy.default}
_SOFTMAX = {aten._softmax.default, aten.softmax.int, aten._safe_softmax.default}
_COMBINE = {aten.mul.Tensor, aten.bmm.default, aten.mm.default}

_PRECISION = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


_GUARDS = {
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.abs.default,
    aten.isinf.default, aten.isnan.default, aten.logical_not.default,
    aten.logical_and.default, aten.logical_or.default, aten.any.dims, aten.any.dim,
}


def _same_logits(a, b) -> bool:
    return (a is not None and b is not None and a.v == b.v and a.rs == b.rs
            and a.summed == b.summed and len(a.vecs) == len(b.vecs)
            and all(x is y for x, y in zip(a.vecs, b.vecs, strict=True))
            and abs(a.scalar - b.scalar) <= 1e-12 * max(abs(a.scalar), abs(b.scalar)))


class NoMatch(Exception):
    """A candidate is not an AttnRes mixture; the message says which check failed."""


# -- sizes (ints, or SymInts under dynamic shapes) ----------------------------------------


def _expr(s):
    if isinstance(s, sympy.Basic):
        return s
    if isinstance(s, torch.SymInt):
        return s.node.expr
    return sympy.Integer(int(s))


def _eq(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return sympy.expand(_expr(a) - _expr(b)) == 0


def _one(s) -> bool:
    return _eq(s, 1)


def _shape(node) -> tuple:
    val = node.meta.get("val") if isinstance(node, Node) else None
    if not isinstance(val, torch.Tensor):
        raise NoMatch(f"{getattr(node, 'name', node)} has no tensor metadata")
    return tuple(val.shape)


def _dtype(node: Node) -> torch.dtype:
    return node.meta["val"].dtype


def _numel(node: Node):
    n = sympy.Integer(1)
    for s in _shape(node):
        n = n * _expr(s)
    return n


def _norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


# -- abstract values ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Val:
    """The abstract value of one node between the root and the weighted sum.

    ``dims``: per tensor dim, the tuple of root axis names merged into it (row-major);
    ``()`` for a size-1 dim. ``kind``:

    - ``mono``: ``scalar * V * rsqrt(mean_h V^2 + rs)^[rs given] * prod(vecs)``, summed
      over the hidden axis if ``summed``; ``v`` False for the bare rsqrt factor.
    - ``sq`` (``V^2``), ``ms`` (``scale * sum_h V^2``), ``mse`` (``mean + eps``),
      ``sqrt`` (``sqrt(mse)``).
    - ``max``/``shifted``/``exps``/``den``: parts of a decomposed softmax over ``axis``
      of the logits ``lg`` (``max`` of node ``src``; ``den`` sums the node ``src``);
      ``guard``: a finiteness test of the logits, only ever a ``where`` condition.
    - ``prob`` (softmax over ``axis``), ``pv`` (prob * V), ``out`` (the mixture).
    """

    kind: str
    dims: tuple
    v: bool = False
    rs: float | None = None
    vecs: tuple = ()
    scalar: float = 1.0
    summed: bool = False
    exact: bool = True
    scale: object = None
    eps: float | None = None
    src: Node | None = None
    axis: tuple | None = None
    lg: _Val | None = None  # the logits a softmax part is computed from

    @property
    def pure_v(self) -> bool:
        return (self.kind == "mono" and self.v and self.rs is None and not self.vecs
                and self.scalar == 1.0 and not self.summed)

    @property
    def logits(self) -> bool:
        return (self.kind == "mono" and self.v and self.rs is not None and self.summed
                and bool(self.vecs))


@dataclass
class _Match:
    softmax: Node
    root: Node
    out: Node  # the node holding the mixture (replaced)
    out_dims: tuple
    axes: list  # root axis names
    n_dim: int | None  # root dim of the source axis (None: one source, size-1 axis)
    eps: float
    vecs: tuple
    scalar: float
    sizes: dict
    segments: list


@dataclass
class FusedSite:
    """One fused mixing site (what ``last_sites`` and the INFO log report)."""

    node: str  # the node now holding the mixture
    op: str
    num_sources: int
    replaced: str

    def __str__(self) -> str:
        return f"{self.replaced} -> {self.op} ({self.num_sources} sources)"


@dataclass
class NearMiss:
    """A softmax that was not fused, and why (one reason per root tried)."""

    softmax: str
    reasons: list = field(default_factory=list)

    def __str__(self) -> str:
        return f"softmax {self.softmax} not fused: " + "; ".join(self.reasons)


# -- the symbolic evaluation of one candidate ---------------------------------------------


class _Evaluator:
    def __init__(self, root: Node, softmax: Node, combine: Node, pos: dict):
        self.root, self.softmax, self.combine, self.pos = root, softmax, combine, pos
        shape = _shape(root)
        self.sizes: dict[str, object] = {}
        dims = []
        for i, s in enumerate(shape):
            if _one(s):
                dims.append(())
            else:
                name = f"a{i}"
                self.sizes[name] = s
                dims.append((name,))
        if not dims or dims[-1] == ():
            raise NoMatch(f"root {root.name}: its last dim (the hidden axis) has size 1")
        self.axes = [d[0] for d in dims if d]
        self.h = dims[-1][0]
        self.H = self.sizes[self.h]
        self.vals: dict[Node, _Val] = {root: _Val("mono", tuple(dims), v=True)}
        self.n_axis: tuple | None = None  # () when the source axis has size 1
        self.prob_node: Node | None = None
        self.logits: _Val | None = None

    # -- driver ---------------------------------------------------------------------
    def run(self) -> tuple[Node, _Val]:
        region = self._region()
        if self.softmax not in region:
            raise NoMatch(f"the weighted sum's values {self.root.name} are not the tensor the "
                          "logits were computed from")
        for node in region:
            self.vals[node] = self._eval(node)
        out, val = self.combine, self.vals[self.combine]
        while val.kind == "pv":  # mul, then views, then the sum over the source axis
            users = list(out.users)
            if len(users) != 1:
                raise NoMatch(f"{out.name} (probabilities x sources) has {len(users)} users; "
                              "expected one sum over the source axis")
            out = users[0]
            val = self._eval(out)
            self.vals[out] = val
        if val.kind != "out":
            raise NoMatch(f"{out.name}: the softmax output meets the sources in a "
                          f"{val.kind!r} value, not a weighted sum over the source axis")
        flat = [a for d in val.dims for a in d]
        want = sorted(a for a in self.axes if (a,) != self.n_axis)
        if sorted(flat) != want:
            raise NoMatch(f"{out.name}: the weighted sum has axes {flat}, expected the root's "
                          f"axes except the source axis: {want}")
        if self.prob_node is not self.softmax:
            raise NoMatch(f"the weighted sum uses softmax {self.prob_node}, not "
                          f"{self.softmax.name}")
        return out, val

    def _region(self) -> list[Node]:
        pos, lo = self.pos, self.pos[self.root]
        anc, stack = set(), [self.combine]
        while stack:
            for a in stack.pop().all_input_nodes:
                if a not in anc and pos.get(a, -1) > lo:
                    anc.add(a)
                    stack.append(a)
        anc.add(self.combine)
        region, stack = set(), [self.root]
        while stack:
            for u in stack.pop().users:
                if u in anc and u not in region:
                    region.add(u)
                    stack.append(u)
        return sorted(region, key=lambda n: pos[n])

    # -- operands -------------------------------------------------------------------
    def _val(self, a) -> _Val | None:
        return self.vals.get(a) if isinstance(a, Node) else None

    def _scalar(self, a) -> float | None:
        if isinstance(a, bool):
            return None
        if isinstance(a, (int, float)):
            return float(a)
        return None

    def _ext_kind(self, ext: Node, dims: tuple, where: str) -> str:
        """How a tensor from outside the region broadcasts against ``dims``: 'vec' or 'scalar'."""
        shape = _shape(ext)
        if len(shape) > len(dims) and not all(_one(s) for s in shape[: len(shape) - len(dims)]):
            raise NoMatch(f"{where}: {ext.name} {list(shape)} broadcasts to more dims")
        kind = "scalar"
        for i in range(1, min(len(shape), len(dims)) + 1):
            s, d = shape[-i], dims[-i]
            if _one(s):
                continue
            if d != (self.h,) or not _eq(s, self.H):
                raise NoMatch(f"{where}: {ext.name} {list(shape)} varies along an axis other "
                              "than the hidden one (not a weight vector)")
            kind = "vec"
        return kind

    def _is_mean(self, scale) -> bool:
        """Is ``scale * sum_h`` the mean over the hidden axis (``scale == 1/H``)?"""
        e = sympy.simplify(sympy.sympify(scale) * _expr(self.H) - 1)
        return abs(float(e)) < 1e-6 if e.is_number else e == 0

    def _bcast(self, a: tuple, b: tuple, where: str) -> tuple:
        n = max(len(a), len(b))
        a = ((),) * (n - len(a)) + tuple(a)
        b = ((),) * (n - len(b)) + tuple(b)
        out = []
        for x, y in zip(a, b, strict=True):
            if x == y or y == ():
                out.append(x)
            elif x == ():
                out.append(y)
            else:
                raise NoMatch(f"{where}: broadcasting pairs axis {x} with {y}")
        return tuple(out)

    # -- one node -------------------------------------------------------------------
    def _eval(self, node: Node) -> _Val:
        t = node.target
        where = f"{node.name} ({getattr(t, '__name__', t)})"
        if node.op != "call_function":
            raise NoMatch(f"{where}: not a function call")
        if t in _VIEWS:
            return self._view(node, where)
        if t in _CASTS:
            return self._cast(node, where)
        if t in (aten.mul.Tensor, aten.mul.Scalar):
            return self._mul(node, where)
        if t in (aten.div.Tensor, aten.div.Scalar):
            return self._div(node, where)
        if t in (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar):
            return self._add(node, where)
        if t is aten.pow.Tensor_Scalar:
            return self._pow(node, where)
        if t in (aten.rsqrt.default, aten.sqrt.default, aten.reciprocal.default,
                 aten.neg.default, aten.exp.default):
            return self._unary(node, where)
        if t in (aten.mean.dim, aten.sum.dim_IntList, aten.amax.default):
            return self._reduce(node, where)
        if t in _SOFTMAX:
            x = self._val(node.args[0])
            if x is None:
                raise NoMatch(f"{where}: softmax of a tensor outside the region")
            return self._prob(node, x, node.args[1], where)
        if t in (aten.bmm.default, aten.mm.default, aten.addmm.default):
            return self._matmul(node, where)
        if t in _GUARDS:
            return self._guard(node, where)
        if t is aten.where.self:
            return self._where(node, where)
        raise NoMatch(f"{where}: op not part of an AttnRes mixture")

    def _guard(self, node: Node, where: str) -> _Val:
        """A finiteness test of the logits (Inductor's softmax-with-temperature rewrite)."""
        for a in node.all_input_nodes:
            v = self._val(a)
            if v is not None and v.kind != "guard" and not v.logits:
                raise NoMatch(f"{where}: test of {v.kind}, not of the logits")
        return _Val("guard", ((),) * len(_shape(node)))

    def _where(self, node: Node, where: str) -> _Val:
        """``where(cond, a, b)`` of two equal shifted logits: the condition does not matter."""
        cond, a, b = (self._val(x) for x in node.args[:3])
        if cond is None or cond.kind != "guard" or a is None or b is None:
            raise NoMatch(f"{where}: where() outside a softmax rewrite")
        if not (a.kind == b.kind == "shifted" and a.axis == b.axis and _same_logits(a.lg, b.lg)):
            raise NoMatch(f"{where}: where() picks between different values")
        return self._checked(node, replace(a, dims=self._bcast(a.dims, b.dims, where)), where)

    def _view(self, node: Node, where: str) -> _Val:
        t, x = node.target, self._val(node.args[0])
        if x is None:
            raise NoMatch(f"{where}: view of a tensor outside the region")
        dims, rank = list(x.dims), len(x.dims)
        in_shape, out_shape = _shape(node.args[0]), _shape(node)
        if t in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
            seq = [a for d in dims for a in d]
            new = []
            for s in out_shape:
                if _one(s):
                    new.append(())
                    continue
                group, prod = [], sympy.Integer(1)
                while seq and not _eq(prod, s):
                    a = seq.pop(0)
                    group.append(a)
                    prod = prod * _expr(self.sizes[a])
                if not _eq(prod, s):
                    raise NoMatch(f"{where}: the reshape splits a root axis")
                new.append(tuple(group))
            if seq:
                raise NoMatch(f"{where}: the reshape drops axes {seq}")
            dims = new
        elif t is aten.unsqueeze.default:
            dims.insert(_norm_dim(node.args[1], rank + 1), ())
        elif t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
            if t is aten.squeeze.default:
                which = range(rank)
            else:
                arg = node.args[1]
                which = [_norm_dim(d, rank) for d in (arg if isinstance(arg, (list, tuple))
                                                      else [arg])]
            drop = {d for d in which if _one(in_shape[d])}
            dims = [d for i, d in enumerate(dims) if i not in drop]
        elif t is aten.permute.default:
            dims = [dims[_norm_dim(p, rank)] for p in node.args[1]]
        elif t in (aten.transpose.int, aten.t.default):
            a, b = (0, 1) if t is aten.t.default else (
                _norm_dim(node.args[1], rank), _norm_dim(node.args[2], rank))
            dims[a], dims[b] = dims[b], dims[a]
        elif t is aten.expand.default:
            if len(out_shape) != rank or not all(
                    _eq(s, o) for s, o in zip(in_shape, out_shape, strict=True)):
                raise NoMatch(f"{where}: expand replicates a value of the mixture")
        elif t is aten.select.int:
            d = _norm_dim(node.args[1], rank)
            if dims[d] != ():
                raise NoMatch(f"{where}: select picks one entry of axis {dims[d]}")
            dims.pop(d)
        elif t is aten.slice.Tensor:
            d = _norm_dim(node.args[1] if len(node.args) > 1 else 0, rank)
            if not _eq(in_shape[d], out_shape[d]):
                raise NoMatch(f"{where}: slice keeps part of axis {dims[d]}")
        # clone / alias / detach: unchanged
        return self._checked(node, replace(x, dims=tuple(dims)), where)

    def _checked(self, node: Node, val: _Val, where: str) -> _Val:
        shape = _shape(node)
        if len(shape) != len(val.dims):
            raise NoMatch(f"{where}: rank {len(shape)} but {len(val.dims)} tracked dims")
        for s, d in zip(shape, val.dims, strict=True):
            size = sympy.Integer(1)
            for a in d:
                size = size * _expr(self.sizes[a])
            if not _eq(size, s):
                raise NoMatch(f"{where}: dim of size {s} holds axes {d}")
        return val

    def _cast(self, node: Node, where: str) -> _Val:
        x = self._val(node.args[0])
        if x is None:
            raise NoMatch(f"{where}: cast of a tensor outside the region")
        if node.target is aten._to_copy.default and set(node.kwargs) - {
                "dtype", "memory_format", "layout", "device"}:
            raise NoMatch(f"{where}: _to_copy with {sorted(node.kwargs)}")
        src, dst = _dtype(node.args[0]), _dtype(node)
        widening = _PRECISION.get(dst, 0) > _PRECISION.get(src, 0) or src == dst
        return replace(x, exact=x.exact and widening)

    def _mul(self, node: Node, where: str) -> _Val:
        a, b = node.args[0], node.args[1]
        va, vb = self._val(a), self._val(b)
        if va is None and vb is not None:
            a, b, va, vb = b, a, vb, va
        if va is None:
            raise NoMatch(f"{where}: product of tensors outside the region")
        c = self._scalar(b)
        if vb is None and c is not None:  # x * python scalar
            if va.kind == "mono":
                return replace(va, scalar=va.scalar * c, exact=va.exact and c == 1.0)
            if va.kind == "ms":
                return replace(va, scale=va.scale * c)
            if va.kind == "shifted" and c > 0:
                return replace(va, lg=replace(va.lg, scalar=va.lg.scalar * c))
            if va.kind == "guard":
                return va
            raise NoMatch(f"{where}: {va.kind} scaled by {c}")
        if vb is None:  # x * a tensor from outside: a weight vector (or a scalar)
            if va.kind != "mono":
                raise NoMatch(f"{where}: {va.kind} times {b.name}")
            kind = self._ext_kind(b, va.dims, where)
            if va.summed and kind == "vec":
                raise NoMatch(f"{where}: a hidden-axis sum times the vector {b.name}")
            extra = len(_shape(b)) - len(va.dims)
            dims = ((),) * extra + va.dims if extra > 0 else va.dims
            return replace(va, dims=dims, vecs=va.vecs + (b,), exact=False)
        dims = self._bcast(va.dims, vb.dims, where)
        if va.kind == vb.kind == "guard":
            return _Val("guard", dims)
        if va.pure_v and vb.pure_v:
            if va.dims != vb.dims:
                raise NoMatch(f"{where}: product of two differently laid out source values")
            return _Val("sq", dims)
        if {va.kind, vb.kind} == {"prob", "mono"}:
            p, v = (va, vb) if va.kind == "prob" else (vb, va)
            if not v.pure_v:
                raise NoMatch(f"{where}: the probabilities multiply a transformed copy of the "
                              "sources (keys or scaled values), not the raw sources")
            if not v.exact:
                raise NoMatch(f"{where}: the values summed are a rounded copy of the sources")
            if (self.h,) in p.dims:
                raise NoMatch(f"{where}: probabilities vary along the hidden axis")
            return _Val("out" if self.n_axis == () else "pv", dims)
        if va.kind == "mono" and vb.kind == "mono":
            if va.v and vb.v:
                raise NoMatch(f"{where}: product of two source-derived values")
            if va.rs is not None and vb.rs is not None:
                raise NoMatch(f"{where}: two rsqrt factors")
            for s, other in ((va, vb), (vb, va)):
                if s.summed and (other.v or other.vecs or (self.h,) in other.dims):
                    raise NoMatch(f"{where}: a hidden-axis sum times a hidden-axis value")
            return _Val("mono", dims, v=va.v or vb.v,
                        rs=va.rs if va.rs is not None else vb.rs,
                        vecs=va.vecs + vb.vecs, scalar=va.scalar * vb.scalar,
                        summed=va.summed or vb.summed, exact=False)
        raise NoMatch(f"{where}: product of {va.kind} and {vb.kind}")

    def _div(self, node: Node, where: str) -> _Val:
        a, b = node.args[0], node.args[1]
        va, vb, c = self._val(a), self._val(b), self._scalar(b)
        if va is None:
            raise NoMatch(f"{where}: division of a tensor outside the region")
        if vb is None and c is not None and c != 0:
            if va.kind == "mono":
                return replace(va, scalar=va.scalar / c, exact=va.exact and c == 1.0)
            if va.kind == "shifted" and c > 0:  # (x - max x) / c == x/c - max(x/c)
                return replace(va, lg=replace(va.lg, scalar=va.lg.scalar / c))
            if va.kind == "ms":
                return replace(va, scale=va.scale / c)
            raise NoMatch(f"{where}: {va.kind} divided by {c}")
        if vb is None:
            raise NoMatch(f"{where}: division by a tensor outside the region")
        dims = self._bcast(va.dims, vb.dims, where)
        if va.kind == "mono" and vb.kind == "sqrt":
            if va.rs is not None or va.summed:
                raise NoMatch(f"{where}: second normalisation of the keys")
            return replace(va, dims=dims, rs=vb.eps, exact=False)
        if va.kind == "exps" and vb.kind == "den" and vb.src is a:
            return self._prob(node, va.lg, None, where, axis=vb.axis)
        raise NoMatch(f"{where}: {va.kind} divided by {vb.kind}")

    def _add(self, node: Node, where: str) -> _Val:
        t = node.target
        if node.kwargs.get("alpha", 1) != 1:
            raise NoMatch(f"{where}: add/sub with alpha")
        a, b = node.args[0], node.args[1]
        va, vb, c = self._val(a), self._val(b), self._scalar(b)
        sub = t in (aten.sub.Tensor, aten.sub.Scalar)
        if va is None:
            raise NoMatch(f"{where}: {'sub' if sub else 'add'} of a tensor outside the region")
        if sub and vb is not None and vb.kind == "max" and vb.src is a:
            return _Val("shifted", self._bcast(va.dims, vb.dims, where), axis=vb.axis, lg=va)
        if va.kind == "ms" and not sub and vb is None and c is not None:
            if not self._is_mean(va.scale):
                raise NoMatch(f"{where}: eps added to {va.scale} * sum(x^2), not the mean")
            if c < 0:
                raise NoMatch(f"{where}: negative eps {c}")
            return _Val("mse", va.dims, eps=c)
        if va.logits:
            # A term constant along the source axis does not change the softmax.
            if vb is None and (c is not None or (isinstance(b, Node) and _numel(b) == 1)):
                return va
        raise NoMatch(f"{where}: {'sub' if sub else 'add'} of {va.kind} and "
                      f"{vb.kind if vb else b}")

    def _pow(self, node: Node, where: str) -> _Val:
        x, e = self._val(node.args[0]), node.args[1]
        if x is None:
            raise NoMatch(f"{where}: power of a tensor outside the region")
        if x.pure_v and e == 2:
            return _Val("sq", x.dims)
        if x.kind == "mse" and e == -0.5:
            return _Val("mono", x.dims, rs=x.eps, exact=False)
        if x.kind == "mse" and e == 0.5:
            return _Val("sqrt", x.dims, eps=x.eps)
        raise NoMatch(f"{where}: {x.kind} ** {e}")

    def _unary(self, node: Node, where: str) -> _Val:
        t, x = node.target, self._val(node.args[0])
        if x is None:
            raise NoMatch(f"{where}: of a tensor outside the region")
        if t is aten.rsqrt.default and x.kind == "mse":
            return _Val("mono", x.dims, rs=x.eps, exact=False)
        if t is aten.rsqrt.default and x.kind == "ms" and self._is_mean(x.scale):
            return _Val("mono", x.dims, rs=0.0, exact=False)
        if t is aten.sqrt.default and x.kind == "mse":
            return _Val("sqrt", x.dims, eps=x.eps)
        if t is aten.reciprocal.default and x.kind == "sqrt":
            return _Val("mono", x.dims, rs=x.eps, exact=False)
        if t is aten.neg.default and x.kind == "mono":
            return replace(x, scalar=-x.scalar, exact=False)
        if t is aten.exp.default and x.kind == "shifted":
            return _Val("exps", x.dims, axis=x.axis, lg=x.lg)
        if t is aten.exp.default and x.kind == "mono":
            self._check_logits(x, node.args[0], where)
            return _Val("exps", x.dims, axis=None, lg=x)
        raise NoMatch(f"{where}: applied to {x.kind}")

    def _reduce(self, node: Node, where: str) -> _Val:
        t, x = node.target, self._val(node.args[0])
        if x is None:
            raise NoMatch(f"{where}: reduction of a tensor outside the region")
        rank = len(x.dims)
        dims_arg = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if dims_arg is None:
            raise NoMatch(f"{where}: reduction over every dim")
        dims_arg = dims_arg if isinstance(dims_arg, (list, tuple)) else [dims_arg]
        if len(dims_arg) != 1:
            raise NoMatch(f"{where}: reduction over {len(dims_arg)} dims")
        d = _norm_dim(dims_arg[0], rank)
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        axis = x.dims[d]
        dims = list(x.dims)
        if keep:
            dims[d] = ()
        else:
            dims.pop(d)
        dims = tuple(dims)
        if t is aten.amax.default:
            ax = self._softmax_axis(axis, where)
            self._check_logits(x, node.args[0], where)
            return _Val("max", dims, src=node.args[0], axis=ax, lg=x)
        if node.kwargs.get("dtype") is not None:
            raise NoMatch(f"{where}: reduction with a dtype")
        hidden = axis == (self.h,)
        if x.kind == "sq" and hidden:
            scale = sympy.Integer(1) / _expr(self.H) if t is aten.mean.dim else sympy.Integer(1)
            return _Val("ms", dims, scale=scale)
        if t is aten.sum.dim_IntList:
            if x.kind == "mono" and x.v and not x.summed and hidden:
                return replace(x, dims=dims, summed=True, exact=False)
            if x.kind == "exps":
                ax = self._softmax_axis(axis, where)
                if x.axis is not None and x.axis != ax:
                    raise NoMatch(f"{where}: softmax sums over {ax} but shifted over {x.axis}")
                return _Val("den", dims, src=node.args[0], axis=ax, lg=x.lg)
            if x.kind == "pv" and self.n_axis is not None and axis == self.n_axis:
                return _Val("out", dims)
        raise NoMatch(f"{where}: reduction of {x.kind} over axis {axis}"
                      + (" (the hidden axis)" if hidden else ""))

    def _softmax_axis(self, axis: tuple, where: str) -> tuple:
        if len(axis) > 1:
            raise NoMatch(f"{where}: softmax over merged axes {axis}")
        if axis == (self.h,):
            raise NoMatch(f"{where}: softmax over the hidden axis")
        return axis

    def _check_logits(self, x: _Val, node: Node, where: str) -> None:
        if x.kind != "mono" or not x.summed:
            raise NoMatch(f"{where}: softmax input {node.name} is not a per-source logit (no "
                          "contraction over the hidden axis)")
        if x.rs is None:
            raise NoMatch(f"{where}: the logits {node.name} use keys that are not "
                          "RMS-normalised (no rsqrt(mean(x^2) + eps) factor)")
        if not x.vecs:
            raise NoMatch(f"{where}: the logits {node.name} have no pseudo-query vector")

    def _prob(self, node: Node, x: _Val, dim, where: str, axis=None) -> _Val:
        src = node.args[0] if dim is not None else None
        if dim is not None:
            axis = self._softmax_axis(x.dims[_norm_dim(dim, len(x.dims))], where)
        self._check_logits(x, src if src is not None else node, where)
        if self.prob_node is not None:
            raise NoMatch(f"{where}: a second softmax ({self.prob_node.name}) in the region")
        self.prob_node, self.n_axis, self.logits = node, axis, x
        return _Val("prob", x.dims, axis=axis)

    def _matmul(self, node: Node, where: str) -> _Val:
        t = node.target
        bias = node.args[0] if t is aten.addmm.default else None
        a, b = node.args[-2:] if bias is not None else node.args[:2]
        va, vb = self._val(a), self._val(b)
        batched = t is aten.bmm.default
        if va is None and vb is None:
            raise NoMatch(f"{where}: matmul of tensors outside the region")
        if va is None or vb is None:  # keys . pseudo-query
            mono, ext, ext_left = (vb, a, True) if va is None else (va, b, False)
            if mono.kind != "mono" or not mono.v or mono.summed:
                raise NoMatch(f"{where}: matmul of {mono.kind} with {ext.name}")
            k_dim = -1 if ext_left else -2
            mono_k = mono.dims[-2] if ext_left else mono.dims[-1]
            if mono_k != (self.h,):
                raise NoMatch(f"{where}: the contraction is over axis {mono_k}, not the hidden "
                              "axis")
            shape = _shape(ext)
            if not _eq(shape[k_dim], self.H) or not all(
                    _one(s) for i, s in enumerate(shape) if i != len(shape) + k_dim):
                raise NoMatch(f"{where}: {ext.name} {list(shape)} is not a vector over the "
                              "hidden axis")
            if ext_left:
                dims = ((mono.dims[0],) if batched else ()) + ((), mono.dims[-1])
            else:
                dims = ((mono.dims[0],) if batched else ()) + (mono.dims[-2], ())
            val = replace(mono, dims=dims, vecs=mono.vecs + (ext,), summed=True, exact=False)
        else:
            kinds = {va.kind, vb.kind}
            if kinds != {"prob", "mono"}:
                raise NoMatch(f"{where}: matmul of {va.kind} and {vb.kind}")
            v = vb if vb.kind == "mono" else va
            if not v.pure_v:
                raise NoMatch(f"{where}: the probabilities multiply a transformed copy of the "
                              "sources (keys or scaled values), not the raw sources")
            if not v.exact:
                raise NoMatch(f"{where}: the values summed are a rounded copy of the sources")
            if va.dims[-1] != vb.dims[-2] or va.dims[-1] != self.n_axis:
                raise NoMatch(f"{where}: the contraction pairs axes {va.dims[-1]} and "
                              f"{vb.dims[-2]}, not the softmax's source axis {self.n_axis}")
            if batched and va.dims[0] != vb.dims[0]:
                raise NoMatch(f"{where}: batch axes {va.dims[0]} and {vb.dims[0]} differ")
            dims = ((va.dims[0],) if batched else ()) + (va.dims[-2], vb.dims[-1])
            flat = [x for d in dims for x in d]
            if len(flat) != len(set(flat)):
                raise NoMatch(f"{where}: the product repeats an axis (not a per-row sum)")
            val = _Val("out", dims)
        if bias is not None:
            c = self._scalar(bias)
            if not (val.kind == "mono" and (c is not None or _numel(bias) == 1)):
                raise NoMatch(f"{where}: addmm bias {bias} is not constant over the sources")
        return self._checked(node, val, where)


# -- finding candidates ------------------------------------------------------------------


def _softmax_nodes(graph: Graph) -> list[Node]:
    found = []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in _SOFTMAX:
            found.append(n)
        elif (n.target is aten.div.Tensor and len(n.args) == 2
              and isinstance(n.args[0], Node) and isinstance(n.args[1], Node)
              and n.args[0].target is aten.exp.default
              and n.args[1].target is aten.sum.dim_IntList and n.args[1].args[0] is n.args[0]):
            found.append(n)
    return found


def _is_pass_through(n: Node) -> bool:
    return n.op == "call_function" and (n.target in _VIEWS or n.target in _CASTS)


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


# -- splitting the root into sources -----------------------------------------------------


@dataclass
class _Segment:
    """Sources ``start..stop`` along ``dim`` of ``tensor`` (bank), or one tensor (one)."""

    kind: str  # "one" | "bank"
    tensor: Node
    dim: int = 0
    start: int = 0
    stop: int = 1


def _base_of_size1_insert(node: Node) -> Node:
    """See through unsqueeze / reshape that only insert size-1 dims."""
    while node.op == "call_function" and node.target in (
            aten.unsqueeze.default, aten.reshape.default, aten.view.default):
        x = node.args[0]
        if not isinstance(x, Node):
            break
        a = [s for s in _shape(x) if not _one(s)]
        b = [s for s in _shape(node) if not _one(s)]
        if len(a) != len(b) or not all(_eq(p, q) for p, q in zip(a, b, strict=True)):
            break
        if len(_shape(x)) >= len(_shape(node)):
            break
        node = x
    return node


def _segments(root: Node, c: int | None) -> list[_Segment]:
    shape = _shape(root)
    if c is None:  # one source; the source axis has size 1
        base = _base_of_size1_insert(root)
        if base is root and not (root.target is aten.cat.default and len(root.args[0]) == 1):
            raise NoMatch(f"root {root.name}: softmax over a size-1 axis that does not come "
                          "from stacking a single source")
        if base is root:
            base = _base_of_size1_insert(root.args[0][0])
        return [_Segment("one", base)]
    if root.target is aten.cat.default:
        dim = _norm_dim(root.args[1] if len(root.args) > 1 else 0, len(shape))
        if dim == c:
            segs = []
            for p in root.args[0]:
                if len(_shape(p)) != len(shape):  # cat's legacy empty 1-D operand
                    if _numel(p) == 0:
                        continue
                    raise NoMatch(f"root {root.name}: piece {p.name} has another rank")
                k = _shape(p)[c]
                if not isinstance(k, int):
                    raise NoMatch(f"root {root.name}: piece {p.name} has a symbolic source count")
                if k == 0:
                    continue
                if k == 1:
                    if p.target is aten.unsqueeze.default and _norm_dim(
                            p.args[1], len(shape)) == c:
                        segs.append(_Segment("one", p.args[0]))
                    else:
                        segs.append(_Segment("bank", p, c, 0, 1))
                    continue
                if (p.target is aten.slice.Tensor and _norm_dim(p.args[1], len(shape)) == c
                        and (len(p.args) < 5 or p.args[4] == 1)):
                    base = p.args[0]
                    start = p.args[2] if len(p.args) > 2 and p.args[2] is not None else 0
                    start = _norm_dim(start, _shape(base)[c]) if start < 0 else start
                    segs.append(_Segment("bank", base, c, start, start + k))
                else:
                    segs.append(_Segment("bank", p, c, 0, k))
            return segs
    if root.target in (aten.reshape.default, aten.view.default) and isinstance(
            root.args[0], Node) and root.args[0].target is aten.cat.default:
        cat = root.args[0]
        pieces = cat.args[0]
        dim = _norm_dim(cat.args[1] if len(cat.args) > 1 else 0, len(_shape(cat)))
        P = _shape(pieces[0])
        want = P[:dim] + (len(pieces),) + P[dim:]
        if dim == c and all(len(_shape(p)) == len(P) and all(
                _eq(x, y) for x, y in zip(_shape(p), P, strict=True)) for p in pieces) and len(
                want) == len(shape) and all(_eq(x, y) for x, y in zip(want, shape, strict=True)):
            return [_Segment("one", p) for p in pieces]  # a lowered torch.stack
    n = shape[c]
    if not isinstance(n, int):
        raise NoMatch(f"root {root.name}: symbolic number of sources")
    return [_Segment("bank", root, c, 0, n)]


# -- the pass -----------------------------------------------------------------------------


def debug_enabled() -> bool:
    flag = os.environ.get(DEBUG_ENV, "")
    return flag not in ("", "0", "false", "False") or bool(
        os.environ.get("TORCHINDUCTOR_PATTERN_MATCH_DEBUG"))


class AttnResFusionPass(KimiGraphPass):
    """Replace plain-torch AttnRes mixing with ``kimi.attn_res_mix`` / ``attn_res_mix_list``."""

    index = 0
    _instance: AttnResFusionPass | None = None

    def __init__(self, debug: bool | None = None):
        #: None: follow $KIMI_PASSES_FUSION_DEBUG / $TORCHINDUCTOR_PATTERN_MATCH_DEBUG.
        self.debug = debug
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
        # ``debug`` only changes logging, never the graph: not part of the cache key. The
        # rewrite also depends on consumer.py (which sites the aux-stream pass will read).
        return {"consumer.py": get_hash_for_files((consumer.__file__,)).hex()}

    def __call__(self, graph: Graph) -> None:
        self.last_fused, self.last_sites, self.last_misses = 0, [], []
        softmaxes = _softmax_nodes(graph)
        if not softmaxes:
            return
        self.dump(graph, "before")
        pos = {n: i for i, n in enumerate(graph.nodes)}
        matches: list[_Match] = []
        taken: set[Node] = set()
        for s in softmaxes:
            try:
                m = _match(s, pos)
            except NoMatch as e:
                self.last_misses.append(NearMiss(s.name, [str(e)]))
                continue
            if isinstance(m, NearMiss):
                self.last_misses.append(m)
            elif m.out not in taken:
                taken.add(m.out)
                matches.append(m)
        tapped = [n.args[0] for n in graph.nodes if n.op == "call_function"
                  and n.target is AUX_TAP]
        for m in matches:
            try:
                self.last_sites.append(_rewrite(graph, m, tapped))
            except NoMatch as e:
                self.last_misses.append(NearMiss(m.softmax.name, [f"rewrite: {e}"]))
        self.last_fused = len(self.last_sites)
        if self.last_fused:
            graph.eliminate_dead_code()
        self.dump(graph, "after")
        logger.info(
            "AttnResFusionPass: fused %d AttnRes mixing site(s)%s", self.last_fused,
            (": " + "; ".join(str(s) for s in self.last_sites)) if self.last_sites else "",
        )
        debug = self.debug if self.debug is not None else debug_enabled()
        if debug:
            for miss in self.last_misses:
                logger.info("AttnResFusionPass: %s", miss)


def _match(softmax: Node, pos: dict) -> _Match | NearMiss:
    combiners = _combiners(softmax)
    if not combiners:
        raise NoMatch("its output reaches no mul/bmm/mm (no weighted sum)")
    miss = NearMiss(softmax.name)
    for w, prob_side in combiners:
        roots = _roots(w, prob_side)
        for root in roots:
            try:
                ev = _Evaluator(root, softmax, w, pos)
                out, val = ev.run()
                n_dim = None if ev.n_axis == () else next(
                    i for i, d in enumerate(ev.vals[root].dims) if d == ev.n_axis)
                segments = _segments(root, n_dim)
            except NoMatch as e:
                miss.reasons.append(f"[{w.name} over root {root.name}] {e}")
                continue
            except Exception as e:  # a matcher bug must not fail the compile: say so, loudly
                logger.warning("AttnResFusionPass: matcher error on softmax %s over root %s "
                               "(site left unfused): %r", softmax.name, root.name, e)
                miss.reasons.append(f"[{w.name} over root {root.name}] matcher error: {e!r}")
                continue
            lg = ev.logits
            return _Match(softmax, root, out, val.dims, ev.axes, n_dim, lg.rs, lg.vecs,
                          lg.scalar, ev.sizes, segments)
        if not roots:
            miss.reasons.append(f"[{w.name}] no other operand")
    return miss


# -- rewriting ----------------------------------------------------------------------------


class _Emitter:
    def __init__(self, graph: Graph, before: Node):
        self.graph, self.before = graph, before
        self.fake_mode = before.meta["val"].fake_mode if hasattr(
            before.meta.get("val"), "fake_mode") else None
        self.meta = {k: before.meta[k] for k in ("nn_module_stack", "stack_trace")
                     if k in before.meta}
        #: Tensors whose dims give symbolic sizes (``sym_size``) under dynamic shapes.
        self.size_sources: list[Node] = []
        self._syms: dict = {}

    def size(self, *factors):
        """A size argument: the product of ``factors`` (ints, SymInts or sympy)."""
        static, nodes = 1, []
        for f in factors:
            e = _expr(f)
            if e.is_number:
                static *= int(e)
            else:
                nodes.append(self._sym(e))
        if not nodes:
            return static
        out = nodes[0]
        for n in nodes[1:]:
            out = self(operator.mul, out, n)
        return out if static == 1 else self(operator.mul, out, static)

    def _sym(self, e) -> Node:
        if e not in self._syms:
            for t in self.size_sources:
                for d, s in enumerate(_shape(t)):
                    if _eq(s, e):
                        self._syms[e] = self(aten.sym_size.int, t, d)
                        return self._syms[e]
            raise NoMatch(f"no tensor at hand carries the symbolic size {e}")
        return self._syms[e]

    def __call__(self, target, *args, **kwargs) -> Node:
        with self.graph.inserting_before(self.before):
            node = self.graph.call_function(target, args, kwargs)
        fake_args = torch.fx.node.map_arg(args, lambda n: n.meta["val"])
        fake_kwargs = torch.fx.node.map_arg(kwargs, lambda n: n.meta["val"])
        if self.fake_mode is not None:
            with self.fake_mode:
                node.meta["val"] = target(*fake_args, **fake_kwargs)
        else:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        node.meta.update(self.meta)
        return node


def _peel_vec(node: Node, H) -> Node:
    """The cleanest node holding the same H values: through views and widening casts."""
    best = node
    while node.op == "call_function" and isinstance(node.args[0] if node.args else None, Node):
        t = node.target
        x = node.args[0]
        if t in _CASTS:
            if _PRECISION.get(_dtype(node), 0) < _PRECISION.get(_dtype(x), 0):
                break
        elif t not in (aten.reshape.default, aten.view.default, aten.unsqueeze.default,
                       aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
                       aten.permute.default, aten.clone.default, aten.alias.default,
                       aten.detach.default, aten.t.default, aten.transpose.int):
            break
        if not _eq(_numel(x), H):
            break
        node = x
        if len(_shape(node)) == 1:
            best = node
    return best if len(_shape(best)) == 1 else node


def _rewrite(graph: Graph, m: _Match, tapped: list) -> FusedSite:
    out = m.out
    src_dtype = _dtype(m.root)
    out_dtype = _dtype(out)
    users = list(out.users)
    if (out_dtype != src_dtype and len(users) == 1 and users[0].target in _CASTS
            and _dtype(users[0]) == src_dtype):
        out = users[0]  # the mixture is cast straight back: absorb the cast
        out_dtype = src_dtype
    segs = m.segments
    H = m.sizes[m.axes[-1]]
    emit = _Emitter(graph, out)
    emit.size_sources = [s.tensor for s in segs]

    # The weights: vectors over H (peeled to 1-D) and scalar factors.
    vecs, scalars = [], []
    for v in m.vecs:
        (vecs if _eq(_numel(v), H) else scalars).append(v)
    vecs = [_peel_vec(v, H) for v in vecs]
    vecs = [v if len(_shape(v)) == 1 else emit(aten.reshape.default, v, [emit.size(H)])
            for v in vecs]
    if not vecs:
        raise NoMatch("no pseudo-query vector")

    bank_prefix = (
        not scalars and m.scalar == 1.0 and len(vecs) <= 2
        and all(_dtype(v) == src_dtype for v in vecs)
        and segs[-1].kind == "one" and len(_shape(segs[-1].tensor)) == 2
        and _dtype(segs[-1].tensor) == src_dtype
        and (len(segs) == 1 or (len(segs) == 2 and segs[0].kind == "bank"
                                and segs[0].start == 0 and segs[0].dim == 1
                                and len(_shape(segs[0].tensor)) == 3
                                and _dtype(segs[0].tensor) == src_dtype))
    )
    # attn_res_mix returns the sources' dtype. A site that wants its mixture wider uses it
    # only when every use rounds back anyway, or when an aux tap reads the site (the
    # aux-stream pass finds attn_res_mix consumers; the output norm then sees the mixture
    # rounded once to the sources' dtype); otherwise attn_res_mix_list keeps it wide.
    widen = out_dtype != src_dtype
    mix_form = bank_prefix and (
        not widen or _recast_only(out, src_dtype)
        or any(_same_sum(_root_of(segs[-1].tensor), _root_of(v)) for v in tapped))
    prefix = segs[-1].tensor
    if mix_form:
        if len(segs) == 2:
            bank, nb = segs[0].tensor, segs[0].stop
        else:  # no completed blocks: an empty [T, 0, H] view of the prefix
            bank, nb = emit(aten.slice.Tensor, emit(aten.unsqueeze.default, prefix, 1),
                            1, 0, 0), 0
        if len(vecs) == 2:
            norm_weight, qk = vecs
        else:  # RMSNorm without a weight: a ones vector
            qk = vecs[0]
            norm_weight = emit(aten.full.default, [emit.size(H)], 1.0, dtype=src_dtype,
                               device=prefix.meta["val"].device)
        mixed = emit(kimi.attn_res_mix.default, prefix, bank, norm_weight, qk, nb, m.eps)
        if widen:
            mixed = emit(prims.convert_element_type.default, mixed, out_dtype)
        src_shape = _shape(prefix)
        op, count = "kimi.attn_res_mix", nb + 1
    else:
        sources = []
        for s in segs:
            if s.kind == "one":
                sources.append(s.tensor)
            else:
                sources += [emit(aten.select.int, s.tensor, s.dim, j)
                            for j in range(s.start, s.stop)]
        shapes = {tuple(_shape(s)) for s in sources}
        if len(shapes) != 1:
            raise NoMatch(f"sources of different shapes {sorted(shapes)}")
        src_shape = _shape(sources[0])
        norm_weight = vecs[0] if len(vecs) >= 2 else None
        rest = vecs[1:] if len(vecs) >= 2 else vecs
        qk = rest[0]
        extra = rest[1:] + scalars
        if extra or m.scalar != 1.0:
            if _dtype(qk) != torch.float32:
                qk = emit(prims.convert_element_type.default, qk, torch.float32)
            for e in extra:
                if _dtype(e) != torch.float32:
                    e = emit(prims.convert_element_type.default, e, torch.float32)
                qk = emit(aten.mul.Tensor, qk, e if _eq(_numel(e), H) else emit(
                    aten.reshape.default, e, []))
            if m.scalar != 1.0:
                qk = emit(aten.mul.Tensor, qk, m.scalar)
        mixed = emit(kimi.attn_res_mix_list.default, sources, norm_weight, qk, m.eps,
                     None if out_dtype == src_dtype else out_dtype)
        op, count = "kimi.attn_res_mix_list", len(sources)

    # The mixture's axes, in the sources' order, mapped onto the replaced node's layout.
    src_axes = [a for i, a in enumerate(m.axes) if m.n_dim is None or a != f"a{m.n_dim}"]
    new = _relayout(emit, mixed, src_shape, src_axes, m.out_dims, _shape(out), m.sizes)
    out.replace_all_uses_with(new)
    return FusedSite(mixed.name, op, count, out.name)


def _recast_only(node: Node, dtype: torch.dtype) -> bool:
    """Does every use of ``node`` (through views) cast it to ``dtype``?"""
    stack, seen = list(node.users), set()
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if u.op == "call_function" and u.target in _CASTS and _dtype(u) == dtype:
            continue
        if u.op == "call_function" and u.target in _VIEWS:
            stack.extend(u.users)
            continue
        return False
    return bool(seen)


def _relayout(emit, mixed: Node, src_shape, src_axes, out_dims, out_shape, sizes) -> Node:
    """``mixed`` (logical axes ``src_axes``) rearranged into ``out_dims`` / ``out_shape``."""
    order = [a for d in out_dims for a in d]
    same_shape = len(src_shape) == len(out_shape) and all(
        _eq(a, b) for a, b in zip(src_shape, out_shape, strict=True))
    target = [emit.size(*(sizes[a] for a in d)) for d in out_dims]
    if order == src_axes:
        return mixed if same_shape else emit(aten.reshape.default, mixed, target)
    x = mixed
    if len(src_shape) != len(src_axes):
        x = emit(aten.reshape.default, x, [emit.size(sizes[a]) for a in src_axes])
    x = emit(aten.permute.default, x, [src_axes.index(a) for a in order])
    return emit(aten.reshape.default, x, target)


__all__ = ["AttnResFusionPass", "FusedSite", "NearMiss", "NoMatch", "debug_enabled"]
