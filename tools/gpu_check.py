"""The GPU check: every CUDA figure of kimi_passes from one device call (stdlib only).

    bash tools/gpu_check.sh                      # on the GPU, repository root, .gpu_carry carried
    bash tools/gpu_check.sh --dry-run            # the same control flow here, on CPU, tiny shapes
    python tools/gpu_check.py --only cuda_tests --cap cuda_tests=200   # a second call
    python tools/gpu_check.py fill-benchmarks results.json    # BENCHMARKS.md's CUDA rows

``STEPS`` is the whole check, in order, one ``Step`` each (name, cap in seconds, command):
another step is one more line. Each step runs under its own timeout (its cap, or what the
budget leaves: ``--budget``, default 330 s); a step the budget cannot fit is skipped, with
why. ``info`` runs first and stops the run when the machine cannot run it (no CUDA, no C
compiler for Triton, torch < 2.11 or triton < 3.6). A step exiting 3 is a skip: it says why
in a ``{"skip": "..."}`` JSON line or in its ``{json}`` file; any other non-zero exit, or its
cap reached, is a failure. Exit: 0 every step passed, 1 one failed or timed out, 3 none
failed and one or more skipped.

Files under ``$OUT`` (else ``bench_out/gpu_check``), at most four of the device's eight:
``gpu_check.log`` (everything), ``summary.txt``, ``results.json`` (rewritten atomically
after every step: each step's rc, seconds, status, MET/MISS rows, test results, its
bench's JSON) and ``junit.xml`` (the pytest steps'). A timed-out step's output and rows
are in all of them. Benches write their own files to a scratch folder, not ``$OUT``.

``--dry-run`` (docs/testing.md, "On a GPU"): every step with ``--device cpu`` and tiny
shapes; what it fakes is each step's ``dry_note``.
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
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field, replace
from pathlib import Path
from queue import Empty, Queue
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SKIP_RC = 3
MAX_FILES = 8
BUDGET_S = 330
DRY_BUDGET_S = 270  # the dry run ends within 5 minutes, start-up included
RESERVE_S = 5  # the driver's own end: the last writes
FILES = ("gpu_check.log", "summary.txt", "results.json", "junit.xml")

Argv = tuple[str, ...]


@dataclass(frozen=True)
class Step:
    """One step: ``cmds`` run side by side (several: pytest shards) from the repository
    root; ``{py}`` is this Python, ``{json}`` the step's scratch JSON (read back into the
    results), ``{junit}`` a shard's JUnit file, ``{jobs}`` the CPU count less two."""

    name: str
    cap_s: int
    cmds: tuple[Argv, ...]
    dry: tuple[Argv, ...] | None = None  # the dry run's commands (None: the same)
    dry_note: str = ""  # what the dry run fakes or shrinks
    needs: tuple[str, ...] = ()  # modules the step imports: skipped (with why) without them
    rows_re: str = ""  # more lines kept as rows (MET/MISS and pytest lines always are)
    dry_env: dict[str, str] = field(default_factory=dict)
    stop_on_failure: bool = False  # info: the machine cannot run the rest
    min_s: int = 0  # the least time worth starting it with (0: a third of the cap, >= 10)
    dry_cap_s: int = 0  # the dry run's cap where the CPU needs another (0: cap_s)

    def cap(self, dry: bool) -> int:
        return self.dry_cap_s if dry and self.dry_cap_s else self.cap_s


def bench(*args: str) -> Argv:
    return ("{py}", "-m", "kimi_passes", "bench", *args)


def pytest(*nodes: str) -> Argv:
    """The CUDA tests by node id (each file collected alone), every result on its line."""
    return ("{py}", "-m", "pytest", "-v", "--tb=short", "-p", "no:cacheprovider",
            "-p", "no:xdist", "--junitxml", "{junit}", *nodes)


CUDA = "tests/test_cuda.py::"
K3_OP = ("--H", "7168", "--blocks", "8", "--dtypes", "bfloat16", "--no-plot", "--out", "{json}")
TINY_OP = ("--device", "cpu", "--H", "256", "--blocks", "2", "--dtypes", "bfloat16",
           "--rounds", "1", "--block-ms", "1", "--no-plot", "--out", "{json}")
