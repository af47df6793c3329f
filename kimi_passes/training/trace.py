"""Dynamo's graph as a functional ATen graph traced below autograd (``trace_to_aten``).

``make_fx`` under Dynamo's fake mode, functionalized, with no decomposition table: these are
the ops autograd sees when AOTAutograd traces the original graph (CompositeImplicitAutograd
ops such as ``einsum``, ``linear``, ``matmul`` and ``softmax.int`` decompose before autograd
either way), so every op outside a fused site keeps the derivative it would have had.
Inputs are faked with the symbolic sizes Dynamo gave them, as AOTAutograd fakes them, so a
dynamic graph is traced dynamic. Then the graph is made readable for the fusion pass:
in-place ops on intermediates become their out-of-place forms (``out_of_place``), a
functional ``copy`` (no derivative) becomes its source (``differentiable_copies``), and
each input is marked with whether it requires grad (``mark_requires_grad``).
"""

from __future__ import annotations

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.func import functionalize
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx

from kimi_passes.fusion.grad_anchor import REQUIRES_GRAD
from kimi_passes.fx.fx_toolkit import call_function

aten = torch.ops.aten


def _fake_inputs(example_inputs, fake_mode) -> list:
    """Fake inputs in ``fake_mode`` with the symbolic sizes Dynamo gave them (the way
    AOTAutograd fakeifies them: Dynamo's symbolic context per tensor); static otherwise."""
    context = torch._guards.TracingContext.try_get()
    known = context.tensor_to_context if context is not None else {}
    fakes = []
    for x in example_inputs:
        if isinstance(x, FakeTensor):
            fakes.append(x if x.fake_mode is fake_mode else fake_mode.from_tensor(x))
        elif isinstance(x, torch.Tensor):
            sym = known.get(x) if x in known else None
            if sym is not None:
                fakes.append(fake_mode.from_tensor(x, symbolic_context=sym,
                                                   source=sym.tensor_source, trace=False))
            else:
                fakes.append(fake_mode.from_tensor(x, static_shapes=True))
        else:
            fakes.append(x)  # ints and Dynamo's SymInts
    return fakes


def trace_to_aten(gm: GraphModule, example_inputs) -> GraphModule:
    """``gm`` as a functional ATen graph traced below autograd (no decompositions), same
    signature. Functional, so a fused op that reads a source reads the value the stacking
    read even when the model updates that tensor in place later (K3's prefix and block
    writes): its backward needs those values, and autograd refuses a saved tensor that was
    modified in place. Input mutations stay, as ``copy_`` at the end."""
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        raise RuntimeError("no fake mode found for the graph's inputs (not a Dynamo graph?)")
    fakes = _fake_inputs(example_inputs, fake_mode)
    with fake_mode, enable_python_dispatcher():
        return make_fx(functionalize(gm, remove="mutations"), pre_dispatch=False)(*fakes)


def out_of_place(graph: torch.fx.Graph) -> None:
    """Rewrite in-place ops on intermediates nothing else reads (``add_`` in ``F.rms_norm``'s
    decomposition) as their out-of-place forms, so the fusion pass sees the functional ops
    it reads in post-grad graphs. Other mutations stay."""
    for node in list(graph.nodes):
        t = node.target
        if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
            continue
        name = t._schema.name.split("::")[-1]
        if not (t._schema.is_mutable and name.endswith("_") and node.args):
            continue
        x = node.args[0]
        if not (isinstance(x, torch.fx.Node) and x.op == "call_function" and len(x.users) == 1):
            continue
        packet = getattr(torch.ops.aten, name[:-1], None)
        functional = getattr(packet, t._overloadname, None) if packet is not None else None
        if functional is None:
            continue
        node.target = functional


def differentiable_copies(graph: torch.fx.Graph) -> None:
    """Replace functional ``aten.copy(dst, src)`` (no derivative) with what it computes:
    ``src`` itself when shape and dtype agree (so the tap and the fused op after an
    in-place update read one node), else ``src`` broadcast to ``dst``'s shape and cast to
    its dtype."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.copy.default:
            continue
        dst, src = node.args[:2]
        want, have = dst.meta["val"], src.meta["val"]
        new = src
        if tuple(have.shape) != tuple(want.shape):
            new = call_function(graph, aten.expand.default, (new, list(want.shape)),
                                before=node)
        if have.dtype != want.dtype or new is not src:
            new = call_function(graph, aten._to_copy.default, (new,), {"dtype": want.dtype},
                                before=node)
        node.replace_all_uses_with(new)
        graph.erase_node(node)


def mark_requires_grad(gm: GraphModule, example_inputs) -> None:
    """Set ``grad_anchor.REQUIRES_GRAD`` on each input node (the trace's fake values do not
    keep the flag)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, x in zip(placeholders, example_inputs, strict=False):
        node.meta[REQUIRES_GRAD] = isinstance(x, torch.Tensor) and x.requires_grad
