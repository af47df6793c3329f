#!/usr/bin/env bash
# Install vLLM 0.33.0 into .venv as its users install it: with its declared dependencies,
# on the torch it pins (2.14.0, which constraints.txt also pins). Every version comes from
# constraints.txt (pip freeze of that environment). vLLM's CUDA extensions do not load on a
# CPU-only machine (vLLM only warns); its compile pipeline, which the tests drive, does.
# Run after the README's set-up command; about 9.4 GB of venv in all (README). The modules
# are byte-compiled after the install, on every core (pip's own compile runs on one): where
# PYTHONDONTWRITEBYTECODE is set (CI's machine sets it) Python never writes the bytecode
# itself, so each process importing vLLM would compile its sources again (about 2.4 s each;
# torch's Inductor imports the CUTLASS DSL vLLM brings in every process that compiles, 1.6 s).
# compileall exits 1 where a package ships a file for another Python; that file is never
# imported, and what it printed goes nowhere.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
.venv/bin/pip install -q --no-compile -c constraints.txt vllm==0.33.0
.venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c \
    'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
.venv/bin/python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vLLM install wall time: $(( $(date +%s) - start )) s"
