#!/usr/bin/env bash
# CI's compatibility jobs: the main job and the version-sensitive tests on a torch other
# than constraints.txt's 2.14.0, in a venv of its own (.venv-compat/torch-VERSION, pins in
# tools/constraints-torch-VERSION.txt):
#   2.11: torch 2.11.0 + triton 3.6.0, the GPU image's versions (the oldest torch accepted);
#   2.15: torch 2.15.0 + triton 3.9.0, the newest release (the newest torch accepted).
# The tests are those whose subject moves with torch and triton most: the goldens (the
# rewritten graphs, with their taps' values), the ops (their registration, the C kernel, the
# Triton kernel under that triton's interpreter), autograd, the depyf dump and the FP8 quant
# fusion (its recogniser reads the shapes torch traces a quant into). vLLM 0.33.0 and 0.34.0
# both pin torch 2.14.0, so the vLLM tests run on constraints.txt's torch only.
#
#   bash tools/compat.sh VERSION          set up, then check
#   bash tools/compat.sh VERSION setup    only the venv (.ci/run runs it beside a pip install)
#   bash tools/compat.sh VERSION check    the main job and the tests, side by side (.ci/run
#                                         runs it beside a pip install): the main job is one
#                                         process, the tests use -n auto
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-}
what=${2:-all}
pins=tools/constraints-torch-$version.txt
if [[ -z $version || ! -f $pins ]]; then
    echo "tools/compat.sh: no pins for torch '$version' (tools/constraints-torch-VERSION.txt);" \
         "give 2.11 or 2.15: bash tools/compat.sh 2.15 [setup|check]" >&2
    exit 2
fi
if [[ $what != all && $what != setup && $what != check ]]; then
    echo "tools/compat.sh: unknown step '$what': give setup, check or nothing (both)" >&2
    exit 2
fi
venv=.venv-compat/torch-$version
start=$(date +%s)
if [[ $what == all || $what == setup ]]; then
    python3 -m venv "$venv"
    # The pins as PIP_CONSTRAINT, not -c: it replaces a constraint file named in pip's
    # configuration (this project's machines cap torch at 2.14.1 there), so the pins alone
    # decide, as on a machine without one.
    PIP_CONSTRAINT=$pins "$venv/bin/pip" install -q --no-compile -e '.[test]'
    # Byte-compiled on every core: where PYTHONDONTWRITEBYTECODE is set (CI's machine sets
    # it) each process of the job would compile torch's sources again (docs/testing.md,
    # "Bytecode", has the costs).
    # compileall exits 1 where a package ships a file for another Python; that file is
    # never imported, and what it printed goes nowhere.
    "$venv/bin/python" -m compileall -q -j 0 "$("$venv/bin/python" -c \
        'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
    echo "compat set-up (torch $version) wall time: $(( $(date +%s) - start )) s"
fi
if [[ $what == all || $what == check ]]; then
    if [[ ! -x $venv/bin/python ]]; then
        echo "tools/compat.sh: $venv is missing: run bash tools/compat.sh $version setup" >&2
        exit 2
    fi
    log=$(mktemp)
    "$venv/bin/python" -m kimi_passes > "$log" 2>&1 &
    main_job=$!
    tests_rc=0
    "$venv/bin/python" -m pytest -q -n auto \
        tests/test_goldens.py tests/test_ops.py tests/test_cpu_native.py \
        tests/test_ops_triton.py tests/test_ops_autograd.py tests/test_debug.py \
        tests/test_quant_fusion.py || tests_rc=$?
    main_rc=0
    wait "$main_job" || main_rc=$?
    echo "--- main job (torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')," \
         "exit $main_rc):"
    cat "$log"
    rm -f "$log"
    echo "compat job (torch $version) wall time: $(( $(date +%s) - start )) s"
    (( tests_rc == 0 && main_rc == 0 )) || exit 1
fi
