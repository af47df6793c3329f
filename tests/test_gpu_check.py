"""tools/gpu (``python -m tools.gpu check``), the GPU check's runner, on CPU: its control
flow with stand-in steps.

Steps run in order, a step's commands side by side; a failing step fails the run; a step
past its cap is killed (its whole process group) and its rows are kept; a skip is exit 3
with its reason; the results are rewritten after every step; at most 8 files land in the
output folder. Then the step list itself (the issue's order, every CUDA test marked for a
shard of it, caps within the budget), the BENCHMARKS rows it fills, and one whole
``--dry-run`` (heavy).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tools.gpu import report  # noqa: E402  (tools/ is the checkout's, not installed)
from tools.gpu import steps as gpu_steps  # noqa: E402


def py(code: str) -> list[str]:
    return ["{py}", "-c", code]


def step(name: str, code: str, cap: int = 20, **kw) -> dict:
    return dict(name=name, cap_s=cap, cmds=[py(code)], **kw)


def check(tmp_path: Path, steps: list[dict], *args: str, budget: int = 120):
    """Run the driver on ``steps``; (exit code, results.json, stdout)."""
    spec = tmp_path / "steps.json"
    spec.write_text(json.dumps(steps))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "tools.gpu", "check", "--steps-json", str(spec),
                        "--out", str(out), "--budget", str(budget), *args],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= gpu_steps.MAX_FILES, files
    assert not [f for f in files if f.startswith(".")], files  # no temporary left behind
    return r.returncode, json.loads((out / "results.json").read_text()), r.stdout


def gone(pid: int) -> bool:
    """The process has ended (a zombie counts: PID 1 in a container may never reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except (OSError, IndexError):
        return True


def statuses(doc: dict) -> list[tuple[str, str]]:
    return [(s["step"], s["status"]) for s in doc["steps"]]


def test_steps_run_in_order_and_a_failure_fails_the_run(tmp_path):
    steps = [step("a", "print('   MET op read: roof >= 0.9: 0.93')"),
             step("b", "print('MISS vllm-k3: error 3e-2 > 2e-2'); raise SystemExit(1)"),
             step("c", "print('row c')", rows_re="^row")]
    code, doc, stdout = check(tmp_path, steps)
    assert code == 1
    assert statuses(doc) == [("a", "passed"), ("b", "failed"), ("c", "passed")]
    assert doc["finished"] and doc["exit"] == 1 and doc["pending"] == []
    a, b, c = doc["steps"]
    assert a["rows"] == [{"status": "MET", "text": "MET op read: roof >= 0.9: 0.93"}]
    assert b["rc"] == 1 and b["rows"][0]["status"] == "MISS"
    assert c["rows"] == [{"status": None, "text": "row c"}]
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert log.index("=== a ") < log.index("=== b ") < log.index("=== c ")
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "exit 1" in summary and "MISS vllm-k3" in summary
    assert summary in stdout  # the device tool shows the output's tail: the summary


def test_a_step_past_its_cap_is_killed_with_its_rows_kept(tmp_path):
    pid_file = tmp_path / "child.pid"
    hang = (f"import subprocess, sys, time; p = subprocess.Popen(['sleep', '60']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); "
            "print('MET before the hang: 1.0'); "
            "print('tests/test_x.py::test_done PASSED'); "
            "print('tests/test_x.py::test_hangs ', end=''); sys.stdout.flush(); time.sleep(60)")
    t0 = time.monotonic()
    code, doc, _ = check(tmp_path, [step("hang", hang, cap=3), step("after", "print('ok')")])
    assert time.monotonic() - t0 < 30
    assert code == 1
    assert statuses(doc) == [("hang", "timed_out"), ("after", "passed")]
    hung = doc["steps"][0]
    assert hung["rows"] == [{"status": "MET", "text": "MET before the hang: 1.0"}]
    assert [(t["test"], t["status"]) for t in hung["tests"]] == [
        ("tests/test_x.py::test_done", "PASSED"), ("tests/test_x.py::test_hangs", "TIMEOUT")]
    junit = (tmp_path / "out" / "junit.xml").read_text()
    assert 'name="test_hangs"' in junit and "TIMEOUT" in junit
    time.sleep(0.2)
    assert gone(int(pid_file.read_text()))  # the step's whole process group was killed


def test_a_child_left_behind_does_not_hold_the_step(tmp_path):
    """A command that exits 0 leaving a child on its output pipe passes (the child is
    stopped a few seconds later), rather than waiting for its cap."""
    pid_file = tmp_path / "child.pid"
    code = (f"import subprocess; p = subprocess.Popen(['sleep', '60']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('MET done: 1')")
    t0 = time.monotonic()
    rc, doc, _ = check(tmp_path, [step("leaves_a_child", code, cap=60)])
    assert rc == 0 and time.monotonic() - t0 < 30
    assert statuses(doc) == [("leaves_a_child", "passed")]
    time.sleep(0.2)
    assert gone(int(pid_file.read_text()))


#: A stand-in shard: waits for the other to start (so the two run at once), writes its
#: JUnit file, prints its ``-v`` line. argv: junit, index, status, the flag file.
SHARD = """import os, sys, time
junit, n, status, flag = sys.argv[1:]
if n == "0":
    t = time.monotonic()
    while not os.path.exists(flag) and time.monotonic() - t < 20:
        time.sleep(0.05)
    if not os.path.exists(flag):
        sys.exit(5)  # the other command never started beside this one
else:
    open(flag, "w").close()
open(junit, "w").write(f'<testsuite name="shard{n}" tests="1"><testcase '
                       f'classname="tests/test_s{n}.py" name="test_{n}"/></testsuite>')
print(f"tests/test_s{n}.py::test_{n} {status}")
sys.exit(status != "PASSED")
"""


def test_a_steps_commands_run_side_by_side(tmp_path):
    """A step of several commands (the GPU's pytest shards): they run at once, each line is
    tagged with its command, each command's JUnit file is in junit.xml, one command
    failing fails the step."""
    flag = str(tmp_path / "second_started")
    cmds = [["{py}", "-c", SHARD, "{junit}", str(n), status, flag]
            for n, status in enumerate(("PASSED", "FAILED"))]
    code, doc, _ = check(tmp_path, [dict(name="shards", cap_s=30, cmds=cmds)])
    assert code == 1
    assert statuses(doc) == [("shards", "failed")] and doc["steps"][0]["rcs"] == [0, 1]
    assert sorted((t["test"], t["status"], t["shard"]) for t in doc["steps"][0]["tests"]) == [
        ("tests/test_s0.py::test_0", "PASSED", 0), ("tests/test_s1.py::test_1", "FAILED", 1)]
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert "[0] tests/test_s0.py::test_0 PASSED" in log
    assert "[1] tests/test_s1.py::test_1 FAILED" in log
    junit = (tmp_path / "out" / "junit.xml").read_text()
    assert 'name="shard0"' in junit and 'name="shard1"' in junit


def test_a_skip_is_exit_3_with_why(tmp_path):
    steps = [step("passes", "print('fine')"),
             step("skips", "import json; print(json.dumps({'skip': 'no vLLM here'})); "
                           "raise SystemExit(3)"),
             step("needs", "print('never')", needs=["no_such_module_for_gpu_check"]),
             step("too_long", "print('never')", cap=500, min_s=400)]
    code, doc, _ = check(tmp_path, steps)
    assert code == 3
    assert statuses(doc) == [("passes", "passed"), ("skips", "skipped"), ("needs", "skipped"),
                             ("too_long", "skipped")]
    why = [s.get("reason", "") for s in doc["steps"]]
    assert why[1] == "no vLLM here"
    assert "no_such_module_for_gpu_check" in why[2]
    assert why[3].startswith("budget:")


def test_a_failed_info_stops_the_run_and_results_follow_every_step(tmp_path):
    # The second step reads results.json while it runs: the first step is in it already.
    results = tmp_path / "out" / "results.json"  # steps run in the repository root
    reads = (f"import json, sys; doc = json.load(open({str(results)!r})); "
             "sys.exit(0 if [s['step'] for s in doc['steps']] == ['first'] "
             "and doc['pending'] == ['second', 'info', 'after'] else 1)")
    steps = [step("first", "print(1)"), step("second", reads),
             step("info", "raise SystemExit(1)", stop_on_failure=True), step("after", "")]
    code, doc, _ = check(tmp_path, steps)
    assert code == 1
    assert statuses(doc) == [("first", "passed"), ("second", "passed"), ("info", "failed"),
                             ("after", "skipped")]
    assert doc["steps"][3]["reason"].startswith("not run: info failed")


def test_only_and_cap_select_steps(tmp_path):
    steps = [step("info", "", stop_on_failure=True), step("a", "print('a')"),
             step("b", "import time; time.sleep(30)")]
    code, doc, _ = check(tmp_path, steps, "--only", "b", "--cap", "b=2")
    assert code == 1
    assert statuses(doc) == [("info", "passed"), ("b", "timed_out")]
    assert doc["steps"][1]["cap_s"] == 2


# ------------------------------------------------------------------------- the step list


def test_the_steps_are_in_the_issues_order_within_the_budget():
    names = [s.name for s in gpu_steps.STEPS]
    assert names == ["info", "op_headline", "decode_sweep", "quant", "cuda_tests",
                     "cuda_graphs", "eager_route", "whole_k3", "vllm_k3", "kernel_build"]
    assert sum(s.cap_s for s in gpu_steps.STEPS) <= gpu_steps.BUDGET_S
    assert gpu_steps.STEPS[0].stop_on_failure
    sweep = gpu_steps.STEPS[2].cmds[0]
    ts = sweep[sweep.index("--T") + 1:sweep.index("--variants")]
    assert ts == ("1", "8", "64", "65", "128", "255", "256", "1024", "4096")


def _cuda_tests_of(path: Path) -> dict[str, str | None]:
    """Test functions that need CUDA (all of test_cuda.py's, elsewhere a skipif on CUDA)
    or carry a ``gpu_check`` mark: each with its shard (None: unmarked)."""
    tree = ast.parse(path.read_text())
    found: dict[str, str | None] = {}
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_"):
            marks = [d for d in fn.decorator_list if isinstance(d, ast.Call)
                     and ast.unparse(d.func) == f"pytest.mark.{gpu_steps.MARKER}"]
            text = " ".join(ast.unparse(d) for d in fn.decorator_list)
            if path.name == "test_cuda.py" or "cuda.is_available" in text or marks:
                shard = [ast.literal_eval(a) for m in marks for a in m.args]
                found[f"tests/{path.name}::{fn.name}"] = shard[0] if len(shard) == 1 else None
    return found


def test_every_cuda_test_is_marked_for_a_shard_of_the_check():
    found = {n: s for f in sorted((ROOT / "tests").glob("test_*.py"))
             for n, s in _cuda_tests_of(f).items()}
    shards = (*gpu_steps.CUDA_SHARDS, gpu_steps.GRAPHS_SHARD)
    unmarked = sorted(n for n, s in found.items() if s not in shards)
    assert not unmarked, (f"CUDA tests the GPU check does not run: mark each "
                          f"@pytest.mark.gpu_check(SHARD), SHARD one of {shards}")
    assert set(found.values()) == set(shards), "a shard of the check with no test marked"
    by_step = {s.name: s for s in gpu_steps.STEPS}
    graphs = (gpu_steps.GRAPHS_SHARD,)
    for name, want in (("cuda_tests", gpu_steps.CUDA_SHARDS), ("cuda_graphs", graphs)):
        cmds = by_step[name].cmds
        assert [argv[argv.index("--gpu-shard") + 1] for argv in cmds] == list(want)
        for argv in cmds:
            shard = argv[argv.index("--gpu-shard") + 1]
            files = {n.split("::")[0] for n, s in found.items() if s == shard}
            assert ("-m", "gpu_check") == argv[argv.index("-m", 3):argv.index("-m", 3) + 2]
            assert files == {a for a in argv if a.endswith(".py")}, shard
    # The dry run, where each test skips: the four shards in one process, the same files.
    [dry] = by_step["cuda_tests"].dry or ()
    assert dry[dry.index("--gpu-shard") + 1] == ",".join(gpu_steps.CUDA_SHARDS)
    assert {a for a in dry if a.endswith(".py")} == {
        a for argv in by_step["cuda_tests"].cmds for a in argv if a.endswith(".py")}


def test_fill_benchmarks_prints_the_cuda_tables():
    ratio = {"median": 1.25, "q1": 1.2, "q3": 1.3}
    row = {"variant": "read", "T": 1, "roofline": ratio, "gbps": {"op": 4000.0},
           "vs_op": {"vllm-k3": ratio}, "op_vs_compiled": ratio,
           "time_s": {"op": {"median": 1e-5}}, "max_rel_err": {"op": 1e-3}}
    doc = {"started": "2026-12-05T00:00:00Z", "commit": "abc1234", "steps": [
        {"step": "info", "data": {"facts": {"device": "NVIDIA H100"}}},
        {"step": "op_headline", "data": {"op": {"rows": [row]}}},
        {"step": "decode_sweep", "data": {"op": {"rows": [row]}}},
        {"step": "quant", "data": {"quant": {"rows": [
            {"T": 8, "time_s": {"fused": {"median": 1e-5}, "unfused": {"median": 2e-5}},
             "speedup": ratio, "bytes_and_scales_equal": True}]}}},
        {"step": "cuda_tests", "status": "passed", "test_counts": {"passed": 120}}]}
    text = report.fill_benchmarks(doc)
    assert "| read | 1.25 [1.20-1.30] | 4000.0 | 1.25 [1.20-1.30] | op 1.0e-03 |" in text
    assert "| decode sweep, H=7168 nb=8 bf16 full | T=1 |\n|---|---|\n" in text
    assert "| t(vLLM)/t(op) [IQR] | 1.25 [1.20-1.30] |" in text
    assert "| fused / unfused ms | 0.010 / 0.020 |" in text
    assert "| bytes, scales equal | yes |" in text
    assert "| cuda_tests | passed | 120 | 0 | 0 | 0 |" in text
    assert "| cuda_graphs | not run |" in text and "NVIDIA H100" in text
    assert all(line.count("|") == text.splitlines()[0].count("|")
               for line in text.splitlines()[:3])  # a well-formed table


# ------------------------------------------------------------------------- the dry run


@pytest.mark.heavy
def test_the_dry_run_runs_every_step_on_cpu(tmp_path):
    """``bash tools/gpu_check.sh --dry-run``: every step in order, on CPU, under 5 minutes,
    at most 8 files; nothing fails (vllm_k3 skips where vLLM is not installed). The quant
    step is the suite's run of bench's quant section: its rows are checked here."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    env.pop("GPU_CHECK_BUDGET", None)
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--dry-run"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert time.monotonic() - t0 < 300
    doc = json.loads((tmp_path / "results.json").read_text())
    assert [s["step"] for s in doc["steps"]] == [s.name for s in gpu_steps.STEPS]
    bad = [(s["step"], s["status"], s.get("reason")) for s in doc["steps"]
           if s["status"] != "passed" and (s["step"], s["status"]) != ("vllm_k3", "skipped")]
    assert not bad, r.stdout[-3000:]
    assert r.returncode in (0, 3) and doc["exit"] == r.returncode
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(gpu_steps.FILES)
    # bench's quant section at tiny sizes (generated C++): a row per T, bytes equal, timed
    quant = doc["steps"][3]["data"]["quant"]["rows"]
    assert [r["T"] for r in quant] == [1, 64]
    assert all(r["bytes_and_scales_equal"] and r["speedup"]["n"] >= 2 for r in quant), quant
    tests = doc["steps"][4]["test_counts"]  # the four shards, in one process here
    assert tests.get("skipped", 0) > 100 and set(tests) == {"skipped"}  # no CUDA here
    assert len(doc["steps"][4]["cmds"]) == 1
    assert doc["steps"][5]["test_counts"] == {"skipped": 1}  # the graphs shard alone
