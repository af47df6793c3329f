"""Separate processes that compile one after another, forked from one that has imported.

The cross-process tests (a shared on-disk cache, vLLM's cache root, a changed drafter)
need each compile in a process of its own: what one process is served must come from the
disk, not from memory. Importing is most of such a process's time (torch with
kimi_passes about 5 s, vLLM about 14 s more), so one parent process imports once and
forks each command after the one before it has exited. A child starts with the modules
imported and nothing compiled, as a fresh process would after its imports; by default
also with Inductor imported, its code generators registered and its CPU patterns traced
(``INDUCTOR_SETUP``), as a fresh process would be once its first compile has begun.
"""

from __future__ import annotations

import importlib
import json
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_PARENT = r"""
import atexit, importlib.util, json, os, runpy, sys, time, traceback

# This file's set_up, loaded by path under its own name (the children keep this process's
# sys.path as is: tests/ is not on it unless the caller's PYTHONPATH says so).
spec = importlib.util.spec_from_file_location("helpers.process", sys.argv[3])
helpers = sys.modules["helpers.process"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(helpers)
helpers.set_up(json.loads(sys.argv[1]))
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


# What any process does at the start of its first compile, whatever it compiles: import
# Inductor and register its code generators (1.3 s of a 3.1 s first compile of a small
# K3 here). Nothing is compiled, traced or cached. ("module:function" calls the function.)
INDUCTOR_SETUP = ("torch._inductor.compile_fx", "torch._inductor.codegen.cpp",
                  "torch._inductor.codegen.wrapper", "torch._inductor.scheduler",
                  "torch._inductor.lowering", "torch._inductor.decomposition",
                  "torch._inductor.codegen.common:init_backend_registration",
                  "helpers.process:init_cpu_patterns")
DEFAULT_IMPORTS = ("torch", "kimi_passes", *INDUCTOR_SETUP)


def init_cpu_patterns() -> None:
    """Inductor's pattern-matcher patterns for CPU graphs (joint-graph and post-grad),
    traced once per process by its first compile (about 0.5 s), with the arguments that
    compile passes (the patterns are cached per device)."""
    import torch
    from torch._inductor.fx_passes import joint_graph, post_grad

    joint_graph.lazy_init(torch.device("cpu"))
    post_grad.lazy_init()


def set_up(names: tuple[str, ...]) -> None:
    """In this process, what the forking parent does before it forks: import each of
    ``names``, and call ``function`` for a ``module:function`` name (for a forkserver's
    preload, which only imports: tests/helpers/rank_preload.py)."""
    for name in names:
        module, _, call = name.partition(":")
        imported = importlib.import_module(module)
        if call:
            getattr(imported, call)()


class ForkingParent:
    """A parent process that has imported ``imports`` under ``env`` and forks one child per
    command, each after the one before it has exited. ``run`` takes commands one at a time
    (a module's tests can share one parent); ``close`` ends it. Use as a context manager."""

    IMPORT_TIMEOUT_S = 120  # the parent's imports, on top of each command's timeout

    def __init__(self, env: dict, timeout: float,
                 imports: tuple[str, ...] = DEFAULT_IMPORTS):
        self._tmp = tempfile.TemporaryDirectory()
        self._timeout = timeout
        self._count = 0
        self._stderr = Path(self._tmp.name) / "parent.err"
        with open(self._stderr, "w") as err:  # a file: a pipe nobody reads could fill
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _PARENT, json.dumps(list(imports)), str(timeout),
                 __file__],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, text=True)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)  # the parent exited

    def _fail(self, why: str) -> None:
        self._proc.kill()
        raise AssertionError(f"the forking parent {why}:\n{self._stderr.read_text()[-4000:]}")

    def run(self, cmd: list[str], check: bool = True):
        """Run ``cmd`` (``[sys.executable, "-c", code, *args]`` or ``[sys.executable, script,
        *args]``) in a child; its stdout. A non-zero exit fails the test with its stderr;
        with ``check=False`` the ``subprocess.CompletedProcess`` is returned instead."""
        assert cmd[0] == sys.executable, cmd
        i, self._count = self._count, self._count + 1
        out, err = (Path(self._tmp.name) / f"{i}.{s}" for s in ("out", "err"))
        try:
            self._proc.stdin.write(json.dumps({"argv": cmd[1:], "stdout": str(out),
                                               "stderr": str(err)}) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            self._fail("exited")
        # Only the parent's own lines: an import may log to stdout (vLLM does).
        deadline = time.monotonic() + self._timeout + self.IMPORT_TIMEOUT_S
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._fail(f"did not answer in {self._timeout + self.IMPORT_TIMEOUT_S:.0f} s")
            if line is None:
                self._fail("exited")
            if line.startswith('{"rc": '):
                break
        rc = json.loads(line)["rc"]
        if not check:
            return subprocess.CompletedProcess(cmd, rc, out.read_text(), err.read_text())
        args = " ".join(a for a in cmd[1:] if len(a) < 80)  # an inline script left out
        assert rc == 0, f"process {i} ({args}) failed (exit {rc}):\n{err.read_text()[-4000:]}"
        return out.read_text()

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._tmp.cleanup()

    def __enter__(self) -> ForkingParent:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def one_after_another(commands: list[list[str]], env: dict, timeout: float,
                      imports: tuple[str, ...] = DEFAULT_IMPORTS) -> list[str]:
    """Run each command in a process of its own, one after another, each forked from a
    parent that has imported ``imports`` under ``env`` (``ForkingParent``). Returns each
    command's stdout; a non-zero exit fails the test with the command's stderr."""
    with ForkingParent(env, timeout, imports) as parent:
        return [parent.run(cmd) for cmd in commands]
