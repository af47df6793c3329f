"""Offline build of the AttnRes Triton kernel for sm_90 / sm_100: registers, spills, occupancy.

No GPU and no driver are needed: Triton's wheel carries ``ptxas`` and ``cuobjdump``, and
``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` builds a real cubin on a
CPU machine. Each build uses the kernel and the constexprs and ``num_warps`` the op launches
with (``ops/triton_kernels.py: launch_config``) and the specialisation such a launch gets:
16-byte aligned pointers, and ``H`` and the row strides divisible by 16 when ``H`` is (the
matrix has one width, 8190, that is not: Triton then loads element by element). ``cuobjdump
--dump-resource-usage`` reads the registers per thread, the stack frame and local memory of
the cubin; a non-zero stack or local size is a spill (the kernels have no local arrays).

The backward (``ops/triton_backward.py``, its own ``launch_config``) is built the same way,
one variant per non-empty set of gradients (``bwd:dprefix+dblocks+dw`` ... ``bwd:dw``), and
so are the decode path's launches (``ops/triton_decode.py``: ``dec-stats:*``,
``dec-mix:*``, ``dec-norm:*``, ``dec-quant:*``). ``attn_res_quant`` and its capture
(``quant*`` variants, the FP8 epilogue of ``ops/triton_quant.py`` with ``scale_ub`` and the
division) store ``float8_e4m3fn`` on sm_90, sm_100 and gfx950 and ``float8_e4m3fnuz`` on
gfx942 (``fp8_type``), as vLLM runs those machines.

Run (the whole matrix, 1944 builds, 1596 distinct; ``--ci`` is the subset that
tests/test_kernel_build.py builds: every forward variant (the quant ones included) at
H = 7168 and 8192, elsewhere three of the forward's, and every backward variant and each
decode launch's superset variant at every width, 864 builds, 594 of them distinct; build
times: BENCHMARKS.md, "Offline kernel build"; ``--only quant`` builds the quant variants
alone):

    python tools/kernel_build.py [--ci] [--only quant] [--jobs 2] [--json out.json] \
                                 [--target gfx942]

``--target gfx942`` (or ``gfx950``) builds the same matrix for one AMD arch (``build_hip``).
It prints one row per build and a summary per (target, dtype, H), and exits 1 when any build
spills. TRITON_INTERPRET must be unset or 0: under the interpreter ``triton.jit`` builds no
compilable kernel (the tool refuses).

The static estimate (a model, not a measurement), per SM:

- resident programs = min over the register file (65536 32-bit registers per SM, allocated
  per warp in units of 256, i.e. per-thread counts rounded up to a multiple of 8), the thread
  slots (2048 per SM), the program slots (32 per SM) and shared memory (228 KB per SM, plus
  1 KB reserved per program); the same for sm_90 and sm_100;
- bytes in flight = resident programs x rows per program (1) x source rows a program has
  issued loads for and not yet reduced x the bytes of one such row. Row kernel: ``PREFETCH``
  rows (3 for 16-bit, 2 for fp32) of ``H`` elements; masked lanes above ``H`` issue no loads
  and are not counted. Chunked kernel: one chunk (``CHUNK`` elements), reduced as it lands.
  The weights, prefix and delta loaded once per row are not counted: in steady state (the
  loop over blocks) only source loads are in flight. The model assumes every resident
  program is in that loop and that the loads issued are all outstanding; it ignores the
  L2, DRAM scheduling and the time a program spends outside the loop.

Against it, Little's law: an H200 at ~4.8 TB/s with ~0.8 us of load latency needs about
4.8e12 * 0.8e-6 / 132 SMs ~ 29 KB in flight per SM to stay busy.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

# Register file, thread and program slots, shared memory per SM (sm_90 and sm_100 alike).
REGS_PER_SM = 65536
THREADS_PER_SM = 2048
PROGRAMS_PER_SM = 32
SHARED_PER_SM = 228 * 1024
SHARED_RESERVED = 1024

TARGETS = (90, 100)
DTYPES = ("bfloat16", "float16", "float32")
# K3-class widths, one not a multiple of 16 (no vectorising specialisation: the worst case
# for registers at BLOCK_H = 8192), and one above 8192.
SLOTS = 8  # K3: 9 blocks of 4 layers... the bank's slots at the headline shape
WIDTHS = (2048, 4096, 7168, 8192, 8190, 16384)

_TL_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def variants() -> list[tuple[str, dict]]:
    """Every flag set the op family launches: (name, flags)."""
    out: list[tuple[str, dict]] = []
    # attn_res_quant / attn_res_quant_capture add the FP8 epilogue (ops/triton_quant.py) with
    # scale_ub and the division (QuantFP8's form: one load and one division more than the
    # AMD kernel's form, QUANT_FORMS[0]).
    quant = dict(QUANT=True, HAS_SCALE_UB=True, DIVIDE=True)
    for op, write_mix, extra in (("attn_res", False, {}), ("capture", True, {}),
                                 ("quant", False, quant), ("quant-capture", True, quant)):
        for delta in (True, False):
            for write in (True, False):
                for norm in (True, False):
                    name = (f"{op}{'+delta' if delta else ''}{'+write' if write else ''}"
                            f"{'+norm' if norm else ''}")
                    out.append((name, dict(HAS_DELTA=delta, DO_WRITE=write,
                                           HAS_OUT_NORM=norm, WRITE_OUT=True,
                                           WRITE_MIX=write_mix, **extra)))
    out.append(("mix", dict(HAS_DELTA=False, DO_WRITE=False, HAS_OUT_NORM=False,
                            WRITE_OUT=False, WRITE_MIX=True)))
    # e4m3fnuz on an NVIDIA GPU (no such Triton type there): the bytes stored by bits.
    out.append(("quant-fnuz+delta+write+norm", dict(
        HAS_DELTA=True, DO_WRITE=True, HAS_OUT_NORM=True, WRITE_OUT=True, WRITE_MIX=True,
        QUANT=True, HAS_SCALE_UB=True, DIVIDE=True, FP8_SOFT_RTNE=2)))
    # attn_res_mix_backward (ops/triton_backward.py): every non-empty set of gradients.
    for dprefix in (True, False):
        for dblocks in (True, False):
            for dw in (True, False):
                if dprefix or dblocks or dw:
                    name = "bwd:" + "+".join(n for n, on in (("dprefix", dprefix),
                                                             ("dblocks", dblocks),
                                                             ("dw", dw)) if on)
                    out.append((name, dict(WRITE_DPREFIX=dprefix, WRITE_DBLOCKS=dblocks,
                                           NEED_DW=dw)))
    # The decode path (ops/triton_decode.py): launch A's in-place flags, launch B's stores
    # (attn_res with or without the output norm, the capture, the pure mixture), launch C.
    for delta in (True, False):
        for write in (True, False):
            name = "+".join(n for n, on in (("delta", delta), ("write", write)) if on)
            out.append(("dec-stats:" + (name or "read"), dict(HAS_DELTA=delta, DO_WRITE=write)))
    for name, out_, mix, norm in (
            ("out+norm", True, False, True), ("out", True, False, False),
            ("out+mix+norm", True, True, True), ("out+mix", True, True, False),
            ("mix", False, True, False)):
        out.append(("dec-mix:" + name, dict(WRITE_OUT=out_, WRITE_MIX=mix, HAS_OUT_NORM=norm)))
    # A quant stages the output and each slice's max |value| (launch B or C), then launch D
    # (``dec-quant``) quantizes it.
    for name, mix in (("quant", False), ("quant+mix", True)):
        out.append(("dec-mix:" + name, dict(WRITE_OUT=True, WRITE_MIX=mix, HAS_OUT_NORM=False,
                                            QUANT=True)))
    out.append(("dec-norm:out", {}))
    out.append(("dec-norm:quant", dict(QUANT=True)))
    out.append(("dec-quant:ub+div", dict(HAS_SCALE_UB=True, DIVIDE=True)))
    out.append(("dec-quant:ub+div+fnuz", dict(HAS_SCALE_UB=True, DIVIDE=True, FP8_SOFT_RTNE=2)))
    return out


def fp8_type(arch) -> str:
    """The FP8 dtype a target's quant stores: e4m3fnuz (``fp8e4b8``) on gfx942, as vLLM runs
    MI300; e4m3fn (``fp8e4nv``) on sm_90, sm_100 and gfx950."""
    return "fp8e4b8" if arch == "gfx942" else "fp8e4nv"


def is_backward(variant: str) -> bool:
    return variant.startswith("bwd:")


def is_decode(variant: str) -> bool:
    return variant.startswith("dec-")


def _op(variant: str) -> str:
    """What a variant builds: ``forward``, ``backward`` or the decode launch (``dec-stats``,
    ``dec-mix``, ``dec-norm``)."""
    if is_backward(variant):
        return "backward"
    return variant.split(":")[0] if is_decode(variant) else "forward"


# CI subset. Registers are not monotone in the flags (ptxas: in the full matrix the variant
# with the most registers differs from width to width), so where a spill is a risk CI builds
# every variant: BLOCK_H = 8192, whose 512 threads cap a thread at 128 registers (H = 7168
# and 8192 share that build). Elsewhere the cap is 255 (the row kernel at BLOCK_H <= 4096,
# the chunked kernel's 128 threads) against at most 128 used in the full matrix, and CI
# builds the superset variant (every load and store, the output norm) and the pure mixture.
# The backward is built in every variant at every width: ptxas spilled it below that cap
# (at 16 elements a thread: `bwd:dw` at 2048 and `bwd:dblocks` at 4096, fp32, sm_100, with
# 96 and 80 registers), so no variant stands for the others.
# The quant variants (attn_res_quant and its capture) are forward variants: every one at
# 7168 / 8192 (up to 122 registers of the 128 there, fp32 on sm_90), the superset elsewhere.
CI_VARIANTS = ("capture+delta+write+norm", "mix", "quant-capture+delta+write+norm")
CI_ALL_VARIANTS_AT = (7168, 8192)
# The decode kernels: 128 threads (a 255-register cap) and at most 72 registers in the full
# matrix; CI builds each launch's superset variant at every width (each slice width).
# The quant's launch D (at most 22 registers in the full matrix) joins them; launches B and
# C with the quant (at most 72 and 28, the full matrix) are built there only.
CI_DECODE_VARIANTS = ("dec-stats:delta+write", "dec-mix:out+mix+norm", "dec-norm:out",
                      "dec-quant:ub+div", "dec-quant:ub+div+fnuz")


def _kernel_module(backward: bool = False):
    """The module whose ``launch_config`` picks the kernel: the forward's or the backward's."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit(
            "kernel_build: TRITON_INTERPRET is set, so triton.jit builds interpreter kernels "
            "that cannot be compiled; run with TRITON_INTERPRET unset (or 0)")
    from kimi_passes.ops import triton_backward, triton_kernels

    tk = triton_backward if backward else triton_kernels
    if tk.INTERPRETED:
        raise SystemExit("kernel_build: the kernel was built for the interpreter; unset "
                         "TRITON_INTERPRET before triton is imported")
    return tk


