#!/usr/bin/env bash
# CI's compatibility job: torch 2.11.0 + triton 3.6.0 (the GPU image's versions), in a venv
# of its own (.venv-compat, pins in tools/constraints-torch-2.11.txt). Runs the main job
# and the tests whose subject moves with torch and triton most: the goldens (the rewritten
# graphs, with their taps' values), the ops (their registration, the C kernel, the Triton
# kernel under triton 3.6's interpreter), autograd, the depyf dump and the FP8 quant fusion
# (its recogniser reads the shapes torch traces a quant into). vLLM 0.33.0 requires torch 2.14, so its tests
# are the main job's. The rest of the suite (refusals, fusion, lowering, taps, ...) ran on
# 2.11 by hand (docs/testing.md, "Torch versions"); it does not fit in CI's 20 minutes beside the main job.
#
#   bash tools/compat.sh          set up, then check
#   bash tools/compat.sh setup    only the venv (.ci/run runs it beside README command 1)
#   bash tools/compat.sh check    the main job and the tests, side by side (.ci/run runs it
#                                 beside the vLLM install): the main job is
#                                 one process, the tests use -n auto
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
start=$(date +%s)
if [[ $what == all || $what == setup ]]; then
    python3 -m venv .venv-compat
    .venv-compat/bin/pip install -q --no-compile -c tools/constraints-torch-2.11.txt -e '.[test]'
    # Byte-compiled on every core: where PYTHONDONTWRITEBYTECODE is set (CI's machine sets
    # it) each process of the job would compile torch's sources again (docs/testing.md,
    # "Bytecode", has the costs).
    # compileall exits 1 where a package ships a file for another Python; that file is
    # never imported, and what it printed goes nowhere.
    .venv-compat/bin/python -m compileall -q -j 0 "$(.venv-compat/bin/python -c \
        'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
    echo "compat set-up wall time: $(( $(date +%s) - start )) s"
fi
if [[ $what == all || $what == check ]]; then
    log=$(mktemp)
    .venv-compat/bin/python -m kimi_passes > "$log" 2>&1 &
    main_job=$!
    tests_rc=0
    .venv-compat/bin/python -m pytest -q -n auto \
        tests/test_goldens.py tests/test_ops.py tests/test_cpu_native.py \
        tests/test_ops_triton.py tests/test_ops_autograd.py tests/test_debug.py \
        tests/test_quant_fusion.py || tests_rc=$?
    main_rc=0
    wait "$main_job" || main_rc=$?
    echo "--- main job (torch 2.11.0), exit $main_rc:"
    cat "$log"
    rm -f "$log"
    echo "compat job wall time: $(( $(date +%s) - start )) s"
    (( tests_rc == 0 && main_rc == 0 )) || exit 1
fi
