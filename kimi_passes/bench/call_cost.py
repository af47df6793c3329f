"""``bench call-cost``: eager call time of the CPU kimi ops at decode sizes, against the
plain-torch statement.

What a model pays per mixing site when it calls ``torch.ops.kimi`` without compiling (or a
compiled graph that still calls an op). Per shape, one ``Timer`` run (interleaved
rounds, 1 thread by default) of:

- ``op``: the op as shipped (``Library`` registration, the C kernel where it serves);
- ``op-torch``: the same registration, the torch path of ``ops/cpu.py`` (``cpu_native``
  off: the module flag is flipped around each call);
- ``custom_op``: the torch path behind a ``torch.library.custom_op`` registration of the
  same schema (``custom_op``'s autograd, version-bump and aliasing-check layers, which the
  ``Library`` registration does without: docs/design.md section 9), in the ``kimi_bench``
  namespace;
- ``plain``: the statement a user writes in plain torch, eagerly, in the input dtype
  (``bench/op.py: plain_torch``; for ``attn_res_mix`` its pure-mixture part).

Outputs are checked against ``plain`` first (``max err``: ``harness.rel_err``). Reported:
the median time per call and, per round, plain / candidate (> 1: faster than the plain
statement), median and IQR. Run::

    python -m kimi_passes bench call-cost                  # T = 1, 8, 64; H=512, 4 blocks
    python -m kimi_passes bench call-cost --T 1 8 --H 7168 --blocks 8 --dtype bfloat16
"""

from __future__ import annotations

import argparse

import torch

import kimi_passes  # noqa: F401  (registers torch.ops.kimi.*)
from kimi_passes.bench.harness import PROG, Timer, ratio_summary, rel_err, summary
from kimi_passes.bench.op import make_op_args, plain_torch
from kimi_passes.ops import cpu_native
from kimi_passes.ops.attn_res_args import AttnResArgs, MixArgs, record_signature
from kimi_passes.ops.conventions import MUTATED_ARGS
from kimi_passes.ops.cpu import torch_rows


@torch.library.custom_op("kimi_bench::attn_res", mutates_args=MUTATED_ARGS)
@record_signature(AttnResArgs, returns=torch.Tensor)
def _custom_op_attn_res(*args) -> torch.Tensor:
    a = AttnResArgs(*args)
    out = torch.empty_like(a.prefix)
    torch_rows(a, out, None)
    return out


@torch.library.custom_op("kimi_bench::attn_res_mix", mutates_args=())
@record_signature(MixArgs, returns=torch.Tensor)
def _custom_op_mix(*args) -> torch.Tensor:
    a = AttnResArgs.mix(*args)
    out = torch.empty_like(a.prefix)
    torch_rows(a, out, None)
    return out


def _torch_path(fn):
    def call(*args):
        cpu_native.ENABLED = False
        try:
            return fn(*args)
        finally:
            cpu_native.ENABLED = True

    return call


def candidates(op: str, args: AttnResArgs) -> dict:
    """name -> zero-argument call, for ``op`` in {"attn_res_mix", "attn_res"}."""
    if op == "attn_res_mix":
        mix = MixArgs.part_of(args)
        pure = AttnResArgs.mix(*mix)  # the plain statement's arguments
        fns = {"op": torch.ops.kimi.attn_res_mix, "custom_op": torch.ops.kimi_bench.attn_res_mix}
        return {**{k: (lambda f=f: f(*mix)) for k, f in fns.items()},
                "op-torch": lambda: _torch_path(torch.ops.kimi.attn_res_mix)(*mix),
                "plain": lambda: plain_torch(*pure)}
    fns = {"op": torch.ops.kimi.attn_res, "custom_op": torch.ops.kimi_bench.attn_res}
    # The op adds delta into prefix in place every call; a tiny delta keeps values bounded.
    return {**{k: (lambda f=f: f(*args)) for k, f in fns.items()},
            "op-torch": lambda: _torch_path(torch.ops.kimi.attn_res)(*args),
            "plain": lambda: plain_torch(*args)}


def check(cands: dict, args: AttnResArgs) -> float:
    """The largest ``rel_err`` of a candidate against ``plain``, each from the same ``args``
    (restored after every call: the full variant updates prefix and blocks)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    saved = [t.clone() for t in tensors]

    def run(fn):
        out = fn()
        for t, s in zip(tensors, saved, strict=True):
            t.copy_(s)
        return out

    want = run(cands["plain"])
    return max(rel_err(run(fn), want) for name, fn in cands.items() if name != "plain")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=f"{PROG} call-cost", description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--H", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=4, help="bank slots mixed (num_blocks)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--block-ms", type=float, default=20.0, help="milliseconds per sample")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    timer = Timer(a.rounds, block_s=a.block_ms / 1e3, threads=a.threads)
    print(f"torch {torch.__version__}, {a.threads} thread(s), H={a.H}, {a.blocks} blocks, "
          f"{a.dtype}; us per call, median; ratio = t(plain) / t(x), median [IQR]")
    print("| op | T | plain | op | ratio | op-torch | ratio | custom_op | ratio | max err |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for op in ("attn_res_mix", "attn_res"):
        for T in a.T:
            variant = "full" if op == "attn_res" else "read"
            args = make_op_args(T, a.H, a.blocks, dtype, variant, "cpu")
            cands = candidates(op, args)
            err = check(cands, args)
            t = timer.run(cands)
            row = [op if op == "attn_res_mix" else "attn_res (delta, write, output norm)",
                   f"{T}", f"{summary(t['plain'])['median'] * 1e6:.1f}"]
            for name in ("op", "op-torch", "custom_op"):
                r = ratio_summary(t["plain"], t[name])
                row += [f"{summary(t[name])['median'] * 1e6:.1f}",
                        f"{r['median']:.2f}x [{r['q1']:.2f}, {r['q3']:.2f}]"]
            print("| " + " | ".join(row + [f"{err:.1e}"]) + " |", flush=True)
    return 0