def launch(variant: str, dtype: str, H: int, warp_size: int = 32):
    """``(kernel, constexprs and num_warps)`` the op launches for this variant at width H
    (``warp_size`` 64: on AMD CDNA; the forward's launches fit 1024 threads either way)."""
    import torch

    tk = _kernel_module(is_backward(variant))
    if is_decode(variant):  # the kernel of launch A, B or C, at the constants the op uses
        from kimi_passes.ops import triton_decode as td

        cfg = td.decode_config(H, SLOTS)
        kernel, consts = {"dec-stats": (td.STATS_KERNEL, cfg.stats),
                          "dec-mix": (td.MIX_KERNEL, cfg.mix),
                          "dec-norm": (td.NORM_KERNEL, cfg.norm),
                          "dec-quant": (td.QUANT_KERNEL, cfg.quant)}[_op(variant)]
        return kernel, dict(consts, num_warps=cfg.num_warps)
    extra = {"warp_size": warp_size} if is_backward(variant) else {}
    return tk.launch_config(H, getattr(torch, dtype), aligned=H % 16 == 0, slots=SLOTS, **extra)


def _compile(src, backend: str, arch, warp_size: int, **options):
    """``triton.compile`` for ``GPUTarget(backend, arch, warp_size)``. Triton's launch
    default for fp fusion is stated: Triton's cache key counts TRITON_DEFAULT_FP_FUSION, so
    a build made by any process (CI's build step, the tests' run of the tool) is one entry."""
    import triton
    from triton.backends.compiler import GPUTarget

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return triton.compile(src, target=GPUTarget(backend, arch, warp_size), options=options)


