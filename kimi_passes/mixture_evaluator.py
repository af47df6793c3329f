"""Recognising a plain-torch AttnRes mixture: symbolic evaluation of one candidate.

Given a candidate root ``R`` (the stacked sources ``V``), a softmax and the node that
combines its probabilities with ``R`` (``mul``/``bmm``/``mm``), ``MixtureEvaluator``
assigns every node between ``R`` and the weighted sum a ``MixtureValue``, in graph
order, through ``mixture_rules.HANDLERS`` (a table from op to rule). Each rule maps the
values of its inputs to its own or raises ``NoMatch`` saying which check failed. What
must come out: raw sources, RMS-normalised over the hidden axis (the last axis of
``R``), dotted with weight vectors that vary only along the hidden axis, softmaxed over
one other axis (the source axis), and the probabilities times the *exact* raw sources
summed over it.
"""

from __future__ import annotations

from torch.fx import Node

from kimi_passes.mixture_axes import check_dims
from kimi_passes.mixture_rules import HANDLERS
from kimi_passes.mixture_values import (
    Kind,
    MixtureValue,
    NoMatch,
    is_one,
    normalize_dim,
    shape_of,
)


class MixtureEvaluator:
    """The symbolic evaluation of one candidate (``root``, ``softmax``, ``combine``).

    After ``run()``: ``axes`` (the root's axis names), ``sizes`` (name -> size),
    ``source_axis`` (the softmax's axis; ``()`` when it has size 1), ``logits``.
    """

    def __init__(self, root: Node, softmax: Node, combine: Node):
        self.root, self.softmax, self.combine = root, softmax, combine
        self.sizes: dict[str, object] = {}
        dims = []
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

    # -- driver ---------------------------------------------------------------------------
    def run(self) -> tuple[Node, MixtureValue]:
        """The node holding the mixture and its value; NoMatch if there is none."""
        region = self._region()
        if self.softmax not in region:
            raise NoMatch(f"the weighted sum's values {self.root.name} are not the tensor the "
                          "logits were computed from")
        for node in region:
            self.values[node] = self.evaluate(node)
        out, val = self.combine, self.values[self.combine]
        while val.kind is Kind.WEIGHTED_SOURCES:  # mul, then views, then the sum over the sources
            users = list(out.users)
            if len(users) != 1:
                raise NoMatch(f"{out.name} (probabilities x sources) has {len(users)} users; "
                              "expected one sum over the source axis")
            out = users[0]
            val = self.evaluate(out)
            self.values[out] = val
        if val.kind is not Kind.MIXTURE:
            raise NoMatch(f"{out.name}: the softmax output meets the sources in a "
                          f"{val.kind.value!r} value, not a weighted sum over the source axis")
        flat = [a for d in val.dims for a in d]
        want = sorted(a for a in self.axes if (a,) != self.source_axis)
        if sorted(flat) != want:
            raise NoMatch(f"{out.name}: the weighted sum has axes {flat}, expected the root's "
                          f"axes except the source axis: {want}")
        if self.probabilities_node is not self.softmax:
            raise NoMatch(f"the weighted sum uses softmax {self.probabilities_node}, not "
                          f"{self.softmax.name}")
        return out, val

    def _region(self) -> list[Node]:
        """The nodes after the root that both depend on it and feed the combine, in order.

        (Nodes compare in graph order.)
        """
        ancestors, stack = set(), [self.combine]
        while stack:
            for a in stack.pop().all_input_nodes:
                if a not in ancestors and a > self.root:
                    ancestors.add(a)
                    stack.append(a)
        ancestors.add(self.combine)
        region, stack = set(), [self.root]
        while stack:
            for u in stack.pop().users:
                if u in ancestors and u not in region:
                    region.add(u)
                    stack.append(u)
        return sorted(region)

    def evaluate(self, node: Node) -> MixtureValue:
        t = node.target
        where = f"{node.name} ({getattr(t, '__name__', t)})"
        if node.op != "call_function":
            raise NoMatch(f"{where}: not a function call")
        handler = HANDLERS.get(t)
        if handler is None:
            raise NoMatch(f"{where}: op not part of an AttnRes mixture")
        return handler(self, node, where)

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
        src = node.args[0] if dim is not None else None
        if dim is not None:
            axis = self.softmax_axis_of(x.dims[normalize_dim(dim, len(x.dims))], where)
        self.check_logits(x, src if src is not None else node, where)
        if self.probabilities_node is not None:
            raise NoMatch(f"{where}: a second softmax ({self.probabilities_node.name}) in the "
                          "region")
        self.probabilities_node, self.source_axis, self.logits = node, axis, x
        return MixtureValue(Kind.PROBABILITIES, x.dims, softmax_axis=axis)
