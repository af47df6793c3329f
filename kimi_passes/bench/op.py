"""Section ``op``: the AttnRes op against plain torch and a same-bytes copy.

``torch.ops.kimi.attn_res`` against the plain-torch statement of docs/design.md section 3
in the input dtype, run eagerly (``eager``) and compiled by Inductor (``compiled``: static
shapes, one compile per cell), and a memory copy of the same bytes (``copy``: ``src`` and
``dst`` ``bytes/2`` each). On CUDA also the Triton kernel called directly (``triton``: what
the op dispatches to; ``triton-row``: forced to the row kernel, beside the decode path the
op takes at small T), ``vllm-k3``: the Triton kernel vLLM serves K3's AttnRes with
(``kimi_passes.vllm.peer.load_peer``: an installed vLLM or a prepared copy; every variant, the op's
arguments and in-place effects), and, when importable, the PyPI peers ``flash-attn-res``
and ``fast-attnres`` on the shapes their kernels accept. Every candidate is checked against
the fp32 reference first: MET within ``OP_TOL``, else MISS with the reason (raised: not
timed; off: timed), in its row's ``candidates`` (``ratio`` = t(candidate) / t(op)).
Variants: ``read`` (no delta, block write or output norm: a pure read of the pre-norm
mixture) and ``full`` (delta, a block write into slot ``nb``, output norm: the
pre-attention call of a block-write layer).
Bytes moved (the op's minimum traffic): every source read once (``nb`` blocks and
the prefix), plus the delta read and the prefix write-back when there is a delta,
plus the block write, plus the output write, plus the weight vectors.
``GB/s = bytes / time``; ``roof = t(copy) / t(op)`` (1.0 = copy speed);
``x eager = t(eager) / t(op)`` and ``x comp = t(compiled) / t(op)`` (>1: the op is
faster). Ratios are medians of per-round ratios of interleaved samples.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kimi_passes.bench.harness import (
    EPS,
    OP_TOL,
    failure,
    fmt_ratio,
    misses,
    op_args,
    ratio_summary,
    rel_err,
    summary,
    verdict,
)
from kimi_passes.ops.attn_res_args import AttnResArgs

VARIANTS = ("read", "full")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PEERS = ("vllm-k3", "flash-attn-res", "fast-attnres")

#: A peer kernel's zero-argument call, or why it is not timed.
Peer = Callable[[], object] | str

# Target (docs/design.md section 5).
TARGET_ROOFLINE = 0.90  # H200 headline shape, fraction of a same-bytes copy


def plain_torch(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight,
                num_blocks, block_write_idx, eps, output_norm_eps):
    """docs/design.md section 3 the way a user writes it: plain torch in the input dtype."""
    H = prefix.shape[-1]
    if delta is not None:
        prefix.add_(delta)
    if block_write_idx >= 0:
        blocks[:, block_write_idx] = prefix
    values = torch.cat([blocks[:, :num_blocks], prefix[:, None]], 1)
    keys = F.rms_norm(values, (H,), norm_weight, eps)
    p = (keys @ qk_weight).softmax(-1)
    out = (p[:, None] @ values)[:, 0]
    if output_norm_weight is not None:
        out = F.rms_norm(out, (H,), output_norm_weight, output_norm_eps)
    return out


def make_op_args(T, H, nb, dtype, variant, device, seed=0) -> AttnResArgs:
    """``kimi::attn_res``'s arguments for ``variant``; the bank has ``nb + 1`` slots (the
    write slot). ``full``'s delta is 1e-3 of the prefix: every timed call adds it again."""
    full = variant == "full"
    return op_args(T, H, nb, dtype=dtype, device=device, delta=1e-3 if full else None,
                   write=nb if full else -1, output_norm=full, seed=seed)


def op_bytes(T, H, nb, dtype, variant) -> int:
    """The op's minimum traffic (see the module docstring)."""
    e = torch.empty((), dtype=dtype).element_size()
    rows = nb + 1 + 1  # sources read once, output written once
    weights = 2
    if variant == "full":
        rows += 2 + 1  # delta read + prefix write-back; block write
        weights += 1  # output norm weight
    return e * (T * H * rows + H * weights)


