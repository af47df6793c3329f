"""``bench decode``: whole models at decode and prefill sizes, kimi_backend vs plain Inductor.

Serving is mostly decode (a DFlash / EAGLE3 target runs 1 to a few dozen tokens a step), so
rows are at T = 1, 8, 64, 256 and 1024. Per model and T, compiled with ``fullgraph=True``:
``backend="inductor"`` (the baseline), ``kimi_backend`` as shipped (``kimi``: the kimi ops
lowered to generated code on CPU) and ``make_kimi_backend(lower_kimi_ops=False)``
(``kimi-ops``: every mixing site a kimi op call). Timed with ``Timer`` (interleaved rounds,
1 thread); a ratio is t(plain Inductor) / t(candidate) per round (> 1: the candidate is
faster), median [IQR]. Outputs are checked against plain Inductor's first (``rel_err``
within ``MODEL_TOL``): a candidate that raises (not timed) or is off (timed) is a MISS on
its row, with the reason. Models (``models.py``, under ``no_grad``):
``k3`` (the reference K3, L=8, H=512, S=2, plain-torch mixing), ``k3-op`` (``mixing="op"``
under kimi_backend against ``mixing="torch"`` under Inductor), ``wiring`` (the K3 wiring,
every sublayer ``x * sigmoid(x)``), ``site`` (one pure mixing site, H=1024), ``attn-res``
(the ``attn-res`` package's Block AttnRes transformer, d=256, 8 layers; tokens as
``[batch, seq]``) and ``stack`` (``WiredStack``, one row per ``--stacks`` spec).

``--control`` adds plain Inductor compiled again: identical code's ratio on this machine.
``--cpu-time`` samples process CPU time (a machine loaded past its cores); ``--dynamic``
compiles one graph with a dynamic token dimension (as vLLM does); ``--device cuda`` runs on
the GPU (a sample is a synchronised step, launches included). Run::

    python -m kimi_passes bench decode                       # every model, static shapes
    python -m kimi_passes bench decode --dynamic --models k3,wiring --out decode.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from kimi_passes.backend import make_kimi_backend
from kimi_passes.bench.harness import (
    MODEL_TOL,
    PROG,
    Timer,
    failure,
    misses,
    ratio_summary,
    rel_err,
    summary,
    verdict,
)
from kimi_passes.bench.models import (
    Site,
    WiredStack,
    attn_res_transformer,
    first_tensor,
    k3_config,
    parse_stack,
    wiring_only,
)
from kimi_passes.graphs.k3 import K3Model

TOKENS = (1, 8, 64, 256, 1024)
ATTN_RES_SHAPES = ((8, 1), (1, 16), (1, 512))
MODELS = ("k3", "k3-op", "wiring", "site", "attn-res", "stack")
STACKS = ("L8-H512-S2-tanh-float32", "L8-H256-S2-tanh-bfloat16", "L4-H2048-S2-silu-float32",
          "L12-H1024-S4-linear-bfloat16")


def k3(mixing: str, cheap: bool = False) -> K3Model:
    model = K3Model(k3_config(), mixing=mixing).eval()
    return wiring_only(model) if cheap else model


def cases(names, tokens, device="cpu", stacks=STACKS):
    """(model name, shape label, baseline model, candidate model, inputs) per row."""
    for name, shape, base, cand, inputs in _cases(names, tokens, stacks):
        yield (name, shape, base.to(device), cand.to(device),
               tuple(x.to(device) for x in inputs))


def _cases(names, tokens, stacks):
    g = torch.Generator().manual_seed(0)
    for name in names:
        if name == "stack":
            for spec in stacks:
                L, H, S, sublayer, dtype = parse_stack(spec)
                model = WiredStack(L, H, S, sublayer, dtype).eval()
                for T in tokens:
                    x = torch.randn(T, H, generator=g).to(dtype)
                    yield f"stack {spec}", f"T={T}", model, model, (x,)
            continue
        if name == "attn-res":
            model = attn_res_transformer()
            for b, s in ATTN_RES_SHAPES:
                ids = torch.randint(0, 1024, (b, s), generator=g)
                yield name, f"[{b}, {s}]", model, model, (ids,)
            continue
        base: torch.nn.Module
        cand: torch.nn.Module
        inputs: tuple[torch.Tensor, ...]
        if name == "site":
            base = cand = Site()
        elif name == "k3-op":
            base, cand = k3("torch"), k3("op")
        else:
            base = cand = k3("torch", cheap=name == "wiring")
        for T in tokens:
            if name == "site":
                inputs = Site.inputs(T)
            else:
                inputs = (torch.arange(T) % 1024,)
            yield name, f"T={T}", base, cand, inputs


def compiled(model, backend, dynamic: bool):
    return torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)


def _inductor_again(gm, example_inputs):
    """Plain Inductor under a backend object of its own, so Dynamo compiles it apart."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def run(names, tokens, dynamic: bool, timer: Timer, out=None,
        device: str = "cpu", control: bool = False, stacks=STACKS,
        ops: bool = True) -> list[dict]:
    out = out or sys.stdout  # at call time: a default bound at import outlives a redirect
    rows = []
    backends: dict[str, Callable] = {"kimi": make_kimi_backend()}
    if ops:
        backends["kimi-ops"] = make_kimi_backend(lower_kimi_ops=False)
    if control:
        backends["control"] = _inductor_again
    compiled_models: dict = {}
    print(f"{'model':9} {'shape':9} {'inductor ms':>12} {'kimi ms':>9} {'ratio [IQR]':>20} "
          f"{'kimi-ops ms':>12} {'ratio [IQR]':>20}"
          + (f" {'control [IQR]':>20}" if control else ""), file=out, flush=True)
    for name, shape, base, cand, inputs in cases(names, tokens, device, stacks):
        key = (name, id(base), id(cand))
        if not dynamic or key not in compiled_models:
            # A fresh Dynamo per graph: models share forward code objects, and three
            # backends times five T would pass Dynamo's recompile limit.
            torch._dynamo.reset()
            compiled_models.clear()
            compiled_models[key] = {"inductor": compiled(base, "inductor", dynamic),
                                    **{k: compiled(base if k == "control" else cand, b, dynamic)
                                       for k, b in backends.items()}}
        row = _row(name, shape, dynamic, compiled_models[key], inputs, timer, device)
        rows.append(row)
        print(_line(row, ops, control), file=out, flush=True)
    return rows


