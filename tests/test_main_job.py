"""python -m kimi_passes: refusal, the SVG, a tap reading the prefix, usage errors.

The compiling tests pass --aten-fallback (no generated kernels: fast compiles; the
passes and the post-grad graphs are the same). The runs at the README's arguments (real
Inductor: pipeline stages, the prefix stream, the dump, bf16) are
tests/test_readme_commands.py's; CI runs the default ``python -m kimi_passes`` as its
set-up step.
"""

from __future__ import annotations

import os

import pytest
from helpers.k3 import main_job_rows

import kimi_passes.__main__
from kimi_passes.__main__ import DRIFT_MARGIN, TOLERANCE, default_taps, main, make_stages

FAST = ["--aten-fallback", "--layers", "3", "--hidden", "16", "--heads", "2", "--tokens", "6"]
#: The README's bf16 command.
README_BF16 = ["--layers", "8", "--block-size", "3", "--taps", "0,3,6,8", "--dtype", "bf16"]


def test_boundary_tap_on_a_non_final_stage_is_refused(capsys):
    assert main([*FAST, "--stages", "2", "--taps", "0,2"]) == 1
    err = capsys.readouterr().err
    assert "stage [0, 2)" in err
    assert "AuxCaptureError: capture id 2 has no consumer in this graph" in err
    assert "pipeline non-final stage owning layers [0, 2)" in err


def test_svg(tmp_path, capsys, monkeypatch):
    # a stand-in for graphviz's dot: copies the DOT text it is fed to the -o file
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_dot = bin_dir / "dot"
    fake_dot.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\ncat > "$2"\n')
    fake_dot.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    svg = tmp_path / "region.svg"
    assert main([*FAST, "--svg", str(svg)]) == 0
    out = capsys.readouterr().out
    dot = svg.read_text()
    assert dot.startswith("digraph kimi {")
    assert 'label="stage [0, 3): before"' in dot and 'label="stage [0, 3): after"' in dot
    assert dot.count("fillcolor=orange") == 3 + 2  # 3 aux_tap before; 2 captures after
    assert f"wrote {svg}" in out


def test_a_tap_reading_the_prefix_fails_the_bf16_check(monkeypatch, capsys):
    """A broken rewrite, one whose every tap reads the running prefix, fails the README's
    bf16 command: the fp32 truth's tolerance is what eager bf16 needs, far below a prefix
    tap's distance. The stage's compile is stood in for by the eager prefix-stream forward
    (exactly those taps; no compile needed to judge the check). Tap 0 reads the
    embedding, where the two streams agree."""
    def prefix_taps(args, model, name, inputs, found):
        out, taps = model(*inputs)
        return out, taps, {}

    monkeypatch.setattr(kimi_passes.__main__, "_compile_and_run", prefix_taps)
    assert main(README_BF16) == 1
    out = capsys.readouterr().out
    table = main_job_rows(out)
    assert sorted(table) == [0, 3, 6, 8], out
    assert table[0][-1] == "yes" and float(table[0][5]) == 0.0, out
    for k in (3, 6, 8):
        err, tol = float(table[k][5]), float(table[k][7])
        assert table[k][-1] == "NO" and table[k][6] == "fp32 ground truth", out
        # eager bf16's drift sets the tolerance: above the dtype's, well below the miss
        assert TOLERANCE["bf16"] < tol and err > 10 * tol, out
    assert "result: 3 of 4 taps DISAGREE (capture ids [3, 6, 8]; bf16" in out
    assert f"{DRIFT_MARGIN:g} x the eager bf16 tap's own distance" in out


def test_usage_errors(capsys):
    assert main(["--stages", "9"]) == 2
    assert "--stages: boundaries [9]" in capsys.readouterr().err
    assert main(["--taps", "0,7"]) == 2
    assert "aux_layer_ids (0, 7)" in capsys.readouterr().err
    assert main(["--dtype", "fp8"]) == 2


def test_svg_without_dot(monkeypatch, capsys):
    monkeypatch.setattr("kimi_passes.__main__.shutil.which", lambda name: None)
    assert main(["--svg", "x.svg"]) == 2
    assert "graphviz's 'dot'" in capsys.readouterr().err


def test_bench_subcommand_is_lazy(monkeypatch):
    import sys
    import types

    seen = []
    fake = types.ModuleType("kimi_passes.bench")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "kimi_passes.bench", fake)
    assert main(["bench", "--quick"]) == 0
    assert seen == [["--quick"]]


def test_helpers():
    assert default_taps(4, 2) == (0, 2, 3, 4)
    assert default_taps(1, 1) == (0, 1)
    assert make_stages([2], 4) == [(0, 2), (2, 4)]
    assert make_stages([], 4) == [(0, 4)]
    with pytest.raises(ValueError, match="strictly inside"):
        make_stages([0], 4)
