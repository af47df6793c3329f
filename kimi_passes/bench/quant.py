"""Section ``quant``: an AttnRes site whose output a per-token FP8 quant reads, compiled
whole, with the quant fused into the op (``fuse_quant=True``: one ``attn_res_quant``)
against the same graph unfused (``fuse_quant=False``: ``attn_res``, then the quant).

The site is K3's pre-attention mixing (delta, output norm; ``--quant-blocks`` completed
blocks) in bf16 at ``--quant-H``; the quant is the AMD kernel's formula in plain torch
(``graphs.k3.fp8_per_token``: ``scale = max(amax, 1e-10) * (1 / 448)``, float8_e4m3fn),
which the pass recognises like vLLM's ``QuantFP8``. Per T, both graphs are compiled by
``kimi_backend`` (static shapes, the kimi ops lowered to generated code on CPU, Inductor's
``emulate_precision_casts`` on: without it Inductor's C++ backend quantizes the unfused
graph's unrounded fp32 output), then timed in interleaved rounds (the op section's timer):
``speedup`` is t(unfused) / t(fused) per round (> 1: fusing is faster), median and
interquartile range. Each candidate is held to the unfused graph's fp8 bytes and scales
(``err``: the elements that differ; tolerance 0) and to its fusion count (1 site fused
with ``fuse_quant``, none without): else MISS with the reason, as when it raises (its
row's ``candidates``; ``ratio`` = t(unfused) / t(candidate)).
"""

from __future__ import annotations

from typing import Any

import torch

from kimi_passes.bench.harness import (
    failure,
    fmt_ratio,
    misses,
    op_args,
    ratio_summary,
    summary,
    verdict,
)
from kimi_passes.graphs.k3 import fp8_per_token


def site(prefix, delta, bank, norm_weight, qk_weight, output_norm_weight, nb: int, eps: float):
    """One mixing site and the quant of its output."""
    y = torch.ops.kimi.attn_res(prefix, delta, bank, norm_weight, qk_weight, output_norm_weight,
                                nb, -1, eps, eps)
    return fp8_per_token(y)


def site_inputs(T: int, H: int, nb: int, device, seed: int = 0) -> list:
    """``site``'s tensors: K3's pre-attention call (delta, output norm, no block write), bf16.
    The one place the quant section builds its inputs."""
    a = op_args(T, H, nb, dtype=torch.bfloat16, device=device, delta=1.0, output_norm=True,
                seed=seed)
    return list(a.tensors)


def bench_quant(cfg, log) -> dict:
    from kimi_passes.debug.recording import graph_caches_off

    # Caches off: a cached graph would skip the passes this section counts (and the reset
    # between compiles makes each compile again on its first timed call).
    with graph_caches_off():
        return {"rows": [_row(cfg, log, T) for T in cfg.quant_T]}


#: The compiles timed per T: fuse_quant for each, and a second unfused compile (the
#: control: what identical code measures against itself in the same rounds).
WAYS = (("fused", True), ("unfused", False), ("control", False))


def _compile(fuse: bool, inputs: list, nb: int, eps: float):
    """One way compiled and run once: ``(fn, its own inputs, outputs, fused sites)``."""
    from kimi_passes import make_kimi_backend
    from kimi_passes.quant import FuseQuantPass

    # emulate_precision_casts: the unfused graph rounds the AttnRes output to bf16
    # before its quant, as eager and the fused op do (docs/design.md section 10).
    backend = make_kimi_backend(fuse_quant=fuse, emulate_precision_casts=True)
    torch._dynamo.reset()
    fn: Any = torch.compile(site, backend=backend, fullgraph=True, dynamic=False)
    args = [x.clone() for x in inputs]  # the prefix is updated in place: own inputs
    with torch.no_grad():
        outs = fn(*args, nb, eps)
    quant = next((p for p in backend.passes.passes if isinstance(p, FuseQuantPass)), None)
    fused = 0 if quant is None else sum(f.skipped is None for f in quant.last_fusions)
    return fn, args, outs, fused


def _differ(outs, want) -> int:
    """Elements of the fp8 data (as bytes) and of the scales that differ from ``want``'s."""
    (q, s), (qw, sw) = outs, want
    if q.shape != qw.shape or s.shape != sw.shape:
        return q.numel() + s.numel()
    return int((q.view(torch.uint8) != qw.view(torch.uint8)).sum() + (s != sw).sum())


def _row(cfg, log, T: int) -> dict:
    H, nb, eps = cfg.quant_H, cfg.quant_blocks, 1e-6
    inputs = site_inputs(T, H, nb, cfg.device)
    compiled, failed, errs = {}, {}, {}
    for name, fuse in WAYS:
        try:
            compiled[name] = _compile(fuse, inputs, nb, eps)
        except Exception as e:  # noqa: BLE001 - a failing way is reported, not fatal
            failed[name] = failure(e)
            continue
        if compiled[name][3] != int(fuse):
            failed[name] = (f"{compiled[name][3]} sites fused, expected {int(fuse)} "
                            f"(fuse_quant={fuse})")
    want = compiled.get("unfused")
    for name, (_, _, outs, _) in compiled.items():
        if want is None:
            failed.setdefault(name, f"no reference: unfused {failed.get('unfused')}")
        else:
            errs[name] = _differ(outs, want[2])
    # A way that compiled is timed, off or not (its MISS says why).
    cands = {name: (lambda fn=fn, args=args: fn(*args, nb, eps))
             for name, (fn, args, _, _) in compiled.items()}
    with torch.no_grad():
        samples = cfg.timer.run(cands) if cands else {}
    ratio = {name: ratio_summary(samples["unfused"], s) for name, s in samples.items()
             if "unfused" in samples}
    row: dict[str, Any] = {
        "T": T, "H": H, "nb": nb, "dtype": "bfloat16", "quant": "AMD formula, e4m3fn",
        "bytes_and_scales_equal": errs.get("fused") == 0,
        "time_s": {name: summary(s) for name, s in samples.items()},
        "speedup": ratio.get("fused"), "control": ratio.get("control"),
        "candidates": [verdict(name, T, summary(samples[name])["median"] if name in samples
                               else None, ratio[name]["median"] if name in ratio else None,
                               errs.get(name), 0, failed.get(name)) for name, _ in WAYS],
    }
    log("  " + quant_line(row))
    return row


def quant_line(r: dict) -> str:
    """A row of the section, as the log and the report print it."""
    t = r["time_s"]

    def ms(name: str) -> str:
        return f"{t[name]['median'] * 1e3:9.3f} ms" if name in t else f"{'-':>9} ms"

    line = (f"T={r['T']:5d} H={r['H']} nb={r['nb']} {r['dtype']}: fused {ms('fused')}, "
            f"unfused {ms('unfused')}, speedup {fmt_ratio(r['speedup'])}, control "
            f"{fmt_ratio(r['control'])}, bytes and scales equal: {r['bytes_and_scales_equal']}")
    return "; ".join([line, *misses(r.get("candidates", []))])