def _row(name, shape, dynamic, fns, inputs, timer: Timer, device) -> dict:
    """One model and shape: each compile checked against plain Inductor's, then timed."""
    errs, failed = _check(fns, inputs)
    with torch.no_grad():
        samples = timer.run({k: _step(f, inputs, device) for k, f in fns.items()
                             if k not in failed})
    ratio = {k: ratio_summary(samples["inductor"], s) for k, s in samples.items()
             if k != "inductor" and "inductor" in samples}
    tol = MODEL_TOL.get(errs.pop("dtype", None), MODEL_TOL[torch.float32])
    T = int(shape[2:]) if shape.startswith("T=") else shape
    return {"model": name, "shape": shape, "dynamic": dynamic,
            "ms": {k: summary(v)["median"] * 1e3 for k, v in samples.items()},
            "ratio": ratio,
            "candidates": [verdict(k, T, summary(samples[k])["median"] if k in samples
                                   else None, ratio[k]["median"] if k in ratio else None,
                                   errs.get(k), tol, failed.get(k)) for k in fns]}


def _check(fns: dict, inputs) -> tuple[dict, dict[str, str]]:
    """``({name: rel_err vs plain Inductor, "dtype": its dtype}, {name: why it failed})``:
    the first call compiles, so a compile error is caught here too."""
    errs: dict = {}
    failed: dict[str, str] = {}
    with torch.no_grad():
        try:
            want = first_tensor(fns["inductor"](*inputs))
        except Exception as e:  # noqa: BLE001 - no reference: every candidate misses
            return errs, dict.fromkeys(fns, f"plain Inductor (the reference) {failure(e)}")
        errs["inductor"], errs["dtype"] = 0.0, want.dtype
        for k, fn in fns.items():
            if k == "inductor":
                continue
            try:
                errs[k] = rel_err(first_tensor(fn(*inputs)), want)
            except Exception as e:  # noqa: BLE001 - a failing candidate is reported
                failed[k] = failure(e)
    return errs, failed


def _line(row: dict, ops: bool, control: bool) -> str:
    ms, r = row["ms"], row["ratio"]
    return (f"{row['model']:9} {row['shape']:9} {ms.get('inductor', float('nan')):12.3f} "
            f"{ms.get('kimi', float('nan')):9.3f} {_fmt(r.get('kimi')):>20} "
            f"{ms.get('kimi-ops', float('nan')):12.3f} "
            f"{_fmt(r.get('kimi-ops')) if ops else '-':>20}"
            + (f" {_fmt(r.get('control')):>20}" if control else "")
            + "".join(f"  {m}" for m in misses(row["candidates"])))


def _step(fn, inputs, device: str):
    """One call; on CUDA synchronised, so a sample is the step's wall time, launches
    included (at decode sizes a GPU step is bound by them)."""
    if device == "cpu":
        return lambda: fn(*inputs)

    def step():
        fn(*inputs)
        torch.cuda.synchronize()

    return step


def _fmt(s: dict | None) -> str:
    return "-" if s is None else f"{s['median']:.2f}x [{s['q1']:.2f}, {s['q3']:.2f}]"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=f"{PROG} decode", description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--T", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--stacks", nargs="+", default=list(STACKS),
                   help="the stack model's rows: L<layers>-H<hidden>-S<block>-<sublayer>-<dtype>")
    p.add_argument("--dynamic", action="store_true")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--block-ms", type=float, default=40.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cpu-time", action="store_true",
                   help="time samples in process CPU time, not wall time (a loaded machine)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (tools/gpu_check.sh)")
    p.add_argument("--no-ops", action="store_true",
                   help="skip kimi-ops (the op calls kept: slow to compile and to run)")
    p.add_argument("--control", action="store_true",
                   help="also time plain Inductor compiled again: identical code's ratio")
    p.add_argument("--out", type=Path, help="write the rows (each candidate's verdict) as JSON")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    names = [m.strip() for m in a.models.split(",") if m.strip()]
    bad = [m for m in names if m not in MODELS]
    if bad:
        p.error(f"unknown model(s) {bad}; choose from {list(MODELS)}")
    timer = Timer(a.rounds, "cpu" if a.cpu_time else "wall", block_s=a.block_ms / 1e3,
                  threads=a.threads)
    print(f"torch {torch.__version__}, {a.device}, {a.threads} thread(s), "
          f"{'dynamic' if a.dynamic else 'static'} shapes, "
          f"{'CPU' if a.cpu_time else 'wall'} time; ratio = t(plain Inductor) / t(x)")
    for spec in a.stacks:
        try:
            parse_stack(spec)
        except ValueError as e:
            p.error(str(e))
    rows = run(names, a.T, a.dynamic, timer, device=a.device, control=a.control,
               stacks=a.stacks, ops=not a.no_ops)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"command": f"{PROG} decode " + " ".join(
                                         sys.argv[1:] if argv is None else argv),
                                     "rows": rows}, indent=1, default=str))
    return 0
