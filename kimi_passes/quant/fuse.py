"""FuseQuantPass: an AttnRes output only a per-token FP8 quant reads is quantized in the kernel.

Invariant after the pass: no ``kimi.attn_res`` / ``attn_res_capture`` output is read by a
dynamic per-token FP8 quant alone (``recognise.find_quants``) that ``kimi.attn_res_quant``
reproduces bit for bit: the call is ``attn_res_quant`` / ``attn_res_quant_capture`` with
the quant's parameters, and the quant's readers read the op's fp8 values and scales. An
output with any other reader stays as it is, and so do the quant and the call.

Before (``QuantFP8``'s native form, as post-grad ATen)::

    x, prefix', bank' = auto_functionalized_v2(kimi.attn_res, ...)[0:3]
    s = clamp_min(div(amax(abs(x)), 448.0), 1 / (448 * 512))
    q = convert(clamp(mul(convert(x, f32), reciprocal(s)), -448.0, 448.0), float8_e4m3fn)

After::

    af = auto_functionalized_v2(kimi.attn_res_quant, ..., quant_dtype=float8_e4m3fn,
                                quant_max=448.0, ..., divide_values=False)
    q, s, prefix', bank' = af[0], af[1], af[2], af[3]

``attn_res_capture`` becomes ``attn_res_quant_capture`` (``q, s, mixture, prefix',
bank'``); v1 calls alike; vLLM's ``_C`` per-token op with ``divide_values=True``. A quant
whose ``scale_ub`` is computed after the call is left unfused, with an INFO line. Runs
after ``AuxStreamPass``, before ``LowerKimiOps`` (option ``fuse_quant``); design.md section 10.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import cast

import torch
from torch.fx import Graph, Node

from kimi_passes.fx.base import KimiGraphPass
from kimi_passes.fx.fx_toolkit import INPUT_CONSTRAINTS, call_function, getitem
from kimi_passes.fx.kimi_calls import AttnResCall
from kimi_passes.quant.recognise import QuantSite, find_quants

kimi = torch.ops.kimi


@dataclass
class QuantFusion:
    """What the pass did with one quant of an AttnRes output (also what it logs)."""

    site: str  # the AttnRes call, as AttnResCall.describe() puts it
    form: str
    #: None: fused; else why not.
    skipped: str | None = None


class FuseQuantPass(KimiGraphPass):
    """Fuse per-token FP8 quants into the AttnRes calls whose output they alone read."""

    def __init__(self):
        #: The quants of AttnRes outputs the last call met (for tests, tools and the log).
        self.last_fusions: list[QuantFusion] = []

    def run(self, graph: Graph) -> list[str]:
        self.last_fusions = []
        for site in find_quants(graph):
            call = _producer(site.source)
            if call is None:
                continue  # a quant of some other value
            where = call.describe()
            reason = _why_not(site, call)
            if reason is None:
                _fuse(graph, call, site)
            self.last_fusions.append(QuantFusion(where, site.form, reason))
        if not self.last_fusions:
            return []
        fused = [f for f in self.last_fusions if f.skipped is None]
        summary = (f"FuseQuantPass: fused {len(fused)} of {len(self.last_fusions)} FP8 quant(s) "
                   "of AttnRes outputs" + (": " if fused else "") +
                   "; ".join(f"{f.site} ({f.form})" for f in fused))
        return [summary] + [f"FuseQuantPass: left {f.site}'s quant ({f.form}) unfused: "
                            f"{f.skipped}" for f in self.last_fusions if f.skipped is not None]


def _producer(source: Node) -> AttnResCall | None:
    """The AttnRes call whose output (getitem 0) ``source`` is, or None."""
    if source.target is not operator.getitem:
        return None
    node, index = source.args
    if index != 0 or not isinstance(node, Node) or not node.args or \
            node.args[0] not in _QUANT_OF:
        return None
    return AttnResCall(node)


def _why_not(site: QuantSite, call: AttnResCall) -> str | None:
    if not site.private():
        return ("the AttnRes output (or a value the quant computes from it) has other readers; "
                "the fused op returns only the fp8 values and the scales")
    ub = site.params.scale_ub
    if ub is not None and not ub < call.node:
        return "its scale_ub is computed after the AttnRes call"
    return None


#: The quantizing op that stands for each unquantized one.
_QUANT_OF = {kimi.attn_res.default: kimi.attn_res_quant.default,
             kimi.attn_res_capture.default: kimi.attn_res_quant_capture.default}


def _extend_input_constraints(new: Node, old: Node, added: dict) -> None:
    """The trace-time input values of ``old``, plus the quant's, on ``new``: Inductor reads
    them per argument (exact strides for the op's inputs; ``call_function`` copies them
    only when the arguments are the same)."""
    recorded = old.meta.get(INPUT_CONSTRAINTS)
    new.meta.pop(INPUT_CONSTRAINTS, None)
    if recorded is None:
        return
    args, kwargs = recorded
    values = {k: v.meta["val"] if isinstance(v, Node) else v for k, v in added.items()}
    new.meta[INPUT_CONSTRAINTS] = (args, {**kwargs, **values})


def _fuse(graph: Graph, call: AttnResCall, site: QuantSite) -> None:
    old = call.node
    kwargs = {**old.kwargs, **site.params.op_kwargs()}
    new = call_function(graph, old.target, (_QUANT_OF[call.op],), kwargs, before=old,
                        stands_for=old)
    _extend_input_constraints(new, old, site.params.op_kwargs())
    site.out.replace_all_uses_with(getitem(new, 0))
    site.scale.replace_all_uses_with(getitem(new, 1))
    # Every output after the first moves one place for the scales (v1 and v2 alike); the
    # first, the unquantized output, is read by the quant only and goes with it.
    for user in list(old.users):
        index = cast(int, user.args[1])
        if index != 0:
            user.args = (new, index + 1)
    for node in sorted(site.nodes, reverse=True):  # readers before what they read
        graph.erase_node(node)
    graph.erase_node(site.source)
    graph.erase_node(old)
