"""The text report of a run's results and the GB/s plot of the op section."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch

from kimi_passes.bench.harness import fmt_ratio
from kimi_passes.bench.op import OP_HEADER, op_line
from kimi_passes.bench.quant import quant_line
from kimi_passes.ops.conventions import cdiv


def format_report(results: dict) -> str:
    out = io.StringIO()
    w = lambda s="": print(s, file=out)  # noqa: E731
    m = results["machine"]
    w(f"kimi_passes bench  {m['date']}  torch {m['torch']}  triton {m.get('triton')}  "
      f"device {m['device']}{' (' + m['gpu'] + ')' if 'gpu' in m else ''}")
    w(f"cpu {m['cpu']} x{m['cpu_count']} (torch threads {m['torch_threads']}), load average "
      f"{_load(m.get('loadavg_start'))} at start, {_load(m.get('loadavg_end'))} at end")
    w(f"command: {results['command']}")
    for name, section in SECTIONS.items():
        if name in results:
            w()
            section(w, results)
    if results.get("targets"):
        w()
        w("== targets ==")
        for t in results["targets"]:
            w(f"   {'MET ' if t['met'] else 'MISS'} {t['target']}: {t['value']:.4g}"
              + (f" ({t['reason']})" if t.get("reason") else ""))
    if results.get("errors"):
        w()
        for sec, err in results["errors"].items():
            w(f"!! section {sec} failed: {err.splitlines()[-1]}")
    return out.getvalue()


def _op(w, results: dict) -> None:
    w("== op: torch.ops.kimi.attn_res vs plain torch (eager, compiled) and a same-bytes "
      "copy ==")
    w("   times are medians; roof = t(copy)/t(op); x eager, x comp = t(baseline)/t(op); "
      "[IQR] of per-round ratios")
    for name, src in results["op"].get("sources", {}).items():
        w(f"   {name}: {src}")
    w(OP_HEADER)
    device = torch.device(results["machine"]["device"])
    for row in results["op"]["rows"]:
        w(op_line(row, device))
    w(verdict_line(results["op"]["rows"]))
    errs = [r["max_rel_err"] for r in results["op"]["rows"] if r["max_rel_err"]]
    if errs:
        worst: dict[str, float] = {}
        for e in errs:
            for k, v in e.items():
                worst[k] = max(worst.get(k, 0.0), v)
        w("   worst relative error vs the fp32 reference: "
          + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))


def _tap(w, results: dict) -> None:
    tp = results["tap"]
    c = tp["config"]
    w(f"== tap: compiled K3 step, L={c['num_layers']} S={c['block_size']} "
      f"H={c['hidden_size']} T={c['T']} {c['dtype']}, capture ids {c['capture_ids']} ==")
    for name, s in tp["time_s"].items():
        w(f"   {name:>10}: {s['median'] * 1e3:9.3f} ms  [IQR {s['q1'] * 1e3:.3f}-"
          f"{s['q3'] * 1e3:.3f}, min {s['min'] * 1e3:.3f}, max {s['max'] * 1e3:.3f}, "
          f"n={s['n']}]  tap err {tp['tap_max_rel_err_vs_ground_truth'][name]:.1e}")
    for key in ("attn_res_vs_prefix", "attn_res_vs_vllm_style", "vllm_style_vs_prefix"):
        w(f"   {key:>24}: {fmt_ratio(tp[key])}")
    for name, cs in tp.get("generated_code", {}).items():
        if cs:
            w(f"   {name:>10} generated code: {cs['kernels']} kernels, {cs['allocations']} "
              f"allocations, {cs['extern_calls']} extern calls, {cs['loops_over_H']} loops "
              "over H")
    w("   per tap at op level (its consumer alone; + fused capture; + separate mix read):")
    for r in tp.get("per_tap_ops", []):
        w(f"   id {r['capture_id']:>3} nb={r['num_blocks']} write={r['block_write_idx']:>2} "
          f"norm={'y' if r['output_norm'] else 'n'}: consumer "
          f"{r['consumer_s']['median'] * 1e3:8.3f} ms; fused +"
          f"{r['fused']['extra_s'] * 1e3:.3f} ms (x{fmt_ratio(r['fused']['ratio'])}); "
          f"separate +{r['separate']['extra_s'] * 1e3:.3f} ms "
          f"(x{fmt_ratio(r['separate']['ratio'])})")
    if "tap_ops_extra_s" in tp:
        e, sh = tp["tap_ops_extra_s"], tp["tap_ops_extra_share_of_step"]
        w(f"   all taps: fused +{e['fused'] * 1e3:.3f} ms ({sh['fused'] * 100:.2f}% of the "
          f"prefix step), separate +{e['separate'] * 1e3:.3f} ms "
          f"({sh['separate'] * 100:.2f}%)")


def _pass(w, results: dict) -> None:
    ps = results["pass"]
    c = ps["config"]
    w(f"== pass: kimi_backend's passes at L={c['num_layers']} (S={c['block_size']}, "
      f"H={c['hidden_size']}, T={c['T']}), capture ids {c['capture_ids']} ==")
    cc = ps.get("cold_compile")
    if cc:
        w(f"   cold compile {cc['total_s']:.2f}s (backend {cc['backend_s']:.2f}s); kimi "
          f"passes {cc['pass_s'] * 1e3:.1f}ms = {cc['share'] * 100:.3f}% of the compile")
    else:
        w(f"   {ps.get('note')}")
    for key in ("standalone", "all_taps"):
        if key in ps:
            sa = ps[key]
            w(f"   passes alone, {sa['taps']} taps, {sa['nodes']} nodes: "
              f"{sa['time_s']['median'] * 1e3:.2f} ms [IQR {sa['time_s']['q1'] * 1e3:.2f}-"
              f"{sa['time_s']['q3'] * 1e3:.2f}] (AuxStreamPass alone "
              f"{sa['aux_time_s']['median'] * 1e3:.2f} ms, with fuse=False "
              f"{sa['aux_unfused_time_s']['median'] * 1e3:.2f} ms); profile of the passes:")
            for r in sa["profile"][:8]:
                w(f"      {r['cumtime_s'] * 1e3:8.2f} ms cum {r['tottime_s'] * 1e3:8.2f} ms "
                  f"self {r['ncalls']:>7} calls  {r['function']}")
    if "per_extra_tap_s" in ps:
        w(f"   per extra tap: {ps['per_extra_tap_s'] * 1e3:.3f} ms")


def _compile(w, results: dict) -> None:
    cp = results["compile"]
    w(f"== compile: cold compile time vs depth (H={cp['hidden_size']}, T={cp['T']}) ==")
    w(f"   {'L':>3} {'total s':>8} {'backend s':>9} {'pass ms':>8} {'share':>7} "
      f"{'s/layer':>8} {'nodes':>6}")
    for p in cp["points"]:
        w(f"   {p['num_layers']:>3} {p['total_s']:8.1f} {p['backend_s']:9.1f} "
          f"{p['pass_s'] * 1e3:8.1f} {p['share'] * 100:6.3f}% "
          f"{p['total_s'] / p['num_layers']:8.2f} {p['nodes']:>6}")
    if "fit_total" in cp:
        f, fp = cp["fit_total"], cp["fit_pass"]
        w(f"   fit total = {f['intercept']:.1f}s + {f['slope']:.2f}s/layer (R^2 "
          f"{f['r2']:.3f}); time/layer deepest/shallowest {cp['per_layer_ratio']:.2f}")
        w(f"   fit pass  = {fp['intercept'] * 1e3:.1f}ms + {fp['slope'] * 1e3:.2f}ms/layer "
          f"(R^2 {fp['r2']:.3f}); pass time/layer deepest/shallowest "
          f"{cp['pass_per_layer_ratio']:.2f}")


def _quant(w, results: dict) -> None:
    w("== quant: compiled AttnRes site + per-token FP8 quant, fused (attn_res_quant) vs "
      "unfused ==")
    w("   speedup = t(unfused) / t(fused) per round, median [IQR]; control = t(unfused) / "
      "t(a second unfused compile)")
    for r in results["quant"]["rows"]:
        w("   " + quant_line(r))
    w(verdict_line(results["quant"]["rows"]))


#: A section's lines of the report, in report order.
SECTIONS = {"op": _op, "tap": _tap, "pass": _pass, "compile": _compile, "quant": _quant}


def verdict_line(rows: list[dict]) -> str:
    """How many candidates met their tolerance and how many missed, over a section's rows."""
    cands = [c for r in rows for c in r.get("candidates", [])]
    miss = sum(c["verdict"] != "MET" for c in cands)
    return (f"   candidates held to their tolerance: {len(cands) - miss} MET, {miss} MISS"
            + (" (each MISS is on its row, with the reason)" if miss else ""))


