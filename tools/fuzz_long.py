"""Run the long fuzz profile on several cores, one seed per process, and summarise the logs.

Each process runs ``tests/test_taps_fuzz.py``'s model property with
``KIMI_PASSES_FUZZ_PROFILE=long`` and ``KIMI_PASSES_FUZZ_KEEP_GOING=1`` (a failing example is
logged and the run goes on; ``test_kept_going_without_failures`` then fails the process),
writing one JSON line per example to ``<log-dir>/fuzz_<seed>.jsonl``. Then the logs are
summarised: examples, distinct configurations (the weights' seed left out), outcomes,
stage compiles verified or refused, taps verified, the spread of the knobs and the worst
error in tolerances. Exit status 1 if any process failed or any example did not pass.

``--suite fusion`` runs ``tests/test_fusion_vs_inductor_fuzz.py`` instead (the differential fuzz of
the AttnRes fusion pass against plain Inductor; ``KIMI_PASSES_FUSION_FUZZ_*``, logs
``fusion_<seed>.jsonl``) and summarises programs, sites fused and refused, and the worst
error per dtype and mode.

    python tools/fuzz_long.py --seeds 20261130 20261131 --examples 600    # ~1 h, 2 cores
    python tools/fuzz_long.py --summarize-only --log-dir fuzz_logs        # logs only
    python tools/fuzz_long.py --suite fusion --examples 200 --timeout 1800

A Hypothesis run revisits some examples (about 15% of draws repeat a configuration), so
the distinct count, not the example count, is the one to quote. Repeats are served from
the compile caches and cost about a second.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG_KEYS = ("L", "S", "H", "ids", "cuts", "T", "dtype", "stream", "fuse")


# suite: (env prefix, log name prefix, test file, -k selection)
SUITES = {
    "taps": ("KIMI_PASSES_FUZZ_", "fuzz", "tests/test_taps_fuzz.py", "ground_truth or kept"),
    "fusion": ("KIMI_PASSES_FUSION_FUZZ_", "fusion", "tests/test_fusion_vs_inductor_fuzz.py",
               "equals or kept"),
}


def run_shards(seeds, examples: int, log_dir: Path, timeout_s: int,
               suite: str = "taps") -> list[int]:
    """One pytest process per seed, all at once; returns their exit codes."""
    env_prefix, name, test_file, select = SUITES[suite]
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for s in seeds:
        log = log_dir / f"{name}_{s}.jsonl"
        log.unlink(missing_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS="1", **{
            env_prefix + k: v for k, v in (("PROFILE", "long"), ("KEEP_GOING", "1"),
                                           ("SEED", str(s)), ("EXAMPLES", str(examples)),
                                           ("LOG", str(log)))})
        out = open(log_dir / f"{name}_{s}.out", "w")  # noqa: SIM115  (closed below)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               test_file, "-k", select]
        procs.append((s, out, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out,
                                               stderr=subprocess.STDOUT)))
    codes, deadline = [], time.monotonic() + timeout_s
    for s, out, p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.terminate()
            codes.append(p.wait())
            print(f"seed {s}: stopped at the {timeout_s} s limit; its log holds what ran")
        out.close()
    return codes


def stage_capture_ids(r: dict, start: int, end: int, cache: dict) -> tuple[int, ...]:
    from kimi_passes.graphs.k3 import K3Config, K3Model

    key = (r["L"], r["S"], tuple(r["ids"]), start, end)
    if key not in cache:
        cfg = K3Config(num_layers=r["L"], hidden_size=16, attn_res_block_size=r["S"],
                       num_heads=2, intermediate_size=32, vocab_size=64,
                       aux_layer_ids=tuple(r["ids"]))
        cache[key] = K3Model(cfg, start, end).capture_ids
    return cache[key]


def summarize(logs: list[Path]) -> tuple[str, bool]:
    rows = [json.loads(line) for log in logs for line in log.read_text().splitlines()]
    if not rows:
        return "no examples logged", False
    n = len(rows)

    def key(r):
        return json.dumps({k: r[k] for k in CONFIG_KEYS}, sort_keys=True)

    def pct(pred):
        return f"{100 * sum(1 for r in rows if pred(r)) / n:.0f}%"

    outcomes = collections.Counter(r["outcome"] for r in rows)
    stages = collections.Counter(s for r in rows for s in r.get("stages", ()))
    cache: dict = {}
    taps, with_tap, fused_taps, served_boundary = 0, 0, 0, 0
    for r in rows:
        k = 0
        for (a, b), st in zip(itertools.pairwise([0, *r["cuts"], r["L"]]),
                              r.get("stages", ()), strict=False):
            if st == "ok":
                ids = stage_capture_ids(r, a, b, cache)
                k += len(ids)
                served_boundary += b != r["L"] and b in ids
        taps += k
        with_tap += k > 0
        fused_taps += k if r["fuse"] else 0
    worst = {d: max((r.get("worst", 0.0) for r in rows if r["dtype"] == d), default=None)
             for d in ("float32", "bfloat16")}
    lines = [
        f"logs: {', '.join(str(p) for p in logs)}",
        f"examples: {n}; distinct configurations: {len({key(r) for r in rows})}",
        f"outcomes: {dict(outcomes)}",
        f"stage compiles: {sum(stages.values())} ({stages['ok']} verified, "
        f"{stages['refused']} refused as expected)",
        f"taps verified: {taps} (fused capture {fused_taps}; boundary taps served in the "
        f"prefix stream {served_boundary}); examples with a verified tap: {with_tap}",
        f"knobs: T=1 {pct(lambda r: r['T'] == 1)}, T>=32 {pct(lambda r: r['T'] >= 32)}, "
        f"bf16 {pct(lambda r: r['dtype'] == 'bfloat16')}, "
        f"prefix stream {pct(lambda r: r['stream'] == 'prefix')}, "
        f"fused {pct(lambda r: r['fuse'])}, 2-3 stages {pct(lambda r: r['cuts'])}, "
        f"no tap {pct(lambda r: not r['ids'])}",
        f"layers: {dict(sorted(collections.Counter(r['L'] for r in rows).items()))}",
        f"worst error / tolerance: fp32 {worst['float32']}, bf16 {worst['bfloat16']}",
        f"example seconds: {sum(r['seconds'] for r in rows) / 60:.1f} min in all",
    ]
    ok = set(outcomes) == {"ok"}
    return "\n".join(lines), ok


def summarize_fusion(logs: list[Path]) -> tuple[str, bool]:
    """Summary of tests/test_fusion_vs_inductor_fuzz.py logs (one row per program and mode)."""
    rows = [json.loads(line) for log in logs for line in log.read_text().splitlines()]
    if not rows:
        return "no examples logged", False
    evals = [r for r in rows if r["mode"] == "eval"]
    sites = [s for r in evals for s in r["program"]["sites"]]
    misses = collections.Counter(s["miss"] for s in sites if s["miss"])
    exact = sum(1 for s in sites if not s["miss"])
    ok_evals = [r for r in evals if r["outcome"] == "ok"]
    ok_trains = [r for r in rows if r["mode"] == "train" and r["outcome"] == "ok"]
    fused = sum(r["fused"] for r in ok_evals)
    refused = sum(len(r["program"]["sites"]) - r["fused"] for r in ok_evals)
    outcomes = collections.Counter((r["mode"], r["outcome"]) for r in rows)

    def worst(mode, dtype):
        return max((r.get("worst", 0.0) for r in rows
                    if r["mode"] == mode and r["program"]["dtype"] == dtype), default=None)

    lines = [
        f"logs: {', '.join(str(p) for p in logs)}",
        f"programs: {len(evals)} (eval) / {len(rows) - len(evals)} (train); distinct: "
        f"{len({r['describe'] for r in evals})}",
        f"outcomes: {dict(sorted((f'{m} {o}', n) for (m, o), n in outcomes.items()))}",
        f"sites: {len(sites)} ({exact} exact, {len(sites) - exact} near misses); in passing "
        f"eval programs {fused} fused, {refused} left alone; in passing training programs "
        f"{sum(r['fused'] for r in ok_trains)} fused before AOTAutograd, "
        f"{sum(len(r['program']['sites']) - r['fused'] for r in ok_trains)} left alone",
        f"near misses: {dict(sorted(misses.items()))}",
        f"layouts: {dict(collections.Counter(r['program']['layout'] for r in evals))}; "
        f"bf16 {sum(1 for r in evals if r['program']['dtype'] == 'bfloat16')}",
        "worst error / max(1, max|ref|): " + ", ".join(
            f"{m} {d} {worst(m, d)}" for m in ("eval", "train") for d in ("float32", "bfloat16")),
        f"example seconds: {sum(r['seconds'] for r in rows) / 60:.1f} min in all",
    ]
    failures = [r for r in rows if r["outcome"] != "ok"]
    lines += [f"{r['outcome'].upper()} ({r['mode']}): {r['describe']}: {r.get('error', '')[:300]}"
              for r in failures[:5]]
    return "\n".join(lines), not failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[20261130, 20261131],
                    help="one process per seed (default: 2, one per core here)")
    ap.add_argument("--examples", type=int, default=600,
                    help="generated examples per seed (plus the 3 explicit ones)")
    ap.add_argument("--log-dir", type=Path, default=Path("fuzz_logs"))
    ap.add_argument("--timeout", type=int, default=3 * 3600, help="seconds for all shards")
    ap.add_argument("--summarize-only", action="store_true", help="summarise existing logs")
    ap.add_argument("--suite", choices=sorted(SUITES), default="taps",
                    help="taps: tests/test_taps_fuzz.py; "
                         "fusion: tests/test_fusion_vs_inductor_fuzz.py")
    args = ap.parse_args(argv)
    name = SUITES[args.suite][1]
    codes = [] if args.summarize_only else run_shards(args.seeds, args.examples,
                                                      args.log_dir, args.timeout, args.suite)
    logs = (sorted(args.log_dir.glob(f"{name}_*.jsonl")) if args.summarize_only
            else [args.log_dir / f"{name}_{s}.jsonl" for s in args.seeds])
    logs = [p for p in logs if p.exists()]
    text, ok = (summarize_fusion if args.suite == "fusion" else summarize)(logs)
    print(text)
    if codes:
        print(f"process exit codes (seeds {args.seeds}): {codes}")
    return 0 if ok and not any(codes) else 1


if __name__ == "__main__":
    sys.exit(main())
