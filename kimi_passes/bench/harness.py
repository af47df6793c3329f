"""The measuring harness: interleaved timers, the statistics every section reports, and the
helpers more than one section uses (error, ratio and target records, the K3 input, Dynamo's
recompile limits, the machine record).

CPU timings use ``torch.utils.benchmark.Timer``; CUDA timings use CUDA events around
each call with the L2 cache flushed before it and the host given a head start (device
time; ``op back-to-back`` adds the host-bound regime). Candidates are interleaved round
by round (their order rotates) and reported as median with the interquartile range. On a
shared or oversubscribed CPU use ``--threads 1``: OpenMP barriers across preempted
threads turn sub-millisecond calls into scheduler quanta.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

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

    def __init__(self, rounds: int, block_s: float, threads: int, max_s: float = 20.0,
                 cpu_time: bool = False):
        self.rounds, self.block_s, self.threads = rounds, block_s, threads
        # The process's CPU time instead of wall time: on a machine loaded past its cores a
        # wall-time sample holds whatever the scheduler gave the neighbours; CPU time does
        # not (caches shared with them still do).
        self.clock = time.process_time if cpu_time else time.perf_counter
        # Fewer rounds (at least 3) when the slowest candidate would take longer than this.
        self.max_s = max_s

    def run(self, cands: dict[str, Callable[[], object]]) -> dict[str, list[float]]:
        from torch.utils.benchmark import Timer

        timers, numbers, estimates = {}, {}, {}
        for name, fn in cands.items():
            fn()  # warm-up: compiles, allocator, caches
            timer = Timer("fn()", globals={"fn": fn}, num_threads=self.threads,
                          timer=self.clock)
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


# ----------------------------------------------------------------------------- shared


def rel_err(out, ref) -> float:
    """Max abs error of ``out`` against ``ref``, relative to max(|ref|, 1), in fp32."""
    ref = ref.float()
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1.0))


def fmt_ratio(r) -> str:
    """A ratio summary as ``median[q1-q3]`` (a dash when there is none)."""
    if r is None:
        return "     -     "
    return f"{r['median']:5.2f}[{r['q1']:.2f}-{r['q3']:.2f}]"


def target(name, value, bound, how) -> dict:
    """The record of a target: ``value`` against ``bound`` with ``how`` (<=, < or >=)."""
    met = value <= bound if how == "<=" else (value < bound if how == "<" else value >= bound)
    return {"target": f"{name} {how} {bound}", "value": value, "met": bool(met)}


def k3_input(cfg, T, device):
    """``T`` token ids for the K3 model ``cfg`` (seeded: every compile sees the same)."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, cfg.vocab_size, (T,), generator=g).to(device)


def set_limits():
    """Lift Dynamo's recompile limits: the op section compiles once per shape."""
    dc = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dc, name):
            setattr(dc, name, 1 << 20)
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(dc, name):
            setattr(dc, name, 1 << 20)


# ----------------------------------------------------------------------------- machine


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
