"""The GPU check's runner: the steps of :mod:`.steps`, in order, under one budget.

    bash tools/gpu_check.sh                      # on the GPU, repository root, .gpu_carry carried
    bash tools/gpu_check.sh --dry-run            # the same control flow here, on CPU, tiny shapes
    python -m tools.gpu check --only cuda_tests --cap cuda_tests=200   # a second call

Each step runs under its own timeout (its cap, or what the budget leaves: ``--budget``,
default 330 s); a step the budget cannot fit is skipped, with why. ``info`` runs first
and stops the run when the machine cannot run it. A step exiting 3 is a skip: it says
why in a ``{"skip": "..."}`` JSON line or in its ``{json}`` file; any other non-zero
exit, or its cap reached, is a failure. Exit: 0 every step passed, 1 one failed or timed
out, 3 none failed and one or more skipped.

Files under ``$OUT`` (else ``bench_out/gpu_check``), at most four of the device's eight:
``gpu_check.log`` (everything), ``summary.txt``, ``results.json`` (rewritten atomically
after every step: each step's rc, seconds, status, MET/MISS rows, test results, its
JSON) and ``junit.xml`` (the pytest steps'). A timed-out step's output and rows are in
all of them. Steps write their own files to a scratch folder, not ``$OUT``.
``--dry-run``: every step on CPU with tiny shapes; what it fakes is each step's
``dry_note``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from queue import Empty, Queue
from typing import Any

from tools.gpu.report import junit_suites, summary
from tools.gpu.steps import (
    BUDGET_S,
    DRY_BUDGET_S,
    FILES,
    MAX_FILES,
    RESERVE_S,
    ROOT,
    SKIP_RC,
    STEPS,
    Step,
    select,
)

MET_RE = re.compile(r"(?<![A-Za-z])(MET|MISS)(?![A-Za-z])")
TEST_RE = re.compile(r"^(\S+\.py::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
STARTED_RE = re.compile(r"^(\S+\.py::\S.*?)\s*$")  # -v's test id, its result not yet printed


class Output:
    """Where every line goes: the log file and stdout, flushed as it comes."""

    def __init__(self, log: Path):
        self.file = open(log, "a", encoding="utf-8")  # noqa: SIM115  (closed by close())

    def __call__(self, line: str) -> None:
        self.file.write(line + "\n")
        self.file.flush()
        print(line, flush=True)

    def close(self) -> None:
        self.file.close()


def _reader(i: int, pipe, q: Queue) -> None:
    for line in iter(pipe.readline, ""):
        q.put((i, line.rstrip("\n")))
    q.put((i, None))


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to each command's process group, SIGKILL 5 s later to what is left (a
    command that has exited may leave children in its group)."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        for p in procs:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        end = time.monotonic() + wait
        while time.monotonic() < end and any(p.poll() is None for p in procs):
            time.sleep(0.1)


def run_cmds(cmds: list[list[str]], timeout: float, env: dict, on_line) -> tuple[list, bool]:
    """Run ``cmds`` side by side, each line to ``on_line(shard, line)`` as it comes; kill
    them all at ``timeout``. Returns (each rc, timed out)."""
    q: Queue = Queue()
    procs = []
    for i, argv in enumerate(cmds):
        p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, errors="replace",
                             start_new_session=True)  # its own group: killed whole
        threading.Thread(target=_reader, args=(i, p.stdout, q), daemon=True).start()
        procs.append(p)
    end, open_pipes, timed_out = time.monotonic() + timeout, len(cmds), False
    orphans_until = None  # every command exited, yet a child of one holds its pipe
    while open_pipes:
        try:
            i, line = q.get(timeout=max(0.0, min(1.0, end - time.monotonic())))
        except Empty:
            if all(p.poll() is not None for p in procs):
                orphans_until = orphans_until or time.monotonic() + 5.0
                if time.monotonic() >= orphans_until:
                    _stop(procs)
                    break
            if time.monotonic() >= end:
                timed_out = True
                _stop(procs)
                end = time.monotonic() + 2.0  # what is still buffered
                while True:  # drain what the pipes still hold, briefly
                    try:
                        i, line = q.get(timeout=max(0.0, end - time.monotonic()))
                    except Empty:
                        break
                    if line is not None:
                        on_line(i, line)
                break
            continue
        if line is None:
            open_pipes -= 1
        else:
            on_line(i, line)
    if not timed_out:
        for p in procs:
            p.wait()
    return [p.poll() for p in procs], timed_out


class StepRecord:
    """What one step printed and returned, as results.json holds it."""

    def __init__(self, step: Step, cmds: list[list[str]]):
        self.step, self.cmds = step, cmds
        self.rows: list[dict] = []
        self.tests: list[dict] = []
        self.skip_why: str | None = None
        self.killed_in: dict[int, str] = {}  # shard -> the test its kill cut short
        self._row_re = re.compile(step.rows_re) if step.rows_re else None

    def line(self, shard: int, line: str) -> None:
        text = line.strip()
        m = TEST_RE.match(text)
        if m:
            self.tests.append({"test": m.group(1), "status": m.group(2), "shard": shard})
            return
        m = STARTED_RE.match(text)
        if m:  # pytest -v writes the id, then the result: a kill leaves the id alone
            self.killed_in[shard] = m.group(1)
            return
        if text.startswith("{") and '"skip"' in text:
            try:
                self.skip_why = str(json.loads(text)["skip"])
                return
            except (ValueError, KeyError, TypeError):
                pass
        m = MET_RE.search(text)
        row = ({"status": m.group(1), "text": text} if m else
               {"status": None, "text": text}
               if self._row_re is not None and self._row_re.search(text) else None)
        if row is not None and row not in self.rows:  # the report repeats the run's lines
            self.rows.append(row)


def run_step(step: Step, dry: bool, timeout: float, work: Path, env: dict, out) -> dict:
    """Run one step; its record (rc, seconds, status, rows, tests, data)."""
    fill = {"py": sys.executable, "json": str(work / f"{step.name}.json"),
            "jobs": str(max(1, (os.cpu_count() or 3) - 2))}
    cmds = [[_fill(a, dict(fill, junit=str(work / f"{step.name}.{i}.xml"))) for a in argv]
            for i, argv in enumerate(step.dry if dry and step.dry is not None else step.cmds)]
    rec = StepRecord(step, cmds)
    many = len(cmds) > 1

    def on_line(i: int, line: str) -> None:
        out(f"[{i}] {line}" if many else line)
        rec.line(i, line)

    for c in cmds:
        out("$ " + " ".join(c))
    t0 = time.monotonic()
    rcs, timed_out = run_cmds(cmds, timeout, dict(env, **(step.dry_env if dry else {})),
                              on_line)
    for shard, test in rec.killed_in.items():
        rec.tests.append({"test": test, "status": "TIMEOUT" if timed_out else "UNFINISHED",
                          "shard": shard})
    data = _read_json(Path(fill["json"]))
    if isinstance(data, dict) and "skip" in data and rec.skip_why is None:
        rec.skip_why = str(data["skip"])
    status, rc = _status(rcs, timed_out)
    result: dict[str, Any] = {"step": step.name, "status": status, "rc": rc, "rcs": rcs,
              "seconds": round(time.monotonic() - t0, 1), "cap_s": step.cap(dry),
              "timeout_s": round(timeout, 1), "cmds": cmds, "rows": rec.rows}
    if status == "skipped":
        result["reason"] = rec.skip_why or "exit 3 without a reason"
    if status == "timed_out":
        result["reason"] = f"killed at {timeout:.0f} s; its output up to then is kept"
    if rec.tests:
        result["tests"] = rec.tests
        result["test_counts"] = _counts(rec.tests)
    if data is not None:
        result["data"] = _digest(step.name, data)
    result["junit"] = junit_suites(step.name, len(cmds), work, rec.tests, status)
    if dry and step.dry_note:
        result["dry_note"] = step.dry_note
    return result


def _fill(arg: str, fill: dict[str, str]) -> str:
    """The placeholders of one argument (plain replacement: code may hold braces)."""
    for k, v in fill.items():
        arg = arg.replace("{" + k + "}", v)
    return arg


def _status(rcs: list, timed_out: bool) -> tuple[str, int | None]:
    if timed_out:
        return "timed_out", None
    bad = [rc for rc in rcs if rc not in (0, SKIP_RC)]
    if bad:
        return "failed", bad[0]
    if all(rc == SKIP_RC for rc in rcs):
        return "skipped", SKIP_RC
    return "passed", 0


def _counts(tests: list[dict]) -> dict:
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["status"].lower()] = counts.get(t["status"].lower(), 0) + 1
    return counts


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _digest(name: str, data):
    """What results.json keeps of a step's own JSON: all of it, except kernel_build's
    hundreds of builds (their count and the spills)."""
    if name == "kernel_build" and isinstance(data, list):
        return {"builds": len(data), "spills": [r for r in data if r.get("spills")]}
    return data


# ------------------------------------------------------------------------- the run


class Run:
    """The run's records and its files under ``out``, rewritten after every step."""

    def __init__(self, out: Path, dry: bool, budget: float, steps: list[Step]):
        self.out, self.dry, self.budget = out, dry, budget
        self.t0 = time.monotonic()
        self.steps = steps
        self.results: list[dict] = []
        self.head = {"check": "kimi_passes GPU check (python -m tools.gpu check)",
                     "mode": "dry-run" if dry else "device", "budget_s": budget,
                     "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "commit": _git("rev-parse", "--short", "HEAD"),
                     "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
                     "python": sys.executable, "out": str(out)}

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0) - RESERVE_S

    def skip(self, step: Step, why: str) -> None:
        self.results.append({"step": step.name, "status": "skipped", "rc": None, "seconds": 0.0,
                             "cap_s": step.cap(self.dry), "reason": why, "rows": []})

    def exit_code(self) -> int:
        statuses = {r["status"] for r in self.results}
        if statuses & {"failed", "timed_out"}:
            return 1
        return SKIP_RC if "skipped" in statuses else 0

    def write(self, finished: bool) -> None:
        """results.json, summary.txt and junit.xml, each replaced whole (never half
        written: a temporary file renamed over it)."""
        done = {r["step"] for r in self.results}
        doc = dict(self.head, elapsed_s=round(time.monotonic() - self.t0, 1),
                   finished=finished, exit=self.exit_code() if finished else None,
                   steps=[{k: v for k, v in r.items() if k != "junit"} for r in self.results],
                   pending=[s.name for s in self.steps if s.name not in done])
        _replace(self.out / "results.json", json.dumps(doc, indent=1, default=str))
        _replace(self.out / "summary.txt", summary(doc))
        suites = [s for r in self.results for s in r.get("junit", [])]
        if suites:
            _replace(self.out / "junit.xml",
                     "<?xml version='1.0' encoding='utf-8'?>\n<testsuites>\n"
                     + "\n".join(suites) + "\n</testsuites>\n")


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def step_env(dry: bool) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # On the GPU every Triton kernel is compiled (the tests' conftest would set the
    # interpreter only without CUDA); the dry run interprets (its steps run on CPU).
    env["TRITON_INTERPRET"] = "1" if dry else "0"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def missing(needs: tuple[str, ...]) -> list[str]:
    import importlib.util

    return [m for m in needs if importlib.util.find_spec(m) is None]


