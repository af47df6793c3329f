"""Recognising a plain-torch AttnRes mixture: symbolic evaluation of one candidate.

Given a candidate root ``R`` (the stacked sources ``V``), a softmax and the node that
combines its probabilities with ``R`` (``mul``/``bmm``/``mm``), ``MixtureEvaluator``
assigns every node between ``R`` and the weighted sum a ``MixtureValue``, in graph
order, through ``fusion.rules.HANDLERS`` (a table from op to rule). Each rule maps the
values of its inputs to its own or raises ``NoMatch`` saying which check failed. What
must come out: raw sources, RMS-normalised over the hidden axis (the last axis of
``R``), dotted with weight vectors that vary only along the hidden axis, softmaxed over
one other axis (the source axis), and the probabilities times the *exact* raw sources
summed over it.
"""

from __future__ import annotations

from torch.fx import Node

from kimi_passes.fusion.rules import HANDLERS
from kimi_passes.fusion.state import MixtureState
from kimi_passes.fusion.values import Kind, MixtureValue, NoMatch


class MixtureEvaluator(MixtureState):
    """The symbolic evaluation of one candidate (``root``, ``softmax``, ``combine``).

    After ``run()`` the state (``MixtureState``) describes the mixture found.
    """

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
