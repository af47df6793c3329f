"""The tiny K3 model (graphs/k3.py): wiring, stage composition, taps, compile health."""

from __future__ import annotations

import time
from itertools import pairwise

import pytest
import torch
from helpers.k3 import token_ids
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from kimi_passes import AuxCaptureError
from kimi_passes.graphs import K3Config, K3Model
from kimi_passes.graphs.k3 import cdiv
from kimi_passes.ops import attn_res_mix_reference

TINY = K3Config.tiny()
# Blocks of 3 over 7 layers: a partial last block and write layers at 0, 3, 6.
ODD = K3Config(num_layers=7, attn_res_block_size=3, hidden_size=32, num_heads=2,
               intermediate_size=48, aux_layer_ids=(0, 3, 4, 7), seed=3)
TINY_BF16 = K3Config(dtype=torch.bfloat16)
T = 12


pytestmark = pytest.mark.usefixtures("one_thread")


def ids_for(cfg: K3Config, n: int = T) -> torch.Tensor:
    return token_ids(cfg, n, seed=7)


def slice_for(stage: K3Model, state_dict: dict) -> dict:
    own = stage.state_dict()
    return {k: v for k, v in state_dict.items() if k in own}


def run_stages(cfg, bounds, mixing="op", full=None):
    """Run stages [b0,b1), [b1,b2), ... on each other's bundles; taps keyed per stage."""
    x, bank, taps = ids_for(cfg), None, []
    for a, b in pairwise(bounds):
        stage = K3Model(cfg, a, b, mixing=mixing)
        if full is not None:
            stage.load_state_dict(slice_for(stage, full.state_dict()), strict=True)
        out, aux = stage(x) if bank is None else stage(x, bank)
        taps.append(dict(zip(stage.capture_ids, aux, strict=True)))
        if b < cfg.num_layers:
            x, bank = out
    return out, taps


