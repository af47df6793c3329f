"""Splitting a recognised mixture's stacked root into the sources it stacks.

The root ``R`` is split along the source axis: the pieces of a ``cat`` (a
``bank[:, a:b]`` slice counts as ``b - a`` sources), the inputs of ``torch.stack``
(``aten.stack`` before decomposition, ``cat`` + ``view`` after), or ``R``'s own slices.
Sizes are compared with ``values.same_size`` (``statically_known_true``, no guard); the
number of sources must be a static int.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from kimi_passes.fusion.values import (
    NoMatch,
    is_one,
    normalize_dim,
    numel,
    same_shape,
    same_size,
    shape_of,
)
from kimi_passes.fx.fx_toolkit import arg_int, arg_node, arg_nodes

aten = torch.ops.aten


@dataclass
class SourceRun:
    """Sources ``start..stop`` along ``dim`` of ``tensor``, or ``tensor`` itself (``single``)."""

    tensor: Node
    single: bool = False
    dim: int = 0
    start: int = 0
    stop: int = 1


def _base_of_size1_insert(node: Node) -> Node:
    """See through unsqueeze / reshape that only insert size-1 dims."""
    while node.op == "call_function" and node.target in (
            aten.unsqueeze.default, aten.reshape.default, aten.view.default):
        x = node.args[0]
        if not isinstance(x, Node):
            break
        a = [s for s in shape_of(x) if not is_one(s)]
        b = [s for s in shape_of(node) if not is_one(s)]
        if not same_shape(a, b):
            break
        if len(shape_of(x)) >= len(shape_of(node)):
            break
        node = x
    return node


def split_sources(root: Node, source_dim: int | None) -> list[SourceRun]:
    """The sources ``root`` stacks along ``source_dim`` (None: one source, a size-1 axis)."""
    shape = shape_of(root)
    c = source_dim
    if root.target is aten.stack.default:  # traced below autograd, not yet decomposed
        pieces = arg_nodes(root, 0)
        dim = normalize_dim(arg_int(root, 1) if len(root.args) > 1 else 0, len(shape))
        if (c is None and len(pieces) == 1) or dim == c:
            return [SourceRun(p, single=True) for p in pieces]
    if c is None:
        base = _base_of_size1_insert(root)
        # Empty pieces (``bank[:, :0]`` before Inductor drops them from the cat) add nothing.
        pieces = [p for p in arg_nodes(root, 0) if not same_size(numel(p), 0)] if (
            root.target is aten.cat.default) else []
        if base is root and len(pieces) != 1:
            raise NoMatch(f"root {root.name}: softmax over a size-1 axis that does not come "
                          "from stacking a single source")
        if base is root:
            base = _base_of_size1_insert(pieces[0])
        return [SourceRun(base, single=True)]
    if root.target is aten.cat.default:
        dim = normalize_dim(arg_int(root, 1) if len(root.args) > 1 else 0, len(shape))
        if dim == c:
            return _cat_pieces(root, c)
    if root.target in (aten.reshape.default, aten.view.default) and isinstance(
            root.args[0], Node) and root.args[0].target is aten.cat.default:
        cat = arg_node(root, 0)
        pieces = arg_nodes(cat, 0)
        dim = normalize_dim(arg_int(cat, 1) if len(cat.args) > 1 else 0, len(shape_of(cat)))
        P = shape_of(pieces[0])
        want = P[:dim] + (len(pieces),) + P[dim:]
        if dim == c and all(same_shape(shape_of(p), P) for p in pieces) and same_shape(
                want, shape):
            return [SourceRun(p, single=True) for p in pieces]  # a lowered torch.stack
    n = shape[c]
    if not isinstance(n, int):
        raise NoMatch(f"root {root.name}: symbolic number of sources")
    return [SourceRun(root, dim=c, start=0, stop=n)]


def _cat_pieces(root: Node, c: int) -> list[SourceRun]:
    """The sources of ``cat(pieces, c)``, piece by piece."""
    rank = len(shape_of(root))
    runs = []
    for p in arg_nodes(root, 0):
        if len(shape_of(p)) != rank:  # cat's legacy empty 1-D operand
            if same_size(numel(p), 0):
                continue
            raise NoMatch(f"root {root.name}: piece {p.name} has another rank")
        k = shape_of(p)[c]
        if not isinstance(k, int):
            raise NoMatch(f"root {root.name}: piece {p.name} has a symbolic source count")
        if k == 0:
            continue
        if k == 1:
            if p.target is aten.unsqueeze.default and normalize_dim(arg_int(p, 1), rank) == c:
                runs.append(SourceRun(arg_node(p, 0), single=True))
            else:
                runs.append(SourceRun(p, dim=c, start=0, stop=1))
            continue
        if (p.target is aten.slice.Tensor and normalize_dim(arg_int(p, 1), rank) == c
                and (len(p.args) < 5 or p.args[4] == 1)):
            base = arg_node(p, 0)
            start = arg_int(p, 2) if len(p.args) > 2 and p.args[2] is not None else 0
            start = normalize_dim(start, shape_of(base)[c]) if start < 0 else start
            runs.append(SourceRun(base, dim=c, start=start, stop=start + k))
        else:
            runs.append(SourceRun(p, dim=c, start=0, stop=k))
    return runs
