"""Whole models at decode and prefill sizes: kimi_backend against plain Inductor, CPU.

Serving is mostly decode (a DFlash / EAGLE3 target runs 1 to a few dozen tokens a step),
so every row is measured at T = 1, 8, 64, 256 and 1024. Per model and T, in one process,
compiled with ``fullgraph=True``: ``backend="inductor"`` (the baseline), ``kimi_backend``
as shipped (``kimi``: the kimi ops lowered to generated code on CPU) and
``make_kimi_backend(lower_kimi_ops=False)`` (``kimi-ops``: every mixing site a kimi op
call, as a graph that keeps the ops runs). Timed with ``CpuTimer``: interleaved
rounds, 1 thread; a ratio is t(plain Inductor) / t(candidate) per round (> 1: the
candidate is faster), reported as the median and the interquartile range over rounds.
Outputs are checked against plain Inductor's first.

Models (inference, ``torch.no_grad()``):

- ``k3``: the reference K3 (``graphs/k3.py``, attention and MLP), L=8, H=512, S=2,
  ``mixing="torch"`` (plain-torch AttnRes mixing; kimi_backend fuses every site);
- ``k3-op``: ``K3Model(mixing="op")`` under kimi_backend against ``mixing="torch"`` under
  plain Inductor (the same weights): what a model written with ``torch.ops.kimi`` costs;
- ``wiring``: the K3 wiring with cheap elementwise sublayers (``x * sigmoid(x)`` in place of
  attention and MLP), L=8, H=512, S=2: mixing-dominated, 17 sites;
- ``site``: one mixing site, ``attn_res_torch``'s pure read over ``bank[:, :8]`` and a
  prefix, H=1024;
- ``attn-res``: the ``attn-res`` package's Block AttnRes transformer, d=256, 8 layers
  (its tokens as ``[batch, seq]``: decode [8, 1], [1, 16], prefill [1, 512]);
- ``stack``: plain-torch K3-wired stacks as a new user writes them (``WiredStack``: each
  site stacks its sources, ``F.rms_norm``s the keys with a weight, dots them with a query
  vector, softmax over depth, weighted sum), one row per ``--stacks`` spec
  ``L<layers>-H<hidden>-S<block>-<sublayer>-<dtype>`` (sublayer ``tanh``, ``silu`` or
  ``linear``, an ``H x H`` matmul then tanh; dtype ``float32`` or ``bfloat16``).

``--control`` adds plain Inductor compiled a second time (``control``: the same generated
code under a backend of its own): its ratio is what identical code measures against
itself on this machine, in the same rounds, so a row's ratio can be read against it.

``--cpu-time`` times samples in process CPU time rather than wall time: on a machine
loaded past its cores, wall-time samples hold the neighbours' time slices (the control
then reads anywhere from 0.15x to 9x), CPU time does not. ``--no-ops`` leaves out
``kimi-ops``.

``--dynamic``: one graph compiled with a dynamic token dimension serves every T (as vLLM
compiles it); default: one static graph per T. ``--device cuda`` runs the models on the
GPU (a sample is a synchronised step: wall time, launches included; ``kimi`` and
``kimi-ops`` are the same graph there, the lowering being CPU-only), as
tools/gpu_check.sh does. Run::

    python -m kimi_passes.bench.decode                       # every model, static shapes
    python -m kimi_passes.bench.decode --dynamic --models k3,wiring
    python tools/bench_decode.py --T 1 8                     # the same entry point
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

from kimi_passes.backend import make_kimi_backend
from kimi_passes.bench.fusion import first_tensor, wiring_only
from kimi_passes.bench.harness import CpuTimer, ratio_summary, summary
from kimi_passes.graphs.k3 import K3Config, K3Model, attn_res_torch

TOKENS = (1, 8, 64, 256, 1024)
ATTN_RES_SHAPES = ((8, 1), (1, 16), (1, 512))
MODELS = ("k3", "k3-op", "wiring", "site", "attn-res", "stack")
STACKS = ("L8-H512-S2-tanh-float32", "L8-H256-S2-tanh-bfloat16", "L4-H2048-S2-silu-float32",
          "L12-H1024-S4-linear-bfloat16")


def _k3_config() -> K3Config:
    return K3Config(num_layers=8, hidden_size=512, attn_res_block_size=2, num_heads=8,
                    intermediate_size=1024, vocab_size=1024, aux_layer_ids=(2, 4, 8))


def k3(mixing: str, cheap: bool = False) -> K3Model:
    model = K3Model(_k3_config(), mixing=mixing).eval()
    return wiring_only(model) if cheap else model


class Site(torch.nn.Module):
    """One pure mixing site in plain torch: ``bank[:, :8]`` and a prefix, H=1024."""

    def __init__(self, H: int = 1024):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.norm_weight = torch.nn.Parameter(1 + 0.1 * torch.randn(H, generator=g))
        self.qk_weight = torch.nn.Parameter(torch.randn(H, generator=g) / H ** 0.5)

    def forward(self, prefix, bank):
        return attn_res_torch(prefix, None, bank, self.norm_weight, self.qk_weight, None, 8,
                              -1, 1e-6, 1e-6)


class WiredStack(torch.nn.Module):
    """A plain-torch K3-wired stack: ``L`` layers of two sublayers, a block every ``S``
    layers; every sublayer and the output read a mixture of the completed blocks and the
    block in progress (docs/design.md section 2), written as a new user writes it."""

    SUBLAYERS = ("tanh", "silu", "linear")

    def __init__(self, L: int, H: int, S: int, sublayer: str, dtype: torch.dtype):
        super().__init__()
        if sublayer not in self.SUBLAYERS:
            raise ValueError(f"WiredStack: sublayer {sublayer!r}; choose from {self.SUBLAYERS}")
        g = torch.Generator().manual_seed(0)
        n = 2 * L + 1
        self.L, self.S, self.sublayer = L, S, sublayer
        self.norm = torch.nn.Parameter(1 + 0.1 * torch.randn(n, H, generator=g))
        self.query = torch.nn.Parameter(torch.randn(n, H, generator=g) / H ** 0.5)
        self.scale = torch.nn.Parameter(torch.randn(2 * L, H, generator=g))
        self.proj = (torch.nn.Parameter(torch.randn(2 * L, H, H, generator=g) / H ** 0.5)
                     if sublayer == "linear" else None)
        self.to(dtype)

    def mix(self, sources: list[torch.Tensor], i: int) -> torch.Tensor:
        v = torch.stack(sources)  # [n, T, H]
        keys = torch.nn.functional.rms_norm(v, (v.shape[-1],), self.norm[i], 1e-6)
        p = (keys * self.query[i]).sum(-1).softmax(0)
        return (p.unsqueeze(-1) * v).sum(0)

    def sub(self, h: torch.Tensor, i: int) -> torch.Tensor:
        if self.proj is not None:
            return torch.tanh(h @ self.proj[i])
        h = h * self.scale[i]
        return torch.tanh(h) if self.sublayer == "tanh" else torch.nn.functional.silu(h)

    def forward(self, x):
        blocks, partial, i = [x], None, 0
        for layer in range(self.L):
            for _ in range(2):
                out = self.sub(self.mix(blocks + ([] if partial is None else [partial]), i), i)
                partial = out if partial is None else partial + out
                i += 1
            if (layer + 1) % self.S == 0:
                blocks.append(partial)
                partial = None
        return self.mix(blocks + ([] if partial is None else [partial]), i)


def parse_stack(spec: str) -> tuple[int, int, int, str, torch.dtype]:
    """``L8-H512-S2-tanh-float32`` -> (8, 512, 2, "tanh", torch.float32)."""
    try:
        L, H, S, sublayer, dtype = spec.split("-")
        if (L[0], H[0], S[0]) != ("L", "H", "S"):
            raise ValueError
        return int(L[1:]), int(H[1:]), int(S[1:]), sublayer, getattr(torch, dtype)
    except (ValueError, AttributeError, IndexError):
        raise ValueError(f"stack spec {spec!r}: write L<layers>-H<hidden>-S<block>-"
                         "<sublayer>-<dtype>, e.g. L8-H512-S2-tanh-float32") from None


def attn_res_package(d: int = 256, layers: int = 8):
    from attn_res import AttnResMode, AttnResOperator, AttnResTransformer, TransformerConfig

    cfg = TransformerConfig(d_model=d, n_layers=layers, n_heads=8, n_kv_heads=2,
                            vocab_size=1024, max_seq_len=2048, n_blocks=4,
                            attn_res_mode=AttnResMode.BLOCK)
    torch.manual_seed(0)
    model = AttnResTransformer(cfg).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, AttnResOperator):
                m.pseudo_query.normal_()
    return model


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
            model = attn_res_package()
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
                inputs = (torch.randn(T, 1024, generator=g), torch.randn(T, 8, 1024, generator=g))
            else:
                inputs = (torch.arange(T) % 1024,)
            yield name, f"T={T}", base, cand, inputs


def compiled(model, backend, dynamic: bool):
    return torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)


def _inductor_again(gm, example_inputs):
    """Plain Inductor under a backend object of its own, so Dynamo compiles it apart."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def run(names, tokens, dynamic: bool, timer: CpuTimer, out=sys.stdout,
        device: str = "cpu", control: bool = False, stacks=STACKS,
        ops: bool = True) -> list[dict]:
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
        fns = compiled_models[key]
        with torch.no_grad():
            want = first_tensor(fns["inductor"](*inputs))
            for k in backends:
                got = first_tensor(fns[k](*inputs))
                err = float((got.float() - want.float()).abs().max())
                scale = float(want.float().abs().max()) or 1.0
                if err > (1e-3 if want.dtype == torch.float32 else 2e-2) * scale:
                    raise AssertionError(f"{name} {shape}: {k} disagrees with plain Inductor "
                                         f"(max abs error {err:.3g}, scale {scale:.3g})")
            samples = timer.run({k: _step(f, inputs, device) for k, f in fns.items()})
        row = {"model": name, "shape": shape, "dynamic": dynamic,
               "ms": {k: summary(v)["median"] * 1e3 for k, v in samples.items()},
               "ratio": {k: ratio_summary(samples["inductor"], samples[k]) for k in backends}}
        rows.append(row)
        r = row["ratio"]
        print(f"{name:9} {shape:9} {row['ms']['inductor']:12.3f} {row['ms']['kimi']:9.3f} "
              f"{_fmt(r['kimi']):>20} {row['ms'].get('kimi-ops', float('nan')):12.3f} "
              f"{_fmt(r['kimi-ops']) if ops else '-':>20}"
              + (f" {_fmt(r['control']):>20}" if control else ""), file=out, flush=True)
    return rows


