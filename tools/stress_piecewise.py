"""Stress: a vLLM-shaped piecewise compile of the reference K3, many times, warm cache.

Each compile: Dynamo traces the K3 (attention behind an opaque custom op), the backend
splits the graph at that op with ``torch.fx.passes.split_module`` and compiles each
other piece with Inductor's ``compile_fx`` (inside the Dynamo backend, on the graph's
fake inputs), with the kimi passes installed alone as ``post_grad_custom_post_pass``
(``kimi_passes.pass_manager(lower_kimi_ops=...)``). Several K3 cases per process;
processes one after another sharing one Inductor cache directory (the FX graph cache
serves the later ones); static and dynamic shapes.

Counts the compiles and the failures (any exception, e.g. Dynamo's ``produce_guards``)::

    python tools/stress_piecewise.py --processes 5 --lower on       # one run: 50 compiles
    python tools/stress_piecewise.py --processes 5 --lower off

Prints one JSON line per process and a summary; exit status 1 when any compile failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import cast

import torch

ATTENTION_OP = "kimi_stress::attention"

#: (num_layers, block_size, hidden, dtype, dynamic): the K3 cases one process compiles.
CASES = [
    (2, 1, 16, "float32", False),
    (2, 1, 16, "float32", True),
    (3, 2, 32, "float32", True),
    (2, 2, 16, "bfloat16", False),
    (3, 1, 16, "bfloat16", True),
]


def _define_attention():
    """The opaque attention op (defined once per process)."""
    import torch.nn.functional as F

    if hasattr(torch.ops.kimi_stress, "attention"):
        return torch.ops.kimi_stress.attention

    @torch.library.custom_op(ATTENTION_OP, mutates_args=(),
                             schema="(Tensor x, Tensor wq, Tensor wk, Tensor wv, "
                                    "int num_heads) -> Tensor")
    def attention(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
                  num_heads: int) -> torch.Tensor:
        T, H = x.shape
        q, k, v = (F.linear(x, w).view(T, num_heads, -1).transpose(0, 1)
                   for w in (wq, wk, wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(0, 1).reshape(T, H).contiguous()

    @attention.register_fake
    def _(x, wq, wk, wv, num_heads):
        return torch.empty_like(x)

    return attention


def _model(num_layers, block_size, hidden, dtype):

    from kimi_passes.graphs.k3 import K3Config, K3Model

    cfg = K3Config(num_layers=num_layers, hidden_size=hidden, attn_res_block_size=block_size,
                   num_heads=2, intermediate_size=2 * hidden, vocab_size=64,
                   aux_layer_ids=tuple(range(1, num_layers + 1, 2)), seed=num_layers,
                   dtype=getattr(torch, dtype))
    model = K3Model(cfg).requires_grad_(False).eval()
    attn = torch.ops.kimi_stress.attention

    def forward(self, x):
        return self.o_proj(attn(x, self.q_proj.weight, self.k_proj.weight,
                                self.v_proj.weight, self.num_heads))

    for layer in model.layers.values():
        attention = cast(torch.nn.Module, layer.self_attn)
        attention.forward = forward.__get__(attention)
    return model, cfg


def piecewise_backend(lower: bool, stats: dict | None = None):
    """A Dynamo backend that compiles as vLLM does: split at the attention op, each other
    piece through ``compile_fx`` with the kimi passes alone as the post-grad custom pass.

    ``stats`` (when given) counts the kimi calls the lowering lowered and kept, over the
    pieces Inductor compiled (a piece the FX graph cache serves runs no pass)."""
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.passes.split_module import split_module

    import kimi_passes

    target = torch.ops.kimi_stress.attention.default

    def backend(gm, example_inputs):
        counter = [0]

        def part(node):
            """The piece of ``node``: each attention call a piece of its own."""
            if node.op == "call_function" and node.target is target:
                counter[0] += 2
                return counter[0] - 1
            return counter[0]

        split = split_module(gm, cast(torch.nn.Module, None), part, keep_original_order=True)
        passes = kimi_passes.pass_manager(lower_kimi_ops=lower)
        patches = {"post_grad_custom_post_pass": passes}

        class Compiler(torch.fx.Interpreter):
            def call_module(self, name, args, kwargs):
                sub = getattr(self.module, name)
                out = super().call_module(name, args, kwargs)
                if not any(n.op == "call_function" and n.target is target
                           for n in sub.graph.nodes):
                    setattr(self.module, name, _Compiled(compile_fx(
                        sub, list(args), config_patches=patches)))
                    if stats is not None and passes.lowering is not None:
                        stats["lowered"] += passes.lowering.last_lowered
                        stats["kept"] += len(passes.lowering.last_kept)
                        passes.lowering.last_lowered, passes.lowering.last_kept = 0, []
                return out

        fake = torch._guards.TracingContext.get().fake_mode
        assert fake is not None  # a Dynamo backend runs under Dynamo's fake mode
        with fake:
            Compiler(split).run(*[
                fake.from_tensor(a) if isinstance(a, torch.Tensor)
                and not isinstance(a, torch._subclasses.FakeTensor) else a
                for a in example_inputs])
        return split

    return backend


class _Compiled(torch.nn.Module):
    """A compiled piece in the split graph's module slot (called with the piece's args)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def run_cases(lower: bool, rounds: int, cases=CASES, shift: int = 0) -> dict:
    """Compile every case ``rounds`` times in this process (round ``r`` at
    ``T = 7 + shift + r``) and check its outputs and taps against the eager ground truth;
    count the failures."""
    _define_attention()
    stats = {"lowered": 0, "kept": 0}
    compiles, failures = 0, []
    for r in range(rounds):
        for case in cases:
            layers, S, H, dtype, dynamic = case
            model, cfg = _model(layers, S, H, dtype)
            torch._dynamo.reset()
            compiled = torch.compile(model, backend=piecewise_backend(lower, stats),
                                     fullgraph=True, dynamic=dynamic)
            ids = torch.randint(0, cfg.vocab_size, (7 + shift + r,),
                                generator=torch.Generator().manual_seed(r))
            compiles += 1
            try:
                (hidden, taps) = compiled(ids)
                want, want_taps = model.ground_truth(ids)
                tol = 1e-4 if dtype == "float32" else 3e-2
                for g, w in zip([hidden, *taps], [want, *want_taps], strict=True):
                    torch.testing.assert_close(g.float(), w.float(), atol=tol, rtol=tol)
            except Exception as e:  # counted and reported, never hidden
                failures.append({"case": list(case), "round": r,
                                 "error": f"{type(e).__name__}: {e}"[:300],
                                 "where": [ln[:160] for ln in
                                           traceback.format_exc().splitlines()[-4:-1]]})
    return {"compiles": compiles, "failures": failures, **stats}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--processes", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="compiles of each case per process")
    p.add_argument("--lower", choices=("on", "off"), default="on")
    p.add_argument("--cache-dir", help="shared Inductor cache (default: a fresh temp dir)")
    p.add_argument("--shift-t", action="store_true",
                   help="process i compiles at T = 7 + i + round: its static cases miss the "
                        "cache while its dynamic ones hit")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        print(json.dumps(run_cases(a.lower == "on", a.rounds,
                                   shift=a.child if a.shift_t else 0)))
        return 0
    import kimi_passes

    cache = a.cache_dir or tempfile.mkdtemp(prefix="kimi-stress-")
    # The children import the kimi_passes this process imported (this checkout).
    root = os.path.dirname(os.path.dirname(os.path.abspath(kimi_passes.__file__)))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    total, failed, lowered, kept = 0, 0, 0, 0
    for i in range(a.processes):
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, __file__, "--child", str(i), "--lower", a.lower,
                              "--rounds", str(a.rounds)] + ["--shift-t"] * a.shift_t,
                             env=env, capture_output=True, text=True)
        if out.returncode:
            print(out.stderr[-3000:], file=sys.stderr)
            print(json.dumps({"process": i, "rc": out.returncode}))
            failed += 1
            continue
        res = json.loads(out.stdout.strip().splitlines()[-1])
        total += res["compiles"]
        failed += len(res["failures"])
        lowered, kept = lowered + res["lowered"], kept + res["kept"]
        print(json.dumps({"process": i, "s": round(time.monotonic() - t0, 1), **res}),
              flush=True)
    print(json.dumps({"lower": a.lower, "shift_t": a.shift_t, "compiles": total, "failures": failed,
                      "calls_lowered": lowered, "calls_kept": kept, "cache": cache}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
