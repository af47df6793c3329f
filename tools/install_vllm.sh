#!/usr/bin/env bash
# Install vLLM VERSION (0.34.0, the default, or 0.33.0) into .venv as its users install it:
# its declared requirements, on the torch it pins (both pin 2.14.0, as constraints.txt
# does), every version from tools/constraints-vllm-VERSION.txt (pip freeze of that
# environment). Run after the README's set-up; on a .venv with the other version it swaps
# them, installing only what the two pin differently (transformers, flashinfer-python, vLLM).
# vLLM's CUDA extensions do not load on a CPU-only machine; its compile pipeline, which the
# tests drive, does.
#
# pip cannot replace one pin of a package, so vLLM's Requires-Dist is read from the
# registry, its markers evaluated, and that list installed with -r, then vLLM with
# --no-deps (tools/vllm_requires.py). Where the registry lacks a version vLLM pins
# (flashinfer-python 0.7.3 for 0.34.0) the nearest available is installed instead and the
# output says so; `pip check` then holds everything else to vLLM's declared requirements.
#
# --no-compile, then the check below imports what a process of the tests imports (vLLM's
# config and compile path; the CUTLASS DSL that torch's Inductor imports, on a process's
# first compile, where vLLM's dependencies are installed) with bytecode writing on: where
# PYTHONDONTWRITEBYTECODE is set (CI's machine sets it) no process would write it, and each
# would compile those sources again. Importing that path once costs a fraction of
# byte-compiling all 22,000 modules the install brings (the costs: docs/testing.md, "Bytecode").
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-0.34.0}
pins=tools/constraints-vllm-$version.txt
if [[ ! -f $pins ]]; then
    echo "tools/install_vllm.sh: no pins for vLLM '$version' ($pins): give 0.34.0 or 0.33.0" >&2
    exit 2
fi
if [[ ! -x .venv/bin/python ]]; then
    echo "tools/install_vllm.sh: no .venv here: run the README's set-up command first" >&2
    exit 2
fi
start=$(date +%s)
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
.venv/bin/python -m tools.vllm_requires requirements "$version" "$reqs"
# A swap: the other vLLM goes first, so that no step between sees one vLLM with the other's
# requirements (pip would report that as a conflict, and pip check below holds the end).
have=$(.venv/bin/python -c "
import importlib.metadata as m
try:
    print(m.version('vllm'))
except m.PackageNotFoundError:
    pass")
if [[ -n $have && $have != "$version" ]]; then
    echo "swapping vLLM $have for $version"
    .venv/bin/pip uninstall -q -y vllm
fi
.venv/bin/pip install -q --no-compile -c "$pins" -r "$reqs"
.venv/bin/pip install -q --no-compile --no-deps -c "$pins" "vllm==$version"
.venv/bin/python -m tools.vllm_requires check "$version"
env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -c "
import torch, vllm, vllm.config, vllm.compilation.backends, vllm.compilation.decorators
from torch._inductor.codegen.common import init_backend_registration
init_backend_registration()
print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vLLM $version install wall time: $(( $(date +%s) - start )) s"