def _step(fn, inputs, device: str):
    """One call; on CUDA synchronised, so a sample is the step's wall time, launches
    included (at decode sizes a GPU step is bound by them)."""
    if device == "cpu":
        return lambda: fn(*inputs)

    def step():
        fn(*inputs)
        torch.cuda.synchronize()

    return step


def _fmt(s: dict) -> str:
    return f"{s['median']:.2f}x [{s['q1']:.2f}, {s['q3']:.2f}]"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    names = [m.strip() for m in a.models.split(",") if m.strip()]
    bad = [m for m in names if m not in MODELS]
    if bad:
        p.error(f"unknown model(s) {bad}; choose from {list(MODELS)}")
    timer = CpuTimer(rounds=a.rounds, block_s=a.block_ms / 1e3, threads=a.threads,
                     cpu_time=a.cpu_time)
    print(f"torch {torch.__version__}, {a.device}, {a.threads} thread(s), "
          f"{'dynamic' if a.dynamic else 'static'} shapes, "
          f"{'CPU' if a.cpu_time else 'wall'} time; ratio = t(plain Inductor) / t(x)")
    for spec in a.stacks:
        try:
            parse_stack(spec)
        except ValueError as e:
            p.error(str(e))
    run(names, a.T, a.dynamic, timer, device=a.device, control=a.control, stacks=a.stacks,
        ops=not a.no_ops)
    return 0


if __name__ == "__main__":
    sys.exit(main())
