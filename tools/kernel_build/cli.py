"""``python -m tools.kernel_build``: build, print the tables, exit 1 on a spill."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from . import __doc__ as PACKAGE_DOC
from .hip import HIP_ARCHS, hip_summary, peer_table, run_hip
from .nvidia import run
from .tables import decode_static, decode_table, summary, table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.kernel_build",
                                 description=(PACKAGE_DOC or "").split("\n\n")[0])
    ap.add_argument("--target", default="nvidia", choices=("nvidia", *HIP_ARCHS),
                    help="nvidia: sm_90 and sm_100 (the default); or an AMD arch")
    ap.add_argument("--vllm-peer", action="store_true",
                    help="with an AMD --target: also build vLLM's AMD K3 kernel (needs vLLM "
                         "or bash tools/gpu_prepare.sh's copy)")
    ap.add_argument("--ci", action="store_true", help="the CI subset of variants")
    ap.add_argument("--only", help="build only the variants whose name contains this "
                                   "(e.g. quant)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--from-json", type=Path, help="print the tables of an earlier --json")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    if a.target != "nvidia":
        results = (json.loads(a.from_json.read_text()) if a.from_json
                   else run_hip(a.ci, a.jobs, a.target, a.only))
        print(hip_summary(results))
        spills = [r for r in results if r["spills"] or r["threads"] > 1024]
        print(f"{len(results)} {a.target} builds in {time.perf_counter() - t0:.0f} s; "
              f"{len(spills)} with scratch, a spill or over 1024 threads")
        for r in spills:
            print("  ", r)
        if a.vllm_peer:
            print()
            print(peer_table(a.target))
        if a.json:
            a.json.write_text(json.dumps(results, indent=1))
        return 1 if spills else 0
    results = json.loads(a.from_json.read_text()) if a.from_json else run(a.ci, a.jobs, a.only)
    print(table(results))
    print()
    print(summary(results))
    if any(r["variant"] == "dec-stats:delta+write" and r["H"] == 7168 and r["sm"] == 90
           and r["dtype"] == "bfloat16" for r in results):
        print()
        print("decode sizes, K3 (H = 7168, 8 blocks, bf16), sm_90 builds, an H200's 132 SMs:")
        print(decode_table(decode_static(results)))
    spills = [r for r in results if r["spills"]]
    took = "read back" if a.from_json else f"in {time.perf_counter() - t0:.0f} s"
    print(f"{len(results)} builds {took}; {len(spills)} spill")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 1 if spills else 0
