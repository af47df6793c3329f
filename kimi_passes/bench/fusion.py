"""CPU speed of plain-torch AttnRes models under kimi_backend (mixing fused) vs plain Inductor.

Models whose AttnRes mixing is written in plain PyTorch:

- ``attn-res``: the third-party ``attn_res.AttnResTransformer`` (Block AttnRes: stacked
  sources, RMSNorm without weight, einsum, softmax(dim=0), einsum); kimi_backend turns
  each sub-layer's mixing into ``kimi.attn_res_mix_list``.
- ``k3``: ``graphs/k3.py``'s ``K3Model(mixing="torch")`` forward step (cat of
  ``bank[:, :n]`` and the prefix, F.rms_norm, einsum, softmax, einsum); kimi_backend turns
  each site into ``kimi.attn_res_mix`` and the taps read it.
- ``wiring``: the same K3 with every sublayer ``x * sigmoid(x)`` (the mixing dominates);
- ``site``: one mixing site alone, ``attn_res_torch``'s pure read over ``bank[:, :8]`` and
  a prefix at ``--site-tokens`` x ``--site-hidden`` (the part of the step the pass changes).

Each model is compiled twice in the same process, ``backend="inductor"`` and
``make_kimi_backend()``, and timed with ``torch.utils.benchmark`` blocked-autorange
medians, the two interleaved: ``--rounds`` rounds, each timing both (order alternating);
the figures are the medians over rounds and the ratio the median of per-round ratios.
Inference (default): under ``torch.no_grad()``, outputs checked to agree first.
``--train``: a training step, forward plus ``torch.autograd.grad`` of a fixed linear
functional of the output with respect to every input and parameter that requires grad
(every model; the K3 model built with ``trainable=True``); outputs and gradients of both
are compared with eager first (kimi_backend must be as close as plain
Inductor). Run::

    python tools/bench_fusion.py                 # every model, fp32, 2 threads
    python tools/bench_fusion.py --model k3 --tokens 512 --threads 1
    python tools/bench_fusion.py --train --model site --site-tokens 1024 --threads 1

(``python -m kimi_passes.bench.fusion`` is the same.)
"""

from __future__ import annotations

import argparse
import logging
import statistics
from typing import cast

import torch
import torch.utils.benchmark as benchmark

from kimi_passes import make_kimi_backend
from kimi_passes.fusion import AttnResFusionPass
from kimi_passes.graphs.k3 import K3Config, K3Model, attn_res_torch


def attn_res_model(args):
    """The attn-res package's Block AttnRes transformer (frozen unless ``--train``)."""
    from attn_res import AttnResMode, AttnResOperator, AttnResTransformer, TransformerConfig

    cfg = TransformerConfig(d_model=args.hidden, n_layers=args.layers, n_heads=8, n_kv_heads=2,
                            vocab_size=1024, max_seq_len=max(2048, args.tokens),
                            n_blocks=args.blocks, attn_res_mode=AttnResMode.BLOCK)
    torch.manual_seed(0)
    model = AttnResTransformer(cfg).eval().requires_grad_(args.train)
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
    model = K3Model(cfg, mixing="torch", trainable=args.train)
    ids = torch.arange(args.tokens) % cfg.vocab_size
    desc = (f"K3Model(mixing='torch') L={cfg.num_layers} S={cfg.attn_res_block_size} "
            f"H={cfg.hidden_size} T={args.tokens}, taps {cfg.aux_layer_ids}")
    return model, (ids,), desc


def _cheap(self, x):
    return x * torch.sigmoid(x)


def wiring_only(model: K3Model) -> K3Model:
    """``model`` with every sublayer (attention, MLP) an elementwise op: the wiring alone."""
    for layer in model.layers.values():  # DecoderLayer: its sublayers are modules
        attn, mlp = cast(torch.nn.Module, layer.self_attn), cast(torch.nn.Module, layer.mlp)
        attn.forward = _cheap.__get__(attn)
        mlp.forward = _cheap.__get__(mlp)
    return model


def wiring_model(args):
    """``k3_model`` with cheap elementwise sublayers: mixing-dominated."""
    model, inputs, desc = k3_model(args)
    return wiring_only(model), inputs, desc + ", every sublayer x * sigmoid(x)"


def site_model(args):
    T, H, nb = args.site_tokens, args.site_hidden, 8
    g = torch.Generator().manual_seed(0)
    prefix, bank = torch.randn(T, H, generator=g), torch.randn(T, nb, H, generator=g)
    norm_weight = 1 + 0.1 * torch.randn(H, generator=g)
    qk_weight = torch.randn(H, generator=g) / H**0.5
    for t in (prefix, bank, norm_weight, qk_weight):
        t.requires_grad_(args.train)

    def mix(prefix, bank, norm_weight, qk_weight):
        return attn_res_torch(prefix, None, bank, norm_weight, qk_weight, None, nb, -1,
                              1e-6, 1e-6)

    desc = f"one pre-norm mixture, bank[:, :{nb}] + prefix, T={T} H={H}"
    return mix, (prefix, bank, norm_weight, qk_weight), desc


