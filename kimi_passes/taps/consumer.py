"""Which AttnRes call reads a tapped value: the tap's consumer.

A call mixes against the value ``prefix + delta`` it receives (or ``prefix`` with no
delta); a tap marks that value, so its consumer is the call whose (root) prefix and delta
sum to the tapped value, in either operand order, or an ``attn_res_mix`` over it. Copies
are seen through (``fx_toolkit.root``); a sum done wider and rounded once counts as the
same sum (``fx_toolkit.same_sum``).
"""

from __future__ import annotations

import torch

from kimi_passes.fx.fx_toolkit import is_plain_add, root, same_sum
from kimi_passes.fx.kimi_calls import AttnResCall, attn_res_calls, mix_nodes


def reads_value(call: AttnResCall, value) -> bool:
    """Does ``call`` mix against ``value`` (its prefix after the optional delta)?"""
    prefix, delta = root(call.base("prefix")), root(call.arg("delta"))
    value = root(value)
    if delta is None:
        return prefix is value or same_sum(prefix, value)
    if is_plain_add(value):
        a, b = (root(x) for x in value.args)
        return (a is prefix and b is delta) or (b is prefix and a is delta)
    return False


def find_consumers(graph: torch.fx.Graph, value, calls=None, mixes=None) -> list:
    """AttnRes calls (``AttnResCall``) or ``attn_res_mix`` nodes that mix against ``value``.

    ``calls`` / ``mixes``: the graph's calls and mix nodes when the caller already has
    them (a pass looking up many taps scans the graph once, not once per tap).
    """
    calls = attn_res_calls(graph) if calls is None else calls
    mixes = mix_nodes(graph) if mixes is None else mixes
    found: list = [c for c in calls if reads_value(c, value)]
    found += [m for m in mixes if same_sum(root(m.args[0]), root(value))]
    return found
