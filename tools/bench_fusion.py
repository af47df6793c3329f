"""CPU speed of plain-torch AttnRes models under kimi_backend (mixing fused) vs plain Inductor.

Two models whose AttnRes mixing is written in plain PyTorch:

- ``attn-res``: the third-party ``attn_res.AttnResTransformer`` (Block AttnRes: stacked
  sources, RMSNorm without weight, einsum, softmax(dim=0), einsum); kimi_backend turns
  each sub-layer's mixing into ``kimi.attn_res_mix_list``.
- ``k3``: ``graphs/k3.py``'s ``K3Model(mixing="torch")`` forward step (cat of
  ``bank[:, :n]`` and the prefix, F.rms_norm, einsum, softmax, einsum); kimi_backend turns
  each site into ``kimi.attn_res_mix`` and the taps read it.
- ``site``: one mixing site alone, ``attn_res_torch``'s pure read over ``bank[:, :8]`` and
  a prefix at ``--site-tokens`` x ``--site-hidden`` (the part of the step the pass changes).

Each model is compiled twice in the same process, ``backend="inductor"`` and
``make_kimi_backend()``, under ``torch.no_grad()``, and timed with
``torch.utils.benchmark`` blocked-autorange medians (2 threads). The outputs are checked
to agree first. Run::

    python tools/bench_fusion.py                 # every model, fp32, 2 threads
    python tools/bench_fusion.py --model k3 --tokens 512 --threads 1
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.utils.benchmark as benchmark

from kimi_passes import make_kimi_backend
from kimi_passes.fusion import AttnResFusionPass
from kimi_passes.graphs.k3 import K3Config, K3Model, attn_res_torch


def attn_res_model(args):
    from attn_res import AttnResMode, AttnResOperator, AttnResTransformer, TransformerConfig

    cfg = TransformerConfig(d_model=args.hidden, n_layers=args.layers, n_heads=8, n_kv_heads=2,
                            vocab_size=1024, max_seq_len=max(2048, args.tokens),
                            n_blocks=args.blocks, attn_res_mode=AttnResMode.BLOCK)
    torch.manual_seed(0)
    model = AttnResTransformer(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, AttnResOperator):
                m.pseudo_query.normal_()
    tokens = torch.randint(0, cfg.vocab_size, (1, args.tokens))
    desc = (f"attn-res AttnResTransformer d_model={cfg.d_model} sub-layers={cfg.n_layers} "
            f"blocks={cfg.n_blocks} tokens={args.tokens} (1 x {args.tokens})")
    return model, (tokens,), desc


def k3_model(args):
    cfg = K3Config(num_layers=args.layers, hidden_size=args.hidden, attn_res_block_size=2,
                   num_heads=8, intermediate_size=2 * args.hidden, vocab_size=1024,
                   aux_layer_ids=(2, args.layers // 2, args.layers))
    model = K3Model(cfg, mixing="torch")
    ids = torch.arange(args.tokens) % cfg.vocab_size
    desc = (f"K3Model(mixing='torch') L={cfg.num_layers} S={cfg.attn_res_block_size} "
            f"H={cfg.hidden_size} T={args.tokens}, taps {cfg.aux_layer_ids}")
    return model, (ids,), desc


def site_model(args):
    T, H, nb = args.site_tokens, args.site_hidden, 8
    g = torch.Generator().manual_seed(0)
    prefix, bank = torch.randn(T, H, generator=g), torch.randn(T, nb, H, generator=g)
    norm_weight = 1 + 0.1 * torch.randn(H, generator=g)
    qk_weight = torch.randn(H, generator=g) / H**0.5

    def mix(prefix, bank, norm_weight, qk_weight):
        return attn_res_torch(prefix, None, bank, norm_weight, qk_weight, None, nb, -1,
                              1e-6, 1e-6)

    desc = f"one pre-norm mixture, bank[:, :{nb}] + prefix, T={T} H={H}"
    return mix, (prefix, bank, norm_weight, qk_weight), desc


def first_tensor(out):
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out


def measure(fn, inputs, min_run_time: float) -> float:
    timer = benchmark.Timer("fn(*inputs)", globals={"fn": fn, "inputs": inputs},
                            num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def run(name, build, args) -> None:
    model, inputs, desc = build(args)
    kimi = make_kimi_backend()
    with torch.no_grad():
        plain = torch.compile(model, backend="inductor")
        fused = torch.compile(model, backend=kimi)
        ref, out = plain(*inputs), fused(*inputs)  # compile both, check they agree
        torch.testing.assert_close(first_tensor(out), first_tensor(ref), atol=2e-3, rtol=2e-3)
        n = kimi.passes.get(AttnResFusionPass).last_fused
        t_plain = measure(plain, inputs, args.min_run_time)
        t_fused = measure(fused, inputs, args.min_run_time)
    print(f"{name}: {desc}")
    print(f"  plain inductor      {t_plain:9.3f} ms")
    print(f"  kimi_backend        {t_fused:9.3f} ms   ({n} mixing sites fused)")
    print(f"  speedup plain/kimi  {t_plain / t_fused:9.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("attn-res", "k3", "site", "all"), default="all")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--blocks", type=int, default=4, help="attn-res n_blocks")
    p.add_argument("--site-tokens", type=int, default=2048)
    p.add_argument("--site-hidden", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--min-run-time", type=float, default=1.0)
    args = p.parse_args()
    logging.getLogger("torch").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, CPU, fp32, {torch.get_num_threads()} threads; "
          "blocked_autorange medians")
    for name, build in (("attn-res", attn_res_model), ("k3", k3_model), ("site", site_model)):
        if args.model in (name, "all"):
            run(name, build, args)


if __name__ == "__main__":
    main()