class AttnResSpy(TorchDispatchMode):
    """Records each ``kimi.attn_res`` call's inputs as they were before the call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.kimi.attn_res.default:
            prefix, delta, blocks, nw, qk, onw, nb, wi, eps, _ = args
            self.calls.append(dict(prefix=prefix.clone(), delta=delta, blocks=blocks.clone(),
                                   norm_weight=nw, qk_weight=qk.clone(), num_blocks=nb,
                                   write_idx=wi, eps=eps))
        return func(*args, **(kwargs or {}))


# --- stage composition ------------------------------------------------------------------

def split(name, cfg, bounds):
    return pytest.param(cfg, bounds, id=f"{name}-" + "-".join(map(str, bounds)))


SPLITS = [
    split("tiny", TINY, (0, 2, 4)),  # at a block boundary (layer 2 writes block 1)
    split("tiny", TINY, (0, 3, 4)),  # inside a block
    split("tiny", TINY, (0, 1, 3, 4)),
    split("tiny", TINY, (0, 2, 3, 4)),
    split("odd", ODD, (0, 3, 7)),
    split("odd", ODD, (0, 4, 7)),
    split("odd", ODD, (0, 2, 5, 7)),
    split("tiny-bf16", TINY_BF16, (0, 1, 3, 4)),
]


@pytest.mark.parametrize("mixing", ["op", "torch"])
@pytest.mark.parametrize("cfg,bounds", SPLITS)
def test_stage_composition_is_bit_exact(cfg, bounds, mixing):
    full = K3Model(cfg, mixing=mixing)
    hidden, aux = full(ids_for(cfg))
    full_taps = dict(zip(full.capture_ids, aux, strict=True))
    for from_seed in (True, False):
        out, stage_taps = run_stages(cfg, bounds, mixing, full=None if from_seed else full)
        assert torch.equal(out, hidden)
        for taps in stage_taps:  # the prefix stream, including the stage-end taps
            for k, v in taps.items():
                assert torch.equal(v, full_taps[k]), k

    # Ground truth per stage: the same bits, and a stage-end tap is refused, not faked.
    _, gt = full.ground_truth(ids_for(cfg))
    gt_full = dict(zip(full.capture_ids, gt, strict=True))
    x, bank = ids_for(cfg), None
    for a, b in pairwise(bounds):
        stage = K3Model(cfg, a, b, mixing=mixing)
        args = (x,) if bank is None else (x, bank)
        if not stage.is_last and b in stage.capture_ids:
            with pytest.raises(AuxCaptureError, match=f"capture id {b} "):
                stage.ground_truth(*args)
            out, _ = stage(*args)
        else:
            out, aux = stage.ground_truth(*args)
            for k, v in zip(stage.capture_ids, aux, strict=True):
                assert torch.equal(v, gt_full[k]), k
        if not stage.is_last:
            x, bank = out


def test_stages_do_not_mutate_their_inputs():
    cfg = TINY
    (h, bank), _ = K3Model(cfg, 0, 2)(ids_for(cfg))
    h0, bank0 = h.clone(), bank.clone()
    K3Model(cfg, 2, 4)(h, bank)
    assert torch.equal(h, h0) and torch.equal(bank, bank0)


def test_stage_bank_has_the_full_models_slots():
    cfg = ODD
    (h, bank), _ = K3Model(cfg, 0, 2)(ids_for(cfg))
    assert h.shape == (T, cfg.hidden_size)
    assert bank.shape == (T, cdiv(cfg.num_layers, cfg.attn_res_block_size), cfg.hidden_size)
    with pytest.raises(ValueError, match="bank"):
        K3Model(cfg, 2, 7)(h, bank[:, :1])


# --- the two mixing statements ---------------------------------------------------------


def test_op_and_torch_mixing_agree():
    for cfg in (TINY, ODD):
        op, pt = K3Model(cfg, mixing="op"), K3Model(cfg, mixing="torch")
        for name in ("forward", "ground_truth"):
            h1, a1 = getattr(op, name)(ids_for(cfg))
            h2, a2 = getattr(pt, name)(ids_for(cfg))
            torch.testing.assert_close(h1, h2, rtol=1e-5, atol=1e-5)
            for x, y in zip(a1, a2, strict=True):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


# --- taps ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg,bounds", [split("tiny", TINY, (0, 4)), split("tiny", TINY, (1, 4)),
                                        split("odd", ODD, (0, 7)), split("odd", ODD, (4, 7)),
                                        split("odd", ODD, (0, 5))])
def test_taps_read_their_consumer(cfg, bounds):
    """Each capture id k: prefix tap == consumer's prefix+delta; ground truth == its mixture."""
    start, end = bounds
    S = cfg.attn_res_block_size
    stage = K3Model(cfg, start, end)
    if start == 0:
        args = (ids_for(cfg),)
    else:
        (h, bank), _ = K3Model(cfg, 0, start)(ids_for(cfg))
        args = (h, bank)
    spy = AttnResSpy()
    with spy:
        _, legacy = stage(*args)
    assert len(spy.calls) == 2 * (end - start) + stage.is_last
    _, truth = stage.ground_truth(*args)
    for k, lt, gt in zip(stage.capture_ids, legacy, truth, strict=True):
        call = spy.calls[2 * (k - start)]  # layer k's pre-attention or the output aggregation
        owner = stage.layers[str(k)] if k < cfg.num_layers else stage
        res_norm = (owner.self_attention_res_norm if k < cfg.num_layers
                    else owner.output_attn_res_norm)
        assert call["norm_weight"] is res_norm.weight
        assert call["num_blocks"] == cdiv(k, S)
        x = call["prefix"] if call["delta"] is None else call["prefix"] + call["delta"]
        assert torch.equal(lt, x), k
        want = attn_res_mix_reference(x, call["blocks"], call["norm_weight"],
                                      call["qk_weight"], cdiv(k, S), cfg.eps)
        torch.testing.assert_close(gt, want, rtol=1e-5, atol=1e-5)
        if cdiv(k, S) == 0:  # a single source: the mixture is the prefix itself
            assert torch.equal(gt, lt)
        else:  # non-zero pseudo-queries: the mixture is far from the running prefix
            assert (gt - lt).abs().max() > 0.1 * lt.abs().max(), k


def test_ground_truth_tap_L_is_the_output_aggregation():
    m = K3Model(TINY)
    hidden, aux = m.ground_truth(ids_for(TINY))
    tap_L = aux[m.capture_ids.index(TINY.num_layers)]
    torch.testing.assert_close(m.norm(tap_L), hidden, rtol=1e-5, atol=1e-5)


def test_ground_truth_refuses_a_stage_end_tap():
    stage = K3Model(TINY, 0, 2)
    assert stage.capture_ids == (0, 2)
    (h, _), aux = stage(ids_for(TINY))  # the prefix stream marks it: the pass refuses it
    assert torch.equal(aux[1], h)
    with pytest.raises(AuxCaptureError, match=r"capture id 2 .*\[0, 2\).*next pipeline stage"):
        stage.ground_truth(ids_for(TINY))