def _load(x) -> str:
    return "?" if not x else "/".join(f"{v:.1f}" for v in x)


# ----------------------------------------------------------------------------- plot


def plot(results: dict, path: Path) -> str:
    """GB/s against T (the T sweep of the op section); returns a status line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'kimi-passes[bench]'): no plot"
    rows = results.get("op", {}).get("rows", [])
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["dtype"], r["variant"], r["H"], r["nb"]), []).append(r)
    groups = {k: v for k, v in groups.items() if len({r["T"] for r in v}) >= 2}
    if not groups:
        return "no T sweep in the results: no plot"
    keys = sorted(groups)
    ncols = 2 if len(keys) > 1 else 1
    nrows = cdiv(len(keys), ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.4 * nrows), squeeze=False,
                             sharey=True)
    m = results["machine"]
    for ax, key in zip(axes.flat, keys, strict=False):
        rs = sorted(groups[key], key=lambda r: r["T"])
        names = [n for n in rs[-1]["gbps"]]
        for n in names:
            ts = [r["T"] for r in rs if n in r["gbps"]]
            ax.plot(ts, [r["gbps"][n] for r in rs if n in r["gbps"]], marker="o", ms=3,
                    label=n, ls="--" if n == "copy" else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{key[0]} {key[1]}, H={key[2]}, {key[3]} blocks", fontsize=9)
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel("GB/s (op's bytes / time)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle(f"kimi attn_res, {m.get('gpu') or m['cpu']} ({m['device']}), "
                 f"torch {m['torch']}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=72)
    plt.close(fig)
    with contextlib.suppress(Exception):  # a palette PNG is a third of the size
        from PIL import Image

        with Image.open(path) as im:
            small = im.convert("RGB").quantize(colors=64)
        small.save(path, optimize=True)
    return f"plot written to {path}"
