"""Benchmarks: the AttnRes op, the cost of a tap, the cost of the pass, compile scaling.

    python -m kimi_passes bench --quick                  # a minute-sized CPU smoke run
    python -m kimi_passes bench --out bench.json         # the fuller CPU sweep (+ bench.png)
    python -m kimi_passes bench --device cuda --out gpu.json
    python -m kimi_passes bench --only op --T 1 64 --H 256 --blocks 2 --dtypes float32

Sections (``--only op,tap,pass,compile``):

``op``
    ``torch.ops.kimi.attn_res`` against the plain-torch statement of DESIGN section 3
    written in the input dtype and run eagerly (``eager``), the same statement compiled
    by Inductor (``compiled``: ``torch.compile(fn, dynamic=False)``, static shapes, one
    compile per cell) and a memory copy moving the same number of bytes (``copy``:
    ``dst.copy_(src)`` with ``src`` and ``dst`` ``bytes/2`` each, so it reads ``bytes/2`` and
    writes ``bytes/2``). On CUDA also the Triton kernel called directly (``triton``: what
    the op dispatches to, without the dispatcher) and, when importable, the PyPI peers
    ``flash-attn-res`` and ``fast-attnres`` on the shapes their kernels accept.
    Variants: ``read`` (no delta, no block write, no output norm: a pure read of the
    pre-norm mixture) and ``full`` (delta, a block write into slot ``nb``, output norm:
    the pre-attention call of a block-write layer).
    Bytes moved (the op's minimum traffic): every source read once (``nb`` blocks and
    the prefix), plus the delta read and the prefix write-back when there is a delta,
    plus the block write, plus the output write, plus the weight vectors.
    ``GB/s = bytes / time``; ``roof = t(copy) / t(op)`` (1.0 = copy speed);
    ``x eager = t(eager) / t(op)`` and ``x comp = t(compiled) / t(op)`` (>1: the op is
    faster). Ratios are medians of per-round ratios of interleaved samples.

``tap``
    One compiled reference K3 step with taps at the EAGLE3 capture ids served three ways:
    ``prefix`` stream, ``attn_res`` stream (fused: one extra ``[T,H]`` write per tap) and
    the vLLM-style capture (``attn_res`` stream, ``fuse_capture=False``: a separate
    ``attn_res_mix`` read of the bank per tap). Targets: attn_res <= 1.02 x prefix, and
    attn_res faster than the separate read.

``pass``
    The aux-stream pass's time as a share of a cold compile (``force_disable_caches``)
    at K3's depth (``K3Config.k3_geometry()``, 93 layers); target <= 2%. Also the pass
    alone, timed on copies of the captured post-grad graph, with a profile, and the same
    with every capture id tapped (how the pass scales with the number of taps).

``compile``
    Cold compile time over 8..93 layers at the same toy width, a linear fit, and the
    time per layer at the deepest over the shallowest depth.

CPU timings use ``torch.utils.benchmark.Timer``; CUDA timings use CUDA events around
each call with the L2 cache flushed before it and the host given a head start (device
time; ``op back-to-back`` adds the host-bound regime). Candidates are interleaved round
by round (their order rotates) and reported as median with the interquartile range. On a
shared or oversubscribed CPU use ``--threads 1``: OpenMP barriers across preempted
threads turn sub-millisecond calls into scheduler quanta.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import datetime
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

SECTIONS = ("op", "tap", "pass", "compile")
VARIANTS = ("read", "full")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EPS = 1e-6
PEERS = ("flash-attn-res", "fast-attnres")

# Targets (DESIGN section 5 and issue 6).
TARGET_ROOFLINE = 0.90  # H200 headline shape, fraction of a same-bytes copy
TARGET_TAP_VS_PREFIX = 1.02  # attn_res stream step / prefix stream step
TARGET_PASS_SHARE = 0.02  # pass time / cold compile time at K3 depth


# ----------------------------------------------------------------------------- statistics


def summary(xs: list[float]) -> dict:
    """Median, quartiles, min, max and count of ``xs``."""
    xs = sorted(xs)
    if len(xs) >= 2:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    else:
        q1 = q3 = xs[0]
    return {"median": statistics.median(xs), "q1": q1, "q3": q3, "min": xs[0], "max": xs[-1],
            "n": len(xs)}


def ratio_summary(num: list[float], den: list[float]) -> dict:
    """Summary of the per-round ratios ``num[r] / den[r]`` (paired samples)."""
    return summary([a / b for a, b in zip(num, den, strict=True)])


def linear_fit(xs: list[float], ys: list[float]) -> dict:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx if sxx else 0.0
    intercept = my - slope * mx
    ss_res = sum((y - (intercept + slope * x)) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = sum((y - my) ** 2 for y in ys)
    r2 = 1.0 - ss_res / ss_tot if ss_tot else 1.0
    return {"slope": slope, "intercept": intercept, "r2": r2}


# ----------------------------------------------------------------------------- timing


class CpuTimer:
    """Interleaved CPU timing with ``torch.utils.benchmark.Timer``.

    Each candidate is warmed up, then calibrated to a sample of about ``block_s``
    seconds (``number`` calls); every round takes one sample of each candidate, in
    an order rotated by one per round, so drift and neighbours' load hit all alike.
    """

    def __init__(self, rounds: int, block_s: float, threads: int, max_s: float = 20.0):
        self.rounds, self.block_s, self.threads = rounds, block_s, threads
        # Fewer rounds (at least 3) when the slowest candidate would take longer than this.
        self.max_s = max_s

    def run(self, cands: dict[str, Callable[[], object]]) -> dict[str, list[float]]:
        from torch.utils.benchmark import Timer

        timers, numbers, estimates = {}, {}, {}
        for name, fn in cands.items():
            fn()  # warm-up: compiles, allocator, caches
            timer = Timer("fn()", globals={"fn": fn}, num_threads=self.threads)
            t1 = timer.timeit(1).mean
            number = max(1, int(self.block_s / max(t1, 1e-9)))
            if number > 1:  # re-estimate on a bigger sample: one call is too noisy
                t1 = timer.timeit(min(number, 10)).mean
                number = max(1, int(self.block_s / max(t1, 1e-9)))
            timers[name], numbers[name] = timer, number
            estimates[name] = t1 * number
        samples: dict[str, list[float]] = {name: [] for name in cands}
        order = list(cands)
        rounds = min(self.rounds, max(3, int(self.max_s / max(estimates.values()))))
        for r in range(rounds):
            k = r % len(order)
            for name in order[k:] + order[:k]:
                samples[name].append(timers[name].timeit(numbers[name]).mean)
        return samples


class CudaTimer:
    """Interleaved CUDA timing: CUDA events around each call, L2 flushed before it.

    The times are device times: before each call the GPU is held busy (``_sleep``) long
    enough for the host to enqueue the call, so Python and launch overhead are hidden
    the way a CUDA graph hides them. ``host_time`` measures the other regime.
    """

    # ~0.5 ms at H200 clocks: longer than the host needs to launch any candidate here.
    SLEEP_CYCLES = 1_000_000

    def __init__(self, rounds: int, reps: int, device):
        self.rounds, self.reps, self.device = rounds, reps, device
        # Bigger than any L2 (H200: 60 MiB), so every call starts cold like a real step.
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)

    def host_time(self, fn) -> float:
        """Seconds per call back to back, synchronised per block: max(launch, device)."""
        from torch.utils.benchmark import Timer

        return Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.2).median

    def run(self, cands: dict[str, Callable[[], object]]) -> dict[str, list[float]]:
        for fn in cands.values():
            for _ in range(3):
                fn()
        torch.cuda.synchronize(self.device)
        samples: dict[str, list[float]] = {name: [] for name in cands}
        order = list(cands)
        for r in range(self.rounds):
            k = r % len(order)
            for name in order[k:] + order[:k]:
                fn = cands[name]
                events = [(torch.cuda.Event(enable_timing=True),
                           torch.cuda.Event(enable_timing=True)) for _ in range(self.reps)]
                for start, end in events:
                    self.flush.zero_()
                    torch.cuda._sleep(self.SLEEP_CYCLES)
                    start.record()
                    fn()
                    end.record()
                torch.cuda.synchronize(self.device)
                per_call = [s.elapsed_time(e) * 1e-3 for s, e in events]
                samples[name].append(statistics.median(per_call))
        return samples


# ----------------------------------------------------------------------------- the op


def plain_torch(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight,
                num_blocks, block_write_idx, eps, output_norm_eps):
    """DESIGN section 3 the way a user writes it: plain torch in the input dtype."""
    H = prefix.shape[-1]
    if delta is not None:
        prefix.add_(delta)
    if block_write_idx >= 0:
        blocks[:, block_write_idx] = prefix
    values = torch.cat([blocks[:, :num_blocks], prefix[:, None]], 1)
    keys = F.rms_norm(values, (H,), norm_weight, eps)
    p = (keys @ qk_weight).softmax(-1)
    out = (p[:, None] @ values)[:, 0]
    if output_norm_weight is not None:
        out = F.rms_norm(out, (H,), output_norm_weight, output_norm_eps)
    return out


def make_op_args(T, H, nb, dtype, variant, device, seed=0):
    """Positional ``kimi::attn_res`` args; the bank has ``nb + 1`` slots (the write slot)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)

    full = variant == "full"
    prefix, blocks = rnd(T, H), rnd(T, nb + 1, H)
    delta = rnd(T, H, scale=1e-3) if full else None
    norm_weight = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype=dtype, device=device)
    qk_weight = rnd(H, scale=2.0 / H**0.5)
    onw = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype=dtype, device=device) if full else None
    write = nb if full else -1
    return [prefix, delta, blocks, norm_weight, qk_weight, onw, nb, write, EPS, EPS]


