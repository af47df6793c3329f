"""Offline sm_90 / sm_100 build of the Triton kernel: no spills, enough bytes in flight.

``python -m tools.kernel_build`` compiles the kernel with Triton's bundled ptxas for Hopper and
Blackwell on this CPU machine and reads registers and stack from the cubin. Triton reads
TRITON_INTERPRET when it is imported and the test session runs interpreted (conftest), so
the builds run in other processes with TRITON_INTERPRET unset: each forked from one parent
that has imported torch, Triton and the kernels (tests/helpers/process.py), since those
imports are most of a process's time when Triton's cache serves the builds.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.process import ForkingParent

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import tools.kernel_build as kb  # noqa: E402  (tools/ is the checkout's, not installed)

#: The tool's command line in a forked child (``ForkingParent`` runs ``-c`` code or a file).
TOOL = ["-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
              "from tools.kernel_build.cli import main; sys.exit(main(sys.argv[1:]))"]


def _triton_version() -> str | None:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def _compiled_env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@pytest.fixture(scope="module")
def compiled():
    """The parent every build process of this module is forked from (compiled mode)."""
    imports = ("torch", "triton", "kimi_passes.ops.triton_kernels",
               "kimi_passes.ops.triton_backward")
    with ForkingParent(_compiled_env(), timeout=900, imports=imports) as parent:
        yield parent


@pytest.fixture(scope="module")
def compiled_run(compiled):
    """``compiled_run(code, *args)``: run ``code`` in a compiled-mode process with ``kb``
    (tools/kernel_build) and ``sys`` imported and ``args`` in ``sys.argv[1:]``; its
    last line of output."""
    preamble = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import tools.kernel_build as kb\n"

    def run(code: str, *args: str) -> str:
        return compiled.run([sys.executable, "-c", preamble + code, *args]).strip().splitlines()[-1]

    return run


@pytest.fixture(scope="module")
def ci_results(compiled, tmp_path_factory):
    """The tool's CI subset, run here in full. Triton's cache serves a build made before
    with the same source, target, options and compiler (CI builds them in a step of its
    own, .ci/run): the binaries read back are the ones a cold build makes."""
    out = tmp_path_factory.mktemp("kernel_build") / "ci.json"
    proc = compiled.run([sys.executable, *TOOL, "--ci", "--json", str(out)], check=False)
    if not out.exists():
        pytest.fail(f"python -m tools.kernel_build --ci failed (rc {proc.returncode}):\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc, json.loads(out.read_text())


# The backward's row kernel at BLOCK_H = 2048 builds with one 8-byte spill (a 64-bit value
# stored once in the prologue and reloaded once, at 48 registers of 255) with triton 3.9.0's
# ptxas at every warp count tried (4, 8, 16, 32), and spill-free at 8 warps with 3.8.0's
# (CI's pin, constraints.txt) and 3.6.0's (the GPU image's): the whole matrix, 864 builds,
# has 0 spills with those two. So the backward's gate is those compilers; the forward's
# holds on all three.
BACKWARD_GATE_TRITON = ("3.6.0", "3.8.0")


def test_every_ci_build_is_spill_free(ci_results):
    proc, results = ci_results
    assert {(r["variant"], r["dtype"], r["H"], r["sm"]) for r in results} == set(
        kb.matrix(ci=True)), "the tool did not build the whole CI matrix"
    gated = [r for r in results
             if not kb.is_backward(r["variant"]) or _triton_version() in BACKWARD_GATE_TRITON]
    spills = [r for r in gated if r["spills"]]
    assert not spills, "builds that spill (stack or local memory):\n" + kb.table(spills)
    # The tool exits 1 on any spill, gated or not.
    assert proc.returncode == int(any(r["spills"] for r in results)), proc.stdout[-3000:]


def test_bytes_in_flight_per_sm_at_k3_widths(ci_results):
    _, results = ci_results
    for r in results:  # the forward's row route (the backward's rows are training's; the
        if kb.is_backward(r["variant"]) or kb.is_decode(r["variant"]):  # decode path: below)
            continue
        if r["sm"] == 90 and r["dtype"] == "bfloat16" and r["H"] in (4096, 7168):
            assert r["in_flight_kb"] >= 32, kb.table([r])
            assert r["kernel"] == "_attn_res_kernel", "K3 widths must take the one-read kernel"


def test_decode_path_spreads_a_k3_call_over_the_gpu(ci_results):
    """At T = 1, 8, 64 with K3's shape (H = 7168, 8 blocks, bf16), the decode path's launch
    A runs at least min(132, 8 T) programs, and the source bytes it has in flight across the
    GPU (the static model, from the sm_90 builds' residency) are at least twice the row
    kernel's and grow with T until the grid is resident."""
    _, results = ci_results
    rows = kb.decode_static(results)
    assert [r["T"] for r in rows] == [1, 8, 64]
    for r in rows:
        assert r["decode_programs"] >= min(132, 8 * r["T"]), r
        assert r["decode_in_flight_kb"] >= 2 * r["row_in_flight_kb"], r
        assert r["decode_in_flight_kb"] <= r["source_kb"], r
    assert rows[1]["decode_in_flight_kb"] == 8 * rows[0]["decode_in_flight_kb"]


# Where ptxas spills is a fact of one compiler: measured with triton 3.9.0's (the limits in
# launch_config come from it); triton 3.8.0's builds the 8190 bf16 row without a spill.
# On every version the property that matters is test_every_ci_build_is_spill_free.
SPILL_FACTS_TRITON = "3.9.0"


@pytest.mark.skipif(_triton_version() != SPILL_FACTS_TRITON,
                    reason=f"where ptxas spills was measured with triton {SPILL_FACTS_TRITON}")
@pytest.mark.parametrize("H,variant,dtype", [
    (16384, "mix", "float32"),                          # above MAX_ROW_ALIGNED
    (8190, "capture+delta+write+norm", "bfloat16"),     # unaligned, above MAX_ROW_UNALIGNED
])
def test_the_row_kernel_spills_where_launch_config_leaves_it(H, variant, dtype, compiled_run):
    """The row kernel past its limits spills (with triton 3.9.0's ptxas), and the build sees
    it: that is why wider rows run the chunked kernel (launch_config), and what the CI
    check would catch."""
    stack, spills = compiled_run(
        "import torch, triton; tk = kb._kernel_module(); H = int(sys.argv[1]); "
        "cfg = dict(BLOCK_H=triton.next_power_of_2(H), PREFETCH=2, "
        "num_warps=tk._num_warps(triton.next_power_of_2(H))); "
        "assert tk.launch_config(H, getattr(torch, sys.argv[3]), H % 16 == 0)[0] "
        "is tk.CHUNKED_KERNEL; "
        "r = kb.build_config(tk._KERNEL, cfg, sys.argv[2], sys.argv[3], H, 90); "
        "print(r['stack'], r['spills'])", str(H), variant, dtype).split()
    assert int(stack) > 0 and spills == "True"


# The backward row kernel at BLOCK_H = 8192 with unaligned rows: 80-208 bytes of stack with
# triton 3.8.0's ptxas (measured here) and 3.9.0's (144-208 B, same launch), every
# gradient set but dprefix/dblocks alone; so unaligned rows above 4096 run the chunked one.
BACKWARD_SPILL_FACTS_TRITON = ("3.8.0", "3.9.0")


@pytest.mark.skipif(_triton_version() not in BACKWARD_SPILL_FACTS_TRITON,
                    reason=f"where ptxas spills was measured with triton "
                           f"{' and '.join(BACKWARD_SPILL_FACTS_TRITON)}")
def test_the_backward_row_kernel_spills_where_launch_config_leaves_it(compiled_run):
    stack, spills = compiled_run(
        "tb = kb._kernel_module(backward=True); H, v = 8190, 'bwd:dprefix+dblocks+dw'; "
        "assert kb.launch(v, 'bfloat16', H)[0] is tb.CHUNKED_KERNEL; "
        "cfg = dict(BLOCK_H=8192, num_warps=tb._num_warps(8192)); "
        "r = kb.build_config(tb._KERNEL, cfg, v, 'bfloat16', H, 90); "
        "print(r['stack'], r['spills'])").split()
    assert int(stack) > 0 and spills == "True"


def test_the_ci_subset_builds_every_backward_variant_wherever_the_forward_is_built():
    forward = {(d, H, cc) for v, d, H, cc in kb.matrix(ci=True) if not kb.is_backward(v)}
    backward = {(v, d, H, cc) for v, d, H, cc in kb.matrix(ci=True) if kb.is_backward(v)}
    every = {n for n, _ in kb.variants() if kb.is_backward(n)}
    assert len(every) == 7  # every non-empty set of the three gradients
    assert backward == {(v, d, H, cc) for v in every for d, H, cc in forward}


def test_the_tool_refuses_the_interpreter():
    env = dict(_compiled_env(), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "tools.kernel_build", "--ci"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0 and "TRITON_INTERPRET" in proc.stderr


@pytest.mark.parametrize("regs,threads,expected", [
    (128, 512, 1),   # 64 Ki registers: exactly one program
    (118, 256, 2),   # rounded up to 120 per thread: 30720 per program
    (129, 512, 0),   # over the register file: the launch would fail
    (32, 128, 16),   # thread slots (2048) bind
    (16, 32, 32),    # program slots bind
])
def test_occupancy_model(regs, threads, expected):
    assert kb.occupancy(regs, threads, 0) == expected


def test_pdl_builds_show_griddepcontrol_and_change_nothing_else(compiled_run):
    """The opt-in programmatic dependent launch (ops/triton_kernels.py ``pdl_launch``): the
    sm_90 build waits and triggers (PTX ``griddepcontrol``, SASS ``ACQBULK`` / ``PREEXIT``)
    with the registers and stack of the default build, which has none of it."""
    variants = ("capture+delta+write+norm", "dec-mix:out+mix+norm")
    pairs = json.loads(compiled_run(  # one process: its imports are most of the time
        "import json; pairs = []\n"
        "for v in sys.argv[1:]:\n"
        "    fn, cfg = kb.launch(v, 'bfloat16', 7168)\n"
        "    pairs.append([kb.build_config(fn, dict(cfg, LAUNCH_PDL=True), v, 'bfloat16', "
        "7168, 90), kb.build_config(fn, cfg, v, 'bfloat16', 7168, 90)])\n"
        "print(json.dumps(pairs))", *variants))
    for variant, (on, off) in zip(variants, pairs, strict=True):
        assert on["pdl"] == {"ptx": ["griddepcontrol.launch_dependents", "griddepcontrol.wait"],
                             "sass": ["ACQBULK", "PREEXIT"]}, (variant, on["pdl"])
        assert "pdl" not in off
        assert (on["regs"], on["stack"]) == (off["regs"], off["stack"]), variant


# triton 3.6.0's AMD backend (the GPU image's version) spills 6 SGPRs, to VGPR lanes and not
# to scratch, in the chunked backward with all three gradients at the unaligned H = 8190
# (BENCHMARKS.md, "AMD MI300", built by hand); 3.8.0 (CI's pin) and 3.9.0 build it clean.
AMD_BACKWARD_GATE_TRITON = ("3.8.0", "3.9.0")


def test_amd_gfx942_builds_have_no_scratch_and_fit_a_workgroup(compiled_run):
    """AMD MI300 (gfx942, 64-wide wavefronts), offline: the launches where CUDA's need most
    registers or threads (the forward's superset at K3's width and chunked, the backward's
    superset at every kernel and warp setting, the decode path's widest slices) build with
    no scratch and no VGPR/SGPR spill, in at most 1024 threads a workgroup. The whole
    matrix: ``python -m tools.kernel_build --target gfx942`` (BENCHMARKS.md)."""
    cases = [("capture+delta+write+norm", "bfloat16", 7168), ("mix", "float32", 16384),
             ("bwd:dprefix+dblocks+dw", "bfloat16", 2048),
             ("bwd:dprefix+dblocks+dw", "float32", 4096),
             ("bwd:dprefix+dblocks+dw", "float32", 8192),
             ("bwd:dprefix+dblocks+dw", "bfloat16", 8190),
             ("dec-stats:delta+write", "float32", 16384),
             ("dec-mix:out+mix+norm", "float32", 16384)]
    results = json.loads(compiled_run(
        "import json; print(json.dumps([kb.build_hip(*c) for c in json.loads(sys.argv[1])]))",
        json.dumps(cases)))
    for r in results:
        assert r["scratch"] == 0 and r["vgpr_spills"] == 0 and r["threads"] <= 1024, r
        if not kb.is_backward(r["variant"]) or _triton_version() in AMD_BACKWARD_GATE_TRITON:
            assert not r["spills"], r
    assert [r["kernel"] for r in results][-3] == "_mix_bwd_chunked_kernel"


@pytest.mark.vllm
@pytest.mark.vllm_kernel_file
def test_vllm_amd_k3_kernel_builds_beside_ours_for_gfx942(compiled_run):
    """The peer: vLLM 0.33.0's AMD K3 kernel, read from the installed vLLM and built for
    gfx942 as its launch does at K3's width (bf16, H = 7168), decode (T < 256) and prefill.
    The op's launches there (the row kernel; the decode path's A and B) use fewer VGPRs
    (BENCHMARKS.md, "AMD MI300": 58-70 against 134-160, at every width)."""
    results = json.loads(compiled_run(
        "import json; peers = [kb.build_vllm_amd('bfloat16', 7168, t) for t in (1, 256)]; "
        "ours = [kb.build_hip(v, 'bfloat16', 7168) for v in ('attn_res+delta+write+norm', "
        "'dec-stats:delta+write', 'dec-mix:out+norm')]; print(json.dumps([peers, ours]))"))
    peers, ours = results
    assert [p["variant"] for p in peers] == ["vllm-amd:decode", "vllm-amd:prefill"]
    assert [p["threads"] for p in peers] == [512, 256]  # its launch: 8 warps, then 4
    for r in ours:
        assert not r["spills"] and r["vgprs"] < min(p["vgprs"] for p in peers), (r, peers)


def test_amd_quant_builds_have_no_scratch(compiled_run):
    """The FP8 quant's launches for AMD, offline: gfx942 storing e4m3fnuz (vLLM's MI300
    dtype) and gfx950 e4m3fn, the forward's quant superset at K3's width (row kernel) and
    chunked, and the decode path's quant launches: no scratch, no spill, at most 1024
    threads. The whole quant matrix: ``python -m tools.kernel_build --only quant --target gfx942``
    (and gfx950)."""
    cases = [("quant-capture+delta+write+norm", "bfloat16", 7168),
             ("quant-capture+delta+write+norm", "float32", 8192),
             ("quant-capture+delta+write+norm", "float32", 16384),
             ("dec-mix:quant+mix", "float32", 16384), ("dec-quant:ub+div", "bfloat16", 7168)]
    results = json.loads(compiled_run(
        "import json; print(json.dumps([kb.build_hip(*c, arch=a) for a in ('gfx942', "
        "'gfx950') for c in json.loads(sys.argv[1])]))", json.dumps(cases)))
    assert len(results) == 2 * len(cases)
    for r in results:
        assert not r["spills"] and r["scratch"] == 0 and r["threads"] <= 1024, r
    assert {r["kernel"] for r in results} >= {"_attn_res_kernel", "_attn_res_chunked_kernel",
                                              "_decode_quant_kernel"}
