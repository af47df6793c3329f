"""Section ``pass``: the kimi passes' cost, inside a cold compile and alone.

The aux-stream pass's time as a share of a cold compile (``force_disable_caches``)
at K3's depth (``K3Config.k3_geometry()``, 93 layers); target <= 2%. Also the pass
alone, timed on copies of the captured post-grad graph, with a profile, and the same
with every capture id tapped (how the pass scales with the number of taps).

(Not named ``pass.py``: ``pass`` is a Python keyword, so no import could name it.)
"""

from __future__ import annotations

import copy
import cProfile
import io
import pstats
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kimi_passes.bench.compile_time import (
    capture_graph,
    cold_compile,
    k3_depth,
    warm_up_compiler,
)
from kimi_passes.bench.harness import summary, target

# Target (docs/design.md section 5).
TARGET_PASS_SHARE = 0.02  # pass time / cold compile time at K3 depth


def bench_pass(cfg, log, cache: dict) -> dict:
    k3 = k3_depth(cfg.pass_layers)
    res: dict = {"config": {"num_layers": k3.num_layers, "hidden_size": k3.hidden_size,
                            "block_size": k3.attn_res_block_size, "T": cfg.compile_T,
                            "capture_ids": list(k3.aux_layer_ids)}}
    if cfg.pass_cold:
        warm_up_compiler(cfg, log, cache)
        cc = cold_compile(k3, cfg.compile_T, cfg.device)
        cache[k3.num_layers] = cc
        graph = cc.pop("graph")
        res["cold_compile"] = cc
        log(f"  cold compile L={k3.num_layers}: total {cc['total_s']:.1f}s, backend "
            f"{cc['backend_s']:.1f}s, pass {cc['pass_s'] * 1e3:.1f}ms "
            f"({cc['share'] * 100:.3f}% of the compile), {cc['nodes']} nodes")
        res["targets"] = [target(f"pass: share of a cold compile at L={k3.num_layers}",
                                 cc["share"], TARGET_PASS_SHARE, "<=")]
    else:
        graph = capture_graph(k3, cfg.compile_T, cfg.device)
        res["cold_compile"] = None
        res["note"] = "no cold compile in --quick: the share needs the default mode"
    res["standalone"] = time_pass(graph, cfg.pass_reps, profile=True)
    sa = res["standalone"]
    log(f"  passes alone ({sa['taps']} taps, {sa['nodes']} nodes): "
        f"{sa['time_s']['median'] * 1e3:.2f}ms [{sa['time_s']['q1'] * 1e3:.2f}-"
        f"{sa['time_s']['q3'] * 1e3:.2f}], AuxStreamPass {sa['aux_time_s']['median'] * 1e3:.2f}"
        f"ms, unfused {sa['aux_unfused_time_s']['median'] * 1e3:.2f}ms")
    if cfg.pass_all_taps:
        all_k3 = replace(k3, aux_layer_ids=tuple(range(k3.num_layers + 1)))
        g_all = capture_graph(all_k3, cfg.compile_T, cfg.device)
        res["all_taps"] = time_pass(g_all, cfg.pass_reps, profile=True)
        at = res["all_taps"]
        per_tap = ((at["time_s"]["median"] - sa["time_s"]["median"])
                   / max(1, at["taps"] - sa["taps"]))
        res["per_extra_tap_s"] = per_tap
        log(f"  passes alone, every capture id tapped ({at['taps']} taps, {at['nodes']} "
            f"nodes): {at['time_s']['median'] * 1e3:.2f}ms, AuxStreamPass "
            f"{at['aux_time_s']['median'] * 1e3:.2f}ms, unfused "
            f"{at['aux_unfused_time_s']['median'] * 1e3:.2f}ms; {per_tap * 1e3:.3f}ms per "
            "extra tap")
    return res


def time_pass(graph, reps: int, profile: bool = False) -> dict:
    """The kimi passes alone on fresh copies of ``graph``: time, nodes, profile.

    ``time_s``: the whole pass manager ``kimi_backend`` installs (every kimi pass);
    ``aux_time_s``: ``AuxStreamPass`` alone; ``aux_unfused_time_s``: it with ``fuse=False``
    (the vLLM-style capture). Interleaved; the graph copies are made outside the timing.
    """
    from kimi_passes import AuxStreamPass, pass_manager

    makers = {"time_s": lambda: pass_manager(aux_stream="attn_res"),
              "aux_time_s": lambda: AuxStreamPass("attn_res"),
              "aux_unfused_time_s": lambda: AuxStreamPass("attn_res", fuse=False)}
    ts: dict[str, list[float]] = {k: [] for k in makers}
    for _ in range(reps):
        for key, make in makers.items():
            g, p = copy.deepcopy(graph), make()
            t0 = time.perf_counter()
            p(g)
            ts[key].append(time.perf_counter() - t0)
    res: dict[str, Any] = {key: summary(v) for key, v in ts.items()}
    res["nodes"] = len(graph.nodes)
    res["taps"] = sum(1 for n in graph.nodes if n.target is torch.ops.kimi.aux_tap.default)
    if profile:
        g, p = copy.deepcopy(graph), pass_manager(aux_stream="attn_res")
        prof = cProfile.Profile()
        prof.enable()
        p(g)
        prof.disable()
        res["profile"] = _profile_rows(prof)
    return res


def _profile_rows(prof, top=25) -> list[dict]:
    st = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    table = st.stats  # type: ignore[attr-defined]  # pstats keeps it there; typeshed omits it
    for (file, line, func), (_cc, nc, tt, ct, _callers) in table.items():
        rows.append({"function": f"{Path(file).name}:{line}({func})", "ncalls": nc,
                     "tottime_s": tt, "cumtime_s": ct})
    rows.sort(key=lambda r: r["cumtime_s"], reverse=True)
    return rows[:top]
