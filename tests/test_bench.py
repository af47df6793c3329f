"""Smoke test of ``kimi_passes.bench``: it runs and writes the documented JSON fields.

Never asserts timings (the machine may be shared); only structure and correctness.
"""

from __future__ import annotations

import json

import pytest
import torch

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
def test_every_section_runs_at_a_tiny_size(tmp_path):
    """``bench --only op,tap,pass,compile,quant``: each section runs and reports, with no
    error (what ``bench --quick`` runs, and the compile and quant sections it leaves out)."""
    out = tmp_path / "bench.json"
    rc = bench.main(["--quick", "--only", "op,tap,pass,compile,quant", "--T", "1", "--H", "64",
                     "--blocks", "2", "--dtypes", "float32", "--variants", "read",
                     "--no-compiled", "--no-peers", "--rounds", "2", "--block-ms", "1",
                     "--threads", "1", "--tap-layers", "2", "--tap-hidden", "64",
                     "--tap-T", "8", "--pass-layers", "2", "--layers", "1", "2",
                     "--quant-T", "1", "8", "--quant-H", "64", "--quant-blocks", "2",
                     "--no-plot", "--out", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and "errors" not in res, res.get("errors")
    assert res["sections"] == ["op", "tap", "pass", "compile", "quant"]
    tap = res["tap"]
    assert tap["tap_max_rel_err_vs_ground_truth"]["attn_res"] < 1e-5
    assert tap["tap_max_rel_err_vs_ground_truth"]["vllm_style"] < 1e-5
    # With the FX graph cache on, a way served from it has no code to read (None).
    shapes = tap["generated_code"]
    assert all(s is None or s["loops_over_H"] > 0 for s in shapes.values()), shapes
    alone = res["pass"]["standalone"]
    assert alone["taps"] == 2 and alone["nodes"] > 0 and alone["time_s"]["n"] > 0
    points = res["compile"]["points"]
    assert [p["num_layers"] for p in points] == [1, 2]
    assert all(p["pass_calls"] > 0 and p["total_s"] > 0 for p in points)
    quant = res["quant"]["rows"]
    assert [r["T"] for r in quant] == [1, 8]
    assert all(r["bytes_and_scales_equal"] and r["speedup"]["n"] >= 2 for r in quant)


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
