"""Normalised text of FX graphs for golden files (and Graphviz DOT of the same views).

``graph_text(graph)`` prints a post-grad graph in a form meant to survive torch
upgrades: no ``# File:`` comments, no ``<lambda>``, no stack traces; inputs named by
parameter name where known (else ``in0, in1, ...``), nodes ``v0, v1, ...`` and dynamic
symbols ``s0, s1, ...`` in order of appearance, and ``auto_functionalized`` (v1 and v2)
written alike: the op with its schema's named arguments and its mutated arguments::

    v4 = kimi.attn_res_capture(prefix=v1, delta=None, blocks=v2, ...) [functional, mutates
        prefix, blocks]
    v4.ret[1]: f32[5, 16]
    v4.updated.blocks: f32[5, 2, 16]
    v5: f32[5, 16] = aten.mm(v4.ret[0], v3)

A ``getitem`` is named after what it reads, on its own line, so that adding or dropping
one does not renumber the rest. Views: ``"full"`` prints every node; ``"skeleton"`` the
kimi ops, their getitems and what feeds them or the output, each other run folded into
one ``... N ops`` line (arguments into it print as ``_``); ``"kimi"`` (the goldens') only
the kimi calls and what the graph returns (``kimi_passes.debug.kimi_view``).
``graph_dot`` draws the same views as Graphviz DOT; this module only reads graphs.
"""

from __future__ import annotations

import operator
from typing import Any, cast

import torch
from torch.fx import Graph, GraphModule, Node

from kimi_passes.debug.graph_names import Symbols, op_name, source_name
from kimi_passes.debug.kimi_view import KimiView, functional_how, functional_output
from kimi_passes.fx.functionalized import FunctionalCall
from kimi_passes.fx.fx_toolkit import AUTO_FUNCTIONALIZED, kimi_op

VIEWS = ("full", "skeleton", "kimi")
#: Every kimi op, as ``kimi_op_counts`` counts them.
KIMI_OPS = ("attn_res", "attn_res_capture", "attn_res_quant", "attn_res_quant_capture",
            "attn_res_mix", "attn_res_mix_list", "aux_tap",
            "attn_res_mix_backward", "attn_res_mix_list_backward")
#: The ops a DOT drawing fills orange: those that produce or mark a mixture for a tap.
MIXTURE_OPS = ("attn_res_capture", "attn_res_quant_capture", "attn_res_mix", "attn_res_mix_list",
               "aux_tap")

_DTYPES = {
    torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "ui8", torch.bool: "b8", torch.complex64: "c64",
}


def graph_text(gm_or_graph: GraphModule | Graph, view: str = "full", names=None) -> str:
    """The normalised text of a graph (see the module docstring).

    ``names``: what to call the graph's inputs, as a mapping ``{input index: name}``
    or a sequence (e.g. ``GraphRecorder``'s Dynamo-derived names, or a model's
    ``named_parameters()`` order). Without it, inputs carrying Dynamo's source
    (``grapharg``) or an AOT descriptor with a target are named from it; the rest
    are ``in<i>``. An AOT input (``PlainAOTInput(idx)``) is looked up by its index.
    SymInt inputs are always named by their symbol (``s0``).
    """
    if view not in VIEWS:
        raise ValueError(f"graph_text: unknown view {view!r}; use one of {list(VIEWS)}")
    graph = gm_or_graph.graph if isinstance(gm_or_graph, GraphModule) else gm_or_graph
    printer = _Printer(graph, view, _as_mapping(names))
    return KimiView(graph, printer).text() if view == "kimi" else printer.text()


def is_kimi(node: Node) -> bool:
    """A kimi op call, or an auto_functionalized node wrapping one."""
    return kimi_op(node) is not None


def kimi_op_counts(gm_or_graph: GraphModule | Graph) -> dict[str, int]:
    """How many calls of each kimi op (``KIMI_OPS``) the graph holds, functionalized or not."""
    graph = gm_or_graph.graph if isinstance(gm_or_graph, GraphModule) else gm_or_graph
    counts = dict.fromkeys(KIMI_OPS, 0)
    for node in graph.nodes:
        op = kimi_op(node)
        if op is not None:
            counts[op._opname] = counts.get(op._opname, 0) + 1
    return counts


def _as_mapping(names) -> dict[int, str]:
    if names is None:
        return {}
    if isinstance(names, dict):
        return {int(k): str(v) for k, v in names.items()}
    return {i: str(v) for i, v in enumerate(names)}


