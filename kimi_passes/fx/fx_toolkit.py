"""What the kimi passes share for reading and editing post-grad FX graphs.

Reading: ``arg_node`` / ``arg_nodes`` / ``arg_int`` (an argument as the type the op's
schema gives it), ``dtype_of``, ``is_widening`` (the float precision ranks), ``root`` (through
copies), ``same_sum`` (two nodes computing one ``x + y``), ``kimi_op`` (the kimi op a
node calls, directly or inside ``auto_functionalized``), ``calls_to`` (indexed lookup,
no scan of the whole graph).

Editing: ``call_function`` inserts a node whose ``meta["val"]`` comes from fake-tensor
propagation and whose provenance (``PROVENANCE``) comes from the node it stands in for;
``getitem`` finds or makes ``node[index]`` the same way. Every node a pass creates goes
through them, so every new node carries the same metadata.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any, TypeGuard, cast

import torch
from torch._higher_order_ops.auto_functionalize import (
    auto_functionalized,
    auto_functionalized_v2,
)
from torch.fx import Graph, Node
from torch.fx.node import map_arg

from kimi_passes import ops  # noqa: F401  (the passes read and emit torch.ops.kimi.*)

aten = torch.ops.aten
prims = torch.ops.prims

#: The wrappers functionalization puts around a mutating op (v1 and v2).
AUTO_FUNCTIONALIZED = (auto_functionalized, auto_functionalized_v2)
#: Ops that hand on the same values (a copy or a view of the whole tensor).
COPIES = (aten.clone.default, aten.alias.default, aten.detach.default)
#: Dtype conversions.
CASTS = (prims.convert_element_type.default, aten._to_copy.default)
#: Float dtypes by precision: a cast to a higher rank keeps every value.
FLOAT_RANK = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
#: Metadata a new node takes over from the node it stands in for (where it came from).
PROVENANCE = ("nn_module_stack", "stack_trace")
#: The input strides recorded at trace time for ops that need exact strides: it describes
#: a node's inputs, so it carries over only to a node reading the very same inputs.
INPUT_CONSTRAINTS = "eager_input_vals"


# -- reading ----------------------------------------------------------------------------------


def arg_node(node: Node, i: int) -> Node:
    """``node.args[i]``, a tensor argument (a node of the graph)."""
    return cast(Node, node.args[i])


def arg_nodes(node: Node, i: int) -> list[Node]:
    """``node.args[i]``, a tensor-list argument (``cat``'s and ``stack``'s tensors)."""
    return cast("list[Node]", node.args[i])


def arg_int(node: Node, i: int) -> int:
    """``node.args[i]``, an int argument (a dim, a slice bound)."""
    return cast(int, node.args[i])


def dtype_of(node) -> torch.dtype | None:
    """The dtype of the tensor ``node`` holds (from ``meta["val"]``), None if not a tensor."""
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def is_widening(src: torch.dtype | None, dst: torch.dtype | None) -> bool:
    """Is a cast ``src -> dst`` between floats to a strictly higher precision?"""
    return src in FLOAT_RANK and dst in FLOAT_RANK and FLOAT_RANK[dst] > FLOAT_RANK[src]


def is_lossless(src: torch.dtype | None, dst: torch.dtype | None) -> bool:
    """Does a cast ``src -> dst`` keep every value (the same dtype, or a widening)?"""
    return src == dst or is_widening(src, dst)


def root(node):
    """Follow copies back to the value they copy."""
    while isinstance(node, Node) and node.op == "call_function" and node.target in COPIES:
        node = node.args[0]
    return node


def is_plain_add(node) -> TypeGuard[Node]:
    """``add(x, y)`` with no ``alpha``."""
    return isinstance(node, Node) and node.target is aten.add.Tensor and not node.kwargs


def sum_operands(node: Node) -> list | None:
    """The operands ``[x, y]`` of a sum ``node`` computes in its own dtype, or None.

    A plain ``add(x, y)``; or that sum done wider and rounded once into ``node``'s dtype,
    as ``prefix.copy_(prefix.float() + delta.float())`` functionalizes for a bf16 prefix:
    ``copy(dst, add(convert(x, f32), convert(y, f32)))`` or ``convert(add(..), bf16)``.
    Both give ``round(x + y)``, what a bf16 ``add(x, y)`` computes (in fp32, rounded once).
    """
    if node.op != "call_function":
        return None
    if is_plain_add(node):
        return [root(x) for x in node.args]
    if node.target is aten.copy.default and dtype_of(node.args[0]) == dtype_of(node):
        wide = node.args[1]
    elif node.target in CASTS:
        wide = node.args[0]
    else:
        return None
    if not is_plain_add(wide):
        return None
    narrow = dtype_of(node)
    operands = []
    for x in wide.args:
        if not (isinstance(x, Node) and x.target in CASTS and isinstance(x.args[0], Node)):
            return None
        base = x.args[0]
        if dtype_of(base) != narrow or not is_widening(narrow, dtype_of(x)):
            return None
        operands.append(root(base))
    return operands


def same_sum(a, b) -> bool:
    """True when ``a`` and ``b`` compute the same ``x + y`` from the same operands."""
    if not (isinstance(a, Node) and isinstance(b, Node)):
        return False
    if a is b:
        return True
    ra, rb = sum_operands(a), sum_operands(b)
    if ra is None or rb is None:
        return False
    return ra == rb or ra == rb[::-1]


def kimi_op(node: Node) -> torch._ops.OpOverload | None:
    """The ``torch.ops.kimi`` op ``node`` calls, directly or functionalized; else None."""
    if node.op != "call_function":
        return None
    target: object = node.target
    if target in AUTO_FUNCTIONALIZED and node.args:
        target = node.args[0]
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "kimi":
        return target
    return None


def calls_to(graph: Graph, *targets) -> list[Node]:
    """The ``call_function`` nodes of ``graph`` calling any of ``targets``, in graph order."""
    if len(targets) == 1:
        return list(graph.find_nodes(op="call_function", target=targets[0]))
    # Nodes compare in graph order (what find_nodes sorts by): no scan of the graph.
    return sorted(n for t in targets for n in graph.find_nodes(op="call_function", target=t))


def functional_calls(graph: Graph, wrapped: Iterable) -> list[Node]:
    """``auto_functionalized`` (v1 or v2) nodes wrapping one of ``wrapped``, in graph order."""
    wrapped = tuple(wrapped)
    return [n for n in calls_to(graph, *AUTO_FUNCTIONALIZED) if n.args and n.args[0] in wrapped]


# -- editing ----------------------------------------------------------------------------------


def fake_value(target, args, kwargs):
    """What ``target(*args, **kwargs)`` returns on the inputs' ``meta["val"]`` (fake tensors)."""
    fake_args = map_arg(args, lambda n: n.meta["val"])
    fake_kwargs = map_arg(kwargs, lambda n: n.meta["val"])
    mode = torch._guards.detect_fake_mode((fake_args, fake_kwargs))
    if mode is None:  # inputs are meta or real tensors: run the op on them as they are
        return target(*fake_args, **fake_kwargs)
    with mode:
        return target(*fake_args, **fake_kwargs)