HIP_ARCH = "gfx942"  # MI300X / MI300A (CDNA3): 64-wide wavefronts


def build_hip(variant: str, dtype: str, H: int, arch: str = HIP_ARCH) -> dict:
    """Compile one variant for AMD ``arch`` as the op launches it there (64-wide wavefronts)
    and read the ``amdgcn`` listing's resource lines: VGPRs, SGPRs, their spill counts,
    scratch (a spill) and the waves per SIMD the compiler reports (``Occupancy``)."""
    fn, cfg = launch(variant, dtype, H, warp_size=64)
    src, num_warps, _ = _ast_source(fn, cfg, variant, dtype, H, fp8_type(arch))
    kernel = _compile(src, "hip", arch, 64, num_warps=num_warps)
    return dict(variant=variant, dtype=dtype, H=H, arch=arch, kernel=fn.fn.__name__,
                num_warps=num_warps, threads=64 * num_warps, **_hip_usage(kernel, variant))


def _hip_usage(kernel, variant: str) -> dict:
    asm = kernel.asm["amdgcn"]

    def field(name: str) -> int:
        m = re.search(rf"{name}:\s*(\d+)", asm)
        if m is None:
            raise RuntimeError(f"kernel_build: no {name} in the amdgcn listing of {variant}")
        return int(m.group(1))

    use = dict(vgprs=field(r"\.vgpr_count"), sgprs=field(r"\.sgpr_count"),
               vgpr_spills=field(r"\.vgpr_spill_count"), sgpr_spills=field(r"\.sgpr_spill_count"),
               scratch=field("ScratchSize"), waves_per_simd=field("Occupancy"))
    return dict(use, spills=bool(use["scratch"] or use["vgpr_spills"] or use["sgpr_spills"]))


