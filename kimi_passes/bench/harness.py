"""What every benchmark shares: the one timer, the statistics, the one error metric and its
tolerances, the verdict of a candidate, the op's argument builder, and the run's records
(targets, the machine, Dynamo's limits).

``Timer`` interleaves its candidates round by round (their order rotated by one a round),
with one of three clocks: ``wall`` / ``cpu`` (``torch.utils.benchmark`` samples of about
``block_s`` seconds, in wall or process CPU time) or ``cuda`` (CUDA events around each call,
the L2 flushed and the host given a head start: device time). Figures are medians with the
interquartile range; a ratio is the summary of per-round ratios. On a shared CPU use
``--threads 1``: OpenMP barriers across preempted threads turn short calls into scheduler
quanta.
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

# The bench's names for them (bench, tests and tools import them from here too).
from kimi_passes.ops.reference import EPS, op_args, rel_err  # noqa: F401

#: The command line every benchmark runs under (``kimi_passes.bench.cli``).
PROG = "python -m kimi_passes bench"

#: The op tolerance, per dtype: what one AttnRes mixture computed in fp32 and rounded once
#: to the output dtype meets against the fp32 reference (the tests' atol = rtol; the
#: benches' bound on ``rel_err``). docs/testing.md, "Tolerances".
OP_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
#: A whole compiled model against plain Inductor's compile of it (``bench decode``): fp32
#: drifts with depth (Inductor's own reassociation), the half types as the op's bf16.
MODEL_TOL = {torch.float32: 1e-3, torch.bfloat16: OP_TOL[torch.bfloat16],
             torch.float16: OP_TOL[torch.bfloat16]}

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


def fmt_ratio(r) -> str:
    """A ratio summary as ``median[q1-q3]`` (a dash when there is none)."""
    if r is None:
        return "     -     "
    return f"{r['median']:5.2f}[{r['q1']:.2f}-{r['q3']:.2f}]"


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


def verdict(candidate: str, T, time: float | None, ratio: float | None, err: float | None,
            tol: float, reason: str | None = None) -> dict:
    """A candidate's record in a bench's rows: MET when it ran and ``err`` is within ``tol``,
    else MISS with the reason (``reason`` given: it raised or was not checked; else the
    error against the tolerance). ``time``: seconds (median); ``ratio``: the bench's own."""
    if reason is None and (err is None or not err <= tol):  # NaN is off too
        reason = ("no error figure" if err is None
                  else f"error {err:.3g} > tolerance {tol:.3g}")
    return {"candidate": candidate, "T": T, "time": time, "ratio": ratio, "err": err,
            "tol": tol, "verdict": "MET" if reason is None else "MISS", "reason": reason}


def failure(e: BaseException) -> str:
    """A MISS reason for a candidate that raised: the exception's type and first line."""
    lines = str(e).strip().splitlines()
    return f"raised {type(e).__name__}" + (f": {lines[0][:200]}" if lines else "")


def misses(candidates: list[dict]) -> list[str]:
    """``MISS name: reason`` for each candidate that missed, for a row's printed line."""
    return [f"MISS {c['candidate']}: {c['reason']}" for c in candidates
            if c["verdict"] != "MET"]


# ----------------------------------------------------------------------------- timing