def first_tensor(out):
    while isinstance(out, (tuple, list)):
        out = out[0]
    if hasattr(out, "logits"):
        out = out.logits
    return out


def measure(fn, min_run_time: float) -> float:
    timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def rel_err(got, want) -> float:
    """Max abs difference over the max abs of ``want`` (0 when both are None)."""
    if got is None or want is None:
        assert got is None and want is None, "a gradient is None on one side only"
        return 0.0
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max()) / (float(want.abs().max()) or 1.0)


def make_step(compiled, model, inputs, train: bool):
    """A zero-argument callable: the forward (no grad), or forward + gradients."""
    if not train:
        def infer():
            with torch.no_grad():
                return compiled(*inputs)
        return infer
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if isinstance(model, torch.nn.Module):
        leaves += [p for p in model.parameters() if p.requires_grad]
    weight = {}

    def train_step():
        out = first_tensor(compiled(*inputs))
        if "w" not in weight:  # a fixed linear functional of the output
            g = torch.Generator().manual_seed(1)
            weight["w"] = torch.randn(out.shape, generator=g, dtype=out.dtype)
        return out, torch.autograd.grad((out * weight["w"]).sum(), leaves,
                                        allow_unused=True)
    return train_step


def run(name, build, args) -> None:
    model, inputs, desc = build(args)
    kimi = make_kimi_backend()
    plain_fn = make_step(torch.compile(model, backend="inductor"), model, inputs, args.train)
    kimi_fn = make_step(torch.compile(model, backend=kimi), model, inputs, args.train)
    ref, got = plain_fn(), kimi_fn()  # compile both, check they agree
    if args.train:
        # Against eager: kimi_backend must be as close to it as plain Inductor is (fp32
        # rounding through a deep model reaches 1e-4..1e-3 of the largest gradient).
        eager = make_step(model, model, inputs, True)()
        kimi_err, plain_err = (max(rel_err(a, b) for a, b in zip(
            (x[0], *x[1]), (eager[0], *eager[1]), strict=True)) for x in (got, ref))
        print(f"  outputs and gradients vs eager (max |diff| / max |eager|): kimi_backend "
              f"{kimi_err:.1e}, plain Inductor {plain_err:.1e}")
        assert kimi_err <= 2 * plain_err + 1e-5, (kimi_err, plain_err)
        assert kimi.pre_autograd is not None  # fuse_torch_mixing is on (the default)
        fusion = kimi.pre_autograd.get(AttnResFusionPass)
    else:
        torch.testing.assert_close(first_tensor(got), first_tensor(ref), atol=2e-3, rtol=2e-3)
        fusion = kimi.passes.get(AttnResFusionPass)
    n = fusion.last_fused
    plain_t: list[float] = []
    kimi_t: list[float] = []
    ratios: list[float] = []
    for r in range(args.rounds):
        order = [(plain_fn, plain_t), (kimi_fn, kimi_t)]
        for fn, times in (order if r % 2 == 0 else order[::-1]):
            times.append(measure(fn, args.min_run_time))
        ratios.append(plain_t[-1] / kimi_t[-1])
    med = statistics.median
    what = "forward + backward" if args.train else "forward (no grad)"
    print(f"{name}: {desc}; {what}")
    print(f"  plain inductor      {med(plain_t):9.3f} ms")
    print(f"  kimi_backend        {med(kimi_t):9.3f} ms   ({n} mixing sites fused)")
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    print(f"  speedup plain/kimi  {med(ratios):9.2f}x  [IQR {q[0]:.2f}-{q[2]:.2f}, "
          f"{len(ratios)} rounds]")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("attn-res", "k3", "wiring", "site", "all"),
                   default="all")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--blocks", type=int, default=4, help="attn-res n_blocks")
    p.add_argument("--site-tokens", type=int, default=2048)
    p.add_argument("--site-hidden", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--min-run-time", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--train", action="store_true",
                   help="time forward + backward")
    args = p.parse_args(argv)
    logging.getLogger("torch").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, CPU, fp32, {torch.get_num_threads()} threads; "
          f"blocked_autorange medians, {args.rounds} interleaved rounds")
    for name, build in (("attn-res", attn_res_model), ("k3", k3_model),
                        ("wiring", wiring_model), ("site", site_model)):
        if args.model in (name, "all"):
            run(name, build, args)


if __name__ == "__main__":
    main()