def vllm_amd_module():
    """vLLM's AMD K3 kernel module (``_attn_res_kernel`` and its launcher ``attn_res``), as
    ``kimi_passes.vllm.peer.load_peer("amd")`` loads it (an installed vLLM or a
    prepared copy; its file unchanged, run with stand-ins for vLLM's imports on a machine
    whose Triton does not compile for a GPU), in the mode triton was imported in (compiled
    here; the interpreter in tests). Its ``get_fp8_min_max`` gives this platform's bound,
    or the module's ``QUANT_MAX`` where a caller set one (tests emulating an fnuz platform)."""
    from kimi_passes.vllm.peer import PeerError, load_peer

    try:
        return load_peer("amd").module
    except PeerError as e:
        raise SystemExit(f"kernel_build: {e}") from e


def _vllm_amd_kernel():
    return vllm_amd_module()._attn_res_kernel


def build_vllm_amd(dtype: str, H: int, tokens: int, arch: str = HIP_ARCH, nb: int = SLOTS):
    """vLLM 0.33.0's AMD K3 kernel (``vllm/models/kimi_k3/amd/ops/attn_res.py``), the peer,
    built for ``arch`` as its ``attn_res`` launches it for a call of ``tokens`` rows with a
    delta, a block write and the output norm over ``nb`` blocks (hidden size, strides and
    counts are constexprs there): 4 sources a tile and 8 warps below 256 tokens, else 1 and 4.
    Needs vLLM installed (``bash tools/install_vllm.sh``) or a prepared copy
    (``vllm_amd_module``)."""
    import triton
    from triton.compiler import ASTSource

    fn = _vllm_amd_kernel()
    block_l, num_warps = (1, 4) if tokens >= 256 or nb <= 1 else (4, 8)
    values = dict(stride_prefix_m=H, stride_delta_m=H, stride_block_m=nb * H, stride_block_r=H,
                  stride_output_m=H, num_blocks=nb, hidden_size=H, block_write_idx=0, eps=1e-6,
                  output_norm_eps=1e-6, HAS_DELTA=True, WRITE_BLOCK=True,
                  APPLY_OUTPUT_NORM=True, QUANT_MAX=0.0, BLOCK_L=block_l,
                  BLOCK_D=triton.next_power_of_2(H))
    ptr = "*" + _TL_DTYPE[dtype]
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in values:
            signature[name] = "constexpr"
        else:
            signature[name] = "*fp32" if name == "output_scale_ptr" else ptr
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, attrs=attrs,
                    constexprs={(fn.arg_names.index(k),): v for k, v in values.items()})
    kernel = _compile(src, "hip", arch, 64, num_warps=num_warps, num_stages=2)
    return dict(variant=f"vllm-amd:{'decode' if block_l > 1 else 'prefill'}", dtype=dtype, H=H,
                arch=arch, kernel="vllm " + fn.fn.__name__, num_warps=num_warps,
                threads=64 * num_warps, **_hip_usage(kernel, "vllm-amd"))


