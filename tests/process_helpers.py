"""Separate processes that compile one after another, forked from one that has imported.

The cross-process tests (a shared on-disk cache, vLLM's cache root, a changed drafter)
need each compile in a process of its own: what one process is served must come from the
disk, not from memory. Importing is most of such a process's time (torch with
kimi_passes about 5 s, vLLM about 14 s more), so one parent process imports once and
forks each command after the one before it has exited. A child starts with the modules
imported and nothing compiled, exactly as a fresh process would after its imports.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

_PARENT = r"""
import atexit, importlib, json, os, runpy, sys, time, traceback

for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
timeout = float(sys.argv[2])
sys.stdout.flush()
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(f, fd)
                os.close(f)
            argv = job["argv"]
            if argv[0] == "-c":
                sys.argv = ["-c", *argv[2:]]
                exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
            else:
                sys.argv = list(argv)
                sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
                runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as e:
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        try:
            atexit._run_exitfuncs()
        except BaseException:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            rc = f"killed after {timeout:.0f} s"
            break
        time.sleep(0.05)
    print(json.dumps({"rc": rc}), flush=True)
"""


def one_after_another(commands: list[list[str]], env: dict, timeout: float,
                      imports: tuple[str, ...] = ("torch", "kimi_passes")) -> list[str]:
    """Run each command (``[sys.executable, "-c", code, *args]`` or
    ``[sys.executable, script, *args]``) in a process of its own, one after another, each
    forked from a parent that has imported ``imports`` under ``env``. Returns each
    command's stdout; a non-zero exit fails the test with the command's stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        jobs = []
        for i, cmd in enumerate(commands):
            assert cmd[0] == sys.executable, cmd
            jobs.append({"argv": cmd[1:], "stdout": str(Path(tmp) / f"{i}.out"),
                         "stderr": str(Path(tmp) / f"{i}.err")})
        parent = subprocess.run(
            [sys.executable, "-c", _PARENT, json.dumps(list(imports)), str(timeout)],
            input="".join(json.dumps(j) + "\n" for j in jobs), env=env, text=True,
            capture_output=True, timeout=60 + timeout * (len(jobs) + 1))
        assert parent.returncode == 0, f"the forking parent failed:\n{parent.stderr[-4000:]}"
        # Only the parent's own lines: an import may log to stdout (vLLM does).
        codes = [json.loads(line)["rc"] for line in parent.stdout.splitlines()
                 if line.startswith('{"rc": ')]
        assert len(codes) == len(jobs), parent.stdout
        outputs = []
        for i, (cmd, job, rc) in enumerate(zip(commands, jobs, codes, strict=True)):
            args = " ".join(a for a in cmd[1:] if len(a) < 80)  # an inline script left out
            stderr = Path(job["stderr"]).read_text()
            assert rc == 0, f"process {i} ({args}) failed (exit {rc}):\n{stderr[-4000:]}"
            outputs.append(Path(job["stdout"]).read_text())
    return outputs
