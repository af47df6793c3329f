"""The tool's tables: one row per build, a summary per (target, dtype, H, op), and the
static model at decode sizes on an H200 (``decode_static``)."""

from __future__ import annotations

from .variants import _ELEM_BYTES, SLOTS, _op, kernel_kind


def table(results: list[dict]) -> str:
    head = (f"{'sm':>4} {'dtype':>8} {'H':>6} {'variant':<26} {'kernel':>7} {'block':>5} "
            f"{'warps':>5} {'ahead':>5} {'regs':>4} {'stack':>5} {'res/SM':>6} "
            f"{'KB in flight/SM':>15}")
    lines = [head]
    for r in sorted(results, key=lambda r: (r["sm"], r["dtype"], r["H"], r["variant"])):
        kind = kernel_kind(r["kernel"])
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
        kind = kernel_kind(rs[0]["kernel"])
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
