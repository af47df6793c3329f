"""``bench fusion``: plain-torch AttnRes models under kimi_backend (mixing fused) vs Inductor.

Models whose AttnRes mixing is written in plain PyTorch (``models.py``):

- ``attn-res``: the ``attn_res`` package's ``AttnResTransformer`` (Block AttnRes); each
  sub-layer's mixing becomes ``kimi.attn_res_mix_list``;
- ``k3``: ``K3Model(mixing="torch")``; each site becomes ``kimi.attn_res_mix``, the taps
  read it; ``wiring``: the same with every sublayer ``x * sigmoid(x)`` (mixing dominates);
- ``site``: one mixing site alone over ``bank[:, :8]`` and a prefix, ``--site-tokens`` x
  ``--site-hidden`` (the part of the step the pass changes).

Each model is compiled twice in one process, ``backend="inductor"`` and
``make_kimi_backend()``, and timed with ``Timer``: ``--rounds`` interleaved rounds, a sample
about ``--min-run-time`` seconds of calls; the figures are medians over rounds and the
speedup the median [IQR] of per-round ratios. Inference (default): under ``no_grad``,
outputs checked to agree first. ``--train``: forward plus ``torch.autograd.grad`` of a fixed
linear functional of the output with respect to every input and parameter that requires
grad; outputs and gradients of both are compared with eager first (``rel_err``: kimi_backend
must be as close as plain Inductor). Run::

    python -m kimi_passes bench fusion                 # every model, fp32, 2 threads
    python -m kimi_passes bench fusion --model k3 --tokens 512 --threads 1
    python -m kimi_passes bench fusion --train --model site --site-tokens 1024 --threads 1
"""

from __future__ import annotations

import argparse
import logging

import torch

from kimi_passes import make_kimi_backend
from kimi_passes.bench.harness import PROG, Timer, ratio_summary, rel_err, summary
from kimi_passes.bench.models import (
    Site,
    attn_res_transformer,
    first_tensor,
    k3_config,
    wiring_only,
)
from kimi_passes.debug.recording import graph_caches_off
from kimi_passes.fusion import AttnResFusionPass
from kimi_passes.graphs.k3 import K3Model


def attn_res_model(args):
    """The attn-res package's Block AttnRes transformer (frozen unless ``--train``)."""
    model = attn_res_transformer(args.hidden, args.layers, args.blocks,
                                 max_seq_len=max(2048, args.tokens), train=args.train)
    tokens = torch.randint(0, 1024, (1, args.tokens))
    desc = (f"attn-res AttnResTransformer d_model={args.hidden} sub-layers={args.layers} "
            f"blocks={args.blocks} tokens={args.tokens} (1 x {args.tokens})")
    return model, (tokens,), desc


def k3_model(args):
    cfg = k3_config(args.layers, args.hidden)
    model = K3Model(cfg, mixing="torch", trainable=args.train)
    ids = torch.arange(args.tokens) % cfg.vocab_size
    desc = (f"K3Model(mixing='torch') L={cfg.num_layers} S={cfg.attn_res_block_size} "
            f"H={cfg.hidden_size} T={args.tokens}, taps {cfg.aux_layer_ids}")
    return model, (ids,), desc


def wiring_model(args):
    """``k3_model`` with cheap elementwise sublayers: mixing-dominated."""
    model, inputs, desc = k3_model(args)
    return wiring_only(model), inputs, desc + ", every sublayer x * sigmoid(x)"


def site_model(args):
    T, H, nb = args.site_tokens, args.site_hidden, 8
    prefix, bank = Site.inputs(T, H, nb)
    for t in (prefix, bank):
        t.requires_grad_(args.train)
    desc = f"one pre-norm mixture, bank[:, :{nb}] + prefix, T={T} H={H}"
    return Site(H, nb).requires_grad_(args.train), (prefix, bank), desc


MODELS = {"attn-res": attn_res_model, "k3": k3_model, "wiring": wiring_model,
          "site": site_model}


def make_step(compiled, model, inputs, train: bool):
    """A zero-argument callable: the forward (no grad), or forward + gradients."""
    if not train:
        def infer():
            with torch.no_grad():
                return compiled(*inputs)
        return infer
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
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


def _check(kimi, model, inputs, got, ref, train: bool) -> int:
    """Check kimi_backend's result ``got`` against plain Inductor's ``ref`` (or, training,
    both against eager); the number of mixing sites the fusion pass fused."""
    if not train:
        torch.testing.assert_close(first_tensor(got), first_tensor(ref), atol=2e-3, rtol=2e-3)
        return kimi.passes.get(AttnResFusionPass).last_fused
    # Against eager: kimi_backend must be as close to it as plain Inductor is (fp32
    # rounding through a deep model reaches 1e-4..1e-3 of the largest gradient).
    eager = make_step(model, model, inputs, True)()
    kimi_err, plain_err = (max(rel_err(a, b) for a, b in zip(
        (x[0], *x[1]), (eager[0], *eager[1]), strict=True)) for x in (got, ref))
    print(f"  outputs and gradients vs eager (max |diff| / max |eager|): kimi_backend "
          f"{kimi_err:.1e}, plain Inductor {plain_err:.1e}")
    assert kimi_err <= 2 * plain_err + 1e-5, (kimi_err, plain_err)
    assert kimi.pre_autograd is not None  # fuse_torch_mixing is on (the default)
    return kimi.pre_autograd.get(AttnResFusionPass).last_fused


def run(name, build, args) -> None:
    model, inputs, desc = build(args)
    kimi = make_kimi_backend()
    plain_fn = make_step(torch.compile(model, backend="inductor"), model, inputs, args.train)
    kimi_fn = make_step(torch.compile(model, backend=kimi), model, inputs, args.train)
    # Both compile here; caches off, or a cached graph would skip the passes (0 fused).
    with graph_caches_off():
        n = _check(kimi, model, inputs, kimi_fn(), plain_fn(), args.train)
    timer = Timer(args.rounds, block_s=args.min_run_time, threads=args.threads,
                  max_s=float("inf"))
    t = timer.run({"plain": plain_fn, "kimi": kimi_fn})
    speedup = ratio_summary(t["plain"], t["kimi"])
    what = "forward + backward" if args.train else "forward (no grad)"
    print(f"{name}: {desc}; {what}")
    print(f"  plain inductor      {summary(t['plain'])['median'] * 1e3:9.3f} ms")
    print(f"  kimi_backend        {summary(t['kimi'])['median'] * 1e3:9.3f} ms   "
          f"({n} mixing sites fused)")
    print(f"  speedup plain/kimi  {speedup['median']:9.2f}x  [IQR {speedup['q1']:.2f}-"
          f"{speedup['q3']:.2f}, {speedup['n']} rounds]")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=f"{PROG} fusion", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=(*MODELS, "all"), default="all")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--blocks", type=int, default=4, help="attn-res n_blocks")
    p.add_argument("--site-tokens", type=int, default=2048)
    p.add_argument("--site-hidden", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--min-run-time", type=float, default=1.0,
                   help="seconds of calls per sample")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--train", action="store_true", help="time forward + backward")
    args = p.parse_args(argv)
    logging.getLogger("torch").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, CPU, fp32, {torch.get_num_threads()} threads; medians "
          f"of samples of ~{args.min_run_time:g} s, {args.rounds} interleaved rounds")
    for name, build in MODELS.items():
        if args.model in (name, "all"):
            run(name, build, args)
    return 0
