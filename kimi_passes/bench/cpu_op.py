"""``bench cpu-op``: CPU speed of ``kimi.attn_res`` against its plain-torch statement.

The baseline is what a user would write eagerly, in the input dtype (docs/design.md
section 3): the in-place prefix update and block write, ``cat`` of the sources,
``F.rms_norm`` keys, two matmuls and a softmax, and the output RMSNorm (``op.plain_torch``).
Per shape, the two are timed alternately (``Timer``, 2 threads by default) until
``--budget`` seconds have passed, at least ``--min-reps`` rounds; the ratio column is
plain / op of the medians. On a busy machine pass ``--threads 1``.

    python -m kimi_passes bench cpu-op --threads 1
"""

from __future__ import annotations

import argparse
import functools
import os

import torch

from kimi_passes.bench.harness import PROG, Timer, load_warning, op_args, summary
from kimi_passes.bench.op import plain_torch  # the eager baseline the op section uses


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"{PROG} cpu-op", description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--H", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--NB", type=int, default=9, help="bank slots")
    ap.add_argument("--num-blocks", type=int, default=8, help="slots mixed (num_blocks)")
    ap.add_argument("--budget", type=float, default=2.0, help="seconds of sampling per shape")
    ap.add_argument("--min-reps", type=int, default=5, help="at least this many rounds")
    ap.add_argument("--threads", type=int, default=2)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    import kimi_passes  # noqa: F401  (registers torch.ops.kimi.*)

    torch.set_num_threads(a.threads)
    op = torch.ops.kimi.attn_res
    print(f"threads={a.threads}  cores={os.cpu_count()}  load average={os.getloadavg()[0]:.2f}")
    warning = load_warning(a.threads)
    if warning:
        print(warning)
    # Samples of ~20 ms, alternating, until the budget is spent.
    timer = Timer(a.min_reps, block_s=0.02, threads=a.threads, max_s=float("inf"),
                  min_s=a.budget)
    print(f"{'T':>5} {'H':>5} {'NB':>3} {'nb':>3} {'dtype':>9} {'flags':>14} "
          f"{'plain ms':>9} {'op ms':>8} {'ratio':>6}")
    worst = float("inf")
    for dtype in (torch.float32, torch.bfloat16):
        for full in (False, True):
            for H in a.H:
                for T in a.T:
                    # A block write goes to the slot after the ones read (a block boundary).
                    args = op_args(T, H, a.num_blocks, dtype=dtype, slots=a.NB,
                                   delta=1e-3 if full else None, output_norm=full,
                                   write=a.num_blocks if full and a.num_blocks < a.NB else -1)
                    t = timer.run({"plain": functools.partial(plain_torch, *args),
                                   "op": functools.partial(op, *args)})
                    base, mine = (summary(t[k])["median"] * 1e3 for k in ("plain", "op"))
                    worst = min(worst, base / mine)
                    flags = "delta+w+onorm" if full else "read-only"
                    print(f"{T:>5} {H:>5} {a.NB:>3} {a.num_blocks:>3} "
                          f"{str(dtype)[6:]:>9} {flags:>14} {base:9.3f} {mine:8.3f} "
                          f"{base / mine:5.2f}x", flush=True)
    print(f"worst ratio: {worst:.2f}x  (load average now {os.getloadavg()[0]:.2f})")
    return 0
