"""The abstract values the mixture evaluator assigns to nodes, and symbolic sizes.

The evaluator (``fusion.evaluator``) gives every node between the stacked sources ``V``
(the root) and the weighted sum one ``MixtureValue``: what it computes from ``V``, as a
``Kind`` with its parameters, and which root axes each of its dims holds. Root dim ``i``
of size > 1 is axis ``"a<i>"``; the last one is the hidden axis (summed over by the
RMSNorm and the query dot), one other becomes the source axis (the softmax's).

Sizes are ints, or SymInts under dynamic shapes (read off ``meta["val"]`` shapes).
Products are SymInt arithmetic; equality is ``statically_known_true(a == b)``: true only
when the shape environment proves it, without installing a guard (``bool()`` on a
SymBool would guard, or fail for an unbacked size). Inductor's own passes compare sizes
with ``V.graph.sizevars``, which does not exist here: post-grad custom passes run before
``GraphLowering`` is built, and the pre-autograd path has no graph lowering at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

from kimi_passes.fx.match import NoMatch  # every matcher's "no match"; fusion/ imports it here

# -- sizes ------------------------------------------------------------------------------------


def same_size(a, b) -> bool:
    """Are sizes ``a`` and ``b`` (ints or SymInts) provably equal? No guard is installed:
    an equality the shape environment cannot prove counts as a difference."""
    return statically_known_true(a == b)


def is_one(s) -> bool:
    return same_size(s, 1)


def same_shape(a, b) -> bool:
    """Are shapes ``a`` and ``b`` provably equal, dim by dim (``same_size``)?"""
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b, strict=True))


def static_int(s) -> int | None:
    """``s`` as an int if it is one (an int, or a SymInt whose expression is a number)."""
    return int(s) if is_concrete_int(s) else None


def shape_of(node) -> tuple:
    """``node``'s tensor shape; NoMatch if it holds no tensor."""
    val = node.meta.get("val") if isinstance(node, Node) else None
    if not isinstance(val, torch.Tensor):
        raise NoMatch(f"{getattr(node, 'name', node)} has no tensor metadata")
    return tuple(val.shape)


def numel(node: Node):
    """The product of ``node``'s sizes (an int, or a SymInt under dynamic shapes)."""
    return math.prod(shape_of(node))


def normalize_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


# -- abstract values --------------------------------------------------------------------------


class Kind(Enum):
    """What a node computes from the sources ``V``; the value is the name the logs use."""

    #: ``coefficient * V * rsqrt(mean_h V^2 + rsqrt_eps) * prod(weights)``, each factor
    #: optional, summed over the hidden axis if ``hidden_summed``: keys, logits, values.
    MONOMIAL = "mono"
    SQUARE = "sq"  # V^2
    SUM_OF_SQUARES = "ms"  # scale * sum_h V^2, or scale * mean_h V^2 (``mean``)
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
    #: SUM_OF_SQUARES: the product of the literal factors the sum (or mean) was
    #: multiplied or divided by, and whether the reduction was a mean.
    scale: float = 1.0
    mean: bool = False
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
