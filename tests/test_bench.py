"""Smoke test of ``kimi_passes.bench``: it runs and writes the documented JSON fields.

Never asserts timings (the machine may be shared); only structure and correctness.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.k3 import TINY_BENCH

from kimi_passes import bench


def test_op_smoke(tmp_path):
    out = tmp_path / "bench.json"
    rc = bench.main(["--quick", "--only", "op", "--T", "1", "8", "--H", "64", "--blocks", "2",
                     "--dtypes", "float32", "bfloat16", "--variants", "read", "full",
                     "--no-compiled", "--rounds", "2", "--block-ms", "1", "--threads", "1",
                     "--no-plot", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["sections"] == ["op"] and res["mode"] == "quick"
    for key in ("date", "torch", "cpu", "cpu_count", "device", "loadavg_start"):
        assert key in res["machine"]
    rows = res["op"]["rows"]
    assert {(r["dtype"], r["variant"], r["T"]) for r in rows} == {
        (d, v, t) for d in ("float32", "bfloat16") for v in ("read", "full") for t in (1, 8)}
    for r in rows:
        assert r["H"] == 64 and r["nb"] == 2
        assert r["bytes"] == bench.op_bytes(r["T"], 64, 2, bench.DTYPES[r["dtype"]], r["variant"])
        for name in ("op", "eager", "copy"):
            t = r["time_s"][name]
            assert t["n"] == 2 and t["min"] <= t["median"] <= t["max"]
            assert r["gbps"][name] > 0
        for key in ("roofline", "op_vs_eager"):
            assert r[key]["median"] > 0 and r[key]["q1"] <= r[key]["q3"]
        assert r["op_vs_compiled"] is None and "compiled" in r["notes"]
        tol = 1e-5 if r["dtype"] == "float32" else 2e-2
        assert r["max_rel_err"]["op"] <= tol
    assert res["targets"] == []  # CPU op rows carry no target


@pytest.mark.heavy
def test_the_compile_section_runs_at_a_tiny_size(tmp_path):
    """``bench --only compile,op``: the compile section's cold compiles at depths 1 and 2,
    then the op section, in the order ``--only`` gives, with no error. The other sections
    run elsewhere at tiny sizes, their reports checked there: op, tap and pass in README's
    ``bench --quick`` (tests/test_readme_commands.py, these TINY_BENCH flags), quant in the
    GPU check's dry run (its quant step, tests/test_gpu_check.py)."""
    out = tmp_path / "bench.json"
    rc = bench.main(["--quick", "--only", "compile,op", *TINY_BENCH, "--layers", "1", "2",
                     "--out", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and "errors" not in res, res.get("errors")
    assert res["sections"] == ["compile", "op"]
    points = res["compile"]["points"]
    assert [p["num_layers"] for p in points] == [1, 2]
    assert all(p["pass_calls"] > 0 and p["total_s"] > 0 for p in points)


def test_op_bytes_counts_each_stream_once():
    # read: nb blocks + prefix read, out written; full adds delta read, prefix write-back,
    # the block write and the output norm weight.
    T, H, nb = 8, 16, 3
    assert bench.op_bytes(T, H, nb, torch.float32, "read") == 4 * (T * H * (nb + 2) + 2 * H)
    assert bench.op_bytes(T, H, nb, torch.bfloat16, "full") == 2 * (T * H * (nb + 5) + 3 * H)


def test_unknown_section_is_refused(capsys):
    assert bench.main(["--only", "op,nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_linear_fit_and_summary():
    fit = bench.linear_fit([1, 2, 3, 4], [3, 5, 7, 9])
    assert abs(fit["slope"] - 2) < 1e-12 and abs(fit["intercept"] - 1) < 1e-12
    assert abs(fit["r2"] - 1) < 1e-12
    s = bench.summary([3.0, 1.0, 2.0])
    assert (s["min"], s["median"], s["max"], s["n"]) == (1.0, 2.0, 3.0, 3)


#: ``bench <subcommand>`` at a tiny size, and a line its table prints.
SUBCOMMAND_RUNS = {
    "cpu-op": (["--T", "8", "--H", "64", "--NB", "3", "--num-blocks", "2", "--budget", "0",
                "--min-reps", "2", "--threads", "1"], "worst ratio:"),
    "call-cost": (["--T", "1", "--H", "64", "--blocks", "2", "--rounds", "2", "--block-ms",
                   "1"], "| attn_res_mix | 1 |"),
    "decode": (["--models", "site", "--T", "1", "--rounds", "2", "--block-ms", "1", "--no-ops"],
               "site      T=1"),
    "fusion": (["--model", "site", "--site-tokens", "8", "--site-hidden", "64", "--rounds", "2",
                "--min-run-time", "0.001", "--threads", "1"], "(1 mixing sites fused)"),
}


@pytest.mark.usefixtures("aten_fallback")  # the subcommands' own code, not Inductor's codegen
@pytest.mark.parametrize("name", sorted(SUBCOMMAND_RUNS))
def test_subcommand_runs_at_a_tiny_size(name, capsys):
    argv, line = SUBCOMMAND_RUNS[name]
    n = torch.get_num_threads()
    try:
        assert bench.main([name, *argv]) == 0
    finally:
        torch.set_num_threads(n)  # the subcommands set the process's threads
    assert line in capsys.readouterr().out


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in bench.SUBCOMMANDS), out


# --------------------------------------------------------------------------- verdicts

#: The fields of a candidate's record in every bench's JSON rows (harness.verdict).
VERDICT_KEYS = {"candidate", "T", "time", "ratio", "err", "tol", "verdict", "reason"}
TINY_OP = ["--quick", "--only", "op", "--T", "2", "--H", "64", "--blocks", "2", "--dtypes",
           "bfloat16", "--no-compiled", "--rounds", "2", "--block-ms", "1", "--threads", "1",
           "--no-plot"]


def _by_name(row: dict) -> dict[str, dict]:
    assert all(set(c) == VERDICT_KEYS for c in row["candidates"]), row["candidates"]
    return {c["candidate"]: c for c in row["candidates"]}


def test_op_candidate_off_or_raising_is_a_miss_with_its_reason(tmp_path, monkeypatch, capsys):
    """A wrong kernel is timed and flagged, one that raises is dropped from the timing; both
    print MISS with the reason on their row and are in the JSON; the op still meets bf16's
    tolerance."""
    from kimi_passes.bench import op

    real = op._op_factories

    def with_bad_candidates(cfg, variant, dtype):
        makers, notes = real(cfg, variant, dtype)
        makers["wrong"] = lambda a: lambda: torch.ops.kimi.attn_res(*a) * 1.5

        def boom(a):
            def call():
                raise RuntimeError("boom\nsecond line")
            return call

        makers["boom"] = boom
        return makers, notes

    monkeypatch.setattr(op, "_op_factories", with_bad_candidates)
    out = tmp_path / "op.json"
    assert bench.main([*TINY_OP, "--variants", "full", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    [row] = json.loads(out.read_text())["op"]["rows"]
    got = _by_name(row)
    assert got["op"]["verdict"] == "MET" and got["op"]["err"] <= got["op"]["tol"] == 2e-2
    assert got["op"]["ratio"] == 1.0 and got["op"]["time"] > 0 and got["op"]["T"] == 2
    wrong, boom = got["wrong"], got["boom"]
    assert wrong["verdict"] == "MISS" and wrong["err"] > wrong["tol"] and wrong["time"] > 0
    assert wrong["reason"] == f"error {wrong['err']:.3g} > tolerance 0.02"
    assert boom["verdict"] == "MISS" and boom["time"] is None and boom["err"] is None
    assert boom["reason"] == "raised RuntimeError: boom"
    assert f"MISS wrong: {wrong['reason']}" in printed
    assert "MISS boom: raised RuntimeError: boom" in printed
    assert "2 MISS (each MISS is on its row, with the reason)" in printed


def test_a_failing_peer_is_a_miss_on_every_variant(tmp_path, monkeypatch, capsys):
    """vLLM's kernel that cannot be loaded and a PyPI peer that is off: MISS on the "full"
    row as on the "read" row, never a column that silently disappears."""
    from kimi_passes.bench import op

    def peers(args, variant, dtype, device):
        return ({"vllm-k3": "failed: vLLM's K3 kernel is not available (bash tools/"
                            "gpu_prepare.sh)",
                 "flash-attn-res": lambda: torch.zeros_like(args.prefix),
                 "fast-attnres": "not installed (ImportError)"}, {})

    monkeypatch.setattr(op, "_peer_fns", peers)
    out = tmp_path / "op.json"
    assert bench.main([*TINY_OP, "--variants", "read", "full", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["op"]["rows"]
    assert [r["variant"] for r in rows] == ["read", "full"]
    for row in rows:
        got = _by_name(row)
        assert got["vllm-k3"]["verdict"] == "MISS" and got["vllm-k3"]["time"] is None
        assert "gpu_prepare.sh" in got["vllm-k3"]["reason"]
        assert got["flash-attn-res"]["verdict"] == "MISS" and got["flash-attn-res"]["err"] == 1
        assert "fast-attnres" not in got and row["notes"]["fast-attnres"].startswith("not")
    # Each row's line, as the run logs it and as the report prints it.
    assert printed.count("MISS vllm-k3: vLLM's K3 kernel is not available") == 2 * 2
    assert printed.count("MISS flash-attn-res: error 1 > tolerance 0.02") == 2 * 2


def test_quant_candidates_are_held_to_the_unfused_bytes(monkeypatch, capsys):
    """Without compiling (``_compile`` stood in): a fused way whose bytes differ, a control
    that raises; the unfused graph is the reference."""
    from kimi_passes.bench import cli, quant

    data = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.float8_e4m3fn)
    scale = torch.ones(3, 1)

    def fake_compile(fuse, inputs, nb, eps):
        if fuse:
            wrong = data.clone()
            wrong[1, 2] = 0.0
            return (lambda *a: None), [], (wrong, scale), 1
        if calls.append(1) or len(calls) == 2:  # the second unfused way: the control
            raise RuntimeError("control failed")
        return (lambda *a: None), [], (data, scale), 0

    calls: list[int] = []
    monkeypatch.setattr(quant, "_compile", fake_compile)
    cfg = cli.Config(cli.parse_args(["--quick", "--rounds", "2", "--block-ms", "1",
                                     "--threads", "1", "--quant-T", "3"]))
    res = quant.bench_quant(cfg, print)
    [row] = res["rows"]
    got = _by_name(row)
    assert got["unfused"]["verdict"] == "MET" and got["unfused"]["err"] == 0
    assert got["fused"]["verdict"] == "MISS" and got["fused"]["err"] == 1
    assert got["fused"]["reason"] == "error 1 > tolerance 0" and got["fused"]["time"] > 0
    assert got["control"]["reason"] == "raised RuntimeError: control failed"
    assert not row["bytes_and_scales_equal"] and row["control"] is None
    printed = capsys.readouterr().out
    assert "MISS fused: error 1 > tolerance 0" in printed
    assert "MISS control: raised RuntimeError: control failed" in printed


@pytest.mark.usefixtures("aten_fallback")
def test_decode_candidates_off_or_raising_are_misses(tmp_path, monkeypatch, capsys):
    """Plain Inductor's place taken by eager (no compile): ``kimi`` off by one, ``kimi-ops``
    raising; both MISS on the row and in ``--out``'s JSON."""
    from kimi_passes.bench import decode

    def off(model):
        return lambda *a: decode.first_tensor(model(*a)) + 1

    def raises(model):
        def call(*a):
            raise ValueError("no kernel")
        return call

    fakes = [off, raises]
    monkeypatch.setattr(decode, "compiled", lambda model, backend, dynamic:
                        model if backend == "inductor" else fakes.pop(0)(model))
    out = tmp_path / "decode.json"
    n = torch.get_num_threads()
    try:
        assert bench.main(["decode", "--models", "site", "--T", "1", "--rounds", "2",
                           "--block-ms", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(n)
    [row] = json.loads(out.read_text())["rows"]
    got = _by_name(row)
    assert got["inductor"]["verdict"] == "MET" and got["kimi"]["verdict"] == "MISS"
    assert got["kimi"]["reason"].startswith("error ") and got["kimi"]["tol"] == 1e-3
    assert got["kimi-ops"]["reason"] == "raised ValueError: no kernel"
    assert got["kimi-ops"]["time"] is None and got["kimi"]["T"] == 1
    printed = capsys.readouterr().out
    assert "MISS kimi: error" in printed and "MISS kimi-ops: raised ValueError" in printed
