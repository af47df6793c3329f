"""Unmarked aux captures: returned values that are an AttnRes consumer's legacy input.

Model code that taps without ``kimi_passes.aux_tap`` (vLLM's own K3 forward) returns the
values. A returned value (an output, or a view or copy of one) is a capture when it is
exactly what a *capture consumer* of the same graph receives as its legacy input:

- ``prefix + delta`` as that call receives them, in either operand order, rounded as the
  kernel's own prefix add rounds (``fx_toolkit.sum_operands``), or the prefix itself when
  the call has no delta and mixes zero blocks (capture id 0, the embedding);
- or the output of a *pure mixing call* (no delta, no block write, no output norm) over
  the same sources, weights, ``num_blocks`` and eps as a capture consumer: vLLM's capture
  with ``VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1``, the same mixture read a second time.

Capture consumers: layer ``k``'s pre-attention mixing (the first AttnRes call traced in
``layers.k``: capture id ``k``) and the output aggregation (outside every layer: capture
id ``L``). The consumer is found by its arguments, never by where the returned value was
computed. Values are compared through copies and views (``root``, ``same_view``) and
through call outputs that leave a mutated argument as it was (``settled``). The rule:
docs/design.md section 4, "The recognition rule".
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.fx import Node

from kimi_passes.fx.fx_toolkit import COPIES, dtype_of, root, sum_operands
from kimi_passes.fx.kimi_calls import AttnResCall
from kimi_passes.taps import messages as msg

aten = torch.ops.aten

#: Ops a returned value may pass through and still be the value it views or copies.
RETURN_VIEWS = (*COPIES, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
                aten.unsqueeze.default)


@dataclass
class Capture:
    """One unmarked capture: a returned value and the consumer whose input it is."""

    consumer: AttnResCall
    #: From the consumer: its layer (pre-attention mixing) or L (output aggregation);
    #: None where the graph names no layer (no ``layers.N`` in its module stack).
    capture_id: int | None
    #: The value the graph returns (the legacy input, or the pure call's output node).
    value: Node
    #: vLLM's flag-on capture: the pure mixing call whose output is returned.
    pure: AttnResCall | None = None
    #: Where the graph returns ``value``: each slot's path into the output tuple and the
    #: views/copies from the slot's node down to (not including) ``value``.
    slots: list[tuple[tuple[int, ...], list[Node]]] = field(default_factory=list)

    @property
    def source(self) -> str:
        return "pure attn_res call" if self.pure is not None else "returned value"

    def describe(self) -> str:
        what = (f"{self.value.name} (a pure attn_res mixing call)" if self.pure is not None
                else msg.returned_value(self.value.name))
        return f"{what}, read by {self.consumer.describe()}"


@dataclass
class Captures:
    """What ``find_captures`` found in one graph."""

    found: list[Capture]
    #: Pure calls that mix exactly what one capture consumer mixes (returned or not).
    pure: list[AttnResCall]
    #: Returned values (a pure call's among them) matching several consumers.
    ambiguous: list[tuple[str, list[AttnResCall]]]


def is_pure(call: AttnResCall) -> bool:
    """A mixing read: no delta, no block write, no output norm (vLLM's flag-on capture)."""
    return (call.op is torch.ops.kimi.attn_res.default and call.arg("delta") is None
            and call.arg("block_write_idx") == -1 and not call.has_output_norm)


def find_captures(graph: torch.fx.Graph, calls: list[AttnResCall]) -> Captures:
    """The unmarked captures among ``graph``'s returned values (see the module docstring)."""
    by_node = {c.node: c for c in calls}
    first: dict[int, AttnResCall] = {}
    for c in calls:
        if c.layer is not None:
            first.setdefault(c.layer, c)
    num_layers = max(first) + 1 if first else None
    outside = [c for c in calls if c.layer is None]
    consumers = list(first.values()) + [c for c in outside if not is_pure(c)]
    ambiguous: list[tuple[str, list[AttnResCall]]] = []

    pure_of: dict[Node, tuple[AttnResCall, AttnResCall]] = {}  # output -> (pure, consumer)
    merged_calls: list[AttnResCall] = []
    pure_of_many: dict[Node, tuple[AttnResCall, list[AttnResCall]]] = {}
    for p in outside:
        if not is_pure(p):
            continue
        matches = [c for c in consumers if _same_mixing(p, c, by_node)]
        out = next((u for u in p.node.users if u.target is operator.getitem
                    and u.args[1] == 0), None)  # read only: no getitem made here
        if len(matches) == 1:
            if out is not None:
                pure_of[out] = (p, matches[0])
            merged_calls.append(p)
        elif matches and out is not None:
            pure_of_many[out] = (p, matches)
    merged = {p.node for p in merged_calls}
    # A pure-shaped call outside the layers that mixes for no consumer is a consumer
    # itself (an output aggregation written with the prefix add before the call).
    consumers += [c for c in outside if is_pure(c) and c.node not in merged]

    def capture_id(c: AttnResCall) -> int | None:
        return c.layer if c.layer is not None else num_layers

    slots: dict[Node, list[tuple[tuple[int, ...], list[Node]]]] = {}
    for path, chain in returned(graph):
        slots.setdefault(chain[-1], []).append((path, chain[:-1]))
    found = []
    for value, where in slots.items():
        if value in pure_of:
            p, c = pure_of[value]
            found.append(Capture(c, capture_id(c), value, p, where))
            continue
        if value in pure_of_many:
            p, many = pure_of_many[value]
            ambiguous.append((msg.returned_value(value.name, p.node.name), many))
            continue
        matches = [c for c in consumers if _returns_input(c, value, by_node)]
        if len(matches) == 1:
            found.append(Capture(matches[0], capture_id(matches[0]), value, None, where))
        elif matches:
            ambiguous.append((msg.returned_value(value.name), matches))
    return Captures(found, merged_calls, ambiguous)


def returned(graph: torch.fx.Graph) -> Iterator[tuple[tuple[int, ...], list[Node]]]:
    """Each node the graph returns: its path in the output, and the chain of views/copies
    from it down to the value it views (the last element; the node itself if none)."""
    def walk(x, path):
        if isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                yield from walk(v, (*path, i))
        elif isinstance(x, Node):
            chain = [x]
            while (chain[-1].op == "call_function" and chain[-1].target in RETURN_VIEWS
                   and isinstance(chain[-1].args[0], Node)):
                chain.append(chain[-1].args[0])
            yield path, chain
    yield from walk(graph.output_node().args[0], ())


def replace_returned(graph: torch.fx.Graph, path: tuple[int, ...], node: Node) -> None:
    """Make the output slot at ``path`` return ``node``."""
    out = graph.output_node()

    def put(x, path):
        if not path:
            return node
        items = list(x)
        items[path[0]] = put(items[path[0]], path[1:])
        return type(x)(items)
    out.args = (put(out.args[0], path), *out.args[1:])


def settled(node, by_node: dict[Node, AttnResCall]):
    """``node`` through copies and through call outputs that equal the call's input.

    A call's new prefix is its input prefix when it has no delta, and its new bank is its
    input bank when it writes no block: those outputs are the same values.
    """
    while True:
        node = root(node)
        if not (isinstance(node, Node) and node.target is operator.getitem
                and node.args[0] in by_node):
            return node
        call, index = by_node[node.args[0]], node.args[1]  # type: ignore[index]
        if index == call.output_index("prefix") and call.arg("delta") is None:
            node = call.base("prefix")
        elif index == call.output_index("blocks") and call.arg("block_write_idx") == -1:
            node = call.base("blocks")
        else:
            return node


def same_view(a, b) -> bool:
    """Do ``a`` and ``b`` compute the same view or copy of the same value?

    vLLM squeezes a projection weight at each use (``proj.weight.squeeze(0)``): two
    ``squeeze`` nodes of one parameter are one weight.
    """
    if a is b:
        return True
    if not (isinstance(a, Node) and isinstance(b, Node)):
        return a == b and not isinstance(a, Node) and not isinstance(b, Node)
    if a.op != "call_function" or b.op != "call_function" or a.target is not b.target:
        return False
    if a.target not in RETURN_VIEWS or a.kwargs != b.kwargs or len(a.args) != len(b.args):
        return False
    return all(same_view(x, y) for x, y in zip(a.args, b.args, strict=True))


def _sum_of(value: Node, x, y, dtype, by_node) -> bool:
    """Is ``value`` ``x + y`` (either order) rounded once into ``dtype``, as the kernel adds?"""
    operands = sum_operands(value) if isinstance(value, Node) else None
    if operands is None or dtype_of(value) != dtype or dtype_of(y) != dtype:
        return False
    a, b = (settled(o, by_node) for o in operands)
    return (a is x and b is y) or (a is y and b is x)


def _reads_legacy(call: AttnResCall, value: Node, by_node) -> bool:
    """Is ``value`` exactly what ``call`` receives: ``prefix + delta``, or its prefix?"""
    prefix = settled(call.base("prefix"), by_node)
    delta = call.arg("delta")
    if delta is None:
        return settled(value, by_node) is prefix
    return _sum_of(root(value), prefix, settled(delta, by_node), dtype_of(prefix), by_node)


def _returns_input(call: AttnResCall, value: Node, by_node) -> bool:
    """Is the returned ``value`` ``call``'s legacy input, and so its capture?

    A call with no delta reads its prefix as it is; a graph returns that prefix also to
    hand it on (one piece of a split stage returns its running prefix to the next piece),
    so only the prefix of a call that mixes zero blocks (layer 0: the embedding, capture
    id 0) counts, whose mixture is that prefix: serving it changes nothing.
    """
    if call.arg("delta") is None and call.arg("num_blocks") != 0:
        return False
    return _reads_legacy(call, value, by_node)


def _same_mixing(pure: AttnResCall, call: AttnResCall, by_node) -> bool:
    """Does ``pure`` mix the very sources, weights, block count and eps ``call`` mixes?"""
    if pure.arg("num_blocks") != call.arg("num_blocks") or pure.arg("eps") != call.arg("eps"):
        return False
    if not (same_view(pure.arg("norm_weight"), call.arg("norm_weight"))
            and same_view(pure.arg("qk_weight"), call.arg("qk_weight"))):
        return False
    if not same_view(settled(pure.base("blocks"), by_node), settled(call.base("blocks"), by_node)):
        return False
    return _reads_legacy(call, pure.base("prefix"), by_node)
