"""One candidate's evaluation state, and the checks the mixture rules share.

``MixtureState`` holds what the evaluation of one candidate (``root``, ``softmax``,
``combine``) has established so far: the root's named axes and their sizes, the value of
every node evaluated, and, once found, the softmax's source axis and logits. The rules
(``fusion.rules``) read and extend it; the driver (``fusion.evaluator``) walks the nodes.
"""

from __future__ import annotations

from typing import cast

from torch.fx import Node

from kimi_passes.fusion.axes import check_dims
from kimi_passes.fusion.values import (
    Kind,
    MixtureValue,
    NoMatch,
    is_one,
    normalize_dim,
    shape_of,
)


class MixtureState:
    """What the evaluation of one candidate (``root``, ``softmax``, ``combine``) knows.

    ``axes`` (the root's axis names), ``sizes`` (name -> size), ``values`` (node -> value),
    and once the softmax is met: ``source_axis`` (its axis; ``()`` when it has size 1),
    ``logits``, ``probabilities_node``.
    """

    def __init__(self, root: Node, softmax: Node, combine: Node):
        self.root, self.softmax, self.combine = root, softmax, combine
        self.sizes: dict[str, object] = {}
        dims: list[tuple[str, ...]] = []
        for i, s in enumerate(shape_of(root)):
            if is_one(s):
                dims.append(())
            else:
                name = f"a{i}"
                self.sizes[name] = s
                dims.append((name,))
        if not dims or dims[-1] == ():
            raise NoMatch(f"root {root.name}: its last dim (the hidden axis) has size 1")
        self.axes = [d[0] for d in dims if d]
        self.hidden_axis: tuple = dims[-1]
        self.hidden_size = self.sizes[self.hidden_axis[0]]
        self.values: dict[Node, MixtureValue] = {
            root: MixtureValue(Kind.MONOMIAL, tuple(dims), has_sources=True)}
        self.source_axis: tuple | None = None  # () when the source axis has size 1
        self.probabilities_node: Node | None = None
        self.logits: MixtureValue | None = None

    # -- operands -------------------------------------------------------------------------
    def value_of(self, a) -> MixtureValue | None:
        """The value of ``a`` if it is a node of the region, else None."""
        return self.values.get(a) if isinstance(a, Node) else None

    def checked(self, node: Node, val: MixtureValue, where: str) -> MixtureValue:
        """``val``, once ``node``'s shape agrees with its dims."""
        check_dims(node, val.dims, self.sizes, where)
        return val

    # -- checks the rules share ------------------------------------------------------------
    def check_summed_values(self, v: MixtureValue, where: str) -> None:
        """The values the probabilities weigh must be the raw sources, bit for bit."""
        if not v.is_raw_sources:
            raise NoMatch(f"{where}: the probabilities multiply a transformed copy of the "
                          "sources (keys or scaled values), not the raw sources")
        if not v.exact:
            raise NoMatch(f"{where}: the values summed are a rounded copy of the sources")

    def softmax_axis_of(self, axis: tuple, where: str) -> tuple:
        """``axis`` if a softmax may run over it (one axis, not the hidden one)."""
        if len(axis) > 1:
            raise NoMatch(f"{where}: softmax over merged axes {axis}")
        if axis == self.hidden_axis:
            raise NoMatch(f"{where}: softmax over the hidden axis")
        return axis

    def check_logits(self, x: MixtureValue, node: Node, where: str) -> None:
        """``x`` (of ``node``) must be RMS-normalised keys dotted with a pseudo-query."""
        if x.kind is not Kind.MONOMIAL or not x.hidden_summed:
            raise NoMatch(f"{where}: softmax input {node.name} is not a per-source logit (no "
                          "contraction over the hidden axis)")
        if x.rsqrt_eps is None:
            raise NoMatch(f"{where}: the logits {node.name} use keys that are not "
                          "RMS-normalised (no rsqrt(mean(x^2) + eps) factor)")
        if not x.weights:
            raise NoMatch(f"{where}: the logits {node.name} have no pseudo-query vector")

    def found_probabilities(self, node: Node, x: MixtureValue, dim, where: str,
                            axis=None) -> MixtureValue:
        """``node`` is the softmax of logits ``x`` over ``dim`` (or ``axis``): the one."""
        src = cast(Node, node.args[0]) if dim is not None else None  # the logits
        if dim is not None:
            axis = self.softmax_axis_of(x.dims[normalize_dim(dim, len(x.dims))], where)
        self.check_logits(x, src if src is not None else node, where)
        if self.probabilities_node is not None:
            raise NoMatch(f"{where}: a second softmax ({self.probabilities_node.name}) in the "
                          "region")
        self.probabilities_node, self.source_axis, self.logits = node, axis, x
        return MixtureValue(Kind.PROBABILITIES, x.dims, softmax_axis=axis)