SWEEP_T = ("1", "8", "64", "65", "128", "255", "256", "1024", "4096")
CUDA_SHARDS = (  # side by side: each shard a process of its own, its Triton builds its own
    pytest(CUDA + "test_attn_res_matches_reference", CUDA + "test_capture_and_mix_match_reference",
           CUDA + "test_cuda_dispatches_to_triton", CUDA + "test_strided_bank_view",
           CUDA + "test_opcheck_cuda"),
    pytest(CUDA + "test_quant_is_the_quant_of_the_routes_output_cuda",
           CUDA + "test_decode_route_at_k3_shapes",
           CUDA + "test_vllm_c_per_token_quant_is_the_op_with_divide_values_cuda"),
    pytest(CUDA + "test_mix_forward_and_backward_at_k3_width_cuda",
           CUDA + "test_chunked_kernels_above_8192_cuda",
           "tests/test_ops_triton.py::test_cuda_kernel_matches_reference"),
    pytest(CUDA + "test_k3_tiny_compiled_on_cuda",
           "tests/test_quant_fusion.py::test_cuda_fused_quant_gives_the_unfused_bytes"),
)
OP_ROW = r"^(bfloat16|float16|float32)\s+(read|full)\s+\d+"  # a cell of the op bench, as it ends
ON_CPU_THEY_SKIP = "the same node ids, collected; without CUDA each test skips"

STEPS: tuple[Step, ...] = (
    Step("info", 20, (("{py}", "tools/gpu_info.py", "--json", "{json}"),),
         dry=(("{py}", "tools/gpu_info.py", "--dry-run", "--json", "{json}"),),
         dry_note="CUDA not required; versions, the C compiler and imports checked",
         stop_on_failure=True),
    Step("op_headline", 40, (bench("--device", "cuda", "--only", "op", "--T", "8192",
                                   "--variants", "read", "full", *K3_OP),),
         dry=(bench("--only", "op", "--T", "64", "--variants", "read", "full", *TINY_OP),),
         dry_note="the op's CPU kernels at T=64 H=256 nb=2, one round", rows_re=OP_ROW),
    Step("decode_sweep", 55, (bench("--device", "cuda", "--only", "op", "--T", *SWEEP_T,
                                    "--variants", "full", "--rounds", "5", *K3_OP),),
         dry=(bench("--only", "op", "--T", *SWEEP_T, "--variants", "full", *TINY_OP),),
         dry_note="every T at H=256 nb=2 on CPU, one round", rows_re=OP_ROW),
    Step("quant", 35, (bench("--device", "cuda", "--only", "quant", "--quant-T", "1", "8",
                             "64", "1024", "--quant-H", "7168", "--quant-blocks", "8",
                             "--no-plot", "--out", "{json}"),),
         dry=(bench("--device", "cpu", "--only", "quant", "--quant-T", "1", "64", "--quant-H",
                    "256", "--quant-blocks", "2", "--rounds", "1", "--block-ms", "1",
                    "--no-plot", "--out", "{json}"),),
         dry_note="T=1, 64 at H=256 nb=2 on CPU (generated C++), one round",
         rows_re=r"^T=\s*\d+ H=\d+ nb=\d+"),
    Step("cuda_tests", 70, CUDA_SHARDS, needs=("pytest",), dry_note=ON_CPU_THEY_SKIP),
    Step("cuda_graphs", 20, (pytest(CUDA + "test_k3_tiny_cuda_graphs_replay_with_new_inputs"),),
         needs=("pytest",), dry_note=ON_CPU_THEY_SKIP),
    Step("eager_route", 20, (("{py}", "tools/k3_eager_gpu.py", "--T", "1,8,64", "--json",
                              "{json}"),),
         dry=(("{py}", "tools/k3_eager_gpu.py", "--dry-run", "--json", "{json}"),),
         dry_note="CPU, H=64, T=1, 8, vLLM's kernel interpreted: the capture check, no graphs"),
    Step("whole_k3", 40, (bench("decode", "--device", "cuda", "--models", "k3", "--T", "1",
                                "8", "64", "--dynamic", "--no-ops", "--rounds", "7",
                                "--block-ms", "20"),),
         dry=(bench("decode", "--models", "site", "--T", "1", "8", "--dynamic", "--no-ops",
                    "--rounds", "1", "--block-ms", "1"),),
         dry_note="the one-site model, not K3 (two compiles of a tiny graph)",
         rows_re=r"^(k3|site)\s+T="),
    Step("vllm_k3", 10, (("{py}", "tools/vllm_k3_gpu.py", "--T", "1", "8", "256", "--json",
                          "{json}"),),
         dry=(("{py}", "tools/vllm_k3_gpu.py", "--device", "cpu", "--hidden", "64", "--layers",
               "3", "--T", "4", "--rounds", "1", "--reps", "1", "--json", "{json}"),),
         dry_note="CPU, H=64, 3 layers, vLLM's kernel interpreted; a skip without vLLM",
         rows_re=r"^T=\s*\d+\s+\S", min_s=5, dry_cap_s=60),
    Step("kernel_build", 20, (("{py}", "tools/kernel_build.py", "--ci", "--only", "bwd",
                               "--jobs", "{jobs}", "--json", "{json}"),),
         dry=(("{py}", "tools/kernel_build.py", "--ci", "--only", "bwd:dw", "--jobs", "1",
               "--json", "{json}"),),
         dry_note="real offline builds, the 36 of bwd:dw", dry_env={"TRITON_INTERPRET": "0"}),
)