def _clone_args(args: AttnResArgs) -> AttnResArgs:
    return AttnResArgs._make(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _vllm_k3(args: AttnResArgs, device) -> tuple[Peer, str | None]:
    """vLLM's K3 kernel on ``args`` (every variant) and where it came from; a reason starting
    ``failed:`` where it cannot be loaded on CUDA (a MISS: the figure the check wants)."""
    if device.type != "cuda":
        return "unsupported: CUDA only", None
    from kimi_passes.vllm.peer import PeerError, load_peer

    try:
        peer = load_peer("nvidia")
    except PeerError as e:
        return f"failed: {e}", None
    return (lambda: peer.attn_res(*args)), peer.source


def _peer_fns(args: AttnResArgs, variant, dtype, device) -> tuple[dict[str, Peer], dict]:
    """``{peer: fn or reason}`` (vLLM's K3 kernel, every variant; the PyPI peers' kernels,
    the ``read`` mixture) and ``{peer: where it came from}``."""
    vllm, source = _vllm_k3(args, device)
    reasons = []
    if device.type != "cuda":
        reasons.append("CUDA only")
    if variant != "read":
        reasons.append("computes the mixture only (no delta, block write or output norm)")
    if dtype != torch.bfloat16:
        reasons.append("bf16 only")
    # The RMSNorm weight folded into the query, in the peers' bf16.
    query = (args.norm_weight.float() * args.qk_weight.float()).to(torch.bfloat16)
    fns = {"vllm-k3": vllm, "flash-attn-res": _flash_attn_res(args, query, list(reasons)),
           "fast-attnres": _fast_attnres(args, query, list(reasons))}
    return fns, ({"vllm-k3": source} if source else {})


def _flash_attn_res(args: AttnResArgs, query, why: list[str]) -> Peer:
    try:
        from flash_attn_res import (
            phase_1_batched_attention_triton_op,
            phase_2_online_softmax_merge_triton_op,
        )
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
        return f"not installed ({type(e).__name__})"
    H, nb = args.prefix.shape[1], args.num_blocks
    if H & (H - 1):
        why.append(f"hidden size must be a power of 2 (tl.arange), got {H}")
    if nb < 1:
        why.append("needs at least one completed block")
    if why:
        return "unsupported: " + "; ".join(why)
    # Its layout is source-major [nb, B=1, T, H]: a copy made once, outside timing.
    vals = args.blocks[:, :nb].permute(1, 0, 2).contiguous()[:, None]
    pq, pre = query[None], args.prefix[None]

    def flash_attn_res():
        out1, lse1 = phase_1_batched_attention_triton_op(vals, pq, EPS)
        return phase_2_online_softmax_merge_triton_op(pre, pq[0], out1[0], lse1[0], EPS)[0]

    return flash_attn_res


def _fast_attnres(args: AttnResArgs, query, why: list[str]) -> Peer:
    try:
        from attnres import attnres
    except Exception as e:  # noqa: BLE001
        return f"not installed ({type(e).__name__})"
    H, nb = args.prefix.shape[1], args.num_blocks
    if H > 8192 or nb + 1 > 129:
        why.append("envelope is H <= 8192 and <= 129 sources")
    if why:
        return "unsupported: " + "; ".join(why)
    sources = [args.blocks[:, j] for j in range(nb)] + [args.prefix]  # views, no copy
    return lambda: attnres(sources, query, eps=EPS)


def _sweep(cfg) -> list[tuple]:
    """Cells ``(dtype, variant, T, H, nb)``: axis sweeps around a centre shape."""
    cells = []
    if cfg.user_shapes:
        for dt in cfg.dtypes:
            for v in cfg.variants:
                for H in cfg.H:
                    for nb in cfg.blocks:
                        for T in cfg.T:
                            cells.append((dt, v, T, H, nb))
        return cells
    H0, nb0, T0 = cfg.H[0], cfg.blocks[0], cfg.T_centre
    for dt in cfg.dtypes:
        for v in cfg.variants:
            cells += [(dt, v, T, H0, nb0) for T in cfg.T]
            cells += [(dt, v, T0, H, nb0) for H in cfg.H[1:]]
            cells += [(dt, v, T0, H0, nb) for nb in cfg.blocks[1:]]
    for dt, v, T, H, nb in cfg.extra_cells:
        if dt in cfg.dtypes and v in cfg.variants:
            cells.append((dt, v, T, H, nb))
    return cells


def _op_factories(cfg, variant, dtype) -> tuple[dict, dict]:
    """``{name: make(args) -> fn}`` for the timed candidates (not copy, not peers)."""
    op = torch.ops.kimi.attn_res
    makers: dict[str, Callable] = {"op": lambda a: lambda: op(*a)}
    notes = {}
    if cfg.device.type == "cuda":
        from kimi_passes.ops import attn_res_triton

        makers["triton"] = lambda a: lambda: attn_res_triton(*a)
        # The row kernel at every T: where auto takes the decode path (T <= 64 at H >= 2048,
        # ops/triton_decode.py), the two routes side by side.
        makers["triton-row"] = lambda a: lambda: attn_res_triton(*a, route="row")
    makers["eager"] = lambda a: lambda: plain_torch(*a)
    if cfg.compiled:
        compiled = torch.compile(plain_torch, dynamic=False)
        makers["compiled"] = lambda a: lambda: compiled(*a)
    else:
        notes["compiled"] = "skipped (--no-compiled)"
    return makers, notes


def bench_op(cfg, log) -> dict:
    rows: list[dict] = []
    sources: dict[str, str] = {}
    for cell in _sweep(cfg):
        torch._dynamo.reset()
        row = _op_row(cfg, *cell)
        for name, src in row["sources"].items():
            if sources.get(name) != src:
                log(f"   {name}: {src}")
                sources[name] = src
        rows.append(row)
        log(op_line(row, cfg.device))
    return {"rows": rows, "sources": sources}


def _op_row(cfg, dt_name, variant, T, H, nb) -> dict:
    """One cell: every candidate checked (``cfg.check``), the ones that ran timed."""
    dtype, device = DTYPES[dt_name], cfg.device
    args = make_op_args(T, H, nb, dtype, variant, device)
    nbytes = op_bytes(T, H, nb, dtype, variant)
    makers, notes = _op_factories(cfg, variant, dtype)
    peers: dict[str, Callable[[], object]] = {}
    failed: dict[str, str] = {}
    sources: dict[str, str] = {}
    if cfg.peers:  # each peer says why it does not run on CPU
        fns, sources = _peer_fns(args, variant, dtype, device)
        for name, fn in fns.items():
            if not isinstance(fn, str):
                peers[name] = fn
            elif fn.startswith("failed:"):  # a peer that should run and cannot: a MISS
                failed[name] = fn.removeprefix("failed: ")
            else:
                notes[name] = fn
    errors = _check_op(makers, peers, args, failed) if cfg.check else {}
    names = [*makers, *peers, *(k for k in failed if k not in makers and k not in peers)]
    makers = {k: v for k, v in makers.items() if k not in failed}
    peers = {k: v for k, v in peers.items() if k not in failed}
    samples, host = _time_op(cfg, args, nbytes, makers, peers)
    t = {name: summary(s) for name, s in samples.items()}
    vs_op = {name: _ratio(samples, name, "op") for name in samples if name not in ("op", "copy")}
    row = {
        "dtype": dt_name, "variant": variant, "T": T, "H": H, "nb": nb, "bytes": nbytes,
        "time_s": t,
        "host_time_s": host,
        "gbps": {name: nbytes / s["median"] / 1e9 for name, s in t.items()},
        "roofline": _ratio(samples, "copy", "op"),
        "op_vs_eager": _ratio(samples, "eager", "op"),
        "op_vs_compiled": _ratio(samples, "compiled", "op"),
        "vs_op": {k: v for k, v in vs_op.items() if v is not None},
        "max_rel_err": errors,
        "notes": notes,
        "sources": sources,
    }
    # ratio: t(candidate) / t(op) (> 1: the op is faster); the op's own is 1.
    ratio = {name: r["median"] for name, r in row["vs_op"].items()}
    if "op" in t:
        ratio["op"] = 1.0
    row["candidates"] = [
        verdict(name, T, t[name]["median"] if name in t else None, ratio.get(name),
                errors.get(name), OP_TOL[dtype],
                failed.get(name) or (None if cfg.check else "not checked (--no-check)"))
        for name in names]
    return row


def _ratio(samples: dict, num: str, den: str) -> dict | None:
    """The summary of per-round ``t(num) / t(den)``; None where either was not timed."""
    if num not in samples or den not in samples:
        return None
    return ratio_summary(samples[num], samples[den])


def _time_op(cfg, args: AttnResArgs, nbytes: int, makers: dict, peers: dict):
    """Interleaved samples of the candidates, a same-bytes copy and the peers; on CUDA also
    the op's and the Triton kernel's back-to-back host time."""
    device = cfg.device
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    # Every candidate shares ``args``: the in-place effects are idempotent enough
    # (the block write copies the prefix; the delta is 1e-3 of it).
    cands = {name: make(args) for name, make in makers.items()}
    cands["copy"] = lambda s=src, d=dst: d.copy_(s)
    cands.update(peers)
    with torch.no_grad():
        samples = cfg.timer.run(cands)
        host = ({name: cfg.timer.host_time(cands[name]) for name in ("op", "triton")
                 if name in cands} if device.type == "cuda" else None)
    return samples, host


def _check_op(makers, peers, args, failed) -> dict:
    """Each candidate's output (on fresh clones) against the fp32 reference, first rows:
    ``{name: rel_err}``. A candidate that raises goes into ``failed`` with the reason."""
    from kimi_passes.ops import attn_res_reference

    n = min(args.prefix.shape[0], 256)
    sliced = args._replace(prefix=args.prefix[:n].clone(), blocks=args.blocks[:n].clone(),
                           delta=None if args.delta is None else args.delta[:n].clone())
    with torch.no_grad():
        ref = attn_res_reference(*sliced)
    errors = {}
    # The peers' closures hold views of ``args`` (read variant: nothing is mutated).
    fns = {name: (lambda make=make: make(_clone_args(args))()) for name, make in makers.items()}
    fns.update(peers)
    for name, fn in fns.items():
        try:
            with torch.no_grad():
                out = fn()
            errors[name] = rel_err(out[:n], ref)
        except Exception as e:  # noqa: BLE001 - a failing candidate is reported, not fatal
            failed[name] = failure(e)
    return errors


# ----------------------------------------------------------------------------- output line


OP_HEADER = (f"{'dtype':>8} {'var':>4} {'T':>5} {'H':>5} {'nb':>2} {'MB':>8} "
             f"{'op ms':>9} {'op GB/s':>7} {'copy GB/s':>9} {'roof [IQR]':>16} "
             f"{'x eager [IQR]':>16} {'x comp [IQR]':>16}")


def op_line(row, device) -> str:
    t, g = row["time_s"], row["gbps"]
    op = (f"{t['op']['median'] * 1e3:9.4f} {g['op']:7.2f}" if "op" in t
          else f"{'-':>9} {'-':>7}")
    s = (f"{row['dtype']:>8} {row['variant']:>4} {row['T']:>5} {row['H']:>5} {row['nb']:>2} "
         f"{row['bytes'] / 1e6:8.2f} {op} {g['copy']:9.2f} {fmt_ratio(row['roofline']):>16} "
         f"{fmt_ratio(row['op_vs_eager']):>16} {fmt_ratio(row['op_vs_compiled']):>16}")
    extra = [f"{n}={t[n]['median'] * 1e3:.4f}ms" for n in ("triton", "triton-row", *PEERS)
             if n in t]
    if "triton-row" in row["vs_op"]:  # t(row kernel) / t(op): > 1 where the route auto took
        extra.append(f"op x row-route={fmt_ratio(row['vs_op']['triton-row'])}")  # is faster
    if "vllm-k3" in row["vs_op"]:  # the peer to beat: t(vLLM's kernel) / t(op), >= 1.0
        extra.append(f"op x vllm-k3={fmt_ratio(row['vs_op']['vllm-k3'])}")
    if "op" in (row.get("host_time_s") or {}):
        extra.append(f"op back-to-back={row['host_time_s']['op'] * 1e3:.4f}ms")
    # Every candidate that raised or is off, peers included, on every row.
    extra += misses(row.get("candidates", []))
    extra += [f"{n}: {why}" for n, why in row["notes"].items() if n in PEERS
              and device.type == "cuda" and row["variant"] == "read"
              and row["dtype"] == "bfloat16"]
    return s + ("  " + "; ".join(extra) if extra else "")
