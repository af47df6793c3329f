"""The GPU check's first step: can this machine run it? (``python -m tools.gpu info``.)

Prints the versions, the device, the C compiler and Python headers Triton builds its
launchers with, where kimi_passes imports from and what was prepared (.gpu_carry), and
exits 1, each problem named with what to do, when the check cannot run here: no CUDA
device (``--dry-run``: not required), no C compiler or ``Python.h``, torch < 2.11 or
triton < 3.6, kimi_passes not importable from this checkout. ``--json FILE``: the facts
and problems as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TORCH_FLOOR, TRITON_FLOOR = (2, 11), (3, 6)


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:2])


def main(argv: list[str] | None = None) -> int:
    """The machine: versions, CUDA, the C compiler Triton builds its launchers with; exit 1,
    each problem named with what to do, when the check cannot run here."""
    ap = argparse.ArgumentParser(prog="python -m tools.gpu info",
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CUDA not required")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # as the check's steps have it (PYTHONPATH)
    facts: dict = {"python": sys.version.split()[0], "executable": sys.executable}
    problems: list[str] = []
    for name, floor in (("torch", TORCH_FLOOR), ("triton", TRITON_FLOOR)):
        try:
            facts[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001  (reported as the problem it is)
            problems.append(f"{name} does not import ({type(e).__name__}: {e}): install "
                            f"{name} >= {'.'.join(map(str, floor))}")
            continue
        if _version(facts[name]) < floor:
            problems.append(f"{name} {facts[name]} is below the floor "
                            f"{'.'.join(map(str, floor))}: use an image with torch >= 2.11 "
                            "and triton >= 3.6")
    if "torch" in facts:
        problems += _cuda_facts(facts, a.dry_run)
    problems += _compiler_facts(facts)
    problems += _import_facts(facts)
    for k, v in facts.items():
        print(f"{k:>16}: {v}")
    for p in problems:
        print(f"info: {p}")
    if a.json:
        a.json.write_text(json.dumps({"facts": facts, "problems": problems}, indent=1))
    return 1 if problems else 0


def _cuda_facts(facts: dict, dry: bool) -> list[str]:
    import torch

    facts["torch_cuda"] = torch.version.cuda or torch.version.hip
    if not torch.cuda.is_available():
        if dry:
            facts["device"] = "cpu (dry run: CUDA not required; the steps run on CPU)"
            return []
        return ["torch.cuda.is_available() is False: no CUDA device or driver here; every "
                "CUDA test would skip and every figure be missing. Run on the lent GPU "
                "(bash tools/gpu_check.sh), or --dry-run here"]
    facts["device"] = (f"{torch.cuda.get_device_name(0)}, capability "
                       f"{torch.cuda.get_device_capability(0)}, {torch.cuda.device_count()} "
                       "device(s)")
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            r = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                "--format=csv,noheader"], capture_output=True, text=True,
                               timeout=5)
            facts["nvidia-smi"] = r.stdout.strip() or r.stderr.strip()
        except subprocess.TimeoutExpired:  # a fact, not a reason to stop
            facts["nvidia-smi"] = "no answer within 5 s"
    return []


def _compiler_facts(facts: dict) -> list[str]:
    """Triton builds its launcher with a C compiler ($CC, else gcc or clang) against
    Python's headers; Inductor's CPU code needs the same compiler."""
    import sysconfig

    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    facts["cc"] = cc or "none"
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    facts["Python.h"] = str(header) if header.exists() else "missing"
    problems = []
    if not cc:
        problems.append("no C compiler (gcc or clang on PATH, or $CC): Triton cannot build "
                        "its launcher; install gcc or set CC")
    if not header.exists():
        problems.append(f"{header} is missing: Triton's launcher needs Python's headers; "
                        "install the python3-dev package of this Python")
    return problems


def _import_facts(facts: dict) -> list[str]:
    import importlib.util

    try:
        import kimi_passes
    except Exception as e:  # noqa: BLE001  (reported as the problem it is)
        return [f"kimi_passes does not import ({type(e).__name__}: {e}): run from the "
                "repository root, with .gpu_carry/site on PYTHONPATH (bash tools/gpu_check.sh "
                "sets it; bash tools/gpu_prepare.sh writes it)"]
    facts["kimi_passes"] = str(Path(kimi_passes.__file__).parent)
    for mod in ("pytest", "vllm", "depyf", "expecttest"):
        spec = importlib.util.find_spec(mod)
        facts[mod] = spec.origin if spec is not None else "not installed"
    carry = ROOT / ".gpu_carry" / "MANIFEST.json"
    facts["prepared"] = (str(carry) if carry.exists()
                         else "no .gpu_carry (bash tools/gpu_prepare.sh; the device tool's carry)")
    facts["vllm_peer"] = os.environ.get("KIMI_PASSES_VLLM_PEER", "unset")
    problems = []
    if Path(kimi_passes.__file__).resolve().parent != ROOT / "kimi_passes":
        problems.append(f"kimi_passes imports from {facts['kimi_passes']}, not this checkout "
                        f"({ROOT}): run from the repository root")
    return problems
