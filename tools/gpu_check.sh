#!/usr/bin/env bash
# One-command GPU check for a session lent a GPU (an H200): run it as
#
#     bash tools/gpu_check.sh
#
# from the repository root (any cwd works). No network is used: nothing is pip-installed.
# The machine is expected to have torch (2.11+) and triton (3.6+) preinstalled; pytest is
# used when present. Results (JSON + text + a log) go to $OUT when set (the device runner
# sets it), else ./gpu_results. Total budget ~7.5 minutes (GPU_CHECK_BUDGET seconds), every
# step under `timeout`; later steps shrink or are skipped when time runs short.
#
# Steps:
#   1. versions, nvidia-smi, where kimi_passes imports from
#   2. CUDA tests: pytest tests -k cuda (tests/test_cuda.py: the op on CUDA = Triton dispatch
#      vs the reference for fp32/bf16/fp16 with its in-place effects, opcheck on CUDA, the
#      tiny K3 compiled with kimi_backend on CUDA with taps vs ground truth)
#   3. op benchmark on CUDA at the headline shape (T=8192, H=7168, 8 blocks, bf16; read and
#      full variants): roofline ratio (target >= 0.9 of a same-bytes device copy), the
#      Triton path, eager and torch.compile baselines, vLLM 0.33.0's K3 Triton kernel
#      (vendored: tools/vllm_k3_attn_res.py; checked against the reference first; target
#      t(vLLM) / t(op) >= 1.0, here and at every T of step 5), the PyPI peers flash-attn-res /
#      fast-attnres when installed
#   2b. tools/kernel_build.py --ci with this machine's triton (the CI runs the pinned one):
#      registers, stack, programs and bytes in flight per SM for sm_90 and sm_100
#   4. CUDA graphs: the tiny K3 compiled with kimi_backend under mode="reduce-overhead"
#      (Inductor's CUDA graphs), replayed 5 times with new
#      inputs of one shape, taps vs the ground truth, no cudagraph skips
#      (tests/test_cuda.py::test_k3_tiny_cuda_graphs_replay_with_new_inputs)
#   5. decode-regime sweep: T = 1, 8, 64, 256 at H=7168 nb=8 bf16, the full variant, against
#      the compiled plain-torch statement, vLLM's K3 kernel and the copy roofline; the op
#      takes the decode path (ops/triton_decode.py) up to T=64 and is timed beside the row
#      kernel forced at the same T (`triton-row`, "op x row-route"): the switch point's check
#   5b. whole compiled steps on CUDA: the reference K3 (L=8, H=512) at T = 1, 8, 64 under
#      kimi_backend against plain Inductor (python -m kimi_passes bench decode --device cuda)
#   5c. vLLM's own K3 forward (its installed NVIDIA code, tests/vllm_k3_harness.py's
#      stand-ins for attention and MoE) at H=7168, 6 layers, T = 1, 8, 256, bf16: vLLM's
#      attn_res (Triton; torch.ops._C.kimi_k3_attn_res where vLLM takes it) with
#      VLLM_KIMI_K3_AUX_ATTN_RES_STREAM off, on, on compiled by Inductor, against the kimi
#      pass (the plugin's route, kimi_backend): aux error vs vLLM's flag-on output and time;
#      first, vLLM's attn_res left unrouted under kimi_backend: refused (AuxCaptureError)
#      in the attn_res stream, runs in the prefix stream (Dynamo's real trace of the launch)
#      (tools/vllm_k3_gpu.py; skipped, with the reason printed, where vLLM is not installed)
#   5d. AttnRes + per-token FP8 quant: one compiled site (H=7168 nb=8 bf16) at T = 1, 8, 64,
#      1024, fused (attn_res_quant, one kernel) against the unfused pair (attn_res, then
#      Inductor's quant kernel), same bytes checked (bench --only quant; the CUDA tests of
#      step 2 include tests/test_quant_fusion.py's bytes check on CUDA)
#   6. (if time is left) the tap section on CUDA with a small K3
#   7. (if time is left) peers at a power-of-two width (flash-attn-res needs one) and fp32
#
# The kernel's registers, spills and occupancy need no GPU (step 2b runs the same tool that
# CI runs): python tools/kernel_build.py (BENCHMARKS.md, "Offline kernel build").
#
# Importing without installing: the repository root on PYTHONPATH (and as the cwd) is enough;
# kimi_passes maps ops/ and graphs/ of its own checkout (kimi_passes/layout.py).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RESULTS="${OUT:-$REPO/gpu_results}"
mkdir -p "$RESULTS"
RESULTS="$(cd "$RESULTS" && pwd)"
BUDGET="${GPU_CHECK_BUDGET:-450}"
PY="${PYTHON:-$(command -v python || command -v python3)}"
exec > >(tee -a "$RESULTS/gpu_check.log") 2>&1

START=$SECONDS
STATUS=()

# The CPU tests' conftest sets TRITON_INTERPRET=1 unless it is set; on the GPU every Triton
# kernel (ours and Inductor's) must be compiled. The kimi kernel picks its mode per device
# whatever this says; Inductor's kernels follow it.
export TRITON_INTERPRET=0
export PYTHONUNBUFFERED=1

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
cd "$REPO" || exit 1

left() { echo $((BUDGET - (SECONDS - START))); }