def _cuobjdump() -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not path.exists():
        raise SystemExit(f"kernel_build: {path} not found; this Triton wheel carries no "
                         f"NVIDIA toolchain (install the Linux x86-64 wheel)")
    return str(path)


def cuobjdump(cubin: bytes, flag: str) -> str:
    """cuobjdump's ``flag`` report of ``cubin`` (``-sass``, ``--dump-resource-usage``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_cuobjdump(), flag, f.name], check=True,
                              capture_output=True, text=True).stdout


def sass(cubin: bytes) -> str:
    """The cubin's SASS listing."""
    return cuobjdump(cubin, "-sass")


def resource_usage(cubin: bytes) -> dict:
    """REG, STACK, SHARED, LOCAL of the one kernel in ``cubin`` (cuobjdump's report)."""
    text = cuobjdump(cubin, "--dump-resource-usage")
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if m is None:
        raise RuntimeError(f"kernel_build: no resource line in cuobjdump's output:\n{text}")
    return dict(zip(("regs", "stack", "shared", "local"), map(int, m.groups()), strict=True))


def build(variant: str, dtype: str, H: int, cc: int) -> dict:
    """Compile one variant for ``sm_<cc>`` exactly as the op launches it at width H."""
    fn, cfg = launch(variant, dtype, H)
    return build_config(fn, cfg, variant, dtype, H, cc)


def _ast_source(fn, cfg: dict, variant: str, dtype: str, H: int, fp8: str = "fp8e4nv"):
    """``(source, num_warps, constexprs)`` of ``fn`` launched with ``cfg`` at width H, with
    the specialisation such a launch gets (``fp8``: the quant's Triton FP8 type)."""
    from triton.compiler import ASTSource

    cfg = dict(cfg)
    flags = dict(variants())[variant]
    num_warps = cfg.pop("num_warps")
    ptr = "*" + _TL_DTYPE[dtype]
    aligned = [["tt.divisibility", 16]]
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in ("dw_ptr", "stats_ptr", "part_ptr", "ms_ptr", "amax_ptr", "scale_ptr",
                    "scale_ub_ptr"):  # fp32 workspaces, the quant's scales
            signature[name], attrs[(i,)] = "*fp32", aligned
        elif name == "q_ptr":  # the quant's FP8 output (its bytes, when stored by bits)
            signature[name] = "*u8" if flags.get("FP8_SOFT_RTNE") else "*" + fp8
            attrs[(i,)] = aligned
        elif name.endswith("_ptr"):
            signature[name], attrs[(i,)] = ptr, aligned
        elif name in ("eps", "out_eps", "qmax", "inv_qmax", "amax_floor", "scale_floor"):
            signature[name] = "fp32"
        elif name in ("num_blocks", "skip_idx", "T", "n_splits"):
            signature[name] = "i32"  # small or any count: not divisible by 16 in general
        elif name == "H" or name.startswith("stride_"):
            # Contiguous rows: strides are multiples of H, so divisible by 16 when H is.
            signature[name] = "i32"
            if H % 16 == 0:
                attrs[(i,)] = aligned
        else:
            signature[name] = "constexpr"
    constexprs = dict(flags, **cfg)
    if "BF16_SOFT_RTNE" in fn.arg_names:  # the forward's interpreter-only rounding
        constexprs["BF16_SOFT_RTNE"] = False
    if "LAUNCH_PDL" in fn.arg_names:  # opt-in (triton_kernels.pdl_launch): off unless asked
        constexprs.setdefault("LAUNCH_PDL", False)
    for name in ("QUANT", "HAS_SCALE_UB", "DIVIDE", "DIVIDE_VALUES"):  # no quant unless asked
        if name in fn.arg_names:
            constexprs.setdefault(name, False)
    if "FP8_SOFT_RTNE" in fn.arg_names:  # 0: the hardware conversion; 2 stores e4m3fnuz by
        constexprs.setdefault("FP8_SOFT_RTNE", 0)  # bits into uint8 (``--only`` fnuz-bits)
    missing = [n for n, t in signature.items() if t == "constexpr" and n not in constexprs]
    if missing:
        raise RuntimeError(f"kernel_build: no value for constexpr(s) {missing}; update "
                           f"tools/kernel_build.py with the kernel's signature")
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    return src, num_warps, constexprs