def op_bytes(T, H, nb, dtype, variant) -> int:
    """The op's minimum traffic (see the module docstring)."""
    e = torch.empty((), dtype=dtype).element_size()
    rows = nb + 1 + 1  # sources read once, output written once
    weights = 2
    if variant == "full":
        rows += 2 + 1  # delta read + prefix write-back; block write
        weights += 1  # output norm weight
    return e * (T * H * rows + H * weights)


def _clone_args(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _rel_err(out, ref) -> float:
    ref = ref.float()
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1.0))


def _peer_fns(args, variant, dtype, device):
    """``{peer: fn or reason}``: the peers' kernels computing the ``read`` mixture."""
    prefix, _, blocks, norm_weight, qk_weight, _, nb, *_ = args
    T, H = prefix.shape
    found: dict[str, object] = {}
    reasons = []
    if device.type != "cuda":
        reasons.append("CUDA only")
    if variant != "read":
        reasons.append("computes the mixture only (no delta, block write or output norm)")
    if dtype != torch.bfloat16:
        reasons.append("bf16 only")
    query = (norm_weight.float() * qk_weight.float())  # RMSNorm weight folded into the query
    try:
        from flash_attn_res import (
            phase_1_batched_attention_triton_op,
            phase_2_online_softmax_merge_triton_op,
        )
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
        found["flash-attn-res"] = f"not installed ({type(e).__name__})"
    else:
        why = list(reasons)
        if H & (H - 1):
            why.append(f"hidden size must be a power of 2 (tl.arange), got {H}")
        if nb < 1:
            why.append("needs at least one completed block")
        if why:
            found["flash-attn-res"] = "unsupported: " + "; ".join(why)
        else:
            # Its layout is source-major [nb, B=1, T, H]: a copy made once, outside timing.
            vals = blocks[:, :nb].permute(1, 0, 2).contiguous()[:, None]
            pq = query.to(torch.bfloat16)[None]
            pre = prefix[None]

            def flash_attn_res():
                out1, lse1 = phase_1_batched_attention_triton_op(vals, pq, EPS)
                return phase_2_online_softmax_merge_triton_op(pre, pq[0], out1[0], lse1[0],
                                                              EPS)[0]

            found["flash-attn-res"] = flash_attn_res
    try:
        from attnres import attnres
    except Exception as e:  # noqa: BLE001
        found["fast-attnres"] = f"not installed ({type(e).__name__})"
    else:
        why = list(reasons)
        if H > 8192 or nb + 1 > 129:
            why.append("envelope is H <= 8192 and <= 129 sources")
        if why:
            found["fast-attnres"] = "unsupported: " + "; ".join(why)
        else:
            sources = [blocks[:, j] for j in range(nb)] + [prefix]  # views, no copy
            q = query.to(torch.bfloat16)

            def fast_attnres():
                return attnres(sources, q, eps=EPS)

            found["fast-attnres"] = fast_attnres
    return found


def _sweep(cfg) -> list[tuple]:
    """Cells ``(dtype, variant, T, H, nb)``: axis sweeps around a centre shape."""
    cells = []
    if cfg.user_shapes:
        for dt in cfg.dtypes:
            for v in cfg.variants:
                for H in cfg.H:
                    for nb in cfg.blocks:
                        for T in cfg.T:
                            cells.append((dt, v, T, H, nb))
        return cells
    H0, nb0, T0 = cfg.H[0], cfg.blocks[0], cfg.T_centre
    for dt in cfg.dtypes:
        for v in cfg.variants:
            cells += [(dt, v, T, H0, nb0) for T in cfg.T]
            cells += [(dt, v, T0, H, nb0) for H in cfg.H[1:]]
            cells += [(dt, v, T0, H0, nb) for nb in cfg.blocks[1:]]
    for dt, v, T, H, nb in cfg.extra_cells:
        if dt in cfg.dtypes and v in cfg.variants:
            cells.append((dt, v, T, H, nb))
    return cells


