#!/usr/bin/env bash
# The GPU check (python -m tools.gpu check; its steps, caps and files: tools/gpu/runner.py,
# tools/gpu/steps.py), with the environment the prepared folder needs:
#
#     bash tools/gpu_prepare.sh      # on the CPU machine: writes .gpu_carry/ (git-ignored)
#     bash tools/gpu_check.sh        # on the GPU, the device call carrying .gpu_carry
#     bash tools/gpu_check.sh --dry-run   # the same control flow here, on CPU (< 5 minutes)
#
# .gpu_carry/site (pure-Python packages the image lacks) goes on PYTHONPATH and the copy of
# vLLM's K3 kernel becomes the peer (kimi_passes/vllm/peer.py, $KIMI_PASSES_VLLM_PEER).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
CARRY="$REPO/.gpu_carry"
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
[[ -d "$CARRY/site" ]] && PYTHONPATH="$PYTHONPATH:$CARRY/site"  # never torch, triton
export PYTHONPATH
if [[ -d "$CARRY/vllm_k3" && -z "${KIMI_PASSES_VLLM_PEER:-}" ]]; then
    export KIMI_PASSES_VLLM_PEER="$CARRY/vllm_k3"
fi
PY="${PYTHON:-$(command -v python || command -v python3)}"  # the image's, with torch
if [[ -z "${PYTHON:-}" && " $* " == *" --dry-run "* && -x "$REPO/.venv/bin/python" ]]; then
    PY="$REPO/.venv/bin/python"  # here: the venv .ci/run and the README's set-up make
fi
exec "$PY" -m tools.gpu check "$@"