class _Printer:
    def __init__(self, graph: Graph, view: str, names: dict[int, str]):
        self.graph, self.view, self.given = graph, view, names
        self.symbols = Symbols()
        self.names: dict[Node, str] = {}
        nodes = list(graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.body = [n for n in nodes if n.op not in ("placeholder", "output")]
        self.outputs = [n for n in nodes if n.op == "output"]
        self.shown = {"full": lambda: set(self.body), "skeleton": self._skeleton,
                      "kimi": set}[view]()
        self.used_inputs = self._used_inputs()
        # Names are fixed here, once: text() and graph_dot only read them.
        self._name_inputs()
        self._name_body()

    # -- which nodes a skeleton shows ------------------------------------------------------
    def _skeleton(self) -> set[Node]:
        kimi = {n for n in self.body if is_kimi(n)}
        kimi |= {
            n for n in self.body
            if n.target is operator.getitem and isinstance(n.args[0], Node) and n.args[0] in kimi
        }
        shown = set(kimi)
        for n in [*kimi, *self.outputs]:
            for a in n.all_input_nodes:
                if a.op != "placeholder":
                    shown.add(a)
        return shown

    def _used_inputs(self) -> set[Node]:
        if self.view == "full":
            return set(self.placeholders)
        return {a for n in [*self.shown, *self.outputs] for a in n.all_input_nodes
                if a.op == "placeholder"}

    # -- naming ------------------------------------------------------------------------------
    def _input_name(self, i: int, node: Node) -> str:
        val = node.meta.get("val")
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return self.symbols.expr(val)
        desc = node.meta.get("desc")
        idx = getattr(desc, "idx", None)
        if isinstance(idx, int) and idx in self.given:
            return self.given[idx]
        if desc is None and i in self.given:
            return self.given[i]
        target = getattr(desc, "target", None)
        if isinstance(target, str):
            return target
        return source_name(node) or f"in{i}"

    def _name_inputs(self) -> None:
        used: set[str] = set()
        for i, node in enumerate(self.placeholders):
            name = self._input_name(i, node)
            if name in used:
                name = f"{name}#{i}"
            used.add(name)
            self.names[node] = name

    # -- formatting --------------------------------------------------------------------------
    def ref(self, node: Node) -> str:
        return self.names.get(node, "_")

    def fmt(self, a: Any) -> str:
        if isinstance(a, Node):
            return self.ref(a)
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self.fmt(x) for x in a)
            if isinstance(a, tuple):
                return f"({inner},)" if len(a) == 1 else f"({inner})"
            return f"[{inner}]"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{k!r}: {self.fmt(v)}" for k, v in a.items()) + "}"
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return self.symbols.expr(a)
        if isinstance(a, torch.dtype):
            return str(a)
        if isinstance(a, torch.device):
            return f"device({str(a)!r})"
        if isinstance(a, (torch.memory_format, torch.layout)):
            return str(a)
        if isinstance(a, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
            return op_name(a)
        if isinstance(a, float):
            return repr(a)
        if isinstance(a, slice):
            return f"slice({self.fmt(a.start)}, {self.fmt(a.stop)}, {self.fmt(a.step)})"
        if callable(a) and not isinstance(a, torch.Tensor):
            return op_name(a)
        return repr(a)

    def type_of(self, node: Node) -> str | None:
        return self.type_of_value(node.meta.get("val", node.meta.get("example_value")))

    def fmt_dtype(self, dtype) -> str:
        return _DTYPES.get(dtype, str(dtype).replace("torch.", ""))

    def type_of_value(self, val) -> str | None:
        if isinstance(val, torch.Tensor):
            dims = ", ".join(self.symbols.expr(d) for d in val.shape)
            return f"{self.fmt_dtype(val.dtype)}[{dims}]"
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return f"Sym({self.symbols.expr(val)})"
        return None

    def call(self, node: Node) -> str:
        target = node.target
        if node.op == "get_attr":
            return f"get_attr {target}"
        if node.op == "call_method":
            obj, *rest = node.args
            return f"{self.fmt(obj)}.{target}({self._args(rest, node.kwargs)})"
        if node.op == "call_module":
            return f"{target}({self._args(node.args, node.kwargs)})"
        if target in AUTO_FUNCTIONALIZED:
            return self._functional(node)
        if target is operator.getitem and isinstance(node.args[0], Node):
            base, index = cast("tuple[Node, Any]", node.args)  # getitem(base, index)
            if base.op == "call_function" and base.target in AUTO_FUNCTIONALIZED:
                return f"{self.ref(base)}.{functional_output(base, index)}"
            return f"{self.ref(base)}[{self.fmt(index)}]"
        return f"{op_name(target)}({self._args(node.args, node.kwargs)})"

    def _args(self, args, kwargs) -> str:
        parts = [self.fmt(a) for a in args]
        parts += [f"{k}={self.fmt(v)}" for k, v in kwargs.items()]
        return ", ".join(parts)

    def _functional(self, node: Node) -> str:
        """auto_functionalized(_v2)(op, ...) as ``op(<schema args>) [functional, mutates ...]``."""
        parts = []
        for a in FunctionalCall(node).arguments():
            text = self.fmt(a.value)
            if a.view:
                text += ".view(" + ", ".join(f"{k}={self.fmt(v)}" for k, v in a.view.items()) + ")"
            parts.append(f"{a.name}={text}")
        return f"{op_name(node.args[0])}({', '.join(parts)}) [{functional_how(node.args[0])}]"

    def line(self, node: Node) -> str:
        t = self.type_of(node)
        head = f"{self.names[node]}: {t}" if t else self.names[node]
        if node.target is operator.getitem and node.op == "call_function":
            return head  # named after what it reads: ``v3.ret[1]: f32[5, 16]``
        return f"{head} = {self.call(node)}"

    def _name_body_node(self, node: Node, i: int) -> int:
        """Name ``node``; returns the next free number.

        A getitem of a named node is named after what it reads (``v3.ret[1]``,
        ``v3.updated.blocks``, ``v7[0]``) and takes no number, so adding or dropping
        an output of a call does not renumber the rest of the graph.
        """
        if (node.op == "call_function" and node.target is operator.getitem
                and isinstance(node.args[0], Node) and node.args[0] in self.names):
            self.names[node] = self.call(node)
            return i
        self.names[node] = f"v{i}"
        return i + 1

    def _name_body(self) -> None:
        i = 0
        for node in self.body:
            if node in self.shown:
                i = self._name_body_node(node, i)

    def text(self) -> str:
        lines = []
        used = self.used_inputs
        for node in self.placeholders:
            if node in used:
                t = self.type_of(node)
                lines.append(f"input {self.names[node]}: {t}" if t else f"input {self.names[node]}")
        hidden_inputs = len(self.placeholders) - len(used)
        if hidden_inputs:
            lines.append(f"... {hidden_inputs} more inputs")
        folded = 0
        for node in self.body:
            if node not in self.shown:
                folded += 1
                continue
            if folded:
                lines.append(f"... {folded} ops")
                folded = 0
            lines.append(self.line(node))
        if folded:
            lines.append(f"... {folded} ops")
        for node in self.outputs:
            lines.append(f"return {self.fmt(node.args[0])}")
        return "\n".join(lines) + "\n"


def graph_dot(graphs: dict[str, tuple[Graph, Any]], view: str = "skeleton") -> str:
    """Graphviz DOT text: one cluster per ``{label: (graph, names)}``, nodes as in ``view``.

    Kimi ops are filled (captures and mixes orange, other AttnRes calls blue); edges
    are the data flow between drawn nodes (folded runs are left out).
    """
    def quote(text: str) -> str:
        text = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{text}"'

    lines = ["digraph kimi {", "  rankdir=TB;",
             '  node [shape=box, fontname="monospace", fontsize=9];']
    for c, (label, (graph, names)) in enumerate(graphs.items()):
        p = _Printer(graph, view, _as_mapping(names))
        lines.append(f"  subgraph cluster_{c} {{")
        lines.append(f"    label={quote(label)};")
        drawn: dict[Node, str] = {}
        for node in [*p.placeholders, *p.body, *p.outputs]:
            if node.op == "placeholder" and node not in p.used_inputs:
                continue
            if node.op not in ("placeholder", "output") and node not in p.shown:
                continue
            key = f"c{c}_{len(drawn)}"
            drawn[node] = key
            attrs = [f"label={quote(_dot_label(p, node))}"]
            op = kimi_op(node)
            if op is not None:
                orange = op._opname in MIXTURE_OPS
                attrs += ["style=filled", f"fillcolor={'orange' if orange else 'lightblue'}"]
            elif node.op == "placeholder":
                attrs.append("shape=ellipse")
            lines.append(f"    {key} [{', '.join(attrs)}];")
            for a in node.all_input_nodes:
                if a in drawn:
                    lines.append(f"    {drawn[a]} -> {key};")
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_label(p: _Printer, node: Node) -> str:
    if node.op == "placeholder":
        return p.names[node]
    if node.op == "output":
        return "return"
    op = kimi_op(node)
    if op is not None and node.target in AUTO_FUNCTIONALIZED:
        kw = node.kwargs
        return (f"{p.names[node]} = {op_name(op)}\nnum_blocks={kw.get('num_blocks')} "
                f"block_write_idx={kw.get('block_write_idx')}")
    if node.target is operator.getitem:
        return p.names[node]
    if op is not None:
        return f"{p.names[node]} = {op_name(op)}"
    return f"{p.names[node]} = {op_name(node.target)}"
