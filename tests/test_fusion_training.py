"""AttnRes mixing fused in training graphs: a fused forward and a fused backward.

A graph that needs a backward is fused before AOTAutograd (``kimi_passes.training.pre_autograd``):
the forward graph calls ``kimi.attn_res_mix`` / ``attn_res_mix_list`` and the backward
graph their backward ops, with no plain-torch mixture or its derivative left in either;
outputs and gradients equal plain Inductor's. Constructs that make tracing below
autograd unsound are refused (compiled unfused, with a warning); in-place updates are
functionalized, and on a graph that is not functional a site whose sources may be mutated
between the stacking and the weighted sum is not fused.

Caches are off (the passes run on every compile). The compiles, ``kimi_backend`` and the
plain-Inductor references alike, use Inductor's ``fallback_by_default`` (the
``aten_fallback`` fixture): the graphs and the passes are a full compile's, no C++ kernel
is built. The one-site test (``codegen``) compiles its fused forward and backward to C++.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from kimi_passes import make_kimi_backend
from kimi_passes.bench import rel_err
from kimi_passes.debug.recording import GraphRecorder
from kimi_passes.fusion import AttnResFusionPass
from kimi_passes.graphs.k3 import K3Config, K3Model, attn_res_torch

aten = torch.ops.aten
kimi = torch.ops.kimi
MIX = ("attn_res_mix", "attn_res_mix_list")
#: Ops of a plain-torch mixture (the key norm and the softmax) and of its derivative.
PLAIN_MIXING = {aten.exp.default, aten._softmax.default, aten.rsqrt.default,
                aten.pow.Tensor_Scalar, aten._softmax_backward_data.default, aten.amax.default}


pytestmark = pytest.mark.usefixtures("caches_off", "aten_fallback")


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _site_inputs(T=5, H=32, nb=3, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randn(T, H, generator=g).to(dtype)
    bank = torch.randn(T, nb + 1, H, generator=g).to(dtype)
    nw = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    qk = (torch.randn(H, generator=g) / H**0.5).to(dtype)
    return [t.requires_grad_(True) for t in (prefix, bank, nw, qk)]


def site(prefix, bank, nw, qk):
    """One pre-norm mixture over ``bank[:, :3]`` and the prefix (K3's plain statement)."""
    return attn_res_torch(prefix, None, bank, nw, qk, None, 3, -1, 1e-6, 1e-6)


def _grads(fn, inputs, backend, weight=None):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = torch.compile(fn, backend=backend, fullgraph=True)(*leaves)
    w = weight if weight is not None else torch.linspace(-1, 1, out.numel()).view(out.shape)
    grads = torch.autograd.grad((out.float() * w).sum(), leaves)
    return out, grads


def _equals_inductor(fn, inputs, out, grads, tol: float) -> None:
    """``out`` and ``grads`` (from kimi_backend) equal plain Inductor's within ``tol``."""
    torch._dynamo.reset()
    ref, ref_grads = _grads(fn, inputs, "inductor")
    assert rel_err(out, ref) < tol
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel_err(g, r) < tol


def _targets(graph) -> list:
    return [n.target for n in graph.nodes if n.op == "call_function"]


@pytest.mark.heavy
@pytest.mark.codegen
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_site_fused_forward_and_backward(dtype):
    inputs = _site_inputs(dtype=dtype)
    rec = GraphRecorder(make_kimi_backend())
    out, grads = _grads(site, inputs, rec)
    torch._dynamo.reset()
    ref, ref_grads = _grads(site, inputs, "inductor")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(out, ref) < tol
    for name, g, r in zip(("prefix", "bank", "norm_weight", "qk_weight"), grads, ref_grads,
                          strict=True):
        assert rel_err(g, r) < tol, name
    assert rec.backend.pre_autograd.get(AttnResFusionPass).last_fused == 1
    fw, bw = rec.graphs
    assert fw.counts()["attn_res_mix"] == 1 and bw.counts()["attn_res_mix_backward"] == 1
    # No duplicate work: neither graph keeps the plain-torch mixture or its derivative.
    for name, g in (("forward", fw), ("backward", bw)):
        left = [t for t in _targets(g.after) if t in PLAIN_MIXING]
        assert not left, f"{name} graph still computes {left}"


def test_attn_res_package_trains_fused():
    attn_res = pytest.importorskip(
        "attn_res", reason="the attn-res package is not installed (test extra: attn-res==0.1.0)")
    cfg = attn_res.TransformerConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                     vocab_size=128, max_seq_len=256, n_blocks=2,
                                     attn_res_mode=attn_res.AttnResMode.BLOCK)
    torch.manual_seed(0)
    model = attn_res.AttnResTransformer(cfg).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, attn_res.AttnResOperator):
                m.pseudo_query.normal_()
    tokens = torch.randint(0, cfg.vocab_size, (1, 24))

    def grads(backend):
        m = copy.deepcopy(model)
        out = torch.compile(m, backend=backend)(tokens)
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.float().pow(2).mean().backward()
        return out, {n: p.grad for n, p in m.named_parameters()}

    rec = GraphRecorder(make_kimi_backend())
    out, g = grads(rec)
    torch._dynamo.reset()
    # The reference: fusion off, no taps in this model, so exactly plain Inductor's graphs.
    rec_plain = GraphRecorder(make_kimi_backend(fuse_torch_mixing=False))
    ref, g_ref = grads(rec_plain)
    assert rel_err(out, ref) < 1e-5
    assert g.keys() == g_ref.keys()
    for name in g:
        assert (g[name] is None) == (g_ref[name] is None), name
        if g[name] is not None:
            assert rel_err(g[name], g_ref[name]) < 1e-4, name
    sites = cfg.n_layers
    assert rec.backend.pre_autograd.get(AttnResFusionPass).last_fused == sites
    fw, bw = rec.graphs
    assert fw.counts()["attn_res_mix_list"] == sites
    assert bw.counts()["attn_res_mix_list_backward"] == sites
    # The model's own RMSNorms and attention softmaxes remain: the mixing sites' do not.

    def n_softmax_exp(g):
        return sum(t in (aten.exp.default, aten.amax.default) for t in _targets(g.after))
    assert n_softmax_exp(fw) < n_softmax_exp(rec_plain.graphs[0])
    assert n_softmax_exp(bw) < n_softmax_exp(rec_plain.graphs[1])


