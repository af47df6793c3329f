"""The eager route (kimi_passes/vllm/k3/eager.py) on a GPU, without vLLM installed.

vLLM is too large to carry to the lent GPU, so this drives the project's reference K3
(``kimi_passes.graphs.k3.K3Model``: its layers' AttnRes calls, block writes and taps in
K3's order) with vLLM's own ``attn_res`` (``kimi_passes.vllm.peer``: an installed vLLM or
``.gpu_carry``) as every mixing call, and reads each tap three ways:

- ``off``: vLLM's flag off (every call vLLM's; a tap is ``prefix + pending``);
- ``on``: vLLM's flag on (a tap is a second, pure mixing call);
- ``route``: the eager route (``k3.route.serve_eager``, then ``k3.route.vllm_attn_res``; a
  tap is the route's ``expect(norm_weight, prefix)``, filled by its consumer's
  ``kimi::attn_res_capture``; every other call vLLM's).

Checked: each route capture against vLLM's flag-on capture at that point (the route's
``watch`` hook, ``k3.eager.capture_call``, ``OP_TOL``); under ``torch.cuda.graph``, the
captured route replayed 5 times with new inputs equal to the eager route. Timed (CUDA graphs, the
bench's ``Timer``, CUDA events): route against off and on per T. Rows are MET / MISS
lines (``tools.gpu.report.emit``) and ``--json``; exit 1 on a MISS, 3 when vLLM's kernel
is not available.

    python -m tools.gpu.eager_route --json eager_route.json            # on the GPU
    TRITON_INTERPRET=1 python -m tools.gpu.eager_route --dry-run       # CPU, tiny, no graphs
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from kimi_passes.bench.harness import OP_TOL, Timer, rel_err, summary, verdict
from kimi_passes.graphs import K3Config, K3Model
from kimi_passes.vllm.k3.eager import capture_call
from kimi_passes.vllm.k3.route import EagerRoute, serve_eager, unroute_attn_res, vllm_attn_res
from tools.gpu.report import emit, skip

MODES = ("off", "on", "route")


class Model:
    """One ``K3Model`` whose mixing and taps follow ``mode`` (off, on, route)."""

    def __init__(self, args: argparse.Namespace, own, route: EagerRoute):
        L, H = args.layers, args.hidden
        self.cfg = K3Config(num_layers=L, hidden_size=H, attn_res_block_size=args.block,
                            num_heads=max(1, H // 128), intermediate_size=max(128, H // 4),
                            aux_layer_ids=tuple(sorted({*range(0, L + 1, 2), 3})),
                            dtype=getattr(torch, args.dtype))
        self.own, self.route, self.mode = own, route, "off"
        with torch.device(args.device):  # the parameters drawn there
            self.k3 = K3Model(self.cfg, mixing=self.mix, tap=self.tap)

    def mix(self, *args):
        return (vllm_attn_res if self.mode == "route" else self.own)(*args)

    def tap(self, k, prefix, pending, bank, norm_weight, qk_weight, num_blocks, eps):
        if self.mode == "route":
            return self.route.expect(norm_weight, prefix)
        x = prefix if pending is None else prefix + pending
        if self.mode == "off":
            return x.clone()  # the layer's call updates prefix in place
        return self.own(x, None, bank, norm_weight, qk_weight, None, num_blocks, -1, eps, 0.0)

    def __call__(self, ids, mode: str):
        self.mode = mode
        return self.k3(ids)[1]


def token_ids(model: Model, T: int, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device).manual_seed(seed)
    return torch.randint(0, model.cfg.vocab_size, (T,), generator=g, device=device)


def capture_check(model: Model, ids, tol: float) -> float:
    """The route's captures against vLLM's flag-on capture of each consumer call."""
    refs: list[torch.Tensor] = []

    def spy(a, kw):  # vLLM's flag-on capture, computed from the consumer's own call
        refs.append(model.own(*capture_call(a, kw)))

    with model.route.watch(spy):
        aux = model(ids.clone(), "route")
    return max(rel_err(a, r) for a, r in zip(aux, refs, strict=True))


def rows_for(args, own, source) -> list[dict]:
    model = Model(args, own, serve_eager(own))
    rows, tol = [], OP_TOL[model.cfg.dtype]
    for T in args.T:
        ids = token_ids(model, T, args.device)
        err = capture_check(model, ids, tol)
        rows.append(emit({**verdict("route capture vs vLLM flag-on capture", T, None, None,
                                    err, tol), "peer": source}))
        if args.device == "cuda" and not args.dry_run:
            rows += graphs_and_time(model, ids, tol)
    return rows


def graphs_and_time(model: Model, ids, tol: float) -> list[dict]:
    """Each mode captured in a CUDA graph; the route's replays with new inputs checked
    against its eager values; replay time per mode (the bench's Timer, CUDA events)."""
    T, graphs = ids.shape[0], {}
    for mode in MODES:
        static = ids.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(static.clone(), mode)  # warm-up
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            aux = model(static, mode)
        graphs[mode] = (g, static, aux)
    g, static, aux = graphs["route"]
    err = 0.0
    for seed in range(1, 6):
        new = token_ids(model, T, ids.device, seed)
        static.copy_(new)
        g.replay()
        want = model(new.clone(), "route")
        torch.cuda.synchronize()
        err = max(err, *(rel_err(a, w) for a, w in zip(aux, want, strict=True)))
    times = Timer(rounds=5, clock="cuda", device="cuda").run(
        {m: graphs[m][0].replay for m in graphs})
    med = {m: summary(v)["median"] for m, v in times.items()}
    vs = {m: med["route"] / med[m] for m in ("off", "on")}
    name = (f"route under CUDA graph, 5 replays vs eager (step time x{vs['off']:.2f} of flag "
            f"off, x{vs['on']:.2f} of flag on)")
    return [emit({**verdict(name, T, med["route"], vs["on"], err, tol),
                  "time_s": med, "route_vs_off": vs["off"], "route_vs_on": vs["on"]})]

def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.gpu.eager_route",
                                description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--block", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--T", type=lambda s: [int(t) for t in s.split(",")], default=[1, 8, 64, 256])
    p.add_argument("--json")
    p.add_argument("--dry-run", action="store_true", help="CPU, H=64, T=1,8: control flow only")
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.hidden, args.T = "cpu", 64, [1, 8]
    elif not torch.cuda.is_available():
        return skip("no CUDA device (use --dry-run on CPU)", args.json)
    try:
        from kimi_passes.vllm.peer import load_peer

        peer = load_peer("nvidia")
    except Exception as e:  # noqa: BLE001  (any loading failure is this step's skip)
        return skip(f"vLLM's K3 attn_res is not available: {e}", args.json)
    try:
        with torch.inference_mode():
            rows = rows_for(args, peer.attn_res, peer.source)
    finally:
        unroute_attn_res()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any(r.get("verdict") == "MISS" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