def call_function(graph: Graph, target, args=(), kwargs=None, *, before: Node | None = None,
                  after: Node | None = None, stands_for: Node | None = None,
                  val: Any = None) -> Node:
    """Insert ``target(*args, **kwargs)`` right ``before`` or ``after`` a node.

    ``meta["val"]`` is ``val`` when given, else computed by fake-tensor propagation
    (running ``target`` in the inputs' fake mode); the ``PROVENANCE`` metadata
    is copied from ``stands_for`` (default: the node it is inserted next to), and so is
    ``INPUT_CONSTRAINTS`` when the new node reads exactly ``stands_for``'s inputs (a call
    swapped for another op). A node reading other inputs gets none: Inductor then leaves
    its input layouts free, as for any node a pass inserts.
    """
    if (before is None) == (after is None):
        raise ValueError("call_function: give exactly one of before= and after=")
    anchor = before if before is not None else after
    assert anchor is not None  # exactly one was given (checked above)
    where = graph.inserting_before(before) if before is not None else graph.inserting_after(after)
    with where:
        node = graph.call_function(target, tuple(args), dict(kwargs or {}))
    node.meta["val"] = val if val is not None else fake_value(target, node.args, node.kwargs)
    source = stands_for if stands_for is not None else anchor
    node.meta.update({k: source.meta[k] for k in PROVENANCE if k in source.meta})
    if INPUT_CONSTRAINTS in source.meta and node.all_input_nodes == source.all_input_nodes:
        node.meta[INPUT_CONSTRAINTS] = source.meta[INPUT_CONSTRAINTS]
    return node


def getitem(node: Node, index: int) -> Node:
    """The existing ``node[index]`` (a ``getitem`` user), or a new one right after ``node``."""
    for user in node.users:
        if user.target is operator.getitem and user.args[1] == index:
            return user
    return call_function(node.graph, operator.getitem, (node, index), after=node)
