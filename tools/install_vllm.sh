#!/usr/bin/env bash
# Install vLLM 0.33.0 into .venv for the vLLM tests (tests/test_vllm.py), keeping torch
# 2.13.0 CPU. vLLM's wheel declares torch==2.14.0 and CUDA packages, so it goes in with
# --no-deps, followed by its pure-Python requirements, pinned in tools/vllm-constraints.txt.
# Its CUDA extensions do not load on CPU (vLLM only warns); `pip check` then lists the
# declared-but-absent requirements, as expected. Run after the README's set-up command.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
.venv/bin/pip install -q --no-deps -r tools/vllm-constraints.txt
.venv/bin/python -c "import vllm; print('vllm', vllm.__version__)"
echo "vLLM install wall time: $(( $(date +%s) - start )) s"
