"""The abstract values the mixture evaluator assigns to nodes, and symbolic sizes.

The evaluator (``fusion.evaluator``) gives every node between the stacked sources ``V``
(the root) and the weighted sum one ``MixtureValue``: what it computes from ``V``, as a
``Kind`` with its parameters, and which root axes each of its dims holds. Root dim ``i``
of size > 1 is axis ``"a<i>"``; the last one is the hidden axis (summed over by the
RMSNorm and the query dot), one other becomes the source axis (the softmax's).

Sizes are ints, or SymInts under dynamic shapes: they are compared with sympy.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import sympy
import torch
from torch.fx import Node


class NoMatch(Exception):
    """A candidate is not an AttnRes mixture; the message says which check failed."""


# -- sizes ------------------------------------------------------------------------------------


def size_expr(s):
    """A size (int, SymInt or sympy expression) as a sympy expression."""
    if isinstance(s, sympy.Basic):
        return s
    if isinstance(s, torch.SymInt):
        return s.node.expr
    return sympy.Integer(int(s))


def same_size(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return sympy.expand(size_expr(a) - size_expr(b)) == 0


def is_one(s) -> bool:
    return same_size(s, 1)


def shape_of(node) -> tuple:
    """``node``'s tensor shape; NoMatch if it holds no tensor."""
    val = node.meta.get("val") if isinstance(node, Node) else None
    if not isinstance(val, torch.Tensor):
        raise NoMatch(f"{getattr(node, 'name', node)} has no tensor metadata")
    return tuple(val.shape)


def numel(node: Node):
    n = sympy.Integer(1)
    for s in shape_of(node):
        n = n * size_expr(s)
    return n


def normalize_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


# -- abstract values --------------------------------------------------------------------------


class Kind(Enum):
    """What a node computes from the sources ``V``; the value is the name the logs use."""

    #: ``coefficient * V * rsqrt(mean_h V^2 + rsqrt_eps) * prod(weights)``, each factor
    #: optional, summed over the hidden axis if ``hidden_summed``: keys, logits, values.
    MONOMIAL = "mono"
    SQUARE = "sq"  # V^2
    SUM_OF_SQUARES = "ms"  # scale * sum_h V^2 (the mean when scale == 1/H)
    MEAN_SQUARE_EPS = "mse"  # mean_h V^2 + eps
    ROOT_MEAN_SQUARE = "sqrt"  # sqrt(mean_h V^2 + eps)
    # The parts of a decomposed softmax over ``softmax_axis`` of ``logits``:
    MAX = "max"  # amax of the node ``reduced``
    SHIFTED = "shifted"  # logits - max
    EXPONENTIALS = "exps"  # exp(shifted) or exp(logits)
    DENOMINATOR = "den"  # the sum of the node ``reduced`` (exponentials)
    GUARD = "guard"  # a finiteness test of the logits, only ever a where() condition
    PROBABILITIES = "prob"  # softmax over ``softmax_axis``
    WEIGHTED_SOURCES = "pv"  # probabilities * V, before the sum over the source axis
    MIXTURE = "out"  # the weighted sum: what the fused op computes

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class MixtureValue:
    """The abstract value of one node between the root and the weighted sum.

    ``dims``: per tensor dim, the tuple of root axis names merged into it (row-major);
    ``()`` for a size-1 dim.
    """

    kind: Kind
    dims: tuple
    #: MONOMIAL: the V factor is there (False for a bare rsqrt factor).
    has_sources: bool = False
    #: MONOMIAL: eps of the rsqrt(mean_h V^2 + eps) factor; None without that factor.
    rsqrt_eps: float | None = None
    #: MONOMIAL: tensors from outside the region multiplied in (weight vectors, scalars).
    weights: tuple = ()
    coefficient: float = 1.0
    hidden_summed: bool = False
    #: The values are V bit for bit (no rounding cast, no arithmetic) where it matters.
    exact: bool = True
    #: SUM_OF_SQUARES: the factor in front of the sum.
    scale: object = None
    #: MEAN_SQUARE_EPS / ROOT_MEAN_SQUARE: the eps added to the mean.
    eps: float | None = None
    #: MAX / DENOMINATOR: the node the reduction reads.
    reduced: Node | None = None
    #: Softmax parts and PROBABILITIES: the axis the softmax runs over.
    softmax_axis: tuple | None = None
    #: Softmax parts: the logits they are computed from.
    logits: MixtureValue | None = None

    @property
    def is_raw_sources(self) -> bool:
        """V itself, laid out somehow (the values a weighted sum must read)."""
        return (self.kind is Kind.MONOMIAL and self.has_sources and self.rsqrt_eps is None
                and not self.weights and self.coefficient == 1.0 and not self.hidden_summed)

    @property
    def is_logits(self) -> bool:
        """RMS-normalised keys dotted with a pseudo-query over the hidden axis."""
        return (self.kind is Kind.MONOMIAL and self.has_sources and self.rsqrt_eps is not None
                and self.hidden_summed and bool(self.weights))


def same_logits(a: MixtureValue | None, b: MixtureValue | None) -> bool:
    """Do ``a`` and ``b`` hold the same logits (the same weight nodes, coefficient)?"""
    return (a is not None and b is not None and a.has_sources == b.has_sources
            and a.rsqrt_eps == b.rsqrt_eps and a.hidden_summed == b.hidden_summed
            and len(a.weights) == len(b.weights)
            and all(x is y for x, y in zip(a.weights, b.weights, strict=True))
            and abs(a.coefficient - b.coefficient)
            <= 1e-12 * max(abs(a.coefficient), abs(b.coefficient)))
