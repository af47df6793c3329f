"""NVIDIA builds (sm_90, sm_100) on a CPU machine: Triton's ``ptxas`` and ``cuobjdump``.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` builds a real cubin
without a GPU or driver. Each build uses the kernel, constexprs and ``num_warps`` the op
launches with (``ops/triton_kernels.py: launch_config``; the backward's and the decode
path's own) and the specialisation such a launch gets: 16-byte aligned pointers, and
``H`` and the row strides divisible by 16 when ``H`` is (8190 is not: Triton then loads
element by element). ``cuobjdump --dump-resource-usage`` reads registers per thread, the
stack frame and local memory; a non-zero stack or local size is a spill (the kernels have
no local arrays). The quant variants store ``float8_e4m3fn`` (``variants.fp8_type``).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from .variants import (
    _ELEM_BYTES,
    _TL_DTYPE,
    SLOTS,
    _op,
    is_backward,
    is_decode,
    matrix,
    occupancy,
    variants,
)


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
                           f"tools/kernel_build/nvidia.py with the kernel's signature")
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


def _build_star(args):
    return build(*args)


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
