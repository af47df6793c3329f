"""Section ``compile``: cold compile time against depth, and the instrumented compile the
``pass`` section measures inside.

Cold compile time over 8..93 layers at the same toy width, a linear fit, and the
time per layer at the deepest over the shallowest depth.

The kimi passes are timed inside a compile by ``_timed_backend``, a kimi backend whose
pass manager records its time and its input graph; ``cold_compile`` and ``capture_graph``
are the two ways the sections use it.
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace
from typing import Any

import torch

from kimi_passes.bench.harness import k3_input, linear_fit
from kimi_passes.debug.recording import graph_caches_off

# ----------------------------------------------------------------------------- K3 models


def k3_ids(L: int) -> tuple[int, ...]:
    """K3-geometry taps at depth L: EAGLE3, the last block-write layer before L-3, and L.

    At L=93 these are ``K3Config.k3_geometry()``'s ids (2, 46, 88, 90, 93).
    """
    return tuple(sorted(k for k in {2, L // 2, 8 * ((L - 3) // 8), L - 3, L} if 0 <= k <= L))


def k3_depth(L: int):
    from kimi_passes.graphs import K3Config

    return replace(K3Config.k3_geometry(), num_layers=L, aux_layer_ids=k3_ids(L))


# ----------------------------------------------------------------------------- compiles


class _Abort(Exception):
    """Raised by the timing pass manager to stop a compile right after the passes."""


def _timed_backend(aux_stream="attn_res", abort=False, keep_graph=True):
    """A kimi backend whose pass manager reports its time and a copy of its input graph."""
    from kimi_passes import make_kimi_backend
    from kimi_passes.fx.manager import PassObserver

    backend = make_kimi_backend(aux_stream=aux_stream)
    rec: dict[str, Any] = {"pass_s": 0.0, "calls": 0, "graph": None, "nodes": 0,
                           "copy_s": 0.0, "backend_s": 0.0}

    class Timing(PassObserver):
        def before_passes(self, graph):
            if keep_graph:
                t0 = time.perf_counter()
                rec["graph"] = copy.deepcopy(graph)
                rec["copy_s"] += time.perf_counter() - t0
            rec["nodes"] = len(graph.nodes)

        def after_passes(self, graph, seconds):
            rec["pass_s"] += seconds  # the passes' own time (each pass times itself)
            rec["calls"] += 1
            if abort:
                raise _Abort

    backend.passes.observe(Timing())

    def fn(gm, example_inputs):
        t0 = time.perf_counter()
        try:
            return backend(gm, example_inputs)
        finally:
            rec["backend_s"] += time.perf_counter() - t0

    return fn, backend, rec


def cold_compile(k3, T, device) -> dict:
    """One cold compile + first call of a K3 model; the pass timed inside it."""
    from kimi_passes.graphs import K3Model

    torch._dynamo.reset()
    model = K3Model(k3).to(device)
    ids = k3_input(k3, T, device)
    fn, backend, rec = _timed_backend()
    cm = torch.compile(model, backend=fn)
    # No cache of any kind: every compile lowers and builds its kernels from scratch.
    with torch._inductor.config.patch(force_disable_caches=True), torch.no_grad():
        t0 = time.perf_counter()
        cm(ids)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        total = time.perf_counter() - t0 - rec["copy_s"]
    return {"num_layers": k3.num_layers, "capture_ids": list(k3.aux_layer_ids),
            "total_s": total, "backend_s": rec["backend_s"] - rec["copy_s"],
            "pass_s": rec["pass_s"], "pass_calls": rec["calls"], "nodes": rec["nodes"],
            "share": rec["pass_s"] / total, "graph": rec["graph"],
            "rewrites": [r.how() for r in backend.aux_pass.last_rewrites]}


def capture_graph(k3, T, device):
    """The post-grad graph the pass sees (the compile is stopped right after the pass)."""
    from kimi_passes.graphs import K3Model

    torch._dynamo.reset()
    model = K3Model(k3).to(device)
    ids = k3_input(k3, T, device)
    fn, _, rec = _timed_backend(abort=True)
    cm = torch.compile(model, backend=fn)
    with graph_caches_off(), torch.no_grad():  # the post-grad passes run
        try:
            cm(ids)
        except Exception as e:  # noqa: BLE001 - the abort surfaces wrapped by Dynamo/Inductor
            if rec["graph"] is None:
                raise
            del e
    torch._dynamo.reset()
    return rec["graph"]


# ----------------------------------------------------------------------------- the section


def warm_up_compiler(cfg, log, cache: dict) -> None:
    """Pay the process's one-time compile costs (imports, headers) before measuring."""
    if cache.get("warm"):
        return
    t0 = time.perf_counter()
    cold_compile(k3_depth(1), cfg.compile_T, cfg.device)
    cache["warm"] = True
    log(f"  warm-up cold compile (1 layer): {time.perf_counter() - t0:.1f}s (not counted)")


def bench_compile(cfg, log, cache: dict) -> dict:
    warm_up_compiler(cfg, log, cache)
    points = []
    for L in cfg.layers:
        cc = cache.get(L)
        if cc is None:
            cc = cold_compile(k3_depth(L), cfg.compile_T, cfg.device)
        cc.pop("graph", None)
        points.append(cc)
        log(f"  L={L:>3}: total {cc['total_s']:7.1f}s  backend {cc['backend_s']:7.1f}s  "
            f"pass {cc['pass_s'] * 1e3:8.1f}ms ({cc['share'] * 100:.3f}%)  nodes {cc['nodes']}")
    Ls = [p["num_layers"] for p in points]
    res = {"T": cfg.compile_T, "hidden_size": k3_depth(1).hidden_size, "points": points}
    if len(points) >= 2:
        res["fit_total"] = linear_fit(Ls, [p["total_s"] for p in points])
        res["fit_pass"] = linear_fit(Ls, [p["pass_s"] for p in points])
        first, last = points[0], points[-1]
        res["per_layer_ratio"] = ((last["total_s"] / last["num_layers"])
                                  / (first["total_s"] / first["num_layers"]))
        res["pass_per_layer_ratio"] = ((last["pass_s"] / last["num_layers"])
                                       / (first["pass_s"] / first["num_layers"]))
    return res