@pytest.mark.heavy
@pytest.mark.parametrize("mixing", ["torch", "op"])
def test_k3_trains_compiled_with_taps(mixing):
    """The reference K3, trainable: with ``mixing="torch"`` every mixing site is fused
    before AOTAutograd; either way the forward mixes with kimi ops, the backward uses their
    backward ops, the taps read their consumers' mixtures and are still right after the
    backward (which must not reuse a tap's buffer), and gradients equal plain Inductor's."""
    # 2 layers, a block write after each, taps 0, 1 (after a write) and L=2: tiny's cases,
    # at half its compile time.
    cfg = K3Config(num_layers=2, hidden_size=32, attn_res_block_size=1, num_heads=2,
                   intermediate_size=64, vocab_size=64, aux_layer_ids=(0, 1, 2))
    ids = torch.arange(12) % cfg.vocab_size
    model = K3Model(cfg, mixing=mixing, trainable=True)

    def run(backend):
        m = copy.deepcopy(model)
        out, taps = torch.compile(m, backend=backend, fullgraph=True)(ids)
        (out.float().pow(2).mean() + sum(t.float().mean() for t in taps)).backward()
        return out, taps, {n: p.grad for n, p in m.named_parameters()}

    rec = GraphRecorder(make_kimi_backend())
    out, taps, g = run(rec)
    torch._dynamo.reset()
    ref, ref_taps, g_ref = run("inductor")
    with torch.no_grad():
        _, truth = model.ground_truth(ids)
    assert rel_err(out, ref) < 1e-5
    assert len(taps) == len(truth) == len(cfg.aux_layer_ids)
    for k, tap, want in zip(cfg.aux_layer_ids, taps, truth, strict=True):
        assert rel_err(tap, want) < 1e-5, f"tap {k}"
    for name in g_ref:
        assert rel_err(g[name], g_ref[name]) < 1e-4, name
    sites = 2 * cfg.num_layers + 1
    fused = rec.backend.pre_autograd.get(AttnResFusionPass).last_fused
    assert fused == (sites if mixing == "torch" else 0)
    fw, bw = rec.graphs
    assert fw.counts()["attn_res_mix"] == sites
    assert bw.counts()["attn_res_mix_backward"] == sites


def _no_grad_inside(prefix, bank, nw, qk):
    with torch.no_grad():
        scale = prefix.abs().mean()
    return site(prefix, bank, nw, qk) * scale


def _checkpointed(prefix, bank, nw, qk):
    from torch.utils.checkpoint import checkpoint

    return checkpoint(site, prefix, bank, nw, qk, use_reentrant=False)


@pytest.mark.parametrize(("fn", "reason"), [(_no_grad_inside, "grad mode"),
                                            (_checkpointed, "higher-order op")])
def test_untraceable_graph_is_refused_loudly(fn, reason, caplog):
    """A grad-mode change, or a higher-order op (activation checkpointing), inside the graph:
    compiled unfused, a WARNING says why, the numbers are plain Inductor's."""
    inputs = _site_inputs()
    rec = GraphRecorder(make_kimi_backend())
    with caplog.at_level(logging.WARNING, logger="kimi_passes"):
        out, grads = _grads(fn, inputs, rec)
    assert any("left unfused" in r.message and reason in r.message
               for r in caplog.records), caplog.text
    assert rec.backend.pre_autograd.get(AttnResFusionPass).last_fused == 0
    assert rec.graphs[0].counts()["attn_res_mix"] == 0
    _equals_inductor(fn, inputs, out, grads, 1e-6)


