"""Every command in README.md's ```bash blocks runs and exits 0, parsed from README.

The README's ```bash lines are read at test time. Skipped, by these rules only: blank
lines and comments; the set-up lines (starting ``python3 -m venv``: CI runs them as its
own steps, .ci/run); ``vllm serve`` (tests/test_vllm_k3_eager.py parses that one with
vLLM's own ``EngineArgs``). Every other line must be ``[VAR=value ...] .venv/bin/python -m
kimi_passes [args]`` (a trailing ``# comment`` dropped), else the test fails naming it: a
new README command cannot escape.

A command runs in this process, through ``kimi_passes.__main__.main(argv)`` (what ``-m``
calls; one interpreter for all, not an import per command), in a fresh working directory
(``--dump dump/`` writes there; ``vllm-plan``, marked ``vllm``, from the checkout's root,
where its ``config.json`` paths lie), with the line's ``VAR=value`` prefixes set. The main job
runs at the documented arguments. ``bench --quick`` (a minute-sized run) runs at a tiny
size: its sections and its mode, with the smallest shapes (``TINY_BENCH``).

These runs are the main job's end-to-end tests: beyond exit 0 the output is checked by
what the line asks for (``--stages``, ``--stream prefix``, ``--dump``, ``--show-graph``, a
reduced ``--dtype``), and ``test_the_commands_cover_the_main_jobs_features`` holds README
to covering each (tests/test_main_job.py has the cheap cases, with ATen fallbacks).
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from unittest import mock

import pytest
from helpers.k3 import TINY_BENCH, main_job_rows
from helpers.readme import bash_lines

from kimi_passes.__main__ import main

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ".venv/bin/python"
#: What the rules skip: the set-up lines and vLLM's own command.
SKIPPED = (re.compile(r"^python3 -m venv "), re.compile(r"\bvllm serve\b"))


def parse(line: str) -> tuple[dict[str, str], list[str]]:
    """``(env, argv)`` of ``[VAR=value ...] .venv/bin/python -m kimi_passes [args]``."""
    words = shlex.split(line)
    env = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if words[:3] != [PYTHON, "-m", "kimi_passes"]:
        raise ValueError(
            f"README command {line!r}: the runner knows `{PYTHON} -m kimi_passes ...` only "
            "(after VAR=value prefixes); teach tests/test_readme_commands.py to run it, or "
            "add it to SKIPPED with the reason")
    return env, words[3:]


def readme_commands() -> list[str]:
    lines = bash_lines((ROOT / "README.md").read_text())
    return [line for line in lines if not any(rule.search(line) for rule in SKIPPED)]


def test_the_parser_reads_bash_blocks_and_refuses_what_it_cannot_run():
    text = ("```python\nx = 1\n```\n```bash\n# a comment\n"
            "A=1 B='x y' .venv/bin/python -m kimi_passes --stages 2   # two stages\n\n"
            "bash tools/gpu_check.sh\n```\n```\nnot bash\n```\n")
    lines = bash_lines(text)
    assert lines == ["A=1 B='x y' .venv/bin/python -m kimi_passes --stages 2",
                     "bash tools/gpu_check.sh"]
    assert parse(lines[0]) == ({"A": "1", "B": "x y"}, ["--stages", "2"])
    with pytest.raises(ValueError, match="bash tools/gpu_check.sh.*the runner knows"):
        parse(lines[1])


def test_every_readme_command_is_one_the_runner_knows():
    commands = readme_commands()
    assert commands, "README.md has no ```bash command to run besides the set-up lines"
    unknown = []
    for line in commands:
        try:
            parse(line)
        except ValueError as e:
            unknown.append(str(e))
    assert not unknown, "\n".join(unknown)


def test_the_commands_cover_the_main_jobs_features():
    """The README's main-job lines are its end-to-end tests: dropping the last line with a
    feature drops that feature's test, so the check moves to test_main_job.py first. The
    same for ``bench --quick`` (bench's tap and pass sections)."""
    argvs = [parse(line)[1] for line in readme_commands()]
    flags = {a for argv in argvs if argv[:1] != ["bench"] for a in argv}
    want = {"--stages", "--stream", "--dump", "--show-graph", "--dtype"}
    assert want <= flags, f"no README main-job command passes {sorted(want - flags)}"
    assert any(argv[:1] == ["bench"] and "--quick" in argv for argv in argvs), (
        "no README `bench --quick`: its run is the suite's one of bench's tap and pass "
        "sections (test_bench.py runs compile and op): move that check there first")


def run(argv: list[str], env: dict[str, str], tmp_path: Path, monkeypatch) -> int:
    """Run ``python -m kimi_passes argv`` in this process; its exit status. ``vllm-plan``
    runs from the checkout's root (its ``config.json`` paths are the checkout's)."""
    monkeypatch.chdir(ROOT if argv[:1] == ["vllm-plan"] else tmp_path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if argv[:1] == ["bench"] and "--quick" in argv:
        argv = [*argv, *TINY_BENCH, "--out", str(tmp_path / "bench.json")]
    try:
        return main(argv)
    except SystemExit as e:  # argparse's --help (0) and usage errors (2)
        return e.code if isinstance(e.code, int) else 1


def check_main_job(argv: list[str], out: str, tmp_path: Path) -> None:
    """What the main job's output must show for the flags on the line."""
    table = main_job_rows(out)
    assert table and all(r[-1] == "yes" for r in table.values()), out
    assert f"result: all {len(table)} taps agree" in out
    assert "graph breaks: 0" in out and "recompiles: 0" in out and "compile time:" in out
    opt = dict(zip(argv, [*argv[1:], ""], strict=True))
    prefix = opt.get("--stream") == "prefix"
    assert all(r[3] == ("prefix" if prefix else "attn_res") for r in table.values()), out
    if prefix:
        assert all(r[4] == "running prefix" and r[8] == "1.0000" for r in table.values()), out
        assert "compared with the model's running prefix value" in out
    else:
        assert all(r[4] == "fused" for r in table.values()), out
        last = max(table)
        assert "output aggregation" in table[last][2], out
    if "--stages" in opt:
        assert len({r[1] for r in table.values()}) > 1, out  # taps on several stages
    dtype = opt.get("--dtype", "fp32")
    assert all(r[6].startswith("fp32" if dtype != "fp32" else ("eager" if prefix else "ground"))
               for r in table.values()), out
    if "--dump" in opt:
        files = [f.name for f in (tmp_path / opt["--dump"]).iterdir()]
        assert any("AuxStreamPass" in n and "before" in n for n in files), files
        assert any("AuxStreamPass" in n and "after" in n for n in files), files
        assert re.search(r"__compiled_fn_\d+\.post_grad\.1\.AuxStreamPass\.after\.\d+\.py", out)
    if "--show-graph" in opt:
        assert re.search(r"post-pass graph of stage \[\d+, \d+\) \(skeleton view\):", out)
        assert ("kimi.attn_res(" if prefix else "kimi.attn_res_capture(") in out, out


def check_bench(tmp_path: Path) -> None:
    """``bench --quick`` at the tiny size: its sections, each run with no error."""
    res = json.loads((tmp_path / "bench.json").read_text())
    assert "errors" not in res, res.get("errors")
    assert res["mode"] == "quick" and res["sections"] == ["op", "tap", "pass"]
    tap = res["tap"]
    assert tap["tap_max_rel_err_vs_ground_truth"]["attn_res"] < 1e-5
    assert tap["tap_max_rel_err_vs_ground_truth"]["vllm_style"] < 1e-5
    shapes = tap["generated_code"]  # None: a way served from the FX graph cache
    assert all(s is None or s["loops_over_H"] > 0 for s in shapes.values()), shapes
    alone = res["pass"]["standalone"]
    assert alone["taps"] == 2 and alone["nodes"] > 0 and alone["time_s"]["n"] > 0


def params() -> list:
    """One per command; ``heavy`` where it compiles (all but ``--help``), ``vllm`` for
    ``vllm-plan`` (vLLM's own config resolution)."""
    return [line if "--help" in line.split() else
            pytest.param(line, marks=pytest.mark.vllm, id="vllm-plan") if " vllm-plan " in line
            else pytest.param(line, marks=pytest.mark.heavy) for line in readme_commands()]


def check_vllm_plan(out: str) -> None:
    """The README's plan: the drafter's declared stream, served by the eager route."""
    import kimi_passes.vllm.k3.route as route

    route.unroute_attn_res()  # vLLM loaded our plugin into this process
    assert re.search(r"^stream +attn_res, from the dflash drafter's config", out, re.M), out
    assert re.search(r"^route +eager: compilation mode NONE", out, re.M), out
    assert re.search(r"^refused +nothing$", out, re.M), out


@pytest.mark.parametrize("line", params())
def test_the_readme_command_runs(line, tmp_path, monkeypatch, capsys):
    env, argv = parse(line)
    with mock.patch.dict(os.environ):  # vLLM's config resolution writes the environment
        rc = run(argv, env, tmp_path, monkeypatch)
    out, err = capsys.readouterr()
    assert rc == 0, f"`{line}` exited {rc}:\n{out[-4000:]}\n{err[-4000:]}"
    if argv[:1] == ["vllm-plan"]:
        check_vllm_plan(out)
    elif argv[:1] != ["bench"]:
        check_main_job(argv, out, tmp_path)
    elif "--quick" in argv:
        check_bench(tmp_path)
    else:
        assert out.strip(), f"`{line}` printed nothing"
