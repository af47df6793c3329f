#!/usr/bin/env bash
# Install vLLM 0.33.0 into .venv as its users install it: with its declared dependencies,
# on the torch it pins (2.14.0, which constraints.txt also pins). Every version comes from
# constraints.txt (pip freeze of that environment). vLLM's CUDA extensions do not load on a
# CPU-only machine (vLLM only warns); its compile pipeline, which the tests drive, does.
# Run after the README's set-up command; about 9.4 GB of venv in all (README). --no-compile:
# Python compiles the modules it imports when it imports them, not all of vLLM's up front.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
.venv/bin/pip install -q --no-compile -c constraints.txt vllm==0.33.0
.venv/bin/python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vLLM install wall time: $(( $(date +%s) - start )) s"
