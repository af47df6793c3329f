"""vLLM's own Kimi K3 forward on a GPU: vLLM's attn_res (flag off, flag on) vs the kimi pass.

Runs the installed vLLM K3 NVIDIA forward code (tests/vllm_k3_harness.py: the same code
objects and stand-ins as tests/test_vllm_k3.py) at K3's width, and reports, per token
count, every row's worst aux-state error against vLLM's own flag-on eager output and its
time per forward (CUDA events, the rows interleaved round by round, median of rounds):

- ``vllm off``: vLLM's own ``attn_res`` (its Triton kernel; its ``torch.ops._C
  .kimi_k3_attn_res`` where vLLM takes it: H=7168 on SM100 with vLLM's extension built),
  eager, ``VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=0`` (the prefix stream: its error is the bug);
- ``vllm on``: the same with the flag on (a second mixing call per capture);
- ``vllm on, compiled``: that, compiled by plain Inductor (Dynamo traces vLLM's launch);
- ``kimi pass``: the route users get (``kimi_passes.vllm.k3_route``: ``kimi::attn_res``), flag
  off, compiled with ``kimi_backend`` (attn_res stream): one dynamic compile for every T.

First, on CUDA: vLLM's own ``attn_res`` left unrouted and compiled with ``kimi_backend``
is refused under the attn_res stream and runs under the prefix stream.

Without vLLM it is a skip: it prints why as ``{"skip": ...}`` (also into ``--json``) and exits
3 (tools/gpu_check.py's convention); a row that fails exits 1. ``python tools/vllm_k3_gpu.py
--device cpu --hidden 64 --T 4 --rounds 1`` runs it here (vLLM's kernel interpreted: slow;
no ``vllm on, compiled`` row: Dynamo traces vLLM's launch only where Triton compiles it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--block-size", type=int, default=2)
    p.add_argument("--T", type=int, nargs="+", default=[1, 8, 256])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=10, help="forwards per timed round")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if importlib.util.find_spec("vllm") is None:
        return skip("vLLM is not installed here (the rows run vLLM's installed K3 code: "
                    "bash tools/install_vllm.sh where a registry is reachable)", args.json)
    if args.device == "cpu":
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    import torch.fx.experimental._config as fx_config
    import vllm_k3_harness as h  # type: ignore[import-not-found]

    import kimi_passes
    import kimi_passes.vllm.k3_route as route

    dtype = getattr(torch, args.dtype)
    spec = h.Spec(num_layers=args.layers, hidden=args.hidden, block_size=args.block_size,
                  inner=args.hidden)
    ids_of = {T: h.token_ids(spec, T).to(args.device) for T in args.T}
    capture = sorted({0, args.block_size, args.block_size + 1, args.layers - 1, args.layers})
    w = h.weights(spec, dtype, args.device)
    nvidia, _ = h.vllm_modules()
    own = h.own_attn_res()
    native = hasattr(torch.ops._C, "kimi_k3_attn_res")
    print(f"vLLM's attn_res: {own.__module__}; torch.ops._C.kimi_k3_attn_res "
          f"{'present' if native else 'absent'} (vLLM takes it at H=7168 on SM100 only)")

    def model(on):
        with h.flag(on):
            return h.build(spec, w, capture).to(args.device)

    def forward(m, on, T, kernel):
        with h.flag(on), fx_config.patch(  # type: ignore[attr-defined]
                backed_size_oblivious=True):
            if kernel == "vllm":
                with h.vllm_kernel():
                    return h.call(m, ids_of[T], dynamic=True)
            route.route_attn_res()
            try:
                return h.call(m, ids_of[T], dynamic=True)
            finally:
                route.unroute_attn_res()

    truth = {T: h.aux_of(forward(model(True), True, T, "vllm")) for T in args.T}
    failed: list[dict] = []
    if args.device == "cuda":  # Dynamo traces vLLM's Triton launch only where it is compiled
        failed += unrouted_check(model, forward, args.T[0])
    torch._dynamo.reset()
    os.environ[route.ENV_VAR] = "attn_res"
    ours = torch.compile(model(False), backend=kimi_passes.make_kimi_backend("attn_res"),
                         fullgraph=True)
    rows = {"vllm off": (model(False), False, "vllm"), "vllm on": (model(True), True, "vllm")}
    if args.device == "cuda":  # on CPU Dynamo cannot trace the interpreted launch
        rows["vllm on, compiled"] = (
            torch.compile(model(True), backend="inductor", fullgraph=True), True, "vllm")
    rows["kimi pass"] = (ours, False, "kimi")
    results: list[dict] = []
    for T in args.T:
        times: dict[str, list[float]] = {name: [] for name in rows}
        errors = {}
        for name, (m, on, kernel) in list(rows.items()):  # first call: compile, values
            t0 = time.perf_counter()
            try:
                got = h.aux_of(forward(m, on, T, kernel))
            except Exception as e:  # a row that cannot run here is reported, then dropped
                print(f"T={T} {name}: FAILED, row dropped: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:300]}")
                del rows[name], times[name]
                failed.append({"T": T, "row": name, "error": f"{type(e).__name__}: {e}"})
                continue
            first = time.perf_counter() - t0
            errors[name] = max(float((g.float() - t.float()).abs().max())
                               for g, t in zip(got, truth[T], strict=True))
            print(f"T={T} {name}: first call {first:.1f}s, worst aux error {errors[name]:.3g}")
        for _ in range(args.rounds):  # interleaved rounds
            for name, (m, on, kernel) in rows.items():
                sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
                sync()
                t0 = time.perf_counter()
                for _ in range(args.reps):
                    forward(m, on, T, kernel)
                sync()
                times[name].append((time.perf_counter() - t0) / args.reps * 1e3)
        base = statistics.median(times["vllm on"]) if "vllm on" in times else float("nan")
        for name in rows:
            ms = statistics.median(times[name])
            results.append({"T": T, "row": name, "ms": ms, "vs_vllm_on": ms / base,
                            "worst_aux_error": errors[name]})
            print(f"T={T:5d}  {name:18s} {ms:8.3f} ms  x{ms / base:5.2f} of vllm on  "
                  f"aux error {errors[name]:.3g}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": results, "failed": failed}, indent=1))
    return 1 if failed else 0


def skip(why: str, json_path: str | None) -> int:
    """A skip as tools/gpu_check.py reads one: ``{"skip": why}`` printed (and in the JSON
    file), exit 3."""
    line = json.dumps({"skip": f"vllm_k3_gpu: {why}"})
    print(line)
    if json_path:
        Path(json_path).write_text(line)
    return 3


def unrouted_check(model, forward, T) -> list[dict]:
    """vLLM's own ``attn_res`` left unrouted, compiled with ``kimi_backend``: the attn_res
    stream must refuse it (``kimi_passes/taps/unrouted.py``: the Triton launch as Dynamo
    records it, or ``_C::kimi_k3_attn_res``), the prefix stream must compile and run."""
    import torch

    import kimi_passes
    from kimi_passes import AuxCaptureError

    failed = []
    for stream in ("attn_res", "prefix"):
        torch._dynamo.reset()
        m = torch.compile(model(False), backend=kimi_passes.make_kimi_backend(stream),
                          fullgraph=True)
        got: Exception | None = None
        try:
            forward(m, False, T, "vllm")
        except Exception as e:  # noqa: BLE001  (reported below, not hidden)
            got = e
        refused = isinstance(got, AuxCaptureError)
        ok = refused if stream == "attn_res" else got is None
        line = "refused" if refused else ("ran" if got is None else f"{type(got).__name__}")
        detail = str(got).splitlines()[0][:300] if got is not None else ""
        print(f"unrouted vLLM attn_res, {stream} stream: {line} "
              f"({'as expected' if ok else 'UNEXPECTED'}) {detail}")
        if not ok:
            failed.append({"T": T, "row": f"unrouted, {stream} stream",
                           "error": f"{line}: {detail}"})
    return failed


if __name__ == "__main__":
    sys.exit(main())
