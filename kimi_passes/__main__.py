"""``python -m kimi_passes`` (``kimi-passes``): compile the embedded tiny K3 and check every tap.

    python -m kimi_passes                          # K3Config.tiny(): L=4, S=2, taps 0,2,3,4
    python -m kimi_passes --stages 2               # two pipeline stages, [0,2) and [2,4)
    python -m kimi_passes --stream prefix --dtype bf16 --tokens 32
    python -m kimi_passes --dump dump/ --show-graph
    python -m kimi_passes bench [args]             # kimi_passes.bench, when installed
    python -m kimi_passes vllm-plan <vllm serve args>   # what vLLM will serve for K3

Each stage is compiled with ``kimi_backend`` (caches off, so the pass runs and
reports), run, and its taps compared with the reference: in the attn_res stream the
model's ``ground_truth`` (each tap its consumer's pre-norm mixture), in the prefix
stream the model's legacy prefix value. In fp32 the reference is the eager model, to
1e-5 (max abs error). In bf16 and fp16 it is the same weights run eagerly in fp32, and
a tap's tolerance is what the eager model in that dtype needs there: the larger of the
dtype's (2e-2 bf16, 5e-3 fp16) and ``DRIFT_MARGIN`` times the eager tap's own distance
from it (Inductor keeps intermediates in fp32 where eager rounds each op, so over
layers both drift from fp32 by about as much; a tap reading the prefix misses by ~50x
more). ``cos(prefix)``: the cosine of the tap to the prefix-stream value.

Exit status: 0 when every tap agrees, 1 when one does not or the pass refuses a tap
(the error is printed), 2 for bad arguments or a missing tool.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from kimi_passes.debug.recording import GraphRecorder

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 5e-3}
#: bf16 / fp16: how many times the eager model's own distance from the fp32 truth a compiled
#: tap may be (another rounding path of the same size; see the module docstring).
DRIFT_MARGIN = 2.0


def _bench(argv: list[str]) -> int:
    try:
        bench = importlib.import_module("kimi_passes.bench")
    except ModuleNotFoundError as e:
        if e.name not in ("kimi_passes.bench",):
            raise
        print("kimi-passes bench: this build has no kimi_passes.bench module", file=sys.stderr)
        return 2
    return int(bench.main(argv) or 0)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kimi-passes",
        description="Compile the embedded tiny Kimi K3 with kimi_backend and check that every "
                    "aux tap reads what it should. Subcommands: 'bench [args]', 'vllm-plan "
                    "<vllm serve args>' (what vLLM will serve for K3).")
    p.add_argument("--layers", type=int, help="decoder layers L (default 4)")
    p.add_argument("--block-size", type=int, help="AttnRes block size S in layers (default 2)")
    p.add_argument("--hidden", type=int, help="hidden size H (default 64)")
    p.add_argument("--heads", type=int, help="attention heads (default 4; must divide H)")
    p.add_argument("--taps", type=_int_list,
                   help="capture ids, comma list in [0, L] (default 0, S, L-1, L)")
    p.add_argument("--stages", type=_int_list, default=[],
                   help="pipeline stage boundaries, e.g. '2' for stages [0,2) and [2,L)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--tokens", type=int, default=16, help="tokens T (default 16)")
    p.add_argument("--stream", choices=("attn_res", "prefix"), default="attn_res",
                   help="the aux stream the backend serves (default attn_res)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-fuse", action="store_true",
                   help="capture with a separate attn_res_mix read instead of fusing the tap "
                        "into its consumer's kernel")
    p.add_argument("--aten-fallback", action="store_true",
                   help="Inductor lowers every op to an ATen call (no generated kernels): much "
                        "faster compiles; the passes and post-grad graphs are unchanged")
    p.add_argument("--dump", metavar="DIR",
                   help="write a depyf dump there (the pass's before/after graphs included)")
    p.add_argument("--show-graph", action="store_true",
                   help="print each stage's post-pass graph (skeleton view)")
    p.add_argument("--svg", metavar="FILE",
                   help="draw the kimi region before and after the pass (needs graphviz 'dot')")
    return p


def default_taps(L: int, S: int) -> tuple[int, ...]:
    """0, the first block-write layer past 0, L-1 and L (K3Config.tiny()'s taps for L=4, S=2)."""
    return tuple(sorted({0, min(S, L), max(L - 1, 0), L}))


def make_config(args):
    from kimi_passes.graphs import K3Config

    tiny = K3Config.tiny()
    L = args.layers if args.layers is not None else tiny.num_layers
    S = args.block_size if args.block_size is not None else tiny.attn_res_block_size
    H = args.hidden if args.hidden is not None else tiny.hidden_size
    heads = args.heads if args.heads is not None else tiny.num_heads
    if args.taps is not None:
        taps = tuple(args.taps)
    elif (L, S) == (tiny.num_layers, tiny.attn_res_block_size):
        taps = tiny.aux_layer_ids
    else:
        taps = default_taps(L, S)
    return K3Config(num_layers=L, hidden_size=H, attn_res_block_size=S, num_heads=heads,
                    intermediate_size=2 * H, vocab_size=tiny.vocab_size, aux_layer_ids=taps,
                    seed=args.seed, dtype=DTYPES[args.dtype])


def make_stages(boundaries: list[int], L: int) -> list[tuple[int, int]]:
    cuts = sorted(set(boundaries))
    bad = [b for b in cuts if not 0 < b < L]
    if bad:
        raise ValueError(f"--stages: boundaries {bad} must lie strictly inside (0, {L})")
    edges = [0, *cuts, L]
    return list(zip(edges[:-1], edges[1:], strict=True))


@dataclass
class TapRow:
    capture_id: int
    stage: str
    consumer: str
    stream: str
    capture: str
    err: float
    reference: str
    cos: float
    tol: float

    @property
    def ok(self) -> bool:
        return self.err <= self.tol


def _table(rows: list[TapRow]) -> str:
    head = ("id", "stage", "consumer", "stream", "capture", "max abs err", "vs", "tol",
            "cos(prefix)", "ok")
    body = [(str(r.capture_id), r.stage, r.consumer, r.stream, r.capture, f"{r.err:.2e}",
             r.reference, f"{r.tol:.2g}", f"{r.cos:.4f}", "yes" if r.ok else "NO")
            for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def _dot_available() -> bool:
    return shutil.which("dot") is not None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    if argv[:1] == ["vllm-plan"]:
        from kimi_passes.vllm.vllm_plan.command import main as vllm_plan

        return vllm_plan(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2)
        return int(e.code or 0)
    try:
        cfg = make_config(args)
        stages = make_stages(args.stages, cfg.num_layers)
        if args.tokens < 1:
            raise ValueError(f"--tokens must be at least 1, got {args.tokens}")
    except ValueError as e:
        print(f"kimi-passes: error: {e}", file=sys.stderr)
        return 2
    if args.svg and not _dot_available():
        print("kimi-passes: --svg needs graphviz's 'dot' on PATH, which was not found; "
              "install graphviz (e.g. apt-get install graphviz) or drop --svg "
              "(--show-graph prints the same region as text)", file=sys.stderr)
        return 2
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*dynamo_pgo force disabled")
        return _run(args, cfg, stages)


@dataclass
class _Stages:
    """What the stages' compiles and runs found, stage after stage."""

    rows: list[TapRow] = field(default_factory=list)
    times: list[tuple[str, float]] = field(default_factory=list)
    recorders: list[tuple[str, GraphRecorder]] = field(default_factory=list)
    recompiles: int = 0
    output_err: float | None = None

    def graphs(self):
        """``(label, recorded graph)`` of every stage's graphs, in order."""
        for name, recorder in self.recorders:
            for i, g in enumerate(recorder.graphs):
                part = f" graph {i}" if len(recorder.graphs) > 1 else ""
                yield f"stage {name}{part}", g


def _run(args, cfg, stages) -> int:
    from torch._dynamo.utils import counters

    from kimi_passes.debug import dump, pass_dumps
    from kimi_passes.debug.recording import graph_caches_off

    fuse = not args.no_fuse
    stage_names = ", ".join(f"[{s}, {e})" for s, e in stages)
    capture = "n/a" if args.stream == "prefix" else ("fused capture" if fuse else
                                                      "separate attn_res_mix capture")
    print(f"kimi-passes: K3 L={cfg.num_layers} S={cfg.attn_res_block_size} H={cfg.hidden_size} "
          f"heads={cfg.num_heads} T={args.tokens} {args.dtype}; taps {list(cfg.aux_layer_ids)}; "
          f"stream {args.stream} ({capture}); stages {stage_names}"
          + ("; ATen fallbacks" if args.aten_fallback else ""))
    ids = torch.randint(0, cfg.vocab_size, (args.tokens,),
                        generator=torch.Generator().manual_seed(args.seed))
    counters.clear()
    found = _Stages()
    # graph_caches_off already makes every compile run the passes; dump's own switch would
    # also drop the kernel build cache and rebuild every C++ kernel.
    dumping = (dump(args.dump, disable_caches=False) if args.dump
               else contextlib.nullcontext())
    with torch.no_grad(), graph_caches_off(), dumping:
        # One chain of stage inputs each: compiled, eager, eager fp32 (reduced precision).
        inputs: _Chains = ((ids,), (ids,), None if args.dtype == "fp32" else (ids,))
        for start, end in stages:
            outs = _stage(args, cfg, start, end, inputs, found)
            if outs is None:
                return 1
            inputs = outs
    _print_results(args, found)
    if args.show_graph:
        for label, g in found.graphs():
            print(f"\npost-pass graph of {label} (skeleton view):")
            print(g.text("skeleton"), end="")
    if args.dump:
        files = pass_dumps(args.dump)
        print(f"\ndepyf dump in {args.dump}: {len(files)} pass graph file(s)")
        for f in files:
            print(f"  {f.name}")
    if args.svg and _write_svg(args.svg, found) != 0:
        return 2
    return _verdict(args, found)


#: A stage's inputs (or outputs) on each side: compiled, eager, eager fp32 (None in fp32).
_Chains = tuple[tuple, tuple, "tuple | None"]


def _stage(args, cfg, start: int, end: int, inputs: _Chains, found: _Stages):
    """Compile, run and check layers ``[start, end)``; the next stage's inputs (each side's
    outputs), or None when the pass refused a tap (the error printed)."""
    import torch.nn.functional as F

    from kimi_passes.graphs import K3Model

    name = f"[{start}, {end})"
    model = K3Model(cfg, start, end)
    ran = _compile_and_run(args, model, name, inputs[0], found)
    if ran is None:
        return None
    out, taps, rewrites = ran
    outs, want, tols, reference, prefix_taps = _references(args, model, inputs)
    for k, got, truth, tol, legacy in zip(model.capture_ids, taps, want, tols, prefix_taps,
                                          strict=True):
        r = rewrites.get(k)
        err = _max_abs(got, truth)
        cos = F.cosine_similarity(got.float().flatten(), legacy.float().flatten(), dim=0).item()
        found.rows.append(TapRow(
            k, name, r.consumer if r else "(no rewrite recorded)",
            r.stream if r else args.stream, r.how() if r else "?", err, reference, cos, tol))
    if model.is_last:
        found.output_err = _max_abs(out, outs[0])
    return (out, *outs)


def _max_abs(got, want) -> float:
    """The main job's distance: max abs error, in fp32 (its tolerances are stated in it)."""
    return (got.float() - want.float()).abs().max().item()


def _compile_and_run(args, model, name: str, inputs: tuple, found: _Stages):
    """``(output, taps, rewrites by capture id)`` of the compiled stage (run twice: the second
    call counts recompiles), or None when the pass refused a tap (the error printed)."""
    from torch._dynamo.exc import BackendCompilerFailed

    from kimi_passes import AuxCaptureError, make_kimi_backend
    from kimi_passes.debug.recording import GraphRecorder

    inductor = {"fallback_by_default": True} if args.aten_fallback else {}
    recorder = GraphRecorder(make_kimi_backend(aux_stream=args.stream,
                                               fuse_capture=not args.no_fuse, **inductor))
    found.recorders.append((name, recorder))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=recorder)
    t0 = time.perf_counter()
    try:
        out, taps = compiled(*inputs)
    except (AuxCaptureError, BackendCompilerFailed) as e:
        error = getattr(e, "inner_exception", e)
        if isinstance(error, AuxCaptureError):
            print(f"kimi-passes: stage {name}: the aux-stream pass refused the "
                  f"compile:\nAuxCaptureError: {error}", file=sys.stderr)
            return None
        raise
    found.times.append((name, time.perf_counter() - t0))
    compiled_graphs = len(recorder.graphs)
    compiled(*inputs)  # the same call again: served without recompiling
    found.recompiles += len(recorder.graphs) - compiled_graphs
    return out, taps, {r.capture_id: r for g in recorder.graphs for r in g.rewrites}


def _references(args, model, inputs: _Chains):
    """The eager side of a stage: ``(outputs of the eager chains, the taps to compare with,
    each tap's tolerance, the reference's name, the eager prefix-stream taps)``.

    fp32: the eager model, to the dtype's tolerance. bf16 / fp16: the same weights in fp32
    on the fp32 chain; each tolerance the larger of the dtype's and ``DRIFT_MARGIN`` times
    the eager model's own tap's distance from that truth (see the module docstring)."""
    attn_res = args.stream == "attn_res"
    ref_out, prefix_taps = model(*inputs[1])
    eager = model.ground_truth(*inputs[1])[1] if attn_res else prefix_taps
    tol = TOLERANCE[args.dtype]
    if inputs[2] is None:
        return ((ref_out, None), eager, [tol] * len(eager),
                "ground truth" if attn_res else "eager prefix", prefix_taps)
    twin = copy.deepcopy(model).float()  # the weights as the model holds them, in fp32
    truth_out, truth_prefix = twin(*inputs[2])
    truth = twin.ground_truth(*inputs[2])[1] if attn_res else truth_prefix
    tols = [max(tol, DRIFT_MARGIN * _max_abs(e, t))
            for e, t in zip(eager, truth, strict=True)]
    return ((ref_out, truth_out), truth, tols,
            "fp32 ground truth" if attn_res else "fp32 prefix", prefix_taps)


def _print_results(args, found: _Stages) -> None:
    from torch._dynamo.utils import counters

    print(_table(found.rows))
    if args.stream == "prefix":
        print("(prefix stream: taps compared with the model's running prefix value, "
              "not with the AttnRes ground truth)")
    if args.dtype != "fp32":
        print(f"({args.dtype}: taps compared with the same weights run eagerly in fp32; tol: "
              f"the larger of {TOLERANCE[args.dtype]:g} and {DRIFT_MARGIN:g} x the eager "
              f"{args.dtype} tap's own distance from it)")
    breaks = sum(counters["graph_break"].values())
    print(f"model output: max abs err {found.output_err:.2e} vs eager")
    print(f"graph breaks: {breaks}")
    print(f"recompiles: {found.recompiles} (each stage called twice with the same inputs)")
    per_stage = ", ".join(f"{n}: {t:.1f} s" for n, t in found.times)
    print(f"compile time: {sum(t for _, t in found.times):.1f} s (first call, one run "
          f"included; {per_stage})")


def _verdict(args, found: _Stages) -> int:
    """Print the result line; the exit status (0: every tap within its tolerance)."""
    bad = [r for r in found.rows if not r.ok]
    how = (f"tolerance {TOLERANCE[args.dtype]:g} for fp32" if args.dtype == "fp32" else
           f"{args.dtype}: each tap's tol column")
    if bad:
        print(f"result: {len(bad)} of {len(found.rows)} taps DISAGREE (capture ids "
              f"{[r.capture_id for r in bad]}; {how})")
        return 1
    print(f"result: all {len(found.rows)} taps agree ({how})")
    return 0


def _write_svg(path: str, found: _Stages) -> int:
    """Draw each stage's kimi region before and after the pass into ``path`` (0: written)."""
    from kimi_passes.debug.graph_text import graph_dot

    graphs = {}
    for label, g in found.graphs():
        if g.before is not None:
            graphs[f"{label}: before"] = (g.before, g.names)
            # set with before: after_passes follows before_passes
            graphs[f"{label}: after"] = (cast("torch.fx.Graph", g.after), g.names)
    done = subprocess.run(["dot", "-Tsvg", "-o", path], input=graph_dot(graphs), text=True,
                          capture_output=True)
    if done.returncode != 0:
        print(f"kimi-passes: dot failed: {done.stderr.strip()}", file=sys.stderr)
        return 2
    print(f"\nwrote {path} (kimi region before and after the pass)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