def run_all(run: Run, out: Output, work: Path) -> int:
    env = step_env(run.dry)
    stopped: str | None = None
    run.write(False)
    for step in run.steps:
        cap = step.cap(run.dry)
        min_s = step.min_s or max(10, cap // 3)
        left = run.left()
        why = None
        if stopped:
            why = f"not run: {stopped}"
        elif missing(step.needs):
            why = (f"{', '.join(missing(step.needs))} not importable here (the GPU image has "
                   "pytest; install it, or carry .gpu_carry/site)")
        elif left < min_s:
            why = (f"budget: {left:.0f} s of {run.budget:.0f} s left, the step needs at "
                   f"least {min_s} s (cap {cap} s)")
        if why:
            out(f"=== {step.name}: SKIPPED: {why}")
            run.skip(step, why)
            run.write(False)
            continue
        timeout = min(cap, left)
        out(f"\n=== {step.name} (timeout {timeout:.0f} s, cap {cap} s, {left:.0f} s "
            "of the budget left) ===")
        try:
            r = run_step(step, run.dry, timeout, work, env, out)
        except Exception as e:  # noqa: BLE001  (the driver's own error: the run goes on)
            r = {"step": step.name, "status": "failed", "rc": None, "seconds": 0.0,
                 "cap_s": cap, "reason": f"gpu_check could not run it: {type(e).__name__}: {e}",
                 "rows": []}
        run.results.append(r)
        out(f"=== {step.name}: {r['status'].upper()} (rc {r['rc']}) in {r['seconds']} s"
            + (f": {r['reason']}" if r.get("reason") else ""))
        if step.stop_on_failure and r["status"] != "passed":
            stopped = f"{step.name} {r['status']}: the machine cannot run the check"
        run.write(False)
    run.write(True)
    return run.exit_code()


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.gpu check",
                                 description=(__doc__ or "").splitlines()[0],
                                 epilog="steps: " + ", ".join(
                                     f"{s.name} ({s.cap_s} s)" for s in STEPS))
    ap.add_argument("--dry-run", action="store_true",
                    help="every step on this CPU machine, tiny shapes (no GPU)")
    ap.add_argument("--out", type=Path, help="default: $OUT, else bench_out/gpu_check")
    ap.add_argument("--budget", type=float,
                    help=f"seconds for the whole run (default $GPU_CHECK_BUDGET, else {BUDGET_S}; "
                         f"a dry run {DRY_BUDGET_S})")
    ap.add_argument("--only", help="comma-separated steps to run (info always runs first)")
    ap.add_argument("--cap", action="append", default=[], metavar="STEP=SECONDS",
                    help="another cap for a step (repeatable)")
    ap.add_argument("--steps-json", type=Path,
                    help="the steps from a JSON list of Step fields (tests)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    steps = select(STEPS, a.steps_json, a.only, a.cap)
    out_dir = a.out or Path(os.environ.get("OUT") or ROOT / "bench_out" / "gpu_check")
    out_dir.mkdir(parents=True, exist_ok=True)
    budget = a.budget or float(os.environ.get("GPU_CHECK_BUDGET")
                               or (DRY_BUDGET_S if a.dry_run else BUDGET_S))
    run = Run(out_dir.resolve(), a.dry_run, budget, steps)
    out = Output(run.out / "gpu_check.log")
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))  # the steps' own files: not $OUT
    try:
        out(f"gpu_check: {run.head['mode']}, {len(steps)} steps, budget {budget:.0f} s, "
            f"results in {run.out} (scratch {work})")
        code = run_all(run, out, work)
        out("")
        out((run.out / "summary.txt").read_text().rstrip())
        extra = sorted(p.name for p in run.out.iterdir() if p.name not in FILES)
        if len(extra) + len(FILES) > MAX_FILES:
            out(f"gpu_check: {run.out} holds {extra} besides its own files: more than "
                f"{MAX_FILES} files will not all come back; give an empty $OUT")
        return code
    finally:
        out.close()
        shutil.rmtree(work, ignore_errors=True)
