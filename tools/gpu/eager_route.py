"""The eager route (kimi_passes/vllm/k3_eager.py) on a GPU, without vLLM installed.

vLLM is too large to carry to the lent GPU, so this drives a K3-shaped model the way
vLLM 0.33.0's NVIDIA ``KimiLinearModel.forward`` drives ``attn_res`` and
``_capture_aux_hidden_stream`` (pre-attention and pre-MLP mixing per layer, the block
write, captures after layers, the output aggregation), with vLLM's own ``attn_res``
loaded by ``kimi_passes.vllm.peer`` (an installed vLLM, or ``.gpu_carry``).
Stand-ins: attention and MLP are one tanh projection each. Three call sequences:

- ``off``: vLLM's flag off (every call vLLM's; captures are ``prefix + pending``);
- ``on``: vLLM's flag on (a second, pure mixing call per capture);
- ``route``: the eager route (consumers ``kimi::attn_res_capture``, the rest vLLM's).

Checked: each route capture against vLLM's flag-on capture at that point (bf16 2e-2);
under ``torch.cuda.graph``, the captured route replayed 5 times with new inputs equal to
the eager route. Timed (CUDA graphs, CUDA events): route against off and on per T. Rows
go to stdout and ``--json``; exit 1 on a MISS, 3 when vLLM's kernel is not available.

    python tools/k3_eager_gpu.py --json eager_route.json            # on the GPU
    TRITON_INTERPRET=1 python tools/k3_eager_gpu.py --dry-run       # CPU, tiny, no graphs
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from kimi_passes.bench.harness import OP_TOL, rel_err, summary, verdict
from kimi_passes.vllm import k3_eager, k3_route


def weights(L, H, dtype, device, seed=0):
    g = torch.Generator(device).manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    def norm():
        return (1 + 0.2 * torch.randn(H, generator=g, device=device)).to(dtype)

    layers = [{"sa_norm": norm(), "sa_proj": rand(H), "in_norm": norm(), "mlp_norm": norm(),
               "mlp_proj": rand(H), "post_norm": norm(), "attn": rand(H, H, scale=H ** -0.5),
               "mlp": rand(H, H, scale=H ** -0.5)} for _ in range(L)]
    return layers, {"norm": norm(), "proj": rand(H)}


def forward(x, layers, out, S, ids, mode, fn, eps=1e-6):
    """vLLM's NVIDIA K3 forward's AttnRes calls and captures, as its code orders them."""
    T, H = x.shape
    NB = -(-len(layers) // S)
    bank = x.new_empty(T, NB, H)
    prefix, hidden, aux = x, None, ([x] if 0 in ids else [])
    for i, w in enumerate(layers):
        write = i % S == 0
        nb = -(-i // S)
        h = fn(prefix, hidden, bank, w["sa_norm"], w["sa_proj"], w["in_norm"], nb,
               i // S if write else -1, eps, eps)
        h = torch.tanh(h @ w["attn"])
        prefix, delta = (h, None) if write else (prefix, h)
        h = fn(prefix, delta, bank, w["mlp_norm"], w["mlp_proj"], w["post_norm"], nb + write,
               -1, eps, eps)
        hidden = torch.tanh(h @ w["mlp"])
        if i + 1 in ids:
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            norm = nxt["sa_norm"] if nxt else out["norm"]
            proj = nxt["sa_proj"] if nxt else out["proj"]
            num = -(-(i + 1) // S) if nxt else NB
            if mode == "off":
                aux.append(prefix + hidden)
            elif mode == "on":
                aux.append(fn(prefix + hidden, None, bank, norm, proj, None, num, -1, eps, 0.0))
            else:
                aux.append(k3_eager.expect(norm, prefix))
    final = fn(prefix, hidden, bank, out["norm"], out["proj"], None, NB, -1, eps, 0.0)
    return final, aux


def rows_for(args, own, source) -> list[dict]:
    dev, dtype = args.device, getattr(torch, args.dtype)
    layers, out = weights(args.layers, args.hidden, dtype, dev)
    ids = tuple(sorted({*range(0, args.layers + 1, 2), 3}))  # 0, boundaries, mid-block, L
    k3_route._own["nvidia"], k3_eager._stream[0] = own, "attn_res"
    fns = {"off": own, "on": own, "route": k3_route.vllm_attn_res}
    rows, tol = [], OP_TOL[dtype]
    for T in args.T:
        x = torch.randn(T, args.hidden, device=dev, dtype=dtype)
        refs: list[torch.Tensor] = []
        claim = k3_eager.claim

        def spy(a, kw, claim=claim, refs=refs):  # vLLM's flag-on capture, here
            buf = claim(a, kw)
            if buf is not None:
                refs.append(own(*k3_eager.capture_call(a, kw)))
            return buf

        k3_eager.claim = spy
        try:
            _, aux = forward(x.clone(), layers, out, args.block, ids, "route", fns["route"])
        finally:
            k3_eager.claim = claim
        err = max(rel_err(a, r) for a, r in zip(aux[1:], refs, strict=True))
        rows.append(report({**verdict("route capture vs vLLM flag-on capture", T, None, None,
                                      err, tol), "peer": source}))
        if dev == "cuda" and not args.dry_run:
            rows += graphs_and_time(x, layers, out, args, ids, fns, tol)
    return rows


def report(row: dict) -> dict:
    """``row`` printed as one JSON line (gpu_check reads MET / MISS off it)."""
    print(json.dumps(row), flush=True)
    return row


def graphs_and_time(x, layers, out, args, ids, fns, tol) -> list[dict]:
    """Each sequence captured in a CUDA graph; the route's replays with new inputs
    checked against its eager values; replay time per sequence (CUDA events)."""
    from kimi_passes.bench.harness import Timer

    T, graphs, rows = x.shape[0], {}, []
    for mode, fn in fns.items():
        static = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward(static.clone(), layers, out, args.block, ids, mode, fn)  # warm-up
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            result = forward(static, layers, out, args.block, ids, mode, fn)
        graphs[mode] = (g, static, result)
    g, static, (_, aux) = graphs["route"]
    err = 0.0
    for _ in range(5):
        new = torch.randn_like(static)
        static.copy_(new)
        g.replay()
        _, want = forward(new.clone(), layers, out, args.block, ids, "route", fns["route"])
        torch.cuda.synchronize()
        err = max(err, *(rel_err(a, w) for a, w in zip(aux, want, strict=True)))
    rows.append(report(verdict("route under CUDA graph, 5 replays vs eager", T, None, None,
                               err, tol)))
    times = Timer(rounds=5, clock="cuda", device="cuda").run(
        {m: graphs[m][0].replay for m in graphs})
    med = {m: summary(v)["median"] for m, v in times.items()}
    rows.append(report({"candidate": "step time, CUDA graph replay", "T": T,
                        **{f"{m}_us": med[m] * 1e6 for m in med},
                        "route_vs_off": med["route"] / med["off"],
                        "route_vs_on": med["route"] / med["on"]}))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
        print(json.dumps({"skip": "no CUDA device (use --dry-run on CPU)"}))
        return 3
    try:
        from kimi_passes.vllm.peer import load_peer

        peer = load_peer("nvidia")
    except Exception as e:  # noqa: BLE001  (any loading failure is this step's skip)
        print(json.dumps({"skip": f"vLLM's K3 attn_res is not available: {e}"}))
        return 3
    with torch.inference_mode():
        rows = rows_for(args, peer.attn_res, peer.source)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any(r.get("verdict") == "MISS" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