def build_config(fn, cfg: dict, variant: str, dtype: str, H: int, cc: int) -> dict:
    """Compile ``fn`` with constexprs and ``num_warps`` ``cfg``; its resources and estimate."""
    src, num_warps, constexprs = _ast_source(fn, cfg, variant, dtype, H)
    t0 = time.perf_counter()
    kernel = _compile(src, "cuda", cc, 32, num_warps=num_warps)
    seconds = time.perf_counter() - t0
    use = resource_usage(kernel.asm["cubin"])
    pdl = None
    if constexprs.get("LAUNCH_PDL"):  # what programmatic dependent launch compiles to
        pdl = {"ptx": sorted(set(re.findall(r"griddepcontrol\.\w+", kernel.asm["ptx"]))),
               "sass": sorted(set(re.findall(r"\b(ACQBULK|PREEXIT)\b", sass(kernel.asm["cubin"]))))}
    rows = cfg.get("ROWS", 1)
    resident = occupancy(use["regs"], 32 * num_warps, use["shared"])
    # Rows (or tiles of sources) loaded ahead of the reduction: the chunked kernel reduces
    # one chunk as it lands; the decode kernels load a [SRC_TILE, SLICE] tile at once.
    prefetch = cfg.get("PREFETCH", cfg.get("SRC_TILE", 1))
    width = min(H, cfg.get("CHUNK", cfg.get("SLICE", H)))
    in_flight = resident * rows * prefetch * width * _ELEM_BYTES[dtype]
    return dict(variant=variant, dtype=dtype, H=H, sm=cc, num_warps=num_warps,
                kernel=fn.fn.__name__,
                block=cfg.get("BLOCK_H", cfg.get("CHUNK", cfg.get("SLICE"))), rows=rows,
                prefetch=prefetch, **use, spills=use["stack"] > 0 or use["local"] > 0,
                resident=resident, in_flight_kb=in_flight / 1024, seconds=round(seconds, 2),
                **({"pdl": pdl} if pdl is not None else {}))


