#!/usr/bin/env bash
# Prepare, on the CPU machine, the folder a GPU check carries: .gpu_carry/ (git-ignored).
# What it holds and how: tools/gpu/prepare.py. Run after .ci/run made .venv; then
# bash tools/gpu_check.sh on the GPU (docs/testing.md, "On a GPU").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
[[ -x $PYTHON ]] || { echo "gpu_prepare: no $PYTHON: run .ci/run first (it makes .venv), or set PYTHON" >&2; exit 1; }
exec "$PYTHON" -m tools.gpu prepare "$@"