class Timer:
    """Interleaved timing: ``run({name: fn})`` is ``{name: [seconds per call, a round]}``.

    ``clock``: ``"wall"`` or ``"cpu"`` (each candidate warmed up, then calibrated to a
    sample of about ``block_s`` seconds; fewer rounds, at least 3, when the slowest would
    take longer than ``max_s``) or ``"cuda"`` (a sample is the median of ``reps`` calls,
    each timed by CUDA events). Rounds go on past ``rounds`` until ``min_s`` seconds have
    passed.
    """

    # ~0.5 ms at H200 clocks: longer than the host needs to launch any candidate here.
    SLEEP_CYCLES = 1_000_000

    def __init__(self, rounds: int, clock: str = "wall", *, block_s: float = 0.04,
                 threads: int = 1, max_s: float = 20.0, min_s: float = 0.0, reps: int = 10,
                 device=None):
        if clock not in ("wall", "cpu", "cuda"):
            raise ValueError(f"Timer: clock {clock!r}; choose 'wall', 'cpu' or 'cuda'")
        self.rounds, self.clock, self.block_s, self.threads = rounds, clock, block_s, threads
        self.max_s, self.min_s, self.reps, self.device = max_s, min_s, reps, device
        self._flush: torch.Tensor | None = None

    def run(self, cands: dict[str, Callable[[], object]]) -> dict[str, list[float]]:
        sample_of, estimates = {}, []
        for name, fn in cands.items():
            sample_of[name], estimate = (self._cuda(fn) if self.clock == "cuda"
                                         else self._cpu(fn))
            estimates.append(estimate)
        rounds, slowest = self.rounds, max(estimates)
        if slowest > 0 and self.max_s / slowest < rounds:
            rounds = max(min(rounds, 3), int(self.max_s / slowest))
        samples: dict[str, list[float]] = {name: [] for name in cands}
        order, r, t_end = list(cands), 0, time.perf_counter() + self.min_s
        while r < rounds or time.perf_counter() < t_end:
            k = r % len(order)
            for name in order[k:] + order[:k]:
                samples[name].append(sample_of[name]())
            r += 1
        return samples

    def _cpu(self, fn) -> tuple[Callable[[], float], float]:
        """A sampler of ``fn`` (``number`` calls, seconds per call) and a sample's seconds."""
        from torch.utils.benchmark import Timer as TorchTimer

        fn()  # warm-up: compiles, allocator, caches
        # Process CPU time on a machine loaded past its cores: a wall-time sample holds
        # whatever the scheduler gave the neighbours (caches shared with them still do).
        clock = time.process_time if self.clock == "cpu" else time.perf_counter
        timer = TorchTimer("fn()", globals={"fn": fn}, num_threads=self.threads, timer=clock)
        t1 = timer.timeit(1).mean
        number = max(1, int(self.block_s / max(t1, 1e-9)))
        if number > 1:  # re-estimate on a bigger sample: one call is too noisy
            t1 = timer.timeit(min(number, 10)).mean
            number = max(1, int(self.block_s / max(t1, 1e-9)))
        return (lambda: timer.timeit(number).mean), t1 * number

    def _cuda(self, fn) -> tuple[Callable[[], float], float]:
        """A sampler of ``fn``'s device time: before each call the GPU is held busy
        (``_sleep``) long enough for the host to enqueue it, so launch overhead is hidden
        the way a CUDA graph hides it; the flush makes every call start cold."""
        if self._flush is None:  # bigger than any L2 (H200: 60 MiB)
            self._flush = torch.empty(256 << 20, dtype=torch.uint8, device=self.device)
        flush = self._flush
        for _ in range(3):
            fn()
        torch.cuda.synchronize(self.device)

        def sample() -> float:
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(self.reps)]
            for start, end in events:
                flush.zero_()
                torch.cuda._sleep(self.SLEEP_CYCLES)
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize(self.device)
            return statistics.median(s.elapsed_time(e) * 1e-3 for s, e in events)

        return sample, 0.0

    def host_time(self, fn) -> float:
        """Seconds per call back to back, synchronised per block: max(launch, device)."""
        from torch.utils.benchmark import Timer as TorchTimer

        return TorchTimer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.2).median


# ----------------------------------------------------------------------------- inputs


def k3_input(cfg, T, device):
    """``T`` token ids for the K3 model ``cfg`` (seeded: every compile sees the same)."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, cfg.vocab_size, (T,), generator=g).to(device)


# ----------------------------------------------------------------------------- the run


def target(name, value, bound, how) -> dict:
    """The record of a target: ``value`` against ``bound`` with ``how`` (<=, < or >=)."""
    met = value <= bound if how == "<=" else (value < bound if how == "<" else value >= bound)
    return {"target": f"{name} {how} {bound}", "value": value, "met": bool(met)}


def set_limits():
    """Lift Dynamo's recompile limits: the op section compiles once per shape."""
    dc = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(dc, name):
            setattr(dc, name, 1 << 20)


def load_warning(threads: int) -> str | None:
    """A warning when the load average exceeds the CPUs and ``threads`` > 1, else None."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if threads > 1 and load > (os.cpu_count() or 1):
        return (f"warning: load average {load:.1f} exceeds the {os.cpu_count()} CPUs and torch "
                f"uses {threads} threads: OpenMP threads wait on the scheduler at every "
                "parallel region and timings are noise; use --threads 1")
    return None


def machine_info(device) -> dict:
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "torch": torch.__version__,
        "platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
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
