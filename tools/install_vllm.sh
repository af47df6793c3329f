#!/usr/bin/env bash
# Install vLLM 0.33.0 into .venv as its users install it: with its declared dependencies,
# on the torch it pins (2.14.0, which constraints.txt also pins). Every version comes from
# constraints.txt (pip freeze of that environment). vLLM's CUDA extensions do not load on a
# CPU-only machine (vLLM only warns); its compile pipeline, which the tests drive, does.
# Run after the README's set-up command; about 9.4 GB of venv in all (README).
# --no-compile, then the check below imports what a process of the tests imports (vLLM's
# config and compile path; the CUTLASS DSL that torch's Inductor imports, on a process's
# first compile, where vLLM's dependencies are installed) with bytecode writing on: where
# PYTHONDONTWRITEBYTECODE is set (CI's machine sets it) no process would write it, and each
# would compile those sources again. Importing that path once costs a fraction of
# byte-compiling all 22,000 modules the install brings (the costs: docs/testing.md, "Bytecode").
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
.venv/bin/pip install -q --no-compile -c constraints.txt vllm==0.33.0
env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -c "
import torch, vllm, vllm.config, vllm.compilation.backends, vllm.compilation.decorators
from torch._inductor.codegen.common import init_backend_registration
init_backend_registration()
print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vLLM install wall time: $(( $(date +%s) - start )) s"
