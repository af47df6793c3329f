"""The command line: ``python -m kimi_passes bench [subcommand] [options]``.

    python -m kimi_passes bench --quick                  # a minute-sized CPU smoke run
    python -m kimi_passes bench --out bench.json         # the fuller CPU sweep (+ bench.png)
    python -m kimi_passes bench --device cuda --out gpu.json
    python -m kimi_passes bench --only op --T 1 64 --H 256 --blocks 2 --dtypes float32
    python -m kimi_passes bench --only quant --threads 1  # AttnRes + FP8 quant, fused or not
    python -m kimi_passes bench decode --T 1 8           # a subcommand: its own --help

Sections run in the order ``--only`` gives (default ``op,tap,pass,compile,quant``;
``--quick``: ``op,tap,pass``); a section that raises is reported, the others still run, and
the exit status is 1. The subcommands (``SUBCOMMANDS``) are benchmarks with tables and
options of their own.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from kimi_passes.bench.compile_time import bench_compile
from kimi_passes.bench.harness import PROG, Timer, load_warning, machine_info, set_limits, target
from kimi_passes.bench.op import DTYPES, OP_HEADER, TARGET_ROOFLINE, VARIANTS, bench_op
from kimi_passes.bench.pass_cost import bench_pass
from kimi_passes.bench.quant import bench_quant
from kimi_passes.bench.report import format_report, plot
from kimi_passes.bench.tap import bench_tap

SECTIONS = ("op", "tap", "pass", "compile", "quant")
#: ``bench <name> [options]``: the module whose ``main(argv)`` runs it, and what it measures.
SUBCOMMANDS = {
    "decode": ("decode", "whole models at decode and prefill sizes, kimi_backend vs Inductor"),
    "fusion": ("fusion", "plain-torch AttnRes models under kimi_backend vs plain Inductor"),
    "cpu-op": ("cpu_op", "CPU speed of kimi.attn_res against its plain-torch statement"),
    "call-cost": ("call_cost", "eager call time of the CPU kimi ops at decode sizes"),
}


class Config:
    """Everything a run does, from the mode presets and the command line."""

    def __init__(self, a: argparse.Namespace):
        self.device = torch.device(a.device)
        quick, cuda = a.quick, self.device.type == "cuda"
        self.quick = quick
        self._op_shapes(a, quick, cuda)
        self.dtypes = a.dtypes or ["bfloat16", "float32"]
        self.variants = a.variants or list(VARIANTS)
        self.compiled = not a.no_compiled
        self.peers = not a.no_peers
        self.check = not a.no_check
        self._timers(a, quick, cuda)
        if quick:
            self.tap_layers, self.tap_hidden, self.tap_block, self.tap_T = 4, 256, 2, 64
        else:
            self.tap_layers, self.tap_hidden, self.tap_block, self.tap_T = 8, 1024, 2, 256
        self.tap_layers = a.tap_layers or self.tap_layers
        self.tap_hidden = a.tap_hidden or self.tap_hidden
        self.tap_T = a.tap_T or self.tap_T
        self.pass_layers = a.pass_layers or (16 if quick else 93)
        self.pass_cold = not quick
        self.pass_all_taps = not quick
        self.pass_reps = 5 if quick else 9
        self.compile_T = 16
        self.layers = a.layers or ([2, 4] if quick else [8, 16, 32, 64, 93])
        self.quant_T = a.quant_T or ([1, 64] if quick else [1, 8, 64, 1024])
        self.quant_H = a.quant_H or (1024 if quick else 7168)
        self.quant_blocks = a.quant_blocks or 8

    def _op_shapes(self, a, quick: bool, cuda: bool) -> None:
        self.user_shapes = any(x is not None for x in (a.T, a.H, a.blocks))
        if quick:
            T, H, nb = [16, 1024], [1024], [8]
        elif cuda:
            T, H, nb = [1, 16, 128, 1024, 4096, 8192], [7168, 1024, 2048, 4096], [8, 1, 2, 4, 9]
        else:
            T, H, nb = [1, 16, 128, 1024, 4096, 8192], [1024, 2048, 4096, 7168], [8, 1, 2, 4, 9]
        self.T, self.H, self.blocks = a.T or T, a.H or H, a.blocks or nb
        self.T_centre = 8192 if cuda else 1024
        # The headline shape (docs/design.md section 5); fp32 at that size is too big for a CPU run.
        self.extra_cells = [] if quick else [("bfloat16", v, 8192, 7168, 8) for v in VARIANTS]
        if cuda and not quick:
            self.extra_cells += [("float32", v, 8192, 7168, 8) for v in VARIANTS]
        if cuda:  # the centre already is the headline shape on CUDA
            centre = (self.T_centre, self.H[0], self.blocks[0])
            self.extra_cells = [c for c in self.extra_cells if (c[2], c[3], c[4]) != centre]

    def _timers(self, a, quick: bool, cuda: bool) -> None:
        """The op section's timer, and the tap section's (a step is ~100x an op call)."""
        threads = a.threads or torch.get_num_threads()
        clock = "cpu" if a.cpu_time else "wall"
        if cuda:
            self.timer = Timer(a.rounds or (5 if quick else 9), "cuda", reps=10,
                               device=self.device)
            self.tap_timer = Timer(a.rounds or 15, "cuda", reps=5, device=self.device)
        else:
            self.timer = Timer(a.rounds or (5 if quick else 9), clock,
                               block_s=a.block_ms / 1e3 if a.block_ms else
                               (0.01 if quick else 0.04), threads=threads,
                               max_s=3.0 if quick else 20.0)
            self.tap_timer = Timer(a.rounds or (7 if quick else 21), clock,
                                   block_s=0.05 if quick else 0.25, threads=threads,
                                   max_s=10.0 if quick else 90.0)
        #: The op section's timer while the tap section runs (``_run_section`` sets it).
        self.op_timer = self.timer


def parse_args(argv):
    ap = argparse.ArgumentParser(
        prog=PROG, usage=f"{PROG} [{{{','.join(SUBCOMMANDS)}}}] [options]",
        description="Benchmarks of the kimi AttnRes op, the tap, the pass and compile time.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="subcommands (each with its own --help):\n" + "\n".join(
            f"  {name:<10} {what}" for name, (_, what) in SUBCOMMANDS.items())
        + "\n\nexamples:\n" + (__doc__.split("\n\n", 2)[1] if __doc__ else ""))
    ap.add_argument("--quick", action="store_true",
                    help="small shapes and models (about a minute on a 2-core CPU)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda[:i]")
    ap.add_argument("--only", default=None,
                    help=f"comma-separated sections of {','.join(SECTIONS)} "
                         "(default: all; --quick: op,tap,pass)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--text", type=Path, help="also write the text report here")
    ap.add_argument("--plot", type=Path,
                    help="PNG of GB/s against T (default: --out with .png)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--T", type=int, nargs="+", help="op: token counts")
    ap.add_argument("--H", type=int, nargs="+", help="op: hidden sizes")
    ap.add_argument("--blocks", type=int, nargs="+", help="op: completed blocks mixed (nb)")
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES))
    ap.add_argument("--variants", nargs="+", choices=VARIANTS)
    ap.add_argument("--no-compiled", action="store_true",
                    help="op: skip the torch.compile baseline")
    ap.add_argument("--no-peers", action="store_true",
                    help="op: skip the peer kernels (vLLM's K3 kernel, the PyPI peers)")
    ap.add_argument("--no-check", action="store_true",
                    help="op: skip the correctness check against the reference")
    ap.add_argument("--rounds", type=int, help="interleaved rounds per measurement")
    ap.add_argument("--block-ms", type=float, help="CPU: milliseconds per timing sample")
    ap.add_argument("--threads", type=int, help="CPU: torch threads (default: torch's)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="CPU: samples in process CPU time, not wall time (a loaded machine)")
    ap.add_argument("--tap-layers", type=int)
    ap.add_argument("--tap-hidden", type=int)
    ap.add_argument("--tap-T", type=int)
    ap.add_argument("--pass-layers", type=int, help="pass: depth (default 93, K3)")
    ap.add_argument("--layers", type=int, nargs="+", help="compile: depths to compile")
    ap.add_argument("--quant-T", type=int, nargs="+",
                    help="quant: token counts (default 1 8 64 1024)")
    ap.add_argument("--quant-H", type=int, help="quant: hidden size (default 7168, K3's)")
    ap.add_argument("--quant-blocks", type=int, help="quant: completed blocks mixed (default 8)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in SUBCOMMANDS:
        module = importlib.import_module(f"kimi_passes.bench.{SUBCOMMANDS[argv[0]][0]}")
        return int(module.main(argv[1:]) or 0)
    a = parse_args(argv)
    sections = _sections(a)
    if sections is None:
        return 2
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    import kimi_passes  # noqa: F401  (registers torch.ops.kimi.*)

    cfg = Config(a)
    if cfg.device.type == "cpu" and a.threads:
        torch.set_num_threads(a.threads)
    set_limits()
    results: dict = {"command": f"{PROG} " + " ".join(argv), "machine": machine_info(cfg.device),
                     "mode": "quick" if a.quick else "default", "sections": sections}
    warning = load_warning(torch.get_num_threads()) if cfg.device.type == "cpu" else None
    if warning:
        _log(warning)
    errors: dict[str, str] = {}
    cache: dict = {}
    t_start = time.perf_counter()
    for sec in sections:
        _run_section(sec, cfg, results, errors, cache)
    results["wall_s"] = time.perf_counter() - t_start
    results["machine"]["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") \
        else None
    results["targets"] = _targets(results, cfg)
    if errors:
        results["errors"] = errors
    _write(a, results)
    return 1 if errors else 0


def _log(s: str) -> None:
    print(s, flush=True)


def _sections(a) -> list[str] | None:
    """The sections to run, in order; None (after a message) when one is unknown."""
    if not a.only:
        return ["op", "tap", "pass"] if a.quick else list(SECTIONS)
    sections = [s.strip() for s in a.only.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        print(f"bench: unknown section(s) {bad}; choose from {list(SECTIONS)}", file=sys.stderr)
        return None
    return sections


def _run_section(sec: str, cfg: Config, results: dict, errors: dict, cache: dict) -> None:
    """Run section ``sec`` into ``results``; a section that raises goes into ``errors``."""
    _log(f"-- {sec} --")
    if sec == "op":
        _log(OP_HEADER)
    t0 = time.perf_counter()
    runs = {"op": lambda: bench_op(cfg, _log), "tap": lambda: bench_tap(cfg, _log),
            "pass": lambda: bench_pass(cfg, _log, cache),
            "compile": lambda: bench_compile(cfg, _log, cache),
            "quant": lambda: bench_quant(cfg, _log)}
    timer = cfg.timer
    if sec == "tap":  # the tap section times its steps with the tap timer, its ops with ours
        cfg.timer, cfg.op_timer = cfg.tap_timer, timer
    try:
        results[sec] = runs[sec]()
    except Exception:  # noqa: BLE001 - report and go on with the other sections
        errors[sec] = traceback.format_exc()
        _log(errors[sec])
    finally:
        cfg.timer = timer
    _log(f"   ({sec}: {time.perf_counter() - t0:.1f}s)")


def _write(a, results: dict) -> None:
    """Print the report; write the plot, the JSON and the text report where asked."""
    report = format_report(results)
    print()
    print(report, end="")
    if not a.no_plot and "op" in results:
        path = a.plot or (a.out.with_suffix(".png") if a.out else None)
        if path is not None:
            status = plot(results, path)
            results["plot"] = status
            print(status)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(results, indent=1, default=str))
        print(f"results written to {a.out}")
    if a.text:
        a.text.parent.mkdir(parents=True, exist_ok=True)
        a.text.write_text(report)


def _targets(results, cfg) -> list[dict]:
    """The op's targets on CUDA: the headline roofline, and vLLM's K3 kernel at every T. A
    figure whose candidate missed its tolerance (or did not run) is no MET."""
    out = []
    for row in results.get("op", {}).get("rows", []):
        missed = {c["candidate"]: c["reason"] for c in row.get("candidates", [])
                  if c["verdict"] != "MET"}
        if (cfg.device.type == "cuda" and (row["T"], row["H"], row["nb"], row["dtype"])
                == (8192, 7168, 8, "bfloat16")):
            out.append(_target(f"op {row['variant']}: fraction of copy bandwidth at T=8192 "
                               "H=7168 nb=8 bf16", row["roofline"], TARGET_ROOFLINE,
                               {k: v for k, v in missed.items() if k == "op"}))
        if "vllm-k3" in row.get("vs_op", {}) or "vllm-k3" in missed:
            # vLLM's K3 kernel, the peer to beat at every T
            out.append(_target(f"op {row['variant']}: t(vLLM's K3 kernel) / t(op) at "
                               f"T={row['T']} H={row['H']} nb={row['nb']} {row['dtype']}",
                               row["vs_op"].get("vllm-k3"), 1.0,
                               {k: v for k, v in missed.items() if k in ("op", "vllm-k3")}))
    for sec in ("tap", "pass"):
        out += results.get(sec, {}).get("targets", [])
    return out


def _target(name: str, ratio: dict | None, bound: float, missed: dict[str, str]) -> dict:
    t = target(name, ratio["median"] if ratio else float("nan"), bound, ">=")
    if missed:
        t["met"] = False
        t["reason"] = "; ".join(f"{k} MISS: {why}" for k, why in missed.items())
    return t
