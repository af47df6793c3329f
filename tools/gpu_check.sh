#!/usr/bin/env bash
# The GPU check: every CUDA figure of kimi_passes from one device call of under
# ~330 s. Prepare here, then check there, from the repository root:
#
#     bash tools/gpu_prepare.sh      # on the CPU machine: writes .gpu_carry/ (git-ignored)
#     bash tools/gpu_check.sh        # on the GPU, the device call carrying .gpu_carry
#     bash tools/gpu_check.sh --dry-run   # the same control flow here, on CPU (< 5 minutes)
#
# The steps, their caps and the files under $OUT: tools/gpu_check.py (its --help), and
# docs/testing.md, "On a GPU". This entry only sets the environment the prepared folder
# needs: its pure-Python packages on PYTHONPATH (the GPU image lacks them) and the copy of
# vLLM's K3 kernel as the op bench's peer (kimi_passes/vllm/peer.py).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
CARRY="$REPO/.gpu_carry"
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if [[ -d "$CARRY/site" ]]; then
    PYTHONPATH="$PYTHONPATH:$CARRY/site"  # only packages the image lacks (no torch, triton)
fi
export PYTHONPATH
if [[ -d "$CARRY/vllm_k3" && -z "${KIMI_PASSES_VLLM_PEER:-}" ]]; then
    export KIMI_PASSES_VLLM_PEER="$CARRY/vllm_k3"
fi
PY="${PYTHON:-$(command -v python || command -v python3)}"  # the image's, with torch
if [[ -z "${PYTHON:-}" && " $* " == *" --dry-run "* && -x "$REPO/.venv/bin/python" ]]; then
    PY="$REPO/.venv/bin/python"  # here: the venv .ci/run and the README's set-up make
fi
exec "$PY" "$REPO/tools/gpu_check.py" "$@"