def test_in_place_update_after_stacking_is_not_seen_by_the_fused_op():
    """The stack copies the sources; the model then updates one in place before the
    weighted sum. The traced graph is functional, so the fused op reads the stacked value."""
    def fn(a, b, w):
        x0, x1 = a * 1.0, b * 1.0
        st = torch.stack([x0, x1])                            # [2, T, H]
        keys = torch.nn.functional.rms_norm(st, (st.shape[-1],))
        p = torch.einsum("nth,h->nt", keys, w).softmax(0)
        x0.add_(1.0)                                          # after the copy, before the sum
        return torch.einsum("nt,nth->th", p, st) + x0

    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g),
              torch.randn(16, generator=g)]
    rec = GraphRecorder(make_kimi_backend())
    out, grads = _grads(fn, inputs, rec)
    assert rec.backend.pre_autograd.get(AttnResFusionPass).last_fused == 1
    _equals_inductor(fn, inputs, out, grads, 1e-5)


def test_fusion_refuses_a_mutation_between_stack_and_weighted_sum():
    """On a graph that is not functional, the pass leaves such a site alone and says why."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def fn(a, b, w):
        x0, x1 = a * 1.0, b * 1.0
        st = torch.stack([x0, x1])
        keys = st * torch.rsqrt(st.pow(2).mean(-1, keepdim=True) + 1e-6)
        p = torch.einsum("nth,h->nt", keys, w).softmax(0)
        x0.add_(1.0)
        return torch.einsum("nt,nth->th", p, st) + x0

    gm = make_fx(fn)(torch.randn(4, 16), torch.randn(4, 16), torch.randn(16))
    assert any(n.target is aten.add_.Tensor for n in gm.graph.nodes)
    fusion = AttnResFusionPass(differentiable=True)
    fusion(gm.graph)
    assert fusion.last_fused == 0
    assert any("mutates a tensor between" in str(m) for m in fusion.last_misses), \
        fusion.last_misses


def test_logit_bias_keeps_a_zero_gradient():
    """A Linear(H, 1) bias on the logits does not change the mixture; after fusion nothing
    reads it, yet its .grad is a zero tensor (as without fusion), not None."""
    H = 16
    proj = torch.nn.Linear(H, 1)

    def fn(x0, x1, x2):
        st = torch.stack([x0, x1, x2], dim=1)                # [T, 3, H]
        keys = torch.nn.functional.rms_norm(st, (H,))
        p = proj(keys).squeeze(-1).softmax(-1)
        return (p.unsqueeze(-1) * st).sum(1)

    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(4, H, generator=g, requires_grad=True) for _ in range(3)]
    rec = GraphRecorder(make_kimi_backend())
    out = torch.compile(fn, backend=rec, fullgraph=True)(*xs)
    out.sum().backward()
    assert rec.backend.pre_autograd.get(AttnResFusionPass).last_fused == 1
    assert proj.bias.grad is not None and torch.equal(proj.bias.grad, torch.zeros(1))
    assert proj.weight.grad is not None


def test_inference_graphs_keep_the_post_grad_fusion():
    inputs = [t.detach() for t in _site_inputs()]
    rec = GraphRecorder(make_kimi_backend())
    with torch.no_grad():
        torch.compile(site, backend=rec, fullgraph=True)(*inputs)
    assert rec.backend.passes.get(AttnResFusionPass).last_fused == 1
    assert rec.backend.pre_autograd.get(AttnResFusionPass).last_fused == 0
    assert len(rec.graphs) == 1 and rec.graphs[0].counts()["attn_res_mix"] == 1


def test_dynamic_shapes_one_compile():
    """A dynamic training graph stays dynamic: one compile serves every token count."""
    rec, calls = GraphRecorder(make_kimi_backend()), []

    def backend(gm, example_inputs):
        calls.append(gm)
        return rec(gm, example_inputs)

    f = torch.compile(site, backend=backend, dynamic=True)
    for T in (5, 9, 17):
        inputs = _site_inputs(T=T, seed=T)
        out = f(*inputs)
        grads = torch.autograd.grad(out.sum(), inputs)
        ref = site(*inputs)
        ref_grads = torch.autograd.grad(ref.sum(), inputs)
        assert rel_err(out, ref) < 1e-5
        for g, r in zip(grads, ref_grads, strict=True):
            assert rel_err(g, r) < 1e-5
    assert len(calls) == 1
    assert rec.backend.pre_autograd.get(AttnResFusionPass).last_fused == 1
    # Symbolic sizes saved for the backward make AOTAutograd compile it right away, inside
    # the same backend call: the record holds the backward graph last.
    assert rec.graphs[-1].counts()["attn_res_mix_backward"] == 1
