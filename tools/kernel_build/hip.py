"""AMD builds (gfx942, gfx950; 64-wide wavefronts) of the op's kernels and of vLLM's AMD K3
kernel (the peer), read from the ``amdgcn`` listing: VGPRs, SGPRs, spills, scratch and
the waves per SIMD the compiler reports."""

from __future__ import annotations

import re
from concurrent.futures import ProcessPoolExecutor

from .nvidia import _ast_source, _compile, launch
from .variants import _TL_DTYPE, SLOTS, WIDTHS, _op, fp8_type, kernel_kind, matrix

HIP_ARCH = "gfx942"  # MI300X / MI300A (CDNA3): 64-wide wavefronts


HIP_ARCHS = ("gfx942", "gfx950")  # MI300X / MI300A, MI355X: both build with triton 3.8's wheel


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
    """vLLM's AMD K3 kernel (``vllm/models/kimi_k3/amd/ops/attn_res.py``), the peer,
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
            f"| {op} | {dtype} | {H} | {kernel_kind(rs[0]['kernel'])}, {rs[0]['num_warps']} "
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
