"""How views, broadcasts and reshapes move the root's named axes (for the mixture evaluator).

A value's ``dims`` say, per tensor dim, which root axes it holds (``()``: size 1).
``sizes`` maps each axis name to its size (an int, or a SymInt under dynamic shapes);
sizes are multiplied as SymInts and compared with ``values.same_size``
(``statically_known_true``, no guard).
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch.fx import Node

from kimi_passes.fusion.values import (
    NoMatch,
    is_one,
    normalize_dim,
    same_size,
    shape_of,
)
from kimi_passes.fx.fx_toolkit import COPIES, arg_int

aten = torch.ops.aten

#: Ops that keep the values and only move axes around (or copy).
VIEWS = {
    aten.reshape.default, aten.view.default, aten._unsafe_view.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.permute.default, aten.transpose.int, aten.t.default, aten.expand.default,
    aten.select.int, aten.slice.Tensor, *COPIES,
}
_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
_SQUEEZES = (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)


def view_dims(node: Node, in_dims: tuple, sizes: dict, where: str) -> tuple:
    """The dims of view ``node`` (a ``VIEWS`` op) of a value laid out as ``in_dims``."""
    t = node.target
    dims, rank = list(in_dims), len(in_dims)
    in_shape, out_shape = shape_of(node.args[0]), shape_of(node)
    if t in _RESHAPES:
        seq = [a for d in dims for a in d]
        new = []
        for s in out_shape:
            if is_one(s):
                new.append(())
                continue
            group, prod = [], 1
            while seq and not same_size(prod, s):
                a = seq.pop(0)
                group.append(a)
                prod = prod * sizes[a]
            if not same_size(prod, s):
                raise NoMatch(f"{where}: the reshape splits a root axis")
            new.append(tuple(group))
        if seq:
            raise NoMatch(f"{where}: the reshape drops axes {seq}")
        dims = new
    elif t is aten.unsqueeze.default:
        dims.insert(normalize_dim(arg_int(node, 1), rank + 1), ())
    elif t in _SQUEEZES:
        which: range | list[int]
        if t is aten.squeeze.default:
            which = range(rank)
        else:
            arg = cast("int | list[int]", node.args[1])  # squeeze.dim / squeeze.dims
            which = [normalize_dim(d, rank) for d in (arg if isinstance(arg, (list, tuple))
                                                      else [arg])]
        drop = {d for d in which if is_one(in_shape[d])}
        dims = [d for i, d in enumerate(dims) if i not in drop]
    elif t is aten.permute.default:
        dims = [dims[normalize_dim(p, rank)] for p in cast("list[int]", node.args[1])]
    elif t in (aten.transpose.int, aten.t.default):
        a, b = (0, 1) if t is aten.t.default else (
            normalize_dim(arg_int(node, 1), rank), normalize_dim(arg_int(node, 2), rank))
        dims[a], dims[b] = dims[b], dims[a]
    elif t is aten.expand.default:
        if len(out_shape) != rank or not all(
                same_size(s, o) for s, o in zip(in_shape, out_shape, strict=True)):
            raise NoMatch(f"{where}: expand replicates a value of the mixture")
    elif t is aten.select.int:
        d = normalize_dim(arg_int(node, 1), rank)
        if dims[d] != ():
            raise NoMatch(f"{where}: select picks one entry of axis {dims[d]}")
        dims.pop(d)
    elif t is aten.slice.Tensor:
        d = normalize_dim(arg_int(node, 1) if len(node.args) > 1 else 0, rank)
        if not same_size(in_shape[d], out_shape[d]):
            raise NoMatch(f"{where}: slice keeps part of axis {dims[d]}")
    # copies: unchanged
    return tuple(dims)


def broadcast_dims(a: tuple, b: tuple, where: str) -> tuple:
    """The dims of an elementwise op of values laid out as ``a`` and ``b``."""
    n = max(len(a), len(b))
    a = ((),) * (n - len(a)) + tuple(a)
    b = ((),) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b, strict=True):
        if x == y or y == ():
            out.append(x)
        elif x == ():
            out.append(y)
        else:
            raise NoMatch(f"{where}: broadcasting pairs axis {x} with {y}")
    return tuple(out)


def check_dims(node: Node, dims: tuple, sizes: dict, where: str) -> None:
    """NoMatch unless ``node``'s shape is what ``dims`` say it holds."""
    shape = shape_of(node)
    if len(shape) != len(dims):
        raise NoMatch(f"{where}: rank {len(shape)} but {len(dims)} tracked dims")
    for s, d in zip(shape, dims, strict=True):
        if not same_size(math.prod(sizes[a] for a in d), s):
            raise NoMatch(f"{where}: dim of size {s} holds axes {d}")