# --- checkpoint names -------------------------------------------------------------------


def test_sliced_state_dict_round_trip():
    full = K3Model(TINY).state_dict()
    H = TINY.hidden_size
    assert full["layers.1.self_attention_res_proj.weight"].shape == (1, H)
    assert full["layers.3.mlp_res_norm.weight"].shape == (H,)
    assert {"embed_tokens.weight", "output_attn_res_norm.weight",
            "output_attn_res_proj.weight", "norm.weight"} <= full.keys()
    other = K3Config(**{**TINY.__dict__, "seed": 1})
    for a, b in ((0, 2), (1, 3), (3, 4)):
        stage = K3Model(other, a, b)
        sliced = slice_for(stage, full)
        assert not any(torch.equal(v, stage.state_dict()[k]) for k, v in sliced.items()
                       if k.endswith("res_proj.weight"))
        stage.load_state_dict(sliced, strict=True)
        assert stage.state_dict().keys() == sliced.keys()
        assert all(torch.equal(stage.state_dict()[k], v) for k, v in sliced.items())
        layers = {k.split(".")[1] for k in sliced if k.startswith("layers.")}
        assert layers == {str(i) for i in range(a, b)}
        assert ("embed_tokens.weight" in sliced) == (a == 0)
        assert ("output_attn_res_proj.weight" in sliced) == (b == TINY.num_layers)


# --- torch.compile ------------------------------------------------------------------------


def _compile_check(model, args, backend, tol):
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    if backend == "record+aot_eager":  # keep Dynamo's graph, run it through AOTAutograd
        def backend(gm, example_inputs):
            graphs.append(gm)
            return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    t0 = time.perf_counter()
    out, aux = compiled(*args)
    seconds = time.perf_counter() - t0
    assert sum(counters["graph_break"].values()) == 0
    ref, ref_aux = model(*args)
    for x, y in zip(torch.utils._pytree.tree_leaves((out, aux)),
                    torch.utils._pytree.tree_leaves((ref, ref_aux)), strict=True):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)
    return seconds, graphs


def test_inductor_fullgraph_matches_eager():
    """Plain Inductor: no graph break; taps are the legacy values (the marker is a clone)."""
    seconds, _ = _compile_check(K3Model(TINY), (ids_for(TINY),), "inductor", 1e-5)
    print(f"tiny K3 ({TINY.num_layers} layers): inductor compile + first run {seconds:.1f}s")


@pytest.mark.parametrize("mixing", ["op", "torch"])
@pytest.mark.parametrize("bounds", [(0, 3), (1, 3), (3, 4)], ids=str)
def test_every_stage_traces_fullgraph(bounds, mixing):
    a, b = bounds
    args = (ids_for(TINY),) if a == 0 else K3Model(TINY, 0, a)(ids_for(TINY))[0]
    stage = K3Model(TINY, a, b, mixing=mixing)
    _, graphs = _compile_check(stage, args, "record+aot_eager", 1e-6)
    paths = [_module_path(n) for n in graphs[0].graph.nodes
             if n.target in (torch.ops.kimi.attn_res, torch.ops.kimi.attn_res.default)]
    if mixing == "op":  # each layer's two calls sit in layers.{i}; the aggregation on top
        want = [f"layers.{i}" for i in range(a, b) for _ in "ab"] + [""] * stage.is_last
        assert len(paths) == len(want)
        assert all(p.endswith(w) if w else p == "" for p, w in zip(paths, want, strict=True)), paths
    else:
        assert paths == []


def _module_path(node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


@pytest.mark.heavy
def test_k3_geometry_traces_functionalizes_and_matches_eager():
    """K3's depth (93 layers) traces as one graph, functionalizes (the bank writes) and
    matches eager. Depth is the subject, so the graph runs through AOTAutograd
    (``aot_eager``): Inductor on the same graph is each layer's compile
    (test_inductor_fullgraph_matches_eager) 93 times over, 90 s even with every op an
    ATen call; the passes at this depth are timed by ``kimi_passes.bench.compile_time``."""
    cfg = K3Config.k3_geometry()
    model = K3Model(cfg)
    seconds, _ = _compile_check(model, (ids_for(cfg, 8),), "aot_eager", 1e-4)
    print(f"K3 geometry ({cfg.num_layers} layers, S={cfg.attn_res_block_size}): "
          f"aot_eager compile + first run {seconds:.1f}s")
    assert model.capture_ids == (2, 46, 88, 90, 93)
