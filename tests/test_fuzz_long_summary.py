"""tools/fuzz_long.py's log summary: counts, distinct configurations, failures (no compile)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "fuzz_long.py"
spec = importlib.util.spec_from_file_location("fuzz_long", TOOL)
fuzz_long = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fuzz_long)


def row(**kw):
    r = {"L": 4, "S": 2, "H": 16, "ids": [0, 2, 3], "cuts": [2], "T": 5, "dtype": "float32",
         "stream": "attn_res", "fuse": True, "seed": 1, "stages": ["refused", "ok"],
         "worst": 0.01, "outcome": "ok", "seconds": 2.0}
    return {**r, **kw}


def write(tmp_path, rows, name="fuzz_1.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_counts_distinct_configurations_and_verified_taps(tmp_path):
    logs = [write(tmp_path, [row(), row(seed=7), row(T=6)]),
            write(tmp_path, [row(stream="prefix", stages=["ok", "ok"], dtype="bfloat16",
                                 worst=0.0)], "fuzz_2.jsonl")]
    text, ok = fuzz_long.summarize(logs)
    assert ok, text
    # Another weights seed is the same configuration; another T is not.
    assert "examples: 4; distinct configurations: 3" in text
    assert "stage compiles: 8 (5 verified, 3 refused as expected)" in text
    # Stage [2, 4) of L=4 taps 2 and 3 (and L=4 is not in ids); the prefix stream also
    # serves stage [0, 2)'s ids 0 and 2, boundary tap 2 included.
    assert "taps verified: 10 (fused capture 10; boundary taps served in the prefix stream 1)" \
        in text, text
    assert "worst error / tolerance: fp32 0.01, bf16 0.0" in text


def test_any_failing_example_fails_the_summary(tmp_path):
    for outcome in ("mismatch", "unexpected", "interrupted"):
        text, ok = fuzz_long.summarize([write(tmp_path, [row(), row(outcome=outcome)])])
        assert not ok and f"'{outcome}': 1" in text
    assert fuzz_long.summarize([write(tmp_path, [])]) == ("no examples logged", False)


def fusion_row(mode="eval", miss=None, fused=1, **kw):
    site = {"n": 2, "miss": miss}
    r = {"mode": mode, "describe": f"tnh float32 | n=2 MISS={miss}", "fused": fused,
         "program": {"layout": "tnh", "dtype": "float32", "sites": [site]},
         "worst": 1e-7, "outcome": "ok", "seconds": 3.0}
    return {**r, **kw}


def test_fusion_summary_counts_programs_sites_and_failures(tmp_path):
    rows = [fusion_row(), fusion_row("train"), fusion_row(miss="mask", fused=0),
            fusion_row("train", miss="mask", fused=0, worst=2e-7),
            fusion_row(worst=3e-3, program={"layout": "bank", "dtype": "bfloat16",
                                            "sites": [{"n": 1, "miss": None}]},
                       describe="bank bf16")]
    text, ok = fuzz_long.summarize_fusion([write(tmp_path, rows, "fusion_1.jsonl")])
    assert ok, text
    assert "programs: 3 (eval) / 2 (train); distinct: 3" in text
    assert "sites: 3 (2 exact, 1 near misses); in passing eval programs 2 fused, 1 left alone" \
        in text, text
    assert "eval float32 1e-07, eval bfloat16 0.003, train float32 2e-07" in text
    text, ok = fuzz_long.summarize_fusion(
        [write(tmp_path, [*rows, fusion_row(outcome="mismatch", error="differs")])])
    assert not ok and "MISMATCH (eval): tnh float32 | n=2 MISS=None: differs" in text
    assert fuzz_long.summarize_fusion([write(tmp_path, [])]) == ("no examples logged", False)
