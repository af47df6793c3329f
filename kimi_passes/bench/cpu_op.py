"""CPU speed of ``kimi.attn_res`` against its plain-torch statement (docs/design.md section 3).

The baseline is what a user would write eagerly, in the input dtype: the in-place prefix
update and block write, ``cat`` of the sources, ``F.rms_norm`` keys, two matmuls and a
softmax, and the output RMSNorm. Run ``python -m kimi_passes.bench.cpu_op`` (or
``python tools/bench_cpu_op.py``; 2 threads; medians of ``torch.utils.benchmark`` samples
taken alternately from plain torch and the op); the ratio column is plain / op. On a busy
machine pass ``--threads 1``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.utils.benchmark as benchmark

import kimi_passes  # noqa: F401  (registers torch.ops.kimi.*)
from kimi_passes.bench.op import plain_torch  # the eager baseline the bench tool uses


def make_args(T, H, NB, nb, dtype, full):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    prefix, blocks = r(T, H), r(T, NB, H)
    delta = r(T, H) * 1e-3 if full else None
    onw = r(H) if full else None
    # Write into the slot after the ones read (the model's block-boundary step).
    write = nb if full and nb < NB else -1
    return [prefix, delta, blocks, r(H), r(H) * 0.05, onw, nb, write, 1e-6, 1e-6]


def measure(fns, args, budget_s, min_reps, threads):
    """Median ms per call of each fn. Samples are interleaved (fn0, fn1, fn0, ...) so a
    shared machine's load bursts hit every fn alike; each sample runs enough calls for
    ~20 ms, and sampling goes on until ``budget_s`` is spent (at least ``min_reps``)."""
    timers = [benchmark.Timer("fn(*args)", globals={"fn": f, "args": args},
                              num_threads=threads)
              for f in fns]
    numbers = []
    for t in timers:
        once = t.timeit(1).median  # the first call also warms up
        numbers.append(max(1, int(0.02 / max(once, 1e-6))))
    samples: list[list[benchmark.Measurement]] = [[] for _ in fns]
    t_end = time.perf_counter() + budget_s
    while len(samples[0]) < min_reps or time.perf_counter() < t_end:
        for i, t in enumerate(timers):
            samples[i].append(t.timeit(numbers[i]))
    return [benchmark.Measurement.merge(s)[0].median * 1e3 for s in samples]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--H", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--NB", type=int, default=9)
    ap.add_argument("--num-blocks", type=int, default=8)
    ap.add_argument("--budget", type=float, default=2.0, help="seconds of sampling per shape")
    ap.add_argument("--min-reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    op = torch.ops.kimi.attn_res
    load = os.getloadavg()[0]
    print(f"threads={a.threads}  cores={os.cpu_count()}  load average={load:.2f}")
    if a.threads > 1 and load > (os.cpu_count() or 1):
        print(f"warning: load average {load:.1f} on {os.cpu_count()} CPUs: OpenMP threads wait "
              "on the scheduler at every parallel region and timings are noise (the op runs "
              "more, smaller regions than plain torch); use --threads 1")
    print(f"{'T':>5} {'H':>5} {'NB':>3} {'nb':>3} {'dtype':>9} {'flags':>14} "
          f"{'plain ms':>9} {'op ms':>8} {'ratio':>6}")
    worst = float("inf")
    for dtype in (torch.float32, torch.bfloat16):
        for full in (False, True):
            for H in a.H:
                for T in a.T:
                    args = make_args(T, H, a.NB, a.num_blocks, dtype, full)
                    base, mine = measure([plain_torch, op], args, a.budget, a.min_reps, a.threads)
                    ratio = base / mine
                    worst = min(worst, ratio)
                    flags = "delta+w+onorm" if full else "read-only"
                    print(f"{T:>5} {H:>5} {a.NB:>3} {a.num_blocks:>3} "
                          f"{str(dtype)[6:]:>9} {flags:>14} {base:9.3f} {mine:8.3f} "
                          f"{ratio:5.2f}x", flush=True)
    print(f"worst ratio: {worst:.2f}x  (load average now {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