def _op_factories(cfg, variant, dtype) -> tuple[dict, dict]:
    """``{name: make(args) -> fn}`` for the timed candidates (not copy, not peers)."""
    op = torch.ops.kimi.attn_res
    makers: dict[str, Callable] = {"op": lambda a: lambda: op(*a)}
    notes = {}
    if cfg.device.type == "cuda":
        from kimi_passes.ops import attn_res_triton

        makers["triton"] = lambda a: lambda: attn_res_triton(*a)
    makers["eager"] = lambda a: lambda: plain_torch(*a)
    if cfg.compiled:
        compiled = torch.compile(plain_torch, dynamic=False)
        makers["compiled"] = lambda a: lambda: compiled(*a)
    else:
        notes["compiled"] = "skipped (--no-compiled)"
    return makers, notes


def bench_op(cfg, log) -> dict:
    device = cfg.device
    rows = []
    for dt_name, variant, T, H, nb in _sweep(cfg):
        dtype = DTYPES[dt_name]
        torch._dynamo.reset()
        args = make_op_args(T, H, nb, dtype, variant, device)
        nbytes = op_bytes(T, H, nb, dtype, variant)
        makers, notes = _op_factories(cfg, variant, dtype)
        peers = {}
        if cfg.peers and device.type == "cuda":
            for name, fn in _peer_fns(args, variant, dtype, device).items():
                if callable(fn):
                    peers[name] = fn
                else:
                    notes[name] = fn
        errors = {}
        if cfg.check:
            errors = _check_op(makers, peers, args, notes)
            for name in list(makers):
                if name in notes:
                    makers.pop(name)
            for name in list(peers):
                if name in notes:
                    peers.pop(name)
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        # Every candidate shares ``args``: the in-place effects are idempotent enough
        # (the block write copies the prefix; the delta is 1e-3 of it).
        cands = {name: make(args) for name, make in makers.items()}
        cands["copy"] = lambda s=src, d=dst: d.copy_(s)
        cands.update(peers)
        with torch.no_grad():
            samples = cfg.timer.run(cands)
            host = ({name: cfg.timer.host_time(cands[name]) for name in ("op", "triton")}
                    if device.type == "cuda" else None)
        t = {name: summary(s) for name, s in samples.items()}
        row = {
            "dtype": dt_name, "variant": variant, "T": T, "H": H, "nb": nb, "bytes": nbytes,
            "time_s": t,
            "host_time_s": host,
            "gbps": {name: nbytes / s["median"] / 1e9 for name, s in t.items()},
            "roofline": ratio_summary(samples["copy"], samples["op"]),
            "op_vs_eager": ratio_summary(samples["eager"], samples["op"]),
            "op_vs_compiled": (ratio_summary(samples["compiled"], samples["op"])
                               if "compiled" in samples else None),
            "vs_op": {name: ratio_summary(s, samples["op"]) for name, s in samples.items()
                      if name not in ("op", "copy")},
            "max_rel_err": errors,
            "notes": notes,
        }
        rows.append(row)
        log(_op_line(row, device))
        del args, src, dst, cands, peers
    return {"rows": rows}


