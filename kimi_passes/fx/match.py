"""Matching FX nodes: one "no match" exception and the readers of constant arguments.

A matcher walks a candidate's nodes and raises ``NoMatch`` (its message names the check
that failed) where the graph is not the form it knows; its caller reads that as "not this
form" and leaves the graph alone. The fusion evaluator (``fusion/``) and the quant
recogniser (``quant/recognise.py``) both match this way.
"""

from __future__ import annotations

from torch.fx import Node


class NoMatch(Exception):
    """A candidate is not the form a matcher knows; the message says which check failed."""


def need(cond: bool, why: str = "") -> None:
    """Go on matching only if ``cond`` holds: else ``NoMatch(why)``."""
    if not cond:
        raise NoMatch(why)


def scalar(a) -> float | None:
    """``a`` as a float if it is a Python number (not a bool, not a node); else None."""
    if isinstance(a, bool) or not isinstance(a, (int, float)):
        return None
    return float(a)


def scalar_arg(node: Node, i: int) -> float:
    """``node``'s ``i``-th argument as a float; ``NoMatch`` if it is no Python number."""
    value = scalar(node.args[i]) if len(node.args) > i else None
    if value is None:
        raise NoMatch(f"{node.name}: argument {i} is not a number")
    return value


def as_node(value) -> Node:
    """``value`` (an FX argument) as the node it must be; ``NoMatch`` if it is a constant."""
    if not isinstance(value, Node):
        raise NoMatch(f"{value!r} is not a node")
    return value


def is_call(node, *targets) -> bool:
    """Is ``node`` a ``call_function`` node of one of ``targets``?"""
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets
