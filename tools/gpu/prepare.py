"""Prepare, on the CPU machine, the one folder a GPU check carries: ``.gpu_carry/``.

- ``vllm_k3/``: vLLM's K3 AttnRes kernel files copied from the installed vLLM, byte for
  byte, with a MANIFEST.json (``kimi_passes.vllm.peer`` loads them through
  ``$KIMI_PASSES_VLLM_PEER``); checked: a tiny call under the interpreter within 1e-5
  of the reference.
- ``site/``: the pure-Python packages the GPU image lacks (``tools/gpu/carry.txt``,
  pinned), for its Python 3.12. pip does the work: ``pip download --no-deps`` of the
  pinned list, then ``pip install --target`` from that wheel folder alone, which resolves
  their requirements there and fails, naming it, on one the list lacks.
- ``MANIFEST.json``: what was prepared, when, and the sizes (at most 16 MiB).

Run after .ci/run (or the README's set-up and ``bash tools/install_vllm.sh``) made .venv:
``bash tools/gpu_prepare.sh`` (``.venv/bin/python -m tools.gpu prepare``).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CARRY = ROOT / ".gpu_carry"
PINNED = Path(__file__).resolve().with_name("carry.txt")
IMAGE_PYTHON = "3.12"  # the GPU image's Python
NEVER = ("torch", "triton", "numpy")  # the image's own: a wheel of these must not shadow them
LIMIT_MIB = 16  # the device call carries at most 64 MiB with the tree


class PrepareError(RuntimeError):
    """A prepare step failed; the message names the fix."""


def _run(argv: list[str], fix: str, **env: str) -> None:
    r = subprocess.run(argv, cwd=ROOT, env=dict(os.environ, **env))
    if r.returncode != 0:
        raise PrepareError(f"{' '.join(argv[:4])} ... exited {r.returncode} (above): {fix}")


def peer_copy(dest: Path) -> None:
    """vLLM's kernel files, copied from the installed vLLM, then loaded from the copy."""
    py = sys.executable
    _run([py, "-m", "kimi_passes.vllm.peer", "prepare", str(dest)],
         "bash tools/install_vllm.sh installs vLLM (0.34.0; 0.33.0 by its argument)")
    _run([py, "-m", "kimi_passes.vllm.peer", "verify", str(dest)],
         "reinstall vLLM (bash tools/install_vllm.sh) and prepare again",
         TRITON_INTERPRET="1")


def site(dest: Path, wheels: Path) -> list[Path]:
    """The pinned pure-Python wheels, downloaded and installed into ``dest`` by pip."""
    pip = [sys.executable, "-m", "pip"]
    image = ["--only-binary=:all:", "--python-version", IMAGE_PYTHON]
    _run([*pip, "download", "-q", "--no-deps", *image, "-c", "constraints.txt", "-r",
          str(PINNED), "-d", str(wheels)],
         f"needs PyPI (network) and wheels at {PINNED.name}'s versions for Python "
         f"{IMAGE_PYTHON}; keep {PINNED.name} and constraints.txt in agreement")
    found = sorted(wheels.glob("*.whl"))
    for w in found:
        name, *_, abi, platform = w.stem.split("-")
        if abi != "none" or platform != "any":
            raise PrepareError(f"{w.name} is not pure Python (none-any): drop it from "
                               f"{PINNED} or pin a pure-Python release")
        if name.lower() in NEVER:
            raise PrepareError(f"{w.name}: {', '.join(NEVER)} come from the GPU image; "
                               f"drop it from {PINNED}")
    _run([*pip, "install", "-q", "--no-index", "--find-links", str(wheels), "--no-compile",
          *image, "--target", str(dest), "-r", str(PINNED)],
         f"a requirement of a package in {PINNED.name} is missing from it: add it there")
    check = ("import sys, expecttest, depyf\n"
             "bad = [m.__file__ for m in (expecttest, depyf) if sys.argv[1] not in m.__file__]\n"
             "sys.exit(f'not from the carried site: {bad}' if bad else 0)")
    _run([sys.executable, "-c", check, str(dest)],
         f"the packages in {dest} must import from there", PYTHONPATH=str(dest))
    return found


def manifest(carry: Path, wheels: list[Path]) -> dict:
    """MANIFEST.json's content: when, which Python, the kernel copy, the wheels, sizes."""
    def size(p: Path) -> int:
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())

    doc = {"prepared": datetime.datetime.now(datetime.timezone.utc).isoformat(
               timespec="seconds"),
           "python": sys.version.split()[0], "image_python": IMAGE_PYTHON,
           "vllm_k3": json.loads((carry / "vllm_k3" / "MANIFEST.json").read_text()),
           "wheels": {w.name: hashlib.sha256(w.read_bytes()).hexdigest() for w in wheels},
           "bytes": {p.name: size(p) for p in (carry / "site", carry / "vllm_k3")}}
    doc["bytes"]["total"] = sum(doc["bytes"].values())
    return doc


def main(argv: list[str]) -> int:
    if argv:
        print(f"tools.gpu prepare takes no arguments, got {argv} (run it from the venv "
              "that has vLLM: bash tools/gpu_prepare.sh)", file=sys.stderr)
        return 2
    shutil.rmtree(CARRY, ignore_errors=True)
    (CARRY / "site").mkdir(parents=True)
    try:
        peer_copy(CARRY / "vllm_k3")
        with tempfile.TemporaryDirectory() as tmp:
            wheels = site(CARRY / "site", Path(tmp))
            doc = manifest(CARRY, wheels)
    except PrepareError as e:
        print(f"gpu prepare: {e}", file=sys.stderr)
        return 1
    (CARRY / "MANIFEST.json").write_text(json.dumps(doc, indent=1) + "\n")
    mib = doc["bytes"]["total"] / 2**20
    print(f"{CARRY}: {mib:.2f} MiB (limit {LIMIT_MIB} MiB)\n"
          f"  vllm_k3/: vLLM {doc['vllm_k3']['vllm_version']}'s "
          + ", ".join(doc["vllm_k3"]["files"]) + f" ({doc['bytes']['vllm_k3']} bytes)\n"
          f"  site/: {', '.join(doc['wheels'])} ({doc['bytes']['site']} bytes)")
    if mib >= LIMIT_MIB:
        print(f"gpu prepare: {CARRY} is {mib:.2f} MiB, over {LIMIT_MIB} MiB: carry fewer "
              f"packages ({PINNED})", file=sys.stderr)
        return 1
    return 0
