"""vLLM's own Kimi K3 forward on a GPU: vLLM's attn_res (flag off, flag on) vs the kimi pass.

Runs the installed vLLM K3 NVIDIA forward code (``kimi_passes.graphs.vllm_k3``: vLLM's
model classes with stand-in attention and MLP) at K3's width and reports, per token
count, one row per candidate: its worst aux-state ``rel_err`` against vLLM's own flag-on
eager output at the bench's whole-model tolerance (``MODEL_TOL``), MET or MISS, and its
time per forward (the bench's ``Timer``: CUDA events; off CUDA, the compiled rows only):

- ``vllm off``: vLLM's ``attn_res``, eager, ``VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=0`` (the
  prefix stream). Its captures are the bug: MET when its error is over the tolerance
  (the comparison sees the bug), MISS when it matches flag on;
- ``vllm on``: the same with the flag on (a second mixing call per capture);
- ``vllm on, compiled``: that, compiled by plain Inductor (CUDA only: Dynamo traces
  vLLM's launch only where Triton compiles it);
- ``kimi pass``: the route users get (``kimi_passes.vllm.k3.route``), flag off, compiled
  with ``kimi_backend`` (attn_res stream): one dynamic compile for every T.
  The compiled rows are judged against flag on compiled by plain Inductor (kimi ops).

First, on CUDA: vLLM's own ``attn_res`` left unrouted and compiled with ``kimi_backend``
is refused under the attn_res stream and runs under the prefix stream (a MET/MISS row).
Without vLLM it is a skip: ``{"skip": ...}`` printed (and in ``--json``), exit 3; a MISS
exits 1. ``python -m tools.gpu.vllm_k3 --device cpu --hidden 64 --T 4 --rounds 1`` runs
it on CPU (vLLM's kernel interpreted).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from tools.gpu.report import emit, skip


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.gpu.vllm_k3",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--block-size", type=int, default=2)
    p.add_argument("--T", type=int, nargs="+", default=[1, 8, 256])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=10, help="CUDA: forwards per timed sample")
    p.add_argument("--json", help="write the rows here")
    return p.parse_args(argv)


class Forwards:
    """vLLM's K3 model built from one set of weights, and one forward of it per kind:
    ``"vllm"`` (vLLM's own ``attn_res``) or ``"kimi"`` (routed to ``kimi::attn_res``)."""

    def __init__(self, args: argparse.Namespace):
        import torch

        import kimi_passes.graphs.vllm_k3 as harness  # vLLM's K3 classes on stand-ins

        self.h: Any = harness
        h, self.device = self.h, args.device
        self.spec = h.Spec(num_layers=args.layers, hidden=args.hidden,
                           block_size=args.block_size, inner=args.hidden)
        self.ids = {T: h.token_ids(self.spec, T).to(args.device) for T in args.T}
        self.capture = sorted({0, args.block_size, args.block_size + 1, args.layers - 1,
                               args.layers})
        self.w = h.weights(self.spec, getattr(torch, args.dtype), args.device)

    def model(self, on: bool):
        with self.h.flag(on):
            return self.h.build(self.spec, self.w, self.capture).to(self.device)

    def __call__(self, m, on: bool, T: int, kernel: str):
        import torch.fx.experimental._config as fx_config

        import kimi_passes.vllm.k3.route as route

        h = self.h
        with h.flag(on), fx_config.patch(  # type: ignore[attr-defined]
                backed_size_oblivious=True):
            if kernel == "vllm":
                with h.vllm_kernel():
                    return h.call(m, self.ids[T], dynamic=True)
            route.route_attn_res()
            try:
                return h.call(m, self.ids[T], dynamic=True)
            finally:
                route.unroute_attn_res()


COMPILED = ("vllm on, compiled", "kimi pass")  # judged against the compiled reference


def candidates(fw: Forwards, device: str) -> dict[str, tuple[Any, bool, str]]:
    """Each row's (model, flag, kernel), and ``reference``: flag on, routed to the kimi ops,
    compiled by plain Inductor (the compiled rows' truth: the same compile's rounding, so
    their error is what the kernel or the pass changes, not Inductor's fp32 intermediates)."""
    import torch

    import kimi_passes
    from kimi_passes.config.stream import ENV_VAR

    torch._dynamo.reset()
    os.environ[ENV_VAR] = "attn_res"
    rows = {"vllm off": (fw.model(False), False, "vllm"),
            "vllm on": (fw.model(True), True, "vllm")}
    if device == "cuda":  # on CPU Dynamo cannot trace the interpreted launch
        rows["vllm on, compiled"] = (
            torch.compile(fw.model(True), backend="inductor", fullgraph=True), True, "vllm")
    rows["kimi pass"] = (torch.compile(fw.model(False), fullgraph=True,
                                       backend=kimi_passes.make_kimi_backend("attn_res")),
                         False, "kimi")
    rows["reference"] = (torch.compile(fw.model(True), backend="inductor", fullgraph=True),
                         True, "kimi")
    return rows


def judge(name: str, T: int, err: float, tol: float, time: float | None, ratio) -> dict:
    """A row's verdict; ``vllm off`` is the bug the route fixes: MET when the comparison
    sees it (its error over the tolerance)."""
    from kimi_passes.bench.harness import verdict

    if name != "vllm off":
        return verdict(name, T, time, ratio, err, tol)
    why = None if err > tol else (f"error {err:.3g} <= {tol:.3g}: flag off matched flag on, "
                                  "so the check cannot see the prefix stream's wrong "
                                  "captures (check the capture ids)")
    return verdict(f"vllm off (the bug: error over {tol:.3g})", T, time, ratio, err,
                   math.inf, why)


def rows_at(fw: Forwards, rows: dict, T: int, args: argparse.Namespace) -> list[dict]:
    """One row per candidate at ``T``: its error against flag-on eager (the compiled rows:
    against ``reference``), its time."""
    import torch

    from kimi_passes.bench.harness import MODEL_TOL, Timer, failure, rel_err, summary, verdict

    tol = MODEL_TOL[getattr(torch, args.dtype)]
    got, out = {}, []
    for name, (m, on, kernel) in rows.items():  # first call: compiles; the values
        try:
            got[name] = fw.h.aux_of(fw(m, on, T, kernel))
        except Exception as e:  # noqa: BLE001  (a row that cannot run is its MISS)
            out.append(emit(verdict(name, T, None, None, None, tol, failure(e))))
    if "vllm on" not in got or "reference" not in got:
        return out  # no truth: the MISS rows above say why

    def forward(name: str):
        m, on, kernel = rows[name]
        return lambda: fw(m, on, T, kernel)

    # Off CUDA vLLM's kernel runs interpreted: its rows get no time (no figure to read).
    timed = [n for n in got if n != "reference" and (args.device == "cuda" or n in COMPILED)]
    clock = "cuda" if args.device == "cuda" else "wall"
    times = Timer(args.rounds, clock, reps=args.reps, block_s=0.0, device=args.device).run(
        {n: forward(n) for n in timed})
    med = {n: summary(v)["median"] for n, v in times.items()}
    for name in (n for n in got if n != "reference"):
        truth = got["reference" if name in COMPILED else "vllm on"]
        err = max(rel_err(g, t) for g, t in zip(got[name], truth, strict=True))
        time, base = med.get(name), med.get("vllm on")
        ratio = time / base if time is not None and base is not None else None
        out.append(emit(judge(name, T, err, tol, time, ratio)))
    return out


def unrouted_check(fw: Forwards, T: int) -> list[dict]:
    """vLLM's own ``attn_res`` left unrouted, compiled with ``kimi_backend``: the attn_res
    stream must refuse it (``kimi_passes/taps/unrouted.py``), the prefix stream must
    compile and run."""
    import torch

    import kimi_passes
    from kimi_passes import AuxCaptureError
    from kimi_passes.bench.harness import verdict

    out = []
    for stream in ("attn_res", "prefix"):
        torch._dynamo.reset()
        m = torch.compile(fw.model(False), backend=kimi_passes.make_kimi_backend(stream),
                          fullgraph=True)
        got: Exception | None = None
        try:
            fw(m, False, T, "vllm")
        except Exception as e:  # noqa: BLE001  (judged below, not hidden)
            got = e
        refused = isinstance(got, AuxCaptureError)
        ok = refused if stream == "attn_res" else got is None
        seen = "refused" if refused else ("ran" if got is None else type(got).__name__)
        detail = str(got).splitlines()[0][:300] if got is not None else ""
        want = "a refusal" if stream == "attn_res" else "a run"
        why = None if ok else f"{seen}, expected {want}: {detail}"
        out.append(emit(verdict(f"unrouted vLLM attn_res, {stream} stream: {seen}", T, None,
                                None, 0.0, 0.0, why)))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if importlib.util.find_spec("vllm") is None:
        return skip("vllm_k3: vLLM is not installed here (the rows run vLLM's installed K3 code: "
                    "bash tools/install_vllm.sh where a registry is reachable)", args.json)
    if args.device == "cpu":
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    fw = Forwards(args)
    native = hasattr(torch.ops._C, "kimi_k3_attn_res")
    print(f"vLLM's attn_res: {fw.h.own_attn_res().__module__}; torch.ops._C.kimi_k3_attn_res "
          f"{'present' if native else 'absent'} (vLLM takes it at H=7168 on SM100 only)")
    rows = unrouted_check(fw, args.T[0]) if args.device == "cuda" else []
    found = candidates(fw, args.device)
    for T in args.T:
        rows += rows_at(fw, found, T, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1, default=str))
    return 1 if any(r["verdict"] == "MISS" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
