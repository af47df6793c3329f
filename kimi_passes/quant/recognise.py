"""Recognising a dynamic per-token FP8 quant in a post-grad ATen graph.

``find_quants(graph)`` returns every ``QuantSite``: the value ``x`` ``[T, H]`` a quant
reads, the nodes holding its fp8 values and its fp32 ``[T, 1]`` scales, the nodes that
compute them, and its parameters in ``kimi::attn_res_quant``'s terms (``QuantParams``).
Three forms, each as it reaches Inductor's post-grad graph:

``QuantFP8`` native (vLLM's ``forward_native``, per token; ``scale_ub`` optional)::

    xf = convert(x, f32);  a = convert(unsqueeze(amax(abs(x), [-1]), -1), f32)
    [a = clamp_max(a, scale_ub)];  s = clamp_min(div(a, FP8_MAX), 1 / (FP8_MAX * 512))
    out = convert(clamp_max(clamp_min(mul(xf, reciprocal(s)), -FP8_MAX), FP8_MAX), fp8)

The AMD kernel's formula (vLLM's ROCm K3 quant): ``a = clamp_min(amax(abs(xf), [-1],
True), 1e-10)``, ``s = mul(a, 1 / QUANT_MAX)``, the same clamped product (torch 2.11 keeps
``1.0 / s`` as ``mul(reciprocal(s), 1.0)``: both are the reciprocal). vLLM's CUDA op
``_C::dynamic_per_token_scaled_fp8_quant``, functionalized: ``QuantFP8``'s scale, but
its values are ``x / scale`` (``divide_values=True``).

Order matters where rounding does (the amax bound before the amax floor, the scale floor
after the scale, clamp bounds ``-qmax``/``qmax``): a chain in any other order, another
dtype than float8_e4m3fn / e4m3fnuz, another reduction dim or a division of the values
is no match (``fx.match.NoMatch``) and is left as it is. docs/design.md section 10.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

from kimi_passes.fx.functionalized import FunctionalCall
from kimi_passes.fx.fx_toolkit import (
    AUTO_FUNCTIONALIZED,
    CASTS,
    dtype_of,
    is_lossless,
)
from kimi_passes.fx.match import NoMatch, as_node, is_call, need, scalar, scalar_arg
from kimi_passes.ops.attn_res_args import AttnResQuantArgs

aten = torch.ops.aten

#: The fp8 dtypes ``attn_res_quant`` stores (torch.float8_e4m3fnuz: AMD's MI300 format).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
#: vLLM's CUDA per-token quant op (``vllm._custom_ops.scaled_fp8_quant`` per token), by name:
#: its extension loads on CUDA machines only.
C_PER_TOKEN_QUANT = "_C::dynamic_per_token_scaled_fp8_quant"


@dataclass(frozen=True)
class QuantParams:
    """A quant's parameters, as ``kimi::attn_res_quant`` names them."""

    quant_dtype: torch.dtype
    quant_max: float
    amax_floor: float  # 0.0: none (the op's default, 1e-10, is the AMD kernel's)
    scale_floor: float
    divide: bool  # scale = amax / qmax (True) or amax * (1 / qmax) (False)
    scale_ub: Node | None
    divide_values: bool = False  # data = x / scale (vLLM's _C op) or x * (1 / scale)

    def op_kwargs(self) -> dict:
        """The op's quant arguments by name (its record's fields after ``attn_res``'s)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _check_fields() -> None:
    """``QuantParams`` holds the op's quant fields, in the op's order."""
    ours = tuple(f.name for f in dataclasses.fields(QuantParams))
    theirs = AttnResQuantArgs._fields[1:]  # the fields after base (AttnResArgs)
    if ours != theirs:
        raise TypeError(f"kimi_passes.quant: QuantParams {ours} disagrees with "
                        f"AttnResQuantArgs' quant fields {theirs}")


_check_fields()


@dataclass
class QuantSite:
    """One per-token quant of ``source``: its outputs, its nodes and its parameters."""

    form: str
    source: Node
    out: Node  # the fp8 values [T, H]
    scale: Node  # the fp32 scales [T, 1]
    params: QuantParams
    #: Every node the quant adds to the graph (``out`` and ``scale`` among them).
    nodes: set[Node] = field(default_factory=set)

    def private(self) -> bool:
        """Is the quant the only reader of ``source`` and of its own intermediate values?"""
        inner = self.nodes - {self.out, self.scale}
        return (all(u in self.nodes for u in self.source.users)
                and all(u in self.nodes for n in inner for u in n.users))


def find_quants(graph: Graph) -> list[QuantSite]:
    """Every per-token FP8 quant ``graph`` holds, in graph order of their fp8 outputs."""
    sites = []
    for target in CASTS:
        for node in graph.find_nodes(op="call_function", target=target):
            site = _match_native(node)
            if site is not None:
                sites.append(site)
    for wrapper in AUTO_FUNCTIONALIZED:
        for node in graph.find_nodes(op="call_function", target=wrapper):
            site = _match_c_op(node)
            if site is not None:
                sites.append(site)
    return sorted(sites, key=lambda s: s.out)


# -- the ATen forms ---------------------------------------------------------------------


def _cast_dtype(node) -> torch.dtype | None:
    """The dtype a cast node converts to (None: not a cast)."""
    if not is_call(node, *CASTS):
        return None
    if node.target is torch.ops.prims.convert_element_type.default:
        return node.args[1]
    if set(node.kwargs) - {"dtype"} or len(node.args) != 1:
        return None  # _to_copy with a layout, device or memory format: not a plain cast
    return node.kwargs.get("dtype")


def _f32(x: float) -> float:
    """``x`` as an fp32 value (how ATen applies a Python scalar to an fp32 tensor)."""
    return torch.tensor(x, dtype=torch.float32).item()


class _Chain:
    """The nodes a match walked through."""

    def __init__(self):
        self.nodes: set[Node] = set()

    def take(self, node) -> Node:
        node = as_node(node)
        self.nodes.add(node)
        return node


def _match_native(cast: Node) -> QuantSite | None:
    """A per-token quant ending in ``cast`` (to fp8), or None."""
    qdtype = _cast_dtype(cast)
    if qdtype not in FP8_DTYPES:
        return None
    try:
        return _walk(cast, qdtype)
    except NoMatch:
        return None


def _walk(cast: Node, qdtype: torch.dtype) -> QuantSite:
    chain = _Chain()
    chain.take(cast)
    lo, hi, prod = _clamp_bounds(chain, chain.take(cast.args[0]))
    need(lo == -hi and hi > 0)
    qmax = hi
    need(is_call(prod, aten.mul.Tensor) and len(prod.args) == 2)
    chain.take(prod)
    a, b = prod.args
    values, other = (b, a) if _reciprocal(a) is not None else (a, b)
    recip = chain.take(as_node(_reciprocal(other)))
    chain.take(other)
    source = _widened_source(chain, values)
    scale = as_node(recip.args[0])
    divide, scale_floor, amax = _scale(chain, scale, qmax)
    amax_floor, scale_ub = _amax(chain, amax, source)
    need(dtype_of(scale) == torch.float32)
    params = QuantParams(qdtype, qmax, amax_floor, scale_floor, divide, scale_ub)
    form = "AMD kernel formula" if not divide else "QuantFP8 native"
    return QuantSite(form, source, cast, scale, params, chain.nodes)


def _clamp_bounds(chain: _Chain, node: Node) -> tuple[float, float, Node]:
    """``clamp(x, lo, hi)``, or ``clamp_min`` / ``clamp_max`` nested either way: (lo, hi, x)."""
    if is_call(node, aten.clamp.default) and len(node.args) == 3 and not node.kwargs:
        return scalar_arg(node, 1), scalar_arg(node, 2), node.args[0]  # type: ignore[return-value]
    bounds: dict[object, float] = {}
    while is_call(node, aten.clamp_min.default, aten.clamp_max.default) \
            and node.target not in bounds:
        bounds[node.target] = scalar_arg(node, 1)
        inner = node.args[0]
        if len(bounds) == 2:
            return (bounds[aten.clamp_min.default], bounds[aten.clamp_max.default],
                    inner)  # type: ignore[return-value]
        node = chain.take(inner)
    raise NoMatch(f"{node.name}: not a clamp to two bounds")


def _reciprocal(node) -> Node | None:
    """The reciprocal node of ``reciprocal(s)``, or of ``mul(reciprocal(s), 1.0)`` as torch
    2.11 traces ``1.0 / s`` (multiplying by one is exact); None for anything else."""
    if is_call(node, aten.reciprocal.default):
        return node
    if not (is_call(node, aten.mul.Tensor) and len(node.args) == 2):
        return None
    recip, one = node.args if is_call(node.args[0], aten.reciprocal.default) else node.args[::-1]
    return recip if scalar(one) == 1 and is_call(recip, aten.reciprocal.default) else None


def _widened_source(chain: _Chain, values) -> Node:
    """The value the quant scales: ``values`` itself when fp32, else the cast it widens."""
    need(isinstance(values, Node) and dtype_of(values) == torch.float32)
    if _cast_dtype(values) == torch.float32:
        src = values.args[0]
        need(isinstance(src, Node) and is_lossless(dtype_of(src), torch.float32))
        chain.take(values)
        return src
    return values


def _scale(chain: _Chain, scale: Node, qmax: float) -> tuple[bool, float, Node]:
    """``scale = [clamp_min](amax / qmax | amax * (1 / qmax), floor)``: (divide, floor, amax)."""
    node = chain.take(scale)
    floor = 0.0
    if is_call(node, aten.clamp_min.default):
        floor = scalar_arg(node, 1)
        node = chain.take(node.args[0])
    if is_call(node, aten.div.Tensor):
        need(scalar_arg(node, 1) == qmax)
        return True, floor, node.args[0]  # type: ignore[return-value]
    need(is_call(node, aten.mul.Tensor))
    need(_f32(scalar_arg(node, 1)) == _f32(1.0 / qmax))
    return False, floor, node.args[0]  # type: ignore[return-value]


def _amax(chain: _Chain, node, source: Node) -> tuple[float, Node | None]:
    """``[clamp_min]([clamp_max](amax|x| per row, scale_ub), floor)``: (floor, scale_ub)."""
    node = chain.take(node)
    floor = 0.0
    if is_call(node, aten.clamp_min.default):
        floor = scalar_arg(node, 1)
        node = chain.take(node.args[0])
    scale_ub = None
    if is_call(node, aten.clamp_max.Tensor, aten.minimum.default):
        scale_ub = node.args[1]
        need(isinstance(scale_ub, Node) and dtype_of(scale_ub) == torch.float32)
        need(scale_ub.meta["val"].numel() == 1)
        node = chain.take(node.args[0])
    if _cast_dtype(node) == torch.float32:  # the amax of bf16 values, widened (exact)
        node = chain.take(node.args[0])
    keepdim = False
    if is_call(node, aten.unsqueeze.default):
        need(node.args[1] in (-1, 1))
        node = chain.take(node.args[0])
        keepdim = True
    need(is_call(node, aten.amax.default))
    dims = node.args[1] if len(node.args) > 1 else []
    need(list(dims) in ([-1], [1]))
    need((len(node.args) > 2 and node.args[2] is True) != keepdim)
    absolute = chain.take(node.args[0])
    need(is_call(absolute, aten.abs.default))
    read = absolute.args[0]
    if read is not source:  # abs of the widened copy, or of another widening cast of source
        need(_cast_dtype(read) == torch.float32 and read.args[0] is source)  # type: ignore
        chain.take(read)
    need(dtype_of(source) is not None and len(source.meta["val"].shape) == 2)
    return floor, scale_ub


# -- vLLM's CUDA op ------------------------------------------------------------------------


def _match_c_op(node: Node) -> QuantSite | None:
    op = node.args[0] if node.args else None
    if not isinstance(op, torch._ops.OpOverload) or op._schema.name != C_PER_TOKEN_QUANT:
        return None
    result, scale, source = _c_outputs(node)
    if result is None or scale is None or not isinstance(source, Node):
        return None
    qdtype = dtype_of(result)
    if qdtype not in FP8_DTYPES:
        return None
    qmax = 448.0 if qdtype == torch.float8_e4m3fn else 224.0
    # The kernel's scale is QuantFP8's (an fp32 division by qmax, then the floor
    # 1 / (qmax * 512)); its values are x / scale (docs/design.md section 10).
    params = QuantParams(qdtype, qmax, 0.0, 1.0 / (qmax * 512.0), True,
                         node.kwargs.get("scale_ub"),  # type: ignore[arg-type]
                         divide_values=True)
    return QuantSite("vLLM _C per-token op", source, result, scale, params, {node, result, scale})


def _c_outputs(node: Node) -> tuple[Node | None, Node | None, object]:
    """The getitems holding the op's new ``result`` and ``scale``, and its ``input``."""
    items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    call = FunctionalCall(node)
    if not {"result", "scale"} <= set(call.mutated):  # another schema: not this quant
        return None, None, None
    return (items.get(call.output_index("result")), items.get(call.output_index("scale")),
            call.arg("input"))
