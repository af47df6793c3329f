"""The build matrix: every variant the op family launches, the targets, dtypes and widths,
the CI subset, and the static occupancy model.

The static estimate (a model, not a measurement), per SM:

- resident programs = min over the register file (65536 32-bit registers per SM, allocated
  per warp in units of 256, i.e. per-thread counts rounded up to a multiple of 8), the
  thread slots (2048 per SM), the program slots (32 per SM) and shared memory (228 KB per
  SM, plus 1 KB reserved per program); the same for sm_90 and sm_100;
- bytes in flight = resident programs x rows per program (1) x source rows a program has
  issued loads for and not yet reduced x the bytes of one such row. Row kernel:
  ``PREFETCH`` rows (3 for 16-bit, 2 for fp32) of ``H`` elements; masked lanes above ``H``
  issue no loads. Chunked kernel: one chunk (``CHUNK`` elements), reduced as it lands.
  Weights, prefix and delta (loaded once per row) are not counted: in steady state only
  source loads are in flight. The model assumes every resident program is in that loop
  with all its issued loads outstanding; it ignores the L2, DRAM scheduling and the time a
  program spends outside the loop.

Against it, Little's law: an H200 at ~4.8 TB/s with ~0.8 us of load latency needs about
4.8e12 * 0.8e-6 / 132 SMs ~ 29 KB in flight per SM to stay busy.
"""

from __future__ import annotations

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


def kernel_kind(kernel: str) -> str:
    """A kernel's kind by its name: the row, the chunked or a decode kernel."""
    return "chunked" if "chunked" in kernel else "decode" if "decode" in kernel else "row"


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


def occupancy(regs: int, threads: int, shared: int) -> int:
    """Programs resident per SM (the occupancy calculator's register, thread, slot and
    shared-memory limits; ``shared`` as cuobjdump reports it, reserve excluded)."""
    warps = -(-threads // 32)
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = (REGS_PER_SM // per_warp) // warps
    by_threads = THREADS_PER_SM // threads
    by_shared = SHARED_PER_SM // (shared + SHARED_RESERVED)
    return min(by_regs, by_threads, PROGRAMS_PER_SM, by_shared)
