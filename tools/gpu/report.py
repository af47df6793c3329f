"""What the GPU check writes: summary.txt, the JUnit suites, BENCHMARKS.md's CUDA tables.

``summary(doc)`` turns results.json's document into the text summary (the steps, their
reasons, MISS then MET rows, failed tests, other rows, what a dry run faked).
``emit(row)`` prints a step's MET / MISS row as the runner reads it, ``skip(why)`` its
skip. ``junit_suites``
gives a step's JUnit suites: pytest's file per shard, or one made from the ``-v`` lines
where pytest was killed before writing it. ``fill_benchmarks(doc)``
prints BENCHMARKS.md's four CUDA tables from a results.json
(``python -m tools.gpu fill-benchmarks results.json``).
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

BAD_TESTS = ("FAILED", "ERROR", "TIMEOUT", "UNFINISHED")

def emit(row: dict) -> dict:
    """A step's row (``kimi_passes.bench.harness.verdict``'s record) printed as one line the
    runner reads: MET or MISS first, the candidate, T, error against tolerance, time, the
    ratio and a MISS's reason. Returns ``row``."""
    err = "-" if row.get("err") is None else f"{row['err']:.3g}"
    line = (f"{row['verdict']:>4} {row['candidate']} T={row['T']}: error {err} "
            f"(tolerance {row['tol']:.3g})")
    if row.get("time") is not None:
        line += f", {row['time'] * 1e6:.1f} us"
    if row.get("ratio") is not None:
        line += f", ratio {row['ratio']:.2f}"
    print(line + (f": {row['reason']}" if row.get("reason") else ""), flush=True)
    return row


def skip(why: str, json_path: str | None = None) -> int:
    """A step's skip as the runner reads one: ``{"skip": why}`` printed (and written to the
    step's JSON file, where it has one). Returns the skip's exit status, 3."""
    line = json.dumps({"skip": why})
    print(line, flush=True)
    if json_path:
        Path(json_path).write_text(line)
    return 3


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
           if t["status"] in BAD_TESTS]
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
    out += ["", "| CUDA tests (-v, marked gpu_check) | status | passed | failed | skipped | "
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


def junit_suites(name: str, shards: int, work: Path, tests: list[dict], status: str) -> list:
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
        if t["status"] in BAD_TESTS:
            ET.SubElement(case, "failure", message=t["status"])
        elif t["status"] in ("SKIPPED", "XFAIL"):
            ET.SubElement(case, "skipped")
    return ET.tostring(suite, encoding="unicode")


