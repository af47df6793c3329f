"""Shared helpers for tests that compile the reference K3."""

from __future__ import annotations

import re

import torch

import kimi_passes
from helpers.op import OP_TOL
from kimi_passes.graphs.k3 import K3Config, K3Model


def small_config(num_layers=4, block_size=2, taps=None, dtype=torch.float32, seed=0, hidden=16):
    taps = tuple(range(num_layers + 1)) if taps is None else tuple(taps)
    return K3Config(num_layers=num_layers, hidden_size=hidden, attn_res_block_size=block_size,
                    num_heads=2, intermediate_size=2 * hidden, vocab_size=64,
                    aux_layer_ids=taps, seed=seed, dtype=dtype)


def ids(T: int = 5, seed: int = 1, vocab: int = 64) -> torch.Tensor:
    """``T`` token ids, seeded (``vocab``: the small test models' vocabulary)."""
    return torch.randint(0, vocab, (T,), generator=torch.Generator().manual_seed(seed))


def token_ids(cfg: K3Config, T: int = 7, seed: int = 0) -> torch.Tensor:
    return ids(T, seed, cfg.vocab_size)


def inference_model(cfg: K3Config, start: int = 0, end: int | None = None, **kw) -> K3Model:
    return K3Model(cfg, start, end, **kw).requires_grad_(False).eval()


def compiled_ground_truth(model, *inputs):
    """Ground-truth taps with the rest of the model compiled by plain Inductor.

    In bf16/fp16 Inductor rounds attention and MLP differently from eager, and that
    drift (a few ulps, growing with depth) reaches the taps. Compiling the ground
    truth too gives both sides the same upstream values, so what is compared is the
    tap itself at the op's tolerance.
    """
    torch._dynamo.reset()
    return torch.compile(model.ground_truth, backend="inductor", fullgraph=True)(*inputs)


def compile_model(model, backend=None, **kw):
    torch._dynamo.reset()
    backend = kimi_passes.kimi_backend if backend is None else backend
    return torch.compile(model, backend=backend, fullgraph=True, **kw)


def assert_taps_close(got, want, dtype, msg=""):
    assert len(got) == len(want), msg
    tol = OP_TOL[dtype]  # a tap is one mixture: the op's tolerance
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=tol, rtol=tol,
                                   msg=lambda m, i=i: f"{msg} tap {i}: {m}")


def main_job_rows(out: str) -> dict[int, list[str]]:
    """The main job's tap table (``python -m kimi_passes``), its rows by capture id
    (columns split on runs of 2+ spaces)."""
    table = {}
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells and cells[0].isdigit() and len(cells) >= 10:
            table[int(cells[0])] = cells
    return table


#: ``bench --quick``'s sections (op, tap, pass) at the smallest shapes, each section's own
#: flags: README's ``bench --quick`` runs them (test_readme_commands.py, the suite's one run
#: of tap and pass); test_bench.py's compile-section test passes them too.
TINY_BENCH = ["--T", "1", "--H", "64", "--blocks", "2", "--dtypes", "float32",
              "--variants", "read", "--no-compiled", "--no-peers", "--rounds", "2",
              "--block-ms", "1", "--threads", "1", "--tap-layers", "2", "--tap-hidden", "64",
              "--tap-T", "8", "--pass-layers", "2", "--no-plot"]
