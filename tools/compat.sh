#!/usr/bin/env bash
# CI's compatibility job: torch 2.11.0 + triton 3.6.0 (the GPU image's versions), in a venv
# of its own (.venv-compat, pins in tools/constraints-torch-2.11.txt). Runs the main job
# and the tests whose subject moves with torch and triton most: the goldens (the rewritten
# graphs, with their taps' values), the ops (the Triton kernel under triton 3.6's
# interpreter), autograd and the depyf dump. vLLM 0.33.0 requires torch 2.14, so its tests
# are the main job's. The rest of the suite (refusals, fusion, lowering, taps, ...) ran on
# 2.11 by hand (README); it does not fit in CI's 20 minutes beside the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
python3 -m venv .venv-compat
.venv-compat/bin/pip install -q --no-compile -c tools/constraints-torch-2.11.txt -e '.[test]'
echo "compat set-up wall time: $(( $(date +%s) - start )) s"
.venv-compat/bin/python -m kimi_passes
.venv-compat/bin/python -m pytest -q -n auto \
    tests/test_goldens.py tests/test_ops.py tests/test_ops_triton.py tests/test_ops_autograd.py \
    tests/test_debug.py
echo "compat job wall time: $(( $(date +%s) - start )) s"