# step NAME LIMIT CMD...: run CMD under timeout min(LIMIT, time left - 15s).
step() {
    local name="$1" limit="$2"
    shift 2
    local remaining=$(($(left) - 15))
    if ((remaining < 30)); then
        echo "=== $name: SKIPPED (only $(left)s of the budget left) ==="
        STATUS+=("$name: skipped (budget)")
        return 0
    fi
    ((limit > remaining)) && limit=$remaining
    echo
    echo "=== $name (timeout ${limit}s, $(left)s of the budget left) ==="
    local t0=$SECONDS
    # timeout runs programs, not shell functions: a child bash gets the exported ones.
    timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@"
    local rc=$?
    local how="rc=$rc"
    ((rc == 124 || rc == 137)) && how="TIMED OUT after ${limit}s"
    echo "=== $name: $how in $((SECONDS - t0))s ==="
    STATUS+=("$name: $how ($((SECONDS - t0))s)")
    return 0
}

info() {
    date -u
    nvidia-smi || echo "nvidia-smi not found"
    "$PY" - <<'EOF'
import importlib, platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
for mod in ("triton", "pytest", "matplotlib", "flash_attn_res", "attnres", "kimi_passes"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod:>15}: {getattr(m, '__version__', '?')} at {getattr(m, '__file__', '?')}")
    except Exception as e:  # noqa: BLE001
        print(f"{mod:>15}: not importable ({type(e).__name__}: {e})")
import kimi_passes.ops, kimi_passes.graphs  # noqa: E401  both from this checkout
print("kimi_passes.ops at", kimi_passes.ops.__file__)
print("kimi ops:", [n for n in dir(torch.ops.kimi) if not n.startswith("_")][:8])
EOF
}

tests() {
    if ! "$PY" -c "import pytest" 2>/dev/null; then
        echo "pytest is not installed here: CUDA tests not run (the op benchmark below"
        echo "still checks each candidate against the fp32 reference)"
        return 3
    fi
    "$PY" -m pytest "$REPO/tests" -k "${1:-cuda}" -q -rs -p no:cacheprovider \
        --rootdir "$REPO" --continue-on-collection-errors \
        --junitxml "$RESULTS/tests_${2:-cuda}.xml"
}

bench() {
    "$PY" -m kimi_passes bench --device cuda "$@"
}

export REPO RESULTS PY
export -f info tests bench

step "info" 60 info
step "cuda tests" 180 tests "cuda and not cuda_graphs" cuda
step "offline kernel build with this machine's triton: sm_90/sm_100, no spills (CI subset)" 60 \
    "$PY" "$REPO/tools/kernel_build.py" --ci --jobs 8 --json "$RESULTS/kernel_build.json"
step "op bench: the headline shape T=8192 H=7168 nb=8 bf16 (target roof >= 0.9)" 150 \
    bench --only op --T 8192 --H 7168 --blocks 8 --dtypes bfloat16 --variants read full \
    --out "$RESULTS/op_headline.json" --text "$RESULTS/op_headline.txt"
step "cuda graphs: tiny K3, kimi_backend, mode=reduce-overhead, 5 replays, taps vs truth" 90 \
    tests cuda_graphs cuda_graphs
step "op bench: decode sweep T=1,8,64,256 H=7168 nb=8 bf16 (full) vs row route, compiled, vLLM" 100 \
    bench --only op --T 1 8 64 256 --H 7168 --blocks 8 --dtypes bfloat16 --variants full \
    --out "$RESULTS/op_decode.json" --text "$RESULTS/op_decode.txt"
step "whole K3 step on CUDA, T=1,8,64: kimi_backend vs plain Inductor" 120 \
    bash -c '"$PY" -m kimi_passes bench decode --device cuda --models k3 --T 1 8 64 \
        --rounds 7 --block-ms 20 | tee "$RESULTS/decode_cuda.txt"'
step "vLLM K3 forward: vLLM's attn_res flag off / on / on compiled vs the kimi pass" 120 \
    "$PY" "$REPO/tools/vllm_k3_gpu.py" --T 1 8 256 --json "$RESULTS/vllm_k3.json"
step "quant bench: AttnRes + FP8 quant fused vs the unfused pair, T=1,8,64,1024 H=7168" 90 \
    bench --only quant --quant-T 1 8 64 1024 --quant-H 7168 --quant-blocks 8 \
    --out "$RESULTS/quant.json" --text "$RESULTS/quant.txt"
step "tap bench (small K3 on CUDA)" 100 \
    bench --only tap --quick --out "$RESULTS/tap.json" --text "$RESULTS/tap.txt"
step "op bench: peers at H=4096 (flash-attn-res needs a power of 2) and fp32" 80 \
    bench --only op --T 8192 --H 4096 7168 --blocks 8 --dtypes bfloat16 float32 \
    --variants read --no-compiled --out "$RESULTS/op_peers.json" --text "$RESULTS/op_peers.txt"

echo
echo "=== summary ($((SECONDS - START))s) ==="
for s in "${STATUS[@]}"; do echo "  $s"; done
grep -h -E "^ +(MET|MISS) " "$RESULTS"/*.txt 2>/dev/null | sort -u
[ -f "$RESULTS/op_decode.txt" ] && { echo "--- decode sweep ---"; cat "$RESULTS/op_decode.txt"; }
[ -f "$RESULTS/decode_cuda.txt" ] && { echo "--- whole K3 step ---"; cat "$RESULTS/decode_cuda.txt"; }
[ -f "$RESULTS/quant.txt" ] && { echo "--- AttnRes + FP8 quant ---"; grep -A8 "== quant" "$RESULTS/quant.txt"; }
{
    for s in "${STATUS[@]}"; do echo "$s"; done
    grep -h -E "^ +(MET|MISS) " "$RESULTS"/*.txt 2>/dev/null | sort -u
} > "$RESULTS/summary.txt"
echo "results in $RESULTS"
for s in "${STATUS[@]}"; do
    case "$s" in *"rc=0"*|*"skipped"*) ;; *) exit 1 ;; esac
done
exit 0