def occupancy(regs: int, threads: int, shared: int) -> int:
    """Programs resident per SM (the occupancy calculator's register, thread, slot and
    shared-memory limits; ``shared`` as cuobjdump reports it, reserve excluded)."""
    warps = -(-threads // 32)
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = (REGS_PER_SM // per_warp) // warps
    by_threads = THREADS_PER_SM // threads
    by_shared = SHARED_PER_SM // (shared + SHARED_RESERVED)
    return min(by_regs, by_threads, PROGRAMS_PER_SM, by_shared)


def _build_star(args):
    return build(*args)


def matrix(ci: bool, only: str | None = None) -> list[tuple[str, str, int, int]]:
    """``(variant, dtype, H, cc)`` of every build (``ci``: the CI subset); ``only``: the
    variants whose name contains it."""
    every = [n for n, _ in variants()]
    backward = [n for n in every if is_backward(n)]
    forward = [n for n in every if not is_backward(n) and not is_decode(n)]
    names = (lambda H: every if not ci
             else [*(forward if H in CI_ALL_VARIANTS_AT else CI_VARIANTS), *backward,
                   *CI_DECODE_VARIANTS])
    return [(v, d, H, cc) for cc in TARGETS for d in DTYPES for H in WIDTHS for v in names(H)
            if only is None or only in v]


def run(ci: bool, jobs: int, only: str | None = None) -> list[dict]:
    """Build the matrix. Widths that launch the same kernel, constexprs and specialisation
    (7168 and 8192: ``H`` is a run-time argument) share one build."""
    todo = matrix(ci, only)
    keys = []
    for v, d, H, cc in todo:
        fn, cfg = launch(v, d, H)
        keys.append((v, d, cc, fn.fn.__name__, tuple(sorted(cfg.items())), H % 16 == 0))
    first: dict[tuple, tuple] = {}
    for key, args in zip(keys, todo, strict=True):
        first.setdefault(key, args)
    unique = list(first.values())
    if jobs <= 1:
        built = [build(*a) for a in unique]
    else:
        with ProcessPoolExecutor(jobs) as pool:
            built = list(pool.map(_build_star, unique))
    by_key = dict(zip(first, built, strict=True))
    results = []
    for key, (_, _, H, _) in zip(keys, todo, strict=True):
        r = dict(by_key[key])
        if r["H"] != H:  # the estimate counts the loads of this width's row
            r["in_flight_kb"] *= min(H, r["block"]) / min(r["H"], r["block"])
            r.update(H=H, shared_build=True)
        results.append(r)
    return results


def _kind(kernel: str) -> str:
    return "chunked" if "chunked" in kernel else "decode" if "decode" in kernel else "row"


def table(results: list[dict]) -> str:
    head = (f"{'sm':>4} {'dtype':>8} {'H':>6} {'variant':<26} {'kernel':>7} {'block':>5} "
            f"{'warps':>5} {'ahead':>5} {'regs':>4} {'stack':>5} {'res/SM':>6} "
            f"{'KB in flight/SM':>15}")
    lines = [head]
    for r in sorted(results, key=lambda r: (r["sm"], r["dtype"], r["H"], r["variant"])):
        kind = _kind(r["kernel"])
        lines.append(f"{r['sm']:>4} {r['dtype']:>8} {r['H']:>6} {r['variant']:<26} {kind:>7} "
                     f"{r['block']:>5} {r['num_warps']:>5} {r['prefetch']:>5} {r['regs']:>4} "
                     f"{r['stack']:>5} {r['resident']:>6} {r['in_flight_kb']:>15.1f}"
                     + ("  SPILLS" if r["spills"] else ""))
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    """Per (target, dtype, H): the worst variant's registers, stack, residency, bytes."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["sm"], r["dtype"], r["H"], _op(r["variant"])), []).append(r)
    lines = ["| sm | dtype | H | op | kernel | warps | rows ahead | regs (max) | stack (max) | "
             "programs/SM (min) | KB in flight/SM (min) | variants |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (sm, dtype, H, op), rs in sorted(groups.items()):
        kind = _kind(rs[0]["kernel"])
        lines.append(
            f"| {sm} | {dtype} | {H} | {op} | {kind} {rs[0]['block']} | {rs[0]['num_warps']} | "
            f"{rs[0]['prefetch']} | {max(r['regs'] for r in rs)} | "
            f"{max(r['stack'] for r in rs)} | {min(r['resident'] for r in rs)} | "
            f"{min(r['in_flight_kb'] for r in rs):.1f} | {len(rs)} |")
    return "\n".join(lines)


H200_SMS = 132


def decode_static(results: list[dict], H: int = 7168, dtype: str = "bfloat16", sm: int = 90,
                  nb: int = SLOTS, tokens=(1, 8, 64)) -> list[dict]:
    """The static model at decode sizes on an H200 (132 SMs), from the builds: per call of T
    rows, the programs and SMs a launch occupies and the bytes of source loads in flight
    across the GPU, row kernel (its superset variant) against the decode path's launch A."""
    from kimi_passes.ops import triton_decode as td

    def one(variant):
        rs = [r for r in results if (r["variant"], r["H"], r["dtype"], r["sm"]) ==
              (variant, H, dtype, sm)]
        if not rs:
            raise SystemExit(f"kernel_build: no {variant} build at sm_{sm} {dtype} H={H}")
        return rs[0]

    row, stats = one("capture+delta+write+norm"), one("dec-stats:delta+write")
    cfg = td.decode_config(H, nb)
    tile = cfg.stats
    elem = _ELEM_BYTES[dtype]
    out = []
    for T in tokens:
        row_progs, dec_progs = T, T * cfg.n_splits
        row_live = min(row_progs, H200_SMS * row["resident"])
        dec_live = min(dec_progs, H200_SMS * stats["resident"])
        out.append(dict(
            T=T, row_programs=row_progs, decode_programs=dec_progs,
            row_sms=min(T, H200_SMS), decode_sms=min(dec_progs, H200_SMS),
            row_in_flight_kb=row_live * min(row["prefetch"], nb) * H * elem / 1024,
            decode_in_flight_kb=dec_live * min(tile["SRC_TILE"], nb) * tile["SLICE"] * elem / 1024,
            source_kb=T * (nb + 1) * H * elem / 1024))
    return out


def decode_table(rows: list[dict]) -> str:
    lines = ["| T | programs: row / decode | SMs busy: row / decode | KB of sources in flight "
             "on the GPU: row / decode | KB of sources a call reads |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['T']} | {r['row_programs']} / {r['decode_programs']} | "
                     f"{r['row_sms']} / {r['decode_sms']} | {r['row_in_flight_kb']:.0f} / "
                     f"{r['decode_in_flight_kb']:.0f} | {r['source_kb']:.0f} |")
    return "\n".join(lines)


HIP_ARCHS = ("gfx942", "gfx950")  # MI300X / MI300A, MI355X: both build with triton 3.8's wheel


def _build_hip_star(args):
    return build_hip(*args)


def run_hip(ci: bool, jobs: int, arch: str, only: str | None = None) -> list[dict]:
    """The matrix (one target: ``arch``) built for AMD; every build, none shared."""
    todo = sorted({(v, d, H) for v, d, H, _ in matrix(ci, only)})
    with ProcessPoolExecutor(max(1, jobs)) as pool:
        return list(pool.map(_build_hip_star, [(*t, arch) for t in todo]))


def hip_summary(results: list[dict]) -> str:
    """Per (op, dtype, H): the worst variant's VGPRs, SGPRs, scratch, waves per SIMD."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((_op(r["variant"]), r["dtype"], r["H"]), []).append(r)
    lines = ["| op | dtype | H | kernel, warps (threads) | VGPRs (max) | SGPRs (max) | "
             "scratch B (max) | waves/SIMD (min) | variants |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (op, dtype, H), rs in sorted(groups.items()):
        lines.append(
            f"| {op} | {dtype} | {H} | {_kind(rs[0]['kernel'])}, {rs[0]['num_warps']} "
            f"({rs[0]['threads']}) | {max(r['vgprs'] for r in rs)} | "
            f"{max(r['sgprs'] for r in rs)} | {max(r['scratch'] for r in rs)} | "
            f"{min(r['waves_per_simd'] for r in rs)} | {len(rs)} |")
    return "\n".join(lines)


def peer_table(arch: str) -> str:
    """vLLM's AMD K3 kernel at its decode (T < 256) and prefill launches beside the op's
    kernels, the superset variant of each, bf16, at every width."""
    lines = ["| H | kernel (launch) | threads | VGPRs | SGPRs | scratch B | waves/SIMD |",
             "|---|---|---|---|---|---|---|"]
    for H in WIDTHS:
        rows = [build_vllm_amd("bfloat16", H, 1, arch), build_vllm_amd("bfloat16", H, 256, arch)]
        rows += [build_hip(v, "bfloat16", H, arch) for v in (
            "attn_res+delta+write+norm", "dec-stats:delta+write", "dec-mix:out+norm",
            "dec-norm:out")]
        for r in rows:
            lines.append(f"| {H} | {r['kernel'].lstrip('_')} ({r['variant']}) | {r['threads']} | "
                         f"{r['vgprs']} | {r['sgprs']} | {r['scratch']} | "
                         f"{r['waves_per_simd']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="nvidia", choices=("nvidia", *HIP_ARCHS),
                    help="nvidia: sm_90 and sm_100 (the default); or an AMD arch")
    ap.add_argument("--vllm-peer", action="store_true",
                    help="with an AMD --target: also build vLLM's AMD K3 kernel (needs vLLM "
                         "or bash tools/gpu_prepare.sh's copy)")
    ap.add_argument("--ci", action="store_true", help="the CI subset of variants")
    ap.add_argument("--only", help="build only the variants whose name contains this "
                                   "(e.g. quant)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--from-json", type=Path, help="print the tables of an earlier --json")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    if a.target != "nvidia":
        results = (json.loads(a.from_json.read_text()) if a.from_json
                   else run_hip(a.ci, a.jobs, a.target, a.only))
        print(hip_summary(results))
        spills = [r for r in results if r["spills"] or r["threads"] > 1024]
        print(f"{len(results)} {a.target} builds in {time.perf_counter() - t0:.0f} s; "
              f"{len(spills)} with scratch, a spill or over 1024 threads")
        for r in spills:
            print("  ", r)
        if a.vllm_peer:
            print()
            print(peer_table(a.target))
        if a.json:
            a.json.write_text(json.dumps(results, indent=1))
        return 1 if spills else 0
    results = json.loads(a.from_json.read_text()) if a.from_json else run(a.ci, a.jobs, a.only)
    print(table(results))
    print()
    print(summary(results))
    if any(r["variant"] == "dec-stats:delta+write" and r["H"] == 7168 and r["sm"] == 90
           and r["dtype"] == "bfloat16" for r in results):
        print()
        print("decode sizes, K3 (H = 7168, 8 blocks, bf16), sm_90 builds, an H200's 132 SMs:")
        print(decode_table(decode_static(results)))
    spills = [r for r in results if r["spills"]]
    took = "read back" if a.from_json else f"in {time.perf_counter() - t0:.0f} s"
    print(f"{len(results)} builds {took}; {len(spills)} spill")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 1 if spills else 0


if __name__ == "__main__":
    sys.exit(main())
