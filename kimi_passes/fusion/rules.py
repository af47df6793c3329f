"""What each op computes from its inputs' abstract values: the mixture evaluator's rules.

``HANDLERS`` maps an ATen op to its rule ``rule(evaluator, node, where) -> MixtureValue``;
a rule reads its operands' values (``evaluator.value_of``), returns the node's value
or raises ``NoMatch`` naming the failed check (``where`` names the node). Views and
casts move axes and track exactness; mul/div/add/pow/unary ops and the reductions
build the RMSNorm, the query dot and the softmax's parts; ``bmm``/``mm``/``addmm`` are
the query dot or the weighted sum, ``mv`` the query dot (training graphs, undecomposed).
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import torch
from torch.fx import Node

from kimi_passes.fusion.axes import VIEWS, broadcast_dims, view_dims
from kimi_passes.fusion.state import MixtureState
from kimi_passes.fusion.values import (
    Kind,
    MixtureValue,
    NoMatch,
    is_one,
    normalize_dim,
    numel,
    same_logits,
    same_size,
    shape_of,
    static_int,
)
from kimi_passes.fx.fx_toolkit import CASTS, arg_node, dtype_of, is_lossless
from kimi_passes.fx.match import scalar

aten = torch.ops.aten

SOFTMAX_OPS = {aten._softmax.default, aten.softmax.int, aten._safe_softmax.default}
#: Tests of the logits' finiteness (Inductor's softmax-with-temperature rewrite).
GUARD_OPS = {
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.abs.default,
    aten.isinf.default, aten.isnan.default, aten.logical_not.default,
    aten.logical_and.default, aten.logical_or.default, aten.any.dims, aten.any.dim,
}


def _ext_kind(ev: MixtureState, ext: Node, dims: tuple, where: str) -> str:
    """How a tensor from outside the region broadcasts against ``dims``: 'vec' or 'scalar'."""
    shape = shape_of(ext)
    if len(shape) > len(dims) and not all(is_one(s) for s in shape[: len(shape) - len(dims)]):
        raise NoMatch(f"{where}: {ext.name} {list(shape)} broadcasts to more dims")
    kind = "scalar"
    for i in range(1, min(len(shape), len(dims)) + 1):
        s, d = shape[-i], dims[-i]
        if is_one(s):
            continue
        if d != ev.hidden_axis or not same_size(s, ev.hidden_size):
            raise NoMatch(f"{where}: {ext.name} {list(shape)} varies along an axis other "
                          "than the hidden one (not a weight vector)")
        kind = "vec"
    return kind


def _is_mean(ev: MixtureState, x: MixtureValue) -> bool:
    """Is the SUM_OF_SQUARES value ``x`` the mean of V^2 over the hidden axis?

    A ``mean`` not scaled again (``scale`` exactly 1.0) is: exact, and safe for a symbolic
    H. A sum scaled by literals is only where H is a static int and the literals make
    1/H: a model that writes 1/H as a literal (``x.pow(2).sum(-1) / 4096``, or
    ``* (1 / 7168)``), whose float rounding need not be exact (``(1 / 49) * 49`` is
    0.9999999999999999). That is the one float tolerance on sizes in the fusion.
    Nothing else is a mean: a mean scaled again, or a literal against a symbolic H (it
    equals 1/H for one H only).
    """
    if x.mean:
        return x.scale == 1.0
    H = static_int(ev.hidden_size)
    return H is not None and abs(x.scale * H - 1) <= 1e-6


def _view(ev: MixtureState, node: Node, where: str) -> MixtureValue:
    x = ev.value_of(node.args[0])
    if x is None:
        raise NoMatch(f"{where}: view of a tensor outside the region")
    dims = view_dims(node, x.dims, ev.sizes, where)
    return ev.checked(node, replace(x, dims=dims), where)


def _cast(ev: MixtureState, node: Node, where: str) -> MixtureValue:
    x = ev.value_of(node.args[0])
    if x is None:
        raise NoMatch(f"{where}: cast of a tensor outside the region")
    if node.target is aten._to_copy.default and set(node.kwargs) - {
            "dtype", "memory_format", "layout", "device"}:
        raise NoMatch(f"{where}: _to_copy with {sorted(node.kwargs)}")
    lossless = is_lossless(dtype_of(node.args[0]), dtype_of(node))
    return replace(x, exact=x.exact and lossless)


def _guard(ev: MixtureState, node: Node, where: str) -> MixtureValue:
    """A finiteness test of the logits (Inductor's softmax-with-temperature rewrite)."""
    for a in node.all_input_nodes:
        v = ev.value_of(a)
        if v is not None and v.kind is not Kind.GUARD and not v.is_logits:
            raise NoMatch(f"{where}: test of {v.kind}, not of the logits")
    return MixtureValue(Kind.GUARD, ((),) * len(shape_of(node)))


def _where(ev: MixtureState, node: Node, where: str) -> MixtureValue:
    """``where(cond, a, b)`` of two equal shifted logits: the condition does not matter."""
    cond, a, b = (ev.value_of(x) for x in node.args[:3])
    if cond is None or cond.kind is not Kind.GUARD or a is None or b is None:
        raise NoMatch(f"{where}: where() outside a softmax rewrite")
    if not (a.kind is b.kind is Kind.SHIFTED and a.softmax_axis == b.softmax_axis
            and same_logits(a.logits, b.logits)):
        raise NoMatch(f"{where}: where() picks between different values")
    dims = broadcast_dims(a.dims, b.dims, where)
    return ev.checked(node, replace(a, dims=dims), where)


def _mul(ev: MixtureState, node: Node, where: str) -> MixtureValue:
    a, b = node.args[0], node.args[1]
    va, vb = ev.value_of(a), ev.value_of(b)
    if va is None and vb is not None:
        a, b, va, vb = b, a, vb, va
    if va is None:
        raise NoMatch(f"{where}: product of tensors outside the region")
    c = scalar(b)
    if vb is None and c is not None:  # x * python scalar
        if va.kind is Kind.MONOMIAL:
            return replace(va, coefficient=va.coefficient * c, exact=va.exact and c == 1.0)
        if va.kind is Kind.SUM_OF_SQUARES:
            return replace(va, scale=va.scale * c)
        if va.kind is Kind.SHIFTED and c > 0:
            lg = cast(MixtureValue, va.logits)  # a SHIFTED value carries its logits
            return replace(va, logits=replace(lg, coefficient=lg.coefficient * c))
        if va.kind is Kind.GUARD:
            return va
        raise NoMatch(f"{where}: {va.kind} scaled by {c}")
    if vb is None:  # x * a tensor from outside: a weight vector (or a scalar)
        b = cast(Node, b)  # not a python scalar (c is None)
        if va.kind is not Kind.MONOMIAL:
            raise NoMatch(f"{where}: {va.kind} times {b.name}")
        ext = _ext_kind(ev, b, va.dims, where)
        if va.hidden_summed and ext == "vec":
            raise NoMatch(f"{where}: a hidden-axis sum times the vector {b.name}")
        extra = len(shape_of(b)) - len(va.dims)
        dims = ((),) * extra + va.dims if extra > 0 else va.dims
        return replace(va, dims=dims, weights=va.weights + (b,), exact=False)
    dims = broadcast_dims(va.dims, vb.dims, where)
    if va.kind is vb.kind is Kind.GUARD:
        return MixtureValue(Kind.GUARD, dims)
    if va.is_raw_sources and vb.is_raw_sources:
        if va.dims != vb.dims:
            raise NoMatch(f"{where}: product of two differently laid out source values")
        return MixtureValue(Kind.SQUARE, dims)
    if {va.kind, vb.kind} == {Kind.PROBABILITIES, Kind.MONOMIAL}:
        p, v = (va, vb) if va.kind is Kind.PROBABILITIES else (vb, va)
        ev.check_summed_values(v, where)
        if ev.hidden_axis in p.dims:
            raise NoMatch(f"{where}: probabilities vary along the hidden axis")
        kind = Kind.MIXTURE if ev.source_axis == () else Kind.WEIGHTED_SOURCES
        return MixtureValue(kind, dims)
    if va.kind is vb.kind is Kind.MONOMIAL:
        if va.has_sources and vb.has_sources:
            raise NoMatch(f"{where}: product of two source-derived values")
        if va.rsqrt_eps is not None and vb.rsqrt_eps is not None:
            raise NoMatch(f"{where}: two rsqrt factors")
        for s, other in ((va, vb), (vb, va)):
            if s.hidden_summed and (other.has_sources or other.weights
                                    or ev.hidden_axis in other.dims):
                raise NoMatch(f"{where}: a hidden-axis sum times a hidden-axis value")
        return MixtureValue(
            Kind.MONOMIAL, dims, has_sources=va.has_sources or vb.has_sources,
            rsqrt_eps=va.rsqrt_eps if va.rsqrt_eps is not None else vb.rsqrt_eps,
            weights=va.weights + vb.weights, coefficient=va.coefficient * vb.coefficient,
            hidden_summed=va.hidden_summed or vb.hidden_summed, exact=False)
    raise NoMatch(f"{where}: product of {va.kind} and {vb.kind}")


def _div(ev: MixtureState, node: Node, where: str) -> MixtureValue:
    a, b = node.args[0], node.args[1]
    va, vb, c = ev.value_of(a), ev.value_of(b), scalar(b)
    if va is None:
        raise NoMatch(f"{where}: division of a tensor outside the region")
    if vb is None and c is not None and c != 0:
        if va.kind is Kind.MONOMIAL:
            return replace(va, coefficient=va.coefficient / c, exact=va.exact and c == 1.0)
        if va.kind is Kind.SHIFTED and c > 0:  # (x - max x) / c == x/c - max(x/c)
            lg = cast(MixtureValue, va.logits)  # a SHIFTED value carries its logits
            return replace(va, logits=replace(lg, coefficient=lg.coefficient / c))
        if va.kind is Kind.SUM_OF_SQUARES:
            return replace(va, scale=va.scale / c)
        raise NoMatch(f"{where}: {va.kind} divided by {c}")
    if vb is None:
        raise NoMatch(f"{where}: division by a tensor outside the region")
    dims = broadcast_dims(va.dims, vb.dims, where)
    if va.kind is Kind.MONOMIAL and vb.kind is Kind.ROOT_MEAN_SQUARE:
        if va.rsqrt_eps is not None or va.hidden_summed:
            raise NoMatch(f"{where}: second normalisation of the keys")
        return replace(va, dims=dims, rsqrt_eps=vb.eps, exact=False)
    if va.kind is Kind.EXPONENTIALS and vb.kind is Kind.DENOMINATOR and vb.reduced is a:
        logits = cast(MixtureValue, va.logits)  # EXPONENTIALS values carry their logits
        return ev.found_probabilities(node, logits, None, where, axis=vb.softmax_axis)
    raise NoMatch(f"{where}: {va.kind} divided by {vb.kind}")


def _add(ev: MixtureState, node: Node, where: str) -> MixtureValue:
    if node.kwargs.get("alpha", 1) != 1:
        raise NoMatch(f"{where}: add/sub with alpha")
    a, b = node.args[0], node.args[1]
    va, vb, c = ev.value_of(a), ev.value_of(b), scalar(b)
    sub = node.target in (aten.sub.Tensor, aten.sub.Scalar)
    if va is None:
        raise NoMatch(f"{where}: {'sub' if sub else 'add'} of a tensor outside the region")
    if sub and vb is not None and vb.kind is Kind.MAX and vb.reduced is a:
        return MixtureValue(Kind.SHIFTED, broadcast_dims(va.dims, vb.dims, where),
                            softmax_axis=vb.softmax_axis, logits=va)
    if va.kind is Kind.SUM_OF_SQUARES and not sub and vb is None and c is not None:
        if not _is_mean(ev, va):
            raise NoMatch(f"{where}: eps added to {va.scale:g} * "
                          f"{'mean' if va.mean else 'sum'}(x^2), not the mean")
        if c < 0:
            raise NoMatch(f"{where}: negative eps {c}")
        return MixtureValue(Kind.MEAN_SQUARE_EPS, va.dims, eps=c)
    if va.is_logits:
        # A term constant along the source axis does not change the softmax.
        if vb is None and (c is not None or (isinstance(b, Node) and is_one(numel(b)))):
            return va
    raise NoMatch(f"{where}: {'sub' if sub else 'add'} of {va.kind} and "
                  f"{vb.kind if vb else b}")


def _pow(ev: MixtureState, node: Node, where: str) -> MixtureValue:
    x, e = ev.value_of(node.args[0]), node.args[1]
    if x is None:
        raise NoMatch(f"{where}: power of a tensor outside the region")
    if x.is_raw_sources and e == 2:
        return MixtureValue(Kind.SQUARE, x.dims)
    if x.kind is Kind.MEAN_SQUARE_EPS and e == -0.5:
        return MixtureValue(Kind.MONOMIAL, x.dims, rsqrt_eps=x.eps, exact=False)
    if x.kind is Kind.MEAN_SQUARE_EPS and e == 0.5:
        return MixtureValue(Kind.ROOT_MEAN_SQUARE, x.dims, eps=x.eps)
    raise NoMatch(f"{where}: {x.kind} ** {e}")


def _unary(ev: MixtureState, node: Node, where: str) -> MixtureValue:
    t, x = node.target, ev.value_of(node.args[0])
    if x is None:
        raise NoMatch(f"{where}: of a tensor outside the region")
    if t is aten.rsqrt.default and x.kind is Kind.MEAN_SQUARE_EPS:
        return MixtureValue(Kind.MONOMIAL, x.dims, rsqrt_eps=x.eps, exact=False)
    if t is aten.rsqrt.default and x.kind is Kind.SUM_OF_SQUARES and _is_mean(ev, x):
        return MixtureValue(Kind.MONOMIAL, x.dims, rsqrt_eps=0.0, exact=False)
    if t is aten.sqrt.default and x.kind is Kind.MEAN_SQUARE_EPS:
        return MixtureValue(Kind.ROOT_MEAN_SQUARE, x.dims, eps=x.eps)
    if t is aten.reciprocal.default and x.kind is Kind.ROOT_MEAN_SQUARE:
        return MixtureValue(Kind.MONOMIAL, x.dims, rsqrt_eps=x.eps, exact=False)
    if t is aten.neg.default and x.kind is Kind.MONOMIAL:
        return replace(x, coefficient=-x.coefficient, exact=False)
    if t is aten.exp.default and x.kind is Kind.SHIFTED:
        return MixtureValue(Kind.EXPONENTIALS, x.dims, softmax_axis=x.softmax_axis,
                            logits=x.logits)
    if t is aten.exp.default and x.kind is Kind.MONOMIAL:
        ev.check_logits(x, arg_node(node, 0), where)
        return MixtureValue(Kind.EXPONENTIALS, x.dims, softmax_axis=None, logits=x)
    raise NoMatch(f"{where}: applied to {x.kind}")


def _reduce(ev: MixtureState, node: Node, where: str) -> MixtureValue:
    t, x = node.target, ev.value_of(node.args[0])
    if x is None:
        raise NoMatch(f"{where}: reduction of a tensor outside the region")
    rank = len(x.dims)
    dims_arg = cast("int | list[int] | None",  # the schema's ``int[1]? dim``
                    node.args[1] if len(node.args) > 1 else node.kwargs.get("dim"))
    if dims_arg is None:
        raise NoMatch(f"{where}: reduction over every dim")
    dims_arg = dims_arg if isinstance(dims_arg, (list, tuple)) else [dims_arg]
    if len(dims_arg) != 1:
        raise NoMatch(f"{where}: reduction over {len(dims_arg)} dims")
    d = normalize_dim(dims_arg[0], rank)
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    axis = x.dims[d]
    kept = list(x.dims)
    if keep:
        kept[d] = ()
    else:
        kept.pop(d)
    dims = tuple(kept)
    if t is aten.amax.default:
        softmax_axis = ev.softmax_axis_of(axis, where)
        ev.check_logits(x, arg_node(node, 0), where)
        return MixtureValue(Kind.MAX, dims, reduced=arg_node(node, 0), softmax_axis=softmax_axis,
                            logits=x)
    if node.kwargs.get("dtype") is not None:
        raise NoMatch(f"{where}: reduction with a dtype")
    hidden = axis == ev.hidden_axis
    if x.kind is Kind.SQUARE and hidden:
        return MixtureValue(Kind.SUM_OF_SQUARES, dims, mean=t is aten.mean.dim)
    if t is aten.sum.dim_IntList:
        if x.kind is Kind.MONOMIAL and x.has_sources and not x.hidden_summed and hidden:
            return replace(x, dims=dims, hidden_summed=True, exact=False)
        if x.kind is Kind.EXPONENTIALS:
            softmax_axis = ev.softmax_axis_of(axis, where)
            if x.softmax_axis is not None and x.softmax_axis != softmax_axis:
                raise NoMatch(f"{where}: softmax sums over {softmax_axis} but shifted over "
                              f"{x.softmax_axis}")
            return MixtureValue(Kind.DENOMINATOR, dims, reduced=arg_node(node, 0),
                                softmax_axis=softmax_axis, logits=x.logits)
        if (x.kind is Kind.WEIGHTED_SOURCES and ev.source_axis is not None
                and axis == ev.source_axis):
            return MixtureValue(Kind.MIXTURE, dims)
    raise NoMatch(f"{where}: reduction of {x.kind} over axis {axis}"
                  + (" (the hidden axis)" if hidden else ""))


def _softmax(ev: MixtureState, node: Node, where: str) -> MixtureValue:
    x = ev.value_of(node.args[0])
    if x is None:
        raise NoMatch(f"{where}: softmax of a tensor outside the region")
    return ev.found_probabilities(node, x, node.args[1], where)


def _matmul(ev: MixtureState, node: Node, where: str) -> MixtureValue:
    t = node.target
    bias = arg_node(node, 0) if t is aten.addmm.default else None
    a, b = node.args[-2:] if bias is not None else node.args[:2]
    va, vb = ev.value_of(a), ev.value_of(b)
    batched = t is aten.bmm.default
    if va is None and vb is None:
        raise NoMatch(f"{where}: matmul of tensors outside the region")
    if va is None or vb is None:
        val = _query_dot(ev, va, vb, a, b, batched, where)
    else:
        if {va.kind, vb.kind} != {Kind.PROBABILITIES, Kind.MONOMIAL}:
            raise NoMatch(f"{where}: matmul of {va.kind} and {vb.kind}")
        ev.check_summed_values(vb if vb.kind is Kind.MONOMIAL else va, where)
        if va.dims[-1] != vb.dims[-2] or va.dims[-1] != ev.source_axis:
            raise NoMatch(f"{where}: the contraction pairs axes {va.dims[-1]} and "
                          f"{vb.dims[-2]}, not the softmax's source axis {ev.source_axis}")
        if batched and va.dims[0] != vb.dims[0]:
            raise NoMatch(f"{where}: batch axes {va.dims[0]} and {vb.dims[0]} differ")
        dims = ((va.dims[0],) if batched else ()) + (va.dims[-2], vb.dims[-1])
        flat = [x for d in dims for x in d]
        if len(flat) != len(set(flat)):
            raise NoMatch(f"{where}: the product repeats an axis (not a per-row sum)")
        val = MixtureValue(Kind.MIXTURE, dims)
    if bias is not None:
        c = scalar(bias)
        if not (val.kind is Kind.MONOMIAL and (c is not None or is_one(numel(bias)))):
            raise NoMatch(f"{where}: addmm bias {bias} is not constant over the sources")
    return ev.checked(node, val, where)


def _query_dot(ev: MixtureState, va, vb, a, b, batched: bool, where: str) -> MixtureValue:
    """keys @ pseudo-query (or its transpose): the contraction over the hidden axis."""
    mono, ext, ext_left = (vb, a, True) if va is None else (va, b, False)
    if mono.kind is not Kind.MONOMIAL or not mono.has_sources or mono.hidden_summed:
        raise NoMatch(f"{where}: matmul of {mono.kind} with {ext.name}")
    k_dim = -1 if ext_left else -2
    mono_k = mono.dims[-2] if ext_left else mono.dims[-1]
    if mono_k != ev.hidden_axis:
        raise NoMatch(f"{where}: the contraction is over axis {mono_k}, not the hidden "
                      "axis")
    shape = shape_of(ext)
    if not same_size(shape[k_dim], ev.hidden_size) or not all(
            is_one(s) for i, s in enumerate(shape) if i != len(shape) + k_dim):
        raise NoMatch(f"{where}: {ext.name} {list(shape)} is not a vector over the "
                      "hidden axis")
    if ext_left:
        dims = ((mono.dims[0],) if batched else ()) + ((), mono.dims[-1])
    else:
        dims = ((mono.dims[0],) if batched else ()) + (mono.dims[-2], ())
    return replace(mono, dims=dims, weights=mono.weights + (ext,), hidden_summed=True,
                   exact=False)


def _mv(ev: MixtureState, node: Node, where: str) -> MixtureValue:
    """keys ``[M, H]`` @ pseudo-query ``[H]`` (``matmul`` of a matrix and a vector, before
    Inductor decomposes it: graphs traced for training)."""
    a, v = cast("tuple[Node, Node]", node.args[:2])  # mv(self, vec)
    mono = ev.value_of(a)
    if mono is None or ev.value_of(v) is not None:
        raise NoMatch(f"{where}: mv of tensors outside the region, or of two region tensors")
    if mono.kind is not Kind.MONOMIAL or not mono.has_sources or mono.hidden_summed:
        raise NoMatch(f"{where}: mv of {mono.kind} with {v.name}")
    if mono.dims[-1] != ev.hidden_axis:
        raise NoMatch(f"{where}: the contraction is over axis {mono.dims[-1]}, not the "
                      "hidden axis")
    if not same_size(numel(v), ev.hidden_size):
        raise NoMatch(f"{where}: {v.name} {list(shape_of(v))} is not a vector over the "
                      "hidden axis")
    val = replace(mono, dims=(mono.dims[-2],), weights=mono.weights + (v,),
                  hidden_summed=True, exact=False)
    return ev.checked(node, val, where)


def _table(*groups) -> dict:
    return {op: handler for ops, handler in groups for op in ops}


#: op -> the rule that evaluates it.
HANDLERS = _table(
    (VIEWS, _view),
    (CASTS, _cast),
    ((aten.mul.Tensor, aten.mul.Scalar), _mul),
    ((aten.div.Tensor, aten.div.Scalar), _div),
    ((aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar), _add),
    ((aten.pow.Tensor_Scalar,), _pow),
    ((aten.rsqrt.default, aten.sqrt.default, aten.reciprocal.default, aten.neg.default,
      aten.exp.default), _unary),
    ((aten.mean.dim, aten.sum.dim_IntList, aten.amax.default), _reduce),
    (SOFTMAX_OPS, _softmax),
    ((aten.bmm.default, aten.mm.default, aten.addmm.default), _matmul),
    ((aten.mv.default,), _mv),
    (GUARD_OPS, _guard),
    ((aten.where.self,), _where),
)
