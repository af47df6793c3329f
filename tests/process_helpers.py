"""Processes that import side by side and compile one after another."""

from __future__ import annotations

import subprocess


def one_after_another(commands: list[list[str]], env: dict, timeout: float) -> list[str]:
    """Start every command at once, so their imports overlap; each waits for a line on
    stdin before it compiles, sent when the one before it has exited. Returns each
    command's stdout; a non-zero exit fails the test with the command's stderr."""
    procs = [subprocess.Popen(cmd, env=env, text=True, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for cmd in commands]
    outputs = []
    try:
        for i, (cmd, proc) in enumerate(zip(commands, procs, strict=True)):
            stdout, stderr = proc.communicate("go\n", timeout=timeout)
            args = " ".join(a for a in cmd[1:] if len(a) < 80)  # an inline script left out
            assert proc.returncode == 0, f"process {i} ({args}) failed:\n{stderr[-4000:]}"
            outputs.append(stdout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return outputs