def _check_op(makers, peers, args, notes) -> dict:
    """Each candidate's output (on fresh clones) against the fp32 reference, first rows.

    A candidate that raises is reported in ``notes`` and dropped from the timing.
    """
    from kimi_passes.ops import attn_res_reference

    prefix, delta, blocks, *rest = args
    n = min(prefix.shape[0], 256)
    sliced = [prefix[:n].clone(), None if delta is None else delta[:n].clone(),
              blocks[:n].clone(), *rest]
    with torch.no_grad():
        ref = attn_res_reference(*sliced)
    errors = {}
    # The peers' closures hold views of ``args`` (read variant: nothing is mutated).
    fns = {name: (lambda make=make: make(_clone_args(args))()) for name, make in makers.items()}
    fns.update(peers)
    for name, fn in fns.items():
        try:
            with torch.no_grad():
                out = fn()
            errors[name] = _rel_err(out[:n], ref)
        except Exception as e:  # noqa: BLE001 - a failing candidate is reported, not fatal
            notes[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return errors


def _fmt_ratio(r) -> str:
    if r is None:
        return "     -     "
    return f"{r['median']:5.2f}[{r['q1']:.2f}-{r['q3']:.2f}]"


OP_HEADER = (f"{'dtype':>8} {'var':>4} {'T':>5} {'H':>5} {'nb':>2} {'MB':>8} "
             f"{'op ms':>9} {'op GB/s':>7} {'copy GB/s':>9} {'roof [IQR]':>16} "
             f"{'x eager [IQR]':>16} {'x comp [IQR]':>16}")


def _op_line(row, device) -> str:
    t = row["time_s"]
    s = (f"{row['dtype']:>8} {row['variant']:>4} {row['T']:>5} {row['H']:>5} {row['nb']:>2} "
         f"{row['bytes'] / 1e6:8.2f} {t['op']['median'] * 1e3:9.4f} {row['gbps']['op']:7.2f} "
         f"{row['gbps']['copy']:9.2f} {_fmt_ratio(row['roofline']):>16} "
         f"{_fmt_ratio(row['op_vs_eager']):>16} {_fmt_ratio(row['op_vs_compiled']):>16}")
    extra = [f"{n}={t[n]['median'] * 1e3:.4f}ms" for n in ("triton", *PEERS) if n in t]
    if row.get("host_time_s"):
        extra.append(f"op back-to-back={row['host_time_s']['op'] * 1e3:.4f}ms")
    extra += [f"{n}: {why}" for n, why in row["notes"].items() if n in PEERS
              and device.type == "cuda" and row["variant"] == "read"
              and row["dtype"] == "bfloat16"]
    return s + ("  " + "; ".join(extra) if extra else "")


# ----------------------------------------------------------------------------- K3 models


def _heads(H: int) -> int:
    """Attention heads of 128 channels where H allows it, else one head."""
    return H // 128 if H % 128 == 0 and H >= 128 else 1


def eagle3_ids(L: int) -> tuple[int, ...]:
    """vLLM's default EAGLE3 aux layers (2, L//2, L-3), as capture ids."""
    return tuple(sorted({2, L // 2, L - 3}))


def k3_ids(L: int) -> tuple[int, ...]:
    """K3-geometry taps at depth L: EAGLE3, the last block-write layer before L-3, and L.

    At L=93 these are ``K3Config.k3_geometry()``'s ids (2, 46, 88, 90, 93).
    """
    return tuple(sorted(k for k in {2, L // 2, 8 * ((L - 3) // 8), L - 3, L} if 0 <= k <= L))


def k3_depth(L: int):
    from kimi_passes.graphs import K3Config

    return replace(K3Config.k3_geometry(), num_layers=L, aux_layer_ids=k3_ids(L))


def _k3_input(cfg, T, device):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, cfg.vocab_size, (T,), generator=g).to(device)


def bench_tap(cfg, log) -> dict:
    from kimi_passes import make_kimi_backend
    from kimi_passes.graphs import K3Config, K3Model

    L, H, S, T = cfg.tap_layers, cfg.tap_hidden, cfg.tap_block, cfg.tap_T
    dtype = torch.bfloat16 if cfg.device.type == "cuda" else torch.float32
    k3 = K3Config(num_layers=L, hidden_size=H, attn_res_block_size=S, num_heads=_heads(H),
                  intermediate_size=2 * H, vocab_size=128, aux_layer_ids=eagle3_ids(L),
                  dtype=dtype)
    ids = _k3_input(k3, T, cfg.device)
    ways = {
        "prefix": dict(aux_stream="prefix"),
        "attn_res": dict(aux_stream="attn_res"),
        "vllm_style": dict(aux_stream="attn_res", fuse_capture=False),
    }
    torch._dynamo.reset()
    eager = K3Model(k3).to(cfg.device)
    with torch.no_grad():
        truth = eager.ground_truth(ids)[1]
    compiled, hows, errs = {}, {}, {}
    for name, opts in ways.items():
        backend = make_kimi_backend(**opts)
        model = K3Model(k3).to(cfg.device)
        cm = torch.compile(model, backend=backend)
        t0 = time.perf_counter()
        with torch.no_grad():
            _, taps = cm(ids)
        log(f"  compiled {name} in {time.perf_counter() - t0:.1f}s")
        hows[name] = [f"{r.capture_id}: {r.how()}" for r in backend.aux_pass.last_rewrites]
        errs[name] = max(_rel_err(a, b) for a, b in zip(taps, truth, strict=True))
        compiled[name] = cm
    cands = {name: (lambda cm=cm: cm(ids)) for name, cm in compiled.items()}
    with torch.no_grad():
        samples = cfg.timer.run(cands)
    t = {name: summary(s) for name, s in samples.items()}
    res = {
        "config": {"num_layers": L, "hidden_size": H, "block_size": S, "T": T,
                   "intermediate_size": 2 * H, "num_heads": k3.num_heads, "dtype": str(dtype),
                   "capture_ids": list(k3.aux_layer_ids)},
        "time_s": t,
        "attn_res_vs_prefix": ratio_summary(samples["attn_res"], samples["prefix"]),
        "attn_res_vs_vllm_style": ratio_summary(samples["attn_res"], samples["vllm_style"]),
        "vllm_style_vs_prefix": ratio_summary(samples["vllm_style"], samples["prefix"]),
        "tap_max_rel_err_vs_ground_truth": errs,
        "rewrites": hows,
    }
    res["per_tap_ops"] = _tap_ops(cfg, k3, log)
    extra = {way: sum(r[way]["extra_s"] for r in res["per_tap_ops"])
             for way in ("fused", "separate")}
    res["tap_ops_extra_s"] = extra
    res["tap_ops_extra_share_of_step"] = {
        way: v / t["prefix"]["median"] for way, v in extra.items()}
    res["targets"] = [
        _target("tap: attn_res step / prefix step", res["attn_res_vs_prefix"]["median"],
                TARGET_TAP_VS_PREFIX, "<="),
        _target("tap: attn_res step / vLLM-style step", res["attn_res_vs_vllm_style"]["median"],
                1.0, "<"),
    ]
    return res


def _consumer_args(k, k3, T, device, seed=0):
    """Args of capture id ``k``'s consumer in ``k3`` (DESIGN section 2) at ``T`` tokens."""
    L, S, H, dtype = k3.num_layers, k3.attn_res_block_size, k3.hidden_size, k3.dtype
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)

    nb = -(-k // S)
    bank = rnd(T, -(-L // S), H)
    weights = [1 + 0.1 * rnd(H), rnd(H, scale=2.0 / H**0.5)]
    if k == L:  # the output aggregation: no output norm, no write
        return [rnd(T, H), rnd(T, H), bank, *weights, None, nb, -1, k3.eps, k3.eps]
    delta = rnd(T, H) if k > 0 else None
    write = k // S if k % S == 0 else -1
    return [rnd(T, H), delta, bank, *weights, 1 + 0.1 * rnd(H), nb, write, k3.eps, k3.eps]


def _tap_ops(cfg, k3, log) -> list[dict]:
    """Each tap's cost at op level: its consumer alone, fused (``attn_res_capture``: one
    extra ``[T,H]`` write) and separate (the consumer, then an ``attn_res_mix`` read)."""
    ops = torch.ops.kimi
    rows = []
    for k in k3.aux_layer_ids:
        a = _consumer_args(k, k3, cfg.tap_T, cfg.device)
        prefix, _, bank, nw, qk, _, nb, *_ = a

        def separate(a=a, prefix=prefix, bank=bank, nw=nw, qk=qk, nb=nb):
            ops.attn_res(*a)
            return ops.attn_res_mix(prefix, bank, nw, qk, nb, k3.eps)

        cands = {"consumer": lambda a=a: ops.attn_res(*a),
                 "fused": lambda a=a: ops.attn_res_capture(*a),
                 "separate": separate}
        with torch.no_grad():
            samples = cfg.op_timer.run(cands)
        row = {"capture_id": k, "num_blocks": nb, "block_write_idx": a[7],
               "output_norm": a[5] is not None,
               "consumer_s": summary(samples["consumer"])}
        for way in ("fused", "separate"):
            diffs = [x - c for x, c in zip(samples[way], samples["consumer"], strict=True)]
            row[way] = {"time_s": summary(samples[way]), "extra_s": statistics.median(diffs),
                        "ratio": ratio_summary(samples[way], samples["consumer"])}
        rows.append(row)
        log(f"  capture id {k}: consumer {row['consumer_s']['median'] * 1e3:.3f}ms, fused "
            f"+{row['fused']['extra_s'] * 1e3:.3f}ms, separate "
            f"+{row['separate']['extra_s'] * 1e3:.3f}ms")
    return rows


def _target(name, value, bound, how) -> dict:
    met = value <= bound if how == "<=" else (value < bound if how == "<" else value >= bound)
    return {"target": f"{name} {how} {bound}", "value": value, "met": bool(met)}


# ----------------------------------------------------------------------------- compile


class _Abort(Exception):
    """Raised by the timing pass manager to stop a compile right after the passes."""


def _set_limits():
    dc = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dc, name):
            setattr(dc, name, 1 << 20)
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(dc, name):
            setattr(dc, name, 1 << 20)


@contextlib.contextmanager
def _cold():
    """No cache of any kind: every compile lowers and builds its kernels from scratch."""
    with torch._inductor.config.patch(force_disable_caches=True):
        yield


@contextlib.contextmanager
def _no_graph_caches():
    """FX graph and AOT caches off, so the post-grad passes run (kernel caches stay on)."""
    patches = {"fx_graph_cache": False}
    with torch._inductor.config.patch(patches):
        fc = torch._functorch.config
        if hasattr(fc, "enable_autograd_cache"):
            with fc.patch(enable_autograd_cache=False):
                yield
        else:
            yield


def _timed_backend(aux_stream="attn_res", abort=False, keep_graph=True):
    """A kimi backend whose pass manager records its time and a copy of its input graph."""
    from kimi_passes import make_kimi_backend
    from kimi_passes.backend import KimiPassManager

    backend = make_kimi_backend(aux_stream=aux_stream)
    rec = {"pass_s": 0.0, "calls": 0, "graph": None, "nodes": 0, "copy_s": 0.0,
           "backend_s": 0.0}

    class TimedPasses(KimiPassManager):
        def __call__(self, graph):
            if keep_graph:
                t0 = time.perf_counter()
                rec["graph"] = copy.deepcopy(graph)
                rec["copy_s"] += time.perf_counter() - t0
            rec["nodes"] = len(graph.nodes)
            t0 = time.perf_counter()
            super().__call__(graph)
            rec["pass_s"] += time.perf_counter() - t0
            rec["calls"] += 1
            if abort:
                raise _Abort

    backend.passes = TimedPasses(backend.passes.passes)

    def fn(gm, example_inputs):
        t0 = time.perf_counter()
        try:
            return backend(gm, example_inputs)
        finally:
            rec["backend_s"] += time.perf_counter() - t0

    return fn, backend, rec


def cold_compile(k3, T, device) -> dict:
    """One cold compile + first call of a K3 model; the pass timed inside it."""
    from kimi_passes.graphs import K3Model

    torch._dynamo.reset()
    model = K3Model(k3).to(device)
    ids = _k3_input(k3, T, device)
    fn, backend, rec = _timed_backend()
    cm = torch.compile(model, backend=fn)
    with _cold(), torch.no_grad():
        t0 = time.perf_counter()
        cm(ids)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        total = time.perf_counter() - t0 - rec["copy_s"]
    return {"num_layers": k3.num_layers, "capture_ids": list(k3.aux_layer_ids),
            "total_s": total, "backend_s": rec["backend_s"] - rec["copy_s"],
            "pass_s": rec["pass_s"], "pass_calls": rec["calls"], "nodes": rec["nodes"],
            "share": rec["pass_s"] / total, "graph": rec["graph"],
            "rewrites": [r.how() for r in backend.aux_pass.last_rewrites]}


def capture_graph(k3, T, device):
    """The post-grad graph the pass sees (the compile is stopped right after the pass)."""
    from kimi_passes.graphs import K3Model

    torch._dynamo.reset()
    model = K3Model(k3).to(device)
    ids = _k3_input(k3, T, device)
    fn, _, rec = _timed_backend(abort=True)
    cm = torch.compile(model, backend=fn)
    with _no_graph_caches(), torch.no_grad():
        try:
            cm(ids)
        except Exception as e:  # noqa: BLE001 - the abort surfaces wrapped by Dynamo/Inductor
            if rec["graph"] is None:
                raise
            del e
    torch._dynamo.reset()
    return rec["graph"]


def time_pass(graph, reps: int, profile: bool = False) -> dict:
    """The kimi passes alone on fresh copies of ``graph``: time, nodes, profile.

    ``time_s``: the whole pass manager ``kimi_backend`` installs (every kimi pass);
    ``aux_time_s``: ``AuxStreamPass`` alone; ``aux_unfused_time_s``: it with ``fuse=False``
    (the vLLM-style capture). Interleaved; the graph copies are made outside the timing.
    """
    from kimi_passes import AuxStreamPass
    from kimi_passes.backend import build_passes

    makers = {"time_s": lambda: build_passes("attn_res"),
              "aux_time_s": lambda: AuxStreamPass("attn_res"),
              "aux_unfused_time_s": lambda: AuxStreamPass("attn_res", fuse=False)}
    ts: dict[str, list[float]] = {k: [] for k in makers}
    for _ in range(reps):
        for key, make in makers.items():
            g, p = copy.deepcopy(graph), make()
            t0 = time.perf_counter()
            p(g)
            ts[key].append(time.perf_counter() - t0)
    res = {key: summary(v) for key, v in ts.items()}
    res["nodes"] = len(graph.nodes)
    res["taps"] = sum(1 for n in graph.nodes if n.target is torch.ops.kimi.aux_tap.default)
    if profile:
        g, p = copy.deepcopy(graph), build_passes("attn_res")
        prof = cProfile.Profile()
        prof.enable()
        p(g)
        prof.disable()
        res["profile"] = _profile_rows(prof)
    return res


def _profile_rows(prof, top=25) -> list[dict]:
    st = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():
        rows.append({"function": f"{Path(file).name}:{line}({func})", "ncalls": nc,
                     "tottime_s": tt, "cumtime_s": ct})
    rows.sort(key=lambda r: r["cumtime_s"], reverse=True)
    return rows[:top]


def bench_pass(cfg, log, cache: dict) -> dict:
    k3 = k3_depth(cfg.pass_layers)
    res: dict = {"config": {"num_layers": k3.num_layers, "hidden_size": k3.hidden_size,
                            "block_size": k3.attn_res_block_size, "T": cfg.compile_T,
                            "capture_ids": list(k3.aux_layer_ids)}}
    if cfg.pass_cold:
        warm_up_compiler(cfg, log, cache)
        cc = cold_compile(k3, cfg.compile_T, cfg.device)
        cache[k3.num_layers] = cc
        graph = cc.pop("graph")
        res["cold_compile"] = cc
        log(f"  cold compile L={k3.num_layers}: total {cc['total_s']:.1f}s, backend "
            f"{cc['backend_s']:.1f}s, pass {cc['pass_s'] * 1e3:.1f}ms "
            f"({cc['share'] * 100:.3f}% of the compile), {cc['nodes']} nodes")
        res["targets"] = [_target(f"pass: share of a cold compile at L={k3.num_layers}",
                                  cc["share"], TARGET_PASS_SHARE, "<=")]
    else:
        graph = capture_graph(k3, cfg.compile_T, cfg.device)
        res["cold_compile"] = None
        res["note"] = "no cold compile in --quick: the share needs the default mode"
    res["standalone"] = time_pass(graph, cfg.pass_reps, profile=True)
    sa = res["standalone"]
    log(f"  passes alone ({sa['taps']} taps, {sa['nodes']} nodes): "
        f"{sa['time_s']['median'] * 1e3:.2f}ms [{sa['time_s']['q1'] * 1e3:.2f}-"
        f"{sa['time_s']['q3'] * 1e3:.2f}], AuxStreamPass {sa['aux_time_s']['median'] * 1e3:.2f}"
        f"ms, unfused {sa['aux_unfused_time_s']['median'] * 1e3:.2f}ms")
    if cfg.pass_all_taps:
        all_k3 = replace(k3, aux_layer_ids=tuple(range(k3.num_layers + 1)))
        g_all = capture_graph(all_k3, cfg.compile_T, cfg.device)
        res["all_taps"] = time_pass(g_all, cfg.pass_reps, profile=True)
        at = res["all_taps"]
        per_tap = ((at["time_s"]["median"] - sa["time_s"]["median"])
                   / max(1, at["taps"] - sa["taps"]))
        res["per_extra_tap_s"] = per_tap
        log(f"  passes alone, every capture id tapped ({at['taps']} taps, {at['nodes']} "
            f"nodes): {at['time_s']['median'] * 1e3:.2f}ms, AuxStreamPass "
            f"{at['aux_time_s']['median'] * 1e3:.2f}ms, unfused "
            f"{at['aux_unfused_time_s']['median'] * 1e3:.2f}ms; {per_tap * 1e3:.3f}ms per "
            "extra tap")
    return res


def warm_up_compiler(cfg, log, cache: dict) -> None:
    """Pay the process's one-time compile costs (imports, headers) before measuring."""
    if cache.get("warm"):
        return
    t0 = time.perf_counter()
    cold_compile(k3_depth(1), cfg.compile_T, cfg.device)
    cache["warm"] = True
    log(f"  warm-up cold compile (1 layer): {time.perf_counter() - t0:.1f}s (not counted)")


def bench_compile(cfg, log, cache: dict) -> dict:
    warm_up_compiler(cfg, log, cache)
    points = []
    for L in cfg.layers:
        cc = cache.get(L)
        if cc is None:
            cc = cold_compile(k3_depth(L), cfg.compile_T, cfg.device)
        cc.pop("graph", None)
        points.append(cc)
        log(f"  L={L:>3}: total {cc['total_s']:7.1f}s  backend {cc['backend_s']:7.1f}s  "
            f"pass {cc['pass_s'] * 1e3:8.1f}ms ({cc['share'] * 100:.3f}%)  nodes {cc['nodes']}")
    Ls = [p["num_layers"] for p in points]
    res = {"T": cfg.compile_T, "hidden_size": k3_depth(1).hidden_size, "points": points}
    if len(points) >= 2:
        res["fit_total"] = linear_fit(Ls, [p["total_s"] for p in points])
        res["fit_pass"] = linear_fit(Ls, [p["pass_s"] for p in points])
        first, last = points[0], points[-1]
        res["per_layer_ratio"] = ((last["total_s"] / last["num_layers"])
                                  / (first["total_s"] / first["num_layers"]))
        res["pass_per_layer_ratio"] = ((last["pass_s"] / last["num_layers"])
                                       / (first["pass_s"] / first["num_layers"]))
    return res


# ----------------------------------------------------------------------------- output


def machine_info(device) -> dict:
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "device": str(device),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        info["triton"] = None
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    with contextlib.suppress(Exception):
        info["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], text=True,
                                     capture_output=True, timeout=5,
                                     cwd=Path(__file__).resolve().parent).stdout.strip()
    return info


def format_report(results: dict) -> str:
    out = io.StringIO()
    w = lambda s="": print(s, file=out)  # noqa: E731
    m = results["machine"]
    w(f"kimi_passes bench  {m['date']}  torch {m['torch']}  triton {m.get('triton')}  "
      f"device {m['device']}{' (' + m['gpu'] + ')' if 'gpu' in m else ''}")
    w(f"cpu {m['cpu']} x{m['cpu_count']} (torch threads {m['torch_threads']}), load average "
      f"{_load(m.get('loadavg_start'))} at start, {_load(m.get('loadavg_end'))} at end")
    w(f"command: {results['command']}")
    if "op" in results:
        w()
        w("== op: torch.ops.kimi.attn_res vs plain torch (eager, compiled) and a same-bytes "
          "copy ==")
        w("   times are medians; roof = t(copy)/t(op); x eager, x comp = t(baseline)/t(op); "
          "[IQR] of per-round ratios")
        w(OP_HEADER)
        device = torch.device(m["device"])
        for row in results["op"]["rows"]:
            w(_op_line(row, device))
        errs = [r["max_rel_err"] for r in results["op"]["rows"] if r["max_rel_err"]]
        if errs:
            worst = {}
            for e in errs:
                for k, v in e.items():
                    worst[k] = max(worst.get(k, 0.0), v)
            w("   worst relative error vs the fp32 reference: "
              + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    if "tap" in results:
        tp = results["tap"]
        c = tp["config"]
        w()
        w(f"== tap: compiled K3 step, L={c['num_layers']} S={c['block_size']} "
          f"H={c['hidden_size']} T={c['T']} {c['dtype']}, capture ids {c['capture_ids']} ==")
        for name, s in tp["time_s"].items():
            w(f"   {name:>10}: {s['median'] * 1e3:9.3f} ms  [IQR {s['q1'] * 1e3:.3f}-"
              f"{s['q3'] * 1e3:.3f}, min {s['min'] * 1e3:.3f}, max {s['max'] * 1e3:.3f}, "
              f"n={s['n']}]  tap err {tp['tap_max_rel_err_vs_ground_truth'][name]:.1e}")
        for key in ("attn_res_vs_prefix", "attn_res_vs_vllm_style", "vllm_style_vs_prefix"):
            w(f"   {key:>24}: {_fmt_ratio(tp[key])}")
        w("   per tap at op level (its consumer alone; + fused capture; + separate mix read):")
        for r in tp.get("per_tap_ops", []):
            w(f"   id {r['capture_id']:>3} nb={r['num_blocks']} write={r['block_write_idx']:>2} "
              f"norm={'y' if r['output_norm'] else 'n'}: consumer "
              f"{r['consumer_s']['median'] * 1e3:8.3f} ms; fused +"
              f"{r['fused']['extra_s'] * 1e3:.3f} ms (x{_fmt_ratio(r['fused']['ratio'])}); "
              f"separate +{r['separate']['extra_s'] * 1e3:.3f} ms "
              f"(x{_fmt_ratio(r['separate']['ratio'])})")
        if "tap_ops_extra_s" in tp:
            e, sh = tp["tap_ops_extra_s"], tp["tap_ops_extra_share_of_step"]
            w(f"   all taps: fused +{e['fused'] * 1e3:.3f} ms ({sh['fused'] * 100:.2f}% of the "
              f"prefix step), separate +{e['separate'] * 1e3:.3f} ms "
              f"({sh['separate'] * 100:.2f}%)")
    if "pass" in results:
        ps = results["pass"]
        c = ps["config"]
        w()
        w(f"== pass: kimi_backend's passes at L={c['num_layers']} (S={c['block_size']}, "
          f"H={c['hidden_size']}, T={c['T']}), capture ids {c['capture_ids']} ==")
        cc = ps.get("cold_compile")
        if cc:
            w(f"   cold compile {cc['total_s']:.2f}s (backend {cc['backend_s']:.2f}s); kimi "
              f"passes {cc['pass_s'] * 1e3:.1f}ms = {cc['share'] * 100:.3f}% of the compile")
        else:
            w(f"   {ps.get('note')}")
        for key in ("standalone", "all_taps"):
            if key in ps:
                sa = ps[key]
                w(f"   passes alone, {sa['taps']} taps, {sa['nodes']} nodes: "
                  f"{sa['time_s']['median'] * 1e3:.2f} ms [IQR {sa['time_s']['q1'] * 1e3:.2f}-"
                  f"{sa['time_s']['q3'] * 1e3:.2f}] (AuxStreamPass alone "
                  f"{sa['aux_time_s']['median'] * 1e3:.2f} ms, with fuse=False "
                  f"{sa['aux_unfused_time_s']['median'] * 1e3:.2f} ms); profile of the passes:")
                for r in sa["profile"][:8]:
                    w(f"      {r['cumtime_s'] * 1e3:8.2f} ms cum {r['tottime_s'] * 1e3:8.2f} ms "
                      f"self {r['ncalls']:>7} calls  {r['function']}")
        if "per_extra_tap_s" in ps:
            w(f"   per extra tap: {ps['per_extra_tap_s'] * 1e3:.3f} ms")
    if "compile" in results:
        cp = results["compile"]
        w()
        w(f"== compile: cold compile time vs depth (H={cp['hidden_size']}, T={cp['T']}) ==")
        w(f"   {'L':>3} {'total s':>8} {'backend s':>9} {'pass ms':>8} {'share':>7} "
          f"{'s/layer':>8} {'nodes':>6}")
        for p in cp["points"]:
            w(f"   {p['num_layers']:>3} {p['total_s']:8.1f} {p['backend_s']:9.1f} "
              f"{p['pass_s'] * 1e3:8.1f} {p['share'] * 100:6.3f}% "
              f"{p['total_s'] / p['num_layers']:8.2f} {p['nodes']:>6}")
        if "fit_total" in cp:
            f, fp = cp["fit_total"], cp["fit_pass"]
            w(f"   fit total = {f['intercept']:.1f}s + {f['slope']:.2f}s/layer (R^2 "
              f"{f['r2']:.3f}); time/layer deepest/shallowest {cp['per_layer_ratio']:.2f}")
            w(f"   fit pass  = {fp['intercept'] * 1e3:.1f}ms + {fp['slope'] * 1e3:.2f}ms/layer "
              f"(R^2 {fp['r2']:.3f}); pass time/layer deepest/shallowest "
              f"{cp['pass_per_layer_ratio']:.2f}")
    if results.get("targets"):
        w()
        w("== targets ==")
        for t in results["targets"]:
            w(f"   {'MET ' if t['met'] else 'MISS'} {t['target']}: {t['value']:.4g}")
    if results.get("errors"):
        w()
        for sec, err in results["errors"].items():
            w(f"!! section {sec} failed: {err.splitlines()[-1]}")
    return out.getvalue()


def _load(x) -> str:
    return "?" if not x else "/".join(f"{v:.1f}" for v in x)


def plot(results: dict, path: Path) -> str:
    """GB/s against T (the T sweep of the op section); returns a status line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'kimi-passes[bench]'): no plot"
    rows = results.get("op", {}).get("rows", [])
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["dtype"], r["variant"], r["H"], r["nb"]), []).append(r)
    groups = {k: v for k, v in groups.items() if len({r["T"] for r in v}) >= 2}
    if not groups:
        return "no T sweep in the results: no plot"
    keys = sorted(groups)
    ncols = 2 if len(keys) > 1 else 1
    nrows = -(-len(keys) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.4 * nrows), squeeze=False,
                             sharey=True)
    m = results["machine"]
    for ax, key in zip(axes.flat, keys, strict=False):
        rs = sorted(groups[key], key=lambda r: r["T"])
        names = [n for n in rs[-1]["gbps"]]
        for n in names:
            ts = [r["T"] for r in rs if n in r["gbps"]]
            ax.plot(ts, [r["gbps"][n] for r in rs if n in r["gbps"]], marker="o", ms=3,
                    label=n, ls="--" if n == "copy" else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{key[0]} {key[1]}, H={key[2]}, {key[3]} blocks", fontsize=9)
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel("GB/s (op's bytes / time)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle(f"kimi attn_res, {m.get('gpu') or m['cpu']} ({m['device']}), "
                 f"torch {m['torch']}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=72)
    plt.close(fig)
    with contextlib.suppress(Exception):  # a palette PNG is a third of the size
        from PIL import Image

        with Image.open(path) as im:
            small = im.convert("RGB").quantize(colors=64)
        small.save(path, optimize=True)
    return f"plot written to {path}"


# ----------------------------------------------------------------------------- CLI


class Config:
    """Everything a run does, from the mode presets and the command line."""

    def __init__(self, a: argparse.Namespace):
        self.device = torch.device(a.device)
        quick, cuda = a.quick, self.device.type == "cuda"
        self.quick = quick
        self.user_shapes = any(x is not None for x in (a.T, a.H, a.blocks))
        if quick:
            T, H, nb = [16, 1024], [1024], [8]
        elif cuda:
            T, H, nb = [1, 16, 128, 1024, 4096, 8192], [7168, 1024, 2048, 4096], [8, 1, 2, 4, 9]
        else:
            T, H, nb = [1, 16, 128, 1024, 4096, 8192], [1024, 2048, 4096, 7168], [8, 1, 2, 4, 9]
        self.T = a.T or T
        self.H = a.H or H
        self.blocks = a.blocks or nb
        self.T_centre = 8192 if cuda else 1024
        # The headline shape (DESIGN section 5); fp32 at that size is too big for a CPU run.
        self.extra_cells = [] if quick else [("bfloat16", v, 8192, 7168, 8) for v in VARIANTS]
        if cuda and not quick:
            self.extra_cells += [("float32", v, 8192, 7168, 8) for v in VARIANTS]
        if cuda:  # the centre already is the headline shape on CUDA
            self.extra_cells = [c for c in self.extra_cells
                                if (c[2], c[3], c[4]) != (self.T_centre, self.H[0],
                                                          self.blocks[0])]
        self.dtypes = a.dtypes or ["bfloat16", "float32"]
        self.variants = a.variants or list(VARIANTS)
        self.compiled = not a.no_compiled
        self.peers = not a.no_peers
        self.check = not a.no_check
        threads = a.threads or torch.get_num_threads()
        if cuda:
            self.timer = CudaTimer(rounds=a.rounds or (5 if quick else 9), reps=10,
                                   device=self.device)
        else:
            self.timer = CpuTimer(rounds=a.rounds or (5 if quick else 9),
                                  block_s=a.block_ms / 1e3 if a.block_ms else
                                  (0.01 if quick else 0.04), threads=threads,
                                  max_s=3.0 if quick else 20.0)
        if quick:
            self.tap_layers, self.tap_hidden, self.tap_block, self.tap_T = 4, 256, 2, 64
        else:
            self.tap_layers, self.tap_hidden, self.tap_block, self.tap_T = 8, 1024, 2, 256
        self.tap_layers = a.tap_layers or self.tap_layers
        self.tap_hidden = a.tap_hidden or self.tap_hidden
        self.tap_T = a.tap_T or self.tap_T
        self.tap_timer = (CudaTimer(rounds=a.rounds or 15, reps=5, device=self.device) if cuda
                          else CpuTimer(rounds=a.rounds or (7 if quick else 21),
                                        block_s=0.05 if quick else 0.25, threads=threads,
                                        max_s=10.0 if quick else 90.0))
        self.pass_layers = a.pass_layers or (16 if quick else 93)
        self.pass_cold = not quick
        self.pass_all_taps = not quick
        self.pass_reps = 5 if quick else 9
        self.compile_T = 16
        self.layers = a.layers or ([2, 4] if quick else [8, 16, 32, 64, 93])


def parse_args(argv):
    ap = argparse.ArgumentParser(
        prog="python -m kimi_passes bench",
        description="Benchmarks of the kimi AttnRes op, the tap, the pass and compile time.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 2)[1] if __doc__ else None)
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
    ap.add_argument("--no-peers", action="store_true", help="op: skip the PyPI peer kernels")
    ap.add_argument("--no-check", action="store_true",
                    help="op: skip the correctness check against the reference")
    ap.add_argument("--rounds", type=int, help="interleaved rounds per measurement")
    ap.add_argument("--block-ms", type=float, help="CPU: milliseconds per timing sample")
    ap.add_argument("--threads", type=int, help="CPU: torch threads (default: torch's)")
    ap.add_argument("--tap-layers", type=int)
    ap.add_argument("--tap-hidden", type=int)
    ap.add_argument("--tap-T", type=int)
    ap.add_argument("--pass-layers", type=int, help="pass: depth (default 93, K3)")
    ap.add_argument("--layers", type=int, nargs="+", help="compile: depths to compile")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.only:
        sections = [s.strip() for s in a.only.split(",") if s.strip()]
        bad = [s for s in sections if s not in SECTIONS]
        if bad:
            print(f"bench: unknown section(s) {bad}; choose from {list(SECTIONS)}",
                  file=sys.stderr)
            return 2
    else:
        sections = ["op", "tap", "pass"] if a.quick else list(SECTIONS)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    import kimi_passes  # noqa: F401  (registers torch.ops.kimi.*)

    cfg = Config(a)
    if cfg.device.type == "cpu" and a.threads:
        torch.set_num_threads(a.threads)
    _set_limits()
    results: dict = {"command": "python -m kimi_passes bench " + " ".join(
        argv if argv is not None else sys.argv[1:]), "machine": machine_info(cfg.device),
        "mode": "quick" if a.quick else "default", "sections": sections}
    log = lambda s: print(s, flush=True)  # noqa: E731
    load = results["machine"]["loadavg_start"]
    if (cfg.device.type == "cpu" and load and torch.get_num_threads() > 1
            and load[0] > (os.cpu_count() or 1)):
        log(f"warning: load average {load[0]:.1f} exceeds the {os.cpu_count()} CPUs and torch "
            f"uses {torch.get_num_threads()} threads: timings will be scheduler noise; "
            "use --threads 1")
    errors, cache = {}, {}
    t_start = time.perf_counter()
    for sec in sections:
        log(f"-- {sec} --")
        if sec == "op":
            log(OP_HEADER)
        t0 = time.perf_counter()
        try:
            if sec == "op":
                results["op"] = bench_op(cfg, log)
            elif sec == "tap":
                timer, cfg.timer = cfg.timer, cfg.tap_timer
                cfg.op_timer = timer
                try:
                    results["tap"] = bench_tap(cfg, log)
                finally:
                    cfg.timer = timer
            elif sec == "pass":
                results["pass"] = bench_pass(cfg, log, cache)
            elif sec == "compile":
                results["compile"] = bench_compile(cfg, log, cache)
        except Exception:  # noqa: BLE001 - report and go on with the other sections
            errors[sec] = traceback.format_exc()
            log(errors[sec])
        log(f"   ({sec}: {time.perf_counter() - t0:.1f}s)")
    results["wall_s"] = time.perf_counter() - t_start
    results["machine"]["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") \
        else None
    results["targets"] = _targets(results, cfg)
    if errors:
        results["errors"] = errors
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
    return 1 if errors else 0


def _targets(results, cfg) -> list[dict]:
    out = []
    for row in results.get("op", {}).get("rows", []):
        if (cfg.device.type == "cuda" and (row["T"], row["H"], row["nb"], row["dtype"])
                == (8192, 7168, 8, "bfloat16")):
            out.append(_target(f"op {row['variant']}: fraction of copy bandwidth at T=8192 "
                               "H=7168 nb=8 bf16", row["roofline"]["median"],
                               TARGET_ROOFLINE, ">="))
    for sec in ("tap", "pass"):
        out += results.get(sec, {}).get("targets", [])
    return out


if __name__ == "__main__":
    raise SystemExit(main())