MET_RE = re.compile(r"(?<![A-Za-z])(MET|MISS)(?![A-Za-z])")
TEST_RE = re.compile(r"^(\S+\.py::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
STARTED_RE = re.compile(r"^(\S+\.py::\S.*?)\s*$")  # -v's test id, its result not yet printed


# ------------------------------------------------------------------------- one step


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
    result["junit"] = _junit_suites(step.name, len(cmds), work, rec.tests, status)
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


def _junit_suites(name: str, shards: int, work: Path, tests: list[dict], status: str) -> list:
    """The step's JUnit test suites as strings: pytest's file per shard, or, where pytest
    did not write it (killed), one made from the ``-v`` lines."""
    suites = []
    for i in range(shards):
        path = work / f"{name}.{i}.xml"
        if path.exists():
            try:
                root = ET.parse(path).getroot()
            except ET.ParseError:
                root = None
            if root is not None:
                found = [root] if root.tag == "testsuite" else list(root)
                suites += [ET.tostring(s, encoding="unicode") for s in found]
                continue
        mine = [t for t in tests if t["shard"] == i]
        if mine:
            suites.append(_suite_from_lines(f"{name} shard {i} ({status}: from the -v log)",
                                            mine))
    return suites


def _suite_from_lines(label: str, tests: list[dict]) -> str:
    suite = ET.Element("testsuite", name=label, tests=str(len(tests)))
    for t in tests:
        path, _, test = t["test"].partition("::")
        case = ET.SubElement(suite, "testcase", classname=path, name=test)
        if t["status"] in ("FAILED", "ERROR", "TIMEOUT", "UNFINISHED"):
            ET.SubElement(case, "failure", message=t["status"])
        elif t["status"] in ("SKIPPED", "XFAIL"):
            ET.SubElement(case, "skipped")
    return ET.tostring(suite, encoding="unicode")


# ------------------------------------------------------------------------- the run


class Run:
    """The run's records and its files under ``out``, rewritten after every step."""

    def __init__(self, out: Path, dry: bool, budget: float, steps: list[Step]):
        self.out, self.dry, self.budget = out, dry, budget
        self.t0 = time.monotonic()
        self.steps = steps
        self.results: list[dict] = []
        self.head = {"check": "kimi_passes GPU check (tools/gpu_check.py)",
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


# ------------------------------------------------------------------------- the summary


def summary(doc: dict) -> str:
    lines = [f"{doc['check']}: {doc['mode']}, started {doc['started']}, commit "
             f"{doc['commit'] or '?'}{' (dirty)' if doc['dirty'] else ''}, budget "
             f"{doc['budget_s']:.0f} s, elapsed {doc['elapsed_s']:.0f} s",
             (f"exit {doc['exit']} (0: every step passed; 1: a step failed or timed out; "
              "3: none failed, some skipped)") if doc["finished"]
             else f"RUNNING (or cut off): not yet run: {', '.join(doc['pending']) or '-'}",
             "", f"{'step':<14} {'status':<10} {'rc':>4} {'seconds':>8} {'cap':>5}  printed"]
    for r in doc["steps"]:
        lines.append(f"{r['step']:<14} {r['status']:<10} {_s(r['rc']):>4} {r['seconds']:>8} "
                     f"{r['cap_s']:>5}  {_what(r)}")
    for r in doc["steps"]:
        if r.get("reason"):
            lines.append(f"  {r['step']} {r['status']}: {r['reason']}")
    for status in ("MISS", "MET"):
        rows = [(r["step"], x["text"]) for r in doc["steps"] for x in r["rows"]
                if x["status"] == status]
        if rows:
            lines += ["", f"{status} rows:"] + [f"  [{s}] {t}" for s, t in rows]
    bad = [(r["step"], t) for r in doc["steps"] for t in r.get("tests", [])
           if t["status"] in ("FAILED", "ERROR", "TIMEOUT", "UNFINISHED")]
    if bad:
        lines += ["", "failed tests:"] + [f"  [{s}] {t['test']} {t['status']}" for s, t in bad]
    other = [(r["step"], x["text"]) for r in doc["steps"] for x in r["rows"] if not x["status"]]
    if other:
        lines += ["", "rows:"] + [f"  [{s}] {t}" for s, t in other]
    notes = [(r["step"], r["dry_note"]) for r in doc["steps"] if r.get("dry_note")]
    if notes:
        lines += ["", "dry run, faked or shrunk:"] + [f"  {s}: {n}" for s, n in notes]
    return "\n".join(lines) + "\n"


def _s(x) -> str:
    return "-" if x is None else str(x)


def _what(r: dict) -> str:
    parts = []
    if r.get("test_counts"):
        parts.append(", ".join(f"{n} {k}" for k, n in sorted(r["test_counts"].items())))
    for status in ("MET", "MISS"):
        n = sum(x["status"] == status for x in r["rows"])
        if n:
            parts.append(f"{n} {status}")
    return "; ".join(parts)


# ------------------------------------------------------------------------- fill-benchmarks


def fill_benchmarks(doc: dict) -> str:
    """BENCHMARKS.md's four CUDA tables, filled from a results.json (printed: paste them)."""
    by = {r["step"]: r for r in doc.get("steps", [])}
    dev = ((by.get("info", {}).get("data") or {}).get("facts") or {}).get("device", "?")
    head = f"{doc.get('started', '?')[:10]}, {doc.get('commit') or '?'}, {dev}"
    out = ["| op, T=8192 H=7168 nb=8 bf16 | roof = t(copy)/t(op) [IQR] | op GB/s | "
           "t(vLLM)/t(op) [IQR] | max rel. error | date, commit, device |", _rule(6)]
    for row in _op_rows(by.get("op_headline")):
        out.append(f"| {row['variant']} | {_ratio(row.get('roofline'))} | "
                   f"{_num(row.get('gbps', {}).get('op'))} | "
                   f"{_ratio(row.get('vs_op', {}).get('vllm-k3'))} | {_errs(row)} | {head} |")
    sweep = _op_rows(by.get("decode_sweep"))
    out += ["", "| decode sweep, H=7168 nb=8 bf16 full | "
            + " | ".join(f"T={r['T']}" for r in sweep) + " |", _rule(len(sweep) + 1)]
    for label, get in (("t(vLLM)/t(op) [IQR]", lambda r: r.get("vs_op", {}).get("vllm-k3")),
                       ("t(compiled)/t(op) [IQR]", lambda r: r.get("op_vs_compiled")),
                       ("roof [IQR]", lambda r: r.get("roofline")),
                       ("t(row route)/t(op) [IQR]",
                        lambda r: r.get("vs_op", {}).get("triton-row"))):
        out.append(f"| {label} | " + " | ".join(_ratio(get(r)) for r in sweep) + " |")
    quant = ((by.get("quant") or {}).get("data") or {}).get("quant", {}).get("rows", [])
    out += ["", "| FP8 quant, H=7168 nb=8 bf16 | "
            + " | ".join(f"T={r['T']}" for r in quant) + " |", _rule(len(quant) + 1),
            "| fused / unfused ms | " + " | ".join(
                f"{_ms(r, 'fused')} / {_ms(r, 'unfused')}" for r in quant) + " |",
            "| unfused / fused [IQR] | " + " | ".join(_ratio(r.get("speedup")) for r in quant)
            + " |",
            "| bytes, scales equal | " + " | ".join(
                {True: "yes", False: "NO"}.get(r.get("bytes_and_scales_equal"), "-")
                for r in quant) + " |"]
    out += ["", "| CUDA tests (-v, by node id) | status | passed | failed | skipped | "
            "errors, timeouts |", _rule(6)]
    for name in ("cuda_tests", "cuda_graphs"):
        r = by.get(name) or {"status": "not run"}
        c = r.get("test_counts", {})
        worse = c.get("error", 0) + c.get("timeout", 0) + c.get("unfinished", 0)
        out.append(f"| {name} | {r['status']} | {c.get('passed', 0)} | {c.get('failed', 0)} "
                   f"| {c.get('skipped', 0)} | {worse} |")
    return "\n".join(out) + "\n"


def _rule(n: int) -> str:
    return "|" + "---|" * n


def _ms(row: dict, name: str) -> str:
    t = row.get("time_s", {}).get(name, {}).get("median")
    return "-" if t is None else f"{t * 1e3:.3f}"


def _op_rows(step: dict | None) -> list[dict]:
    return (((step or {}).get("data") or {}).get("op") or {}).get("rows", [])


def _ratio(s) -> str:
    if not isinstance(s, dict) or s.get("median") is None:
        return "-"
    return f"{s['median']:.2f} [{s.get('q1', float('nan')):.2f}-{s.get('q3', float('nan')):.2f}]"


def _num(x, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _errs(row: dict) -> str:
    errs = row.get("max_rel_err") or {}
    return ", ".join(f"{k} {v:.1e}" for k, v in errs.items()) or "-"


# ------------------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
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


def select(a: argparse.Namespace) -> list[Step]:
    steps = list(STEPS)
    if a.steps_json:
        steps = [_step_from(d) for d in json.loads(a.steps_json.read_text())]
    names = [s.name for s in steps]
    if a.only:
        want = {n.strip() for n in a.only.split(",") if n.strip()}
        bad = want - set(names)
        if bad:
            raise SystemExit(f"gpu_check: unknown step(s) {sorted(bad)}; the steps: {names}")
        steps = [s for s in steps if s.name in want or s.stop_on_failure]
    for c in a.cap:
        name, _, sec = c.partition("=")
        if name not in names or not sec.isdigit():
            raise SystemExit(f"gpu_check: --cap {c!r}: give STEP=SECONDS, a step of {names}")
        steps = [replace(s, cap_s=int(sec), dry_cap_s=0) if s.name == name else s
                 for s in steps]
    return steps


def _step_from(d: dict[str, Any]) -> Step:
    """A Step from JSON: lists become the tuples the dataclass holds."""
    fields: dict[str, Any] = dict(d)
    for k in ("cmds", "dry"):
        if fields.get(k) is not None:
            fields[k] = tuple(tuple(argv) for argv in fields[k])
    fields["needs"] = tuple(fields.get("needs", ()))
    return Step(**fields)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["fill-benchmarks"]:
        if len(argv) != 2:
            raise SystemExit("usage: python tools/gpu_check.py fill-benchmarks results.json")
        print(fill_benchmarks(json.loads(Path(argv[1]).read_text())), end="")
        return 0
    a = parse_args(argv)
    steps = select(a)
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


if __name__ == "__main__":
    sys.exit(main())
