"""AttnResFusionPass: AttnRes mixing written in plain torch becomes one kimi op.

Graphs are inspected, so the FX graph cache is off for every test here (a cache hit
would skip the passes). Goldens are the normalised post-pass graph (``graph_text``);
``EXPECTTEST_ACCEPT=1`` regenerates them. Each golden also checks op counts and numerics.
The module compiles at Inductor's ``aten_fallback`` setting (what is recognised is the
subject: the same post-grad graph and passes, the fused op's own kernel against eager);
the goldens and the dynamic-shape tests, marked ``codegen``, compile to C++ kernels (the
fused op lowered into generated code).
"""

from __future__ import annotations

import logging

import expecttest
import pytest
import torch
import torch.nn.functional as F
from helpers.op import rnd
from torch import nn

from kimi_passes import aux_tap, make_kimi_backend
from kimi_passes.debug.recording import GraphRecorder
from kimi_passes.fusion import DEBUG_ENV, AttnResFusionPass
from kimi_passes.graphs.k3 import K3Config, K3Model, attn_res_torch
from kimi_passes.ops import AttnResArgumentError

OPS = torch.ops.kimi
aten = torch.ops.aten
T, H = 8, 16
EPS = 1e-6
FP32 = dict(atol=1e-5, rtol=1e-5)


pytestmark = pytest.mark.usefixtures("caches_off", "aten_fallback")


def compile_recorded(fn, *args, **backend_options):
    """Compile ``fn`` (fullgraph: no graph breaks) with kimi_backend, recording its graphs."""
    rec = GraphRecorder(make_kimi_backend(**backend_options))
    with torch.no_grad():
        out = torch.compile(fn, backend=rec, fullgraph=True)(*args)
    return out, rec


def fusion_pass(rec: GraphRecorder) -> AttnResFusionPass:
    return rec.backend.passes.get(AttnResFusionPass)


def count(graph, target) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function" and n.target is target)


# --------------------------------------------------------------------------- the K3 model


@pytest.mark.heavy
def test_k3_torch_mixing_is_fully_fused_and_taps_read_it():
    cfg = K3Config.tiny()
    ids = torch.arange(16) % cfg.vocab_size
    torch_model, op_model = K3Model(cfg, mixing="torch"), K3Model(cfg, mixing="op")
    (hidden, taps), rec = compile_recorded(torch_model, ids)

    # Every mixing site: two per layer plus the output aggregation, all bank + prefix.
    fp = fusion_pass(rec)
    assert fp.last_fused == 2 * cfg.num_layers + 1
    assert {s.op for s in fp.last_sites} == {"kimi.attn_res_mix"}
    after = rec.last.after
    assert rec.last.counts()["attn_res_mix"] == 2 * cfg.num_layers + 1
    assert rec.last.counts()["aux_tap"] == 0
    assert count(after, aten.cat.default) == 0  # no stacked copy of the sources is left
    # The aux-stream pass found each tap's consumer among the fused attn_res_mix nodes.
    rewrites = rec.aux_pass.last_rewrites
    assert [r.capture_id for r in rewrites] == list(cfg.aux_layer_ids)
    assert all(r.fused and r.consumer.startswith("attn_res_mix") for r in rewrites)

    with torch.no_grad():
        hidden_op, taps_op = torch.compile(op_model, backend=make_kimi_backend(),
                                           fullgraph=True)(ids)
        _, truth = op_model.ground_truth(ids)
    torch.testing.assert_close(hidden, hidden_op, **FP32)
    for k, tap, tap_op, ref in zip(cfg.aux_layer_ids, taps, taps_op, truth, strict=True):
        torch.testing.assert_close(tap, tap_op, **FP32, msg=f"capture id {k}")
        torch.testing.assert_close(tap, ref, **FP32, msg=f"capture id {k}")


# --------------------------------------------------------------------------- attn-res package


def test_attn_res_package_block_model_is_fused():
    attn_res = pytest.importorskip(
        "attn_res", reason="the attn-res package is not installed (test extra: attn-res==0.1.0)")
    cfg = attn_res.TransformerConfig(
        d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32,
        n_blocks=2, attn_res_mode=attn_res.AttnResMode.BLOCK)
    torch.manual_seed(0)
    model = attn_res.AttnResTransformer(cfg).eval().requires_grad_(False)
    with torch.no_grad():  # zero-initialised pseudo-queries mix uniformly: make them bite
        for m in model.modules():
            if isinstance(m, attn_res.AttnResOperator):
                m.pseudo_query.normal_()
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))

    logits, rec = compile_recorded(model, tokens)  # fullgraph=True: zero graph breaks
    fp = fusion_pass(rec)
    assert fp.last_fused == cfg.n_layers  # one AttnResOperator per sub-layer
    assert {s.op for s in fp.last_sites} == {"kimi.attn_res_mix_list"}
    assert [s.num_sources for s in fp.last_sites] == [1, 2, 2, 3]
    assert rec.last.counts()["attn_res_mix_list"] == cfg.n_layers
    with torch.no_grad():
        torch.testing.assert_close(logits, model(tokens), **FP32)


# --------------------------------------------------------------------------- goldens


def stack_rmsnorm_einsum(a, b, c, norm_weight, query):
    """torch.stack of a list, F.rms_norm with weight, einsum logits and weighted sum."""
    values = torch.stack([a, b, c], dim=1)  # [T, 3, H]
    keys = F.rms_norm(values, (H,), norm_weight, EPS)
    p = torch.einsum("tnh,h->tn", keys, query).softmax(-1)
    return torch.einsum("tn,tnh->th", p, values)


def bank_manual_norm_matmul(bank, prefix, query):
    """cat of bank[:, :2] and the prefix, RMSNorm by hand (no weight), @ and matmul."""
    values = torch.cat([bank[:, :2], prefix[:, None]], dim=1)  # [T, 3, H]
    keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + EPS)
    p = (keys @ query).softmax(-1)
    return (p[:, None] @ values)[:, 0]


class LinearQueryMix(nn.Module):
    """Sources stacked on dim 0, fp32 RMSNorm of bf16 keys, Linear(H, 1), mul-and-sum."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(H, 1, bias=False)

    def forward(self, a, b, c):
        values = torch.stack([a, b, c], dim=0)  # [3, T, H]
        v32 = values.float()
        keys = (v32 * torch.rsqrt(v32.pow(2).mean(-1, keepdim=True) + EPS)).to(values.dtype)
        p = self.proj(keys).squeeze(-1).float().softmax(dim=0).to(values.dtype)
        return (p[..., None] * values).sum(0)


@pytest.mark.codegen
class TestGoldens(expecttest.TestCase):
    def test_stack_rmsnorm_einsum(self):
        args = (rnd(T, H, seed=1), rnd(T, H, seed=2), rnd(T, H, seed=3),
                1 + 0.1 * rnd(H, seed=4), rnd(H, seed=5, scale=0.5))
        out, rec = compile_recorded(stack_rmsnorm_einsum, *args)
        self.assertExpectedInline(rec.last.text(), """\
input a: f32[8, 16]
input b: f32[8, 16]
input c: f32[8, 16]
input norm_weight: f32[16]
input query: f32[16]
v0: f32[8, 16] = kimi.attn_res_mix_list([a, b, c], norm_weight, query, 9.999999974752427e-07, None)
v1: f32[8, 1, 16] = aten.reshape(v0, [8, 1, 16])
v2: f32[8, 16, 1] = aten.permute(v1, [0, 2, 1])
v3: f32[8, 16] = aten.reshape(v2, [8, 16])
return (v3,)
""")
        self.assertEqual(fusion_pass(rec).last_fused, 1)
        self.assertEqual(rec.last.counts()["attn_res_mix_list"], 1)
        self.assertEqual(count(rec.last.after, aten.cat.default), 0)
        self.assertEqual(count(rec.last.before, aten.cat.default), 1)
        torch.testing.assert_close(out, stack_rmsnorm_einsum(*args), **FP32)

    def test_bank_manual_norm_matmul(self):
        args = (rnd(T, 4, H, seed=1), rnd(T, H, seed=2), rnd(H, seed=3, scale=0.5))
        out, rec = compile_recorded(bank_manual_norm_matmul, *args)
        self.assertExpectedInline(rec.last.text(), """\
input bank: f32[8, 4, 16]
input prefix: f32[8, 16]
input query: f32[16]
v0: f32[16] = aten.full([16], 1.0, dtype=torch.float32, device=device('cpu'))
v1: f32[8, 16] = kimi.attn_res_mix(prefix, bank, v0, query, 2, 1e-06)
v2: f32[8, 1, 16] = aten.reshape(v1, [8, 1, 16])
v3: f32[8, 16] = aten.select.int(v2, 1, 0)
return (v3,)
""")
        self.assertEqual(fusion_pass(rec).last_fused, 1)
        self.assertEqual(rec.last.counts()["attn_res_mix"], 1)
        self.assertEqual(count(rec.last.after, aten.cat.default), 0)
        torch.testing.assert_close(out, bank_manual_norm_matmul(*args), **FP32)

    def test_list_linear_query_bf16(self):
        torch.manual_seed(0)
        model = LinearQueryMix().to(torch.bfloat16).requires_grad_(False)
        args = tuple(rnd(T, H, dtype=torch.bfloat16, seed=s) for s in (1, 2, 3))
        out, rec = compile_recorded(model, *args)
        self.assertExpectedInline(rec.last.text(), """\
input a: bf16[8, 16]
input b: bf16[8, 16]
input c: bf16[8, 16]
input proj.weight: bf16[1, 16]
v0: bf16[16] = aten.reshape(proj.weight, [16])
v1: bf16[8, 16] = kimi.attn_res_mix_list([a, b, c], None, v0, 1e-06, None)
return (v1,)
""")
        self.assertEqual(fusion_pass(rec).last_fused, 1)
        self.assertEqual(rec.last.counts()["attn_res_mix_list"], 1)
        self.assertEqual(count(rec.last.after, aten.cat.default), 0)
        self.assertEqual(out.dtype, torch.bfloat16)
        # The fused op keeps logits and probabilities in fp32: compare to fp32 math.
        ref = LinearQueryMix()
        ref.proj.weight.data = model.proj.weight.data.float()
        with torch.no_grad():
            expected = ref(*(x.float() for x in args))
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


    @pytest.mark.heavy
    def test_bf16_k3_site_with_and_without_tap(self):
        """attn_res_torch in bf16 mixes in fp32 before its fp32 output norm.

        Untapped, the fp32 mixture is kept (attn_res_mix_list, out_dtype fp32): the output
        equals plain torch. Tapped, the site becomes attn_res_mix (bf16, upcast for the
        norm) so the aux-stream pass finds the tap's consumer: the bf16 prefix update
        ``copy(prefix, add(f32(prefix), f32(pending)))`` is the tap's ``prefix + pending``.
        """
        g = torch.Generator().manual_seed(0)
        prefix, pending, bank = (torch.randn(*s, generator=g).bfloat16()
                                 for s in ((T, H), (T, H), (T, 3, H)))
        nw, onw = ((1 + 0.1 * torch.randn(H, generator=g)).bfloat16() for _ in range(2))
        qk = (0.5 * torch.randn(H, generator=g)).bfloat16()
        args = (prefix, pending, bank, nw, qk, onw)

        # The op calls kept (lower_kimi_ops=False): their bits are what is compared here.
        out, rec = compile_recorded(bf16_site, *args, lower_kimi_ops=False)
        self.assertExpectedInline(rec.last.text(), """\
input prefix: bf16[8, 16]
input pending: bf16[8, 16]
input bank: bf16[8, 3, 16]
input nw: bf16[16]
input qk: bf16[16]
input onw: bf16[16]
v0: f32[8, 16] = prims.convert_element_type(prefix, torch.float32)
v1: f32[8, 16] = prims.convert_element_type(pending, torch.float32)
v2: f32[8, 16] = aten.add.Tensor(v0, v1)
v3: bf16[8, 16] = aten.copy(prefix, v2)
v4: bf16[8, 16] = aten.select.int(bank, 1, 0)
v5: bf16[8, 16] = aten.select.int(bank, 1, 1)
v6: f32[8, 16] = kimi.attn_res_mix_list([v4, v5, v3], nw, qk, 9.999999974752427e-07, torch.float32)
v7: f32[8, 1, 16] = aten.reshape(v6, [8, 1, 16])
v8: f32[8, 16, 1] = aten.permute(v7, [0, 2, 1])
v9: f32[8, 16] = aten.reshape(v8, [8, 16])
v10: f32[8, 16] = aten.pow.Tensor_Scalar(v9, 2)
v11: f32[8, 1] = aten.mean.dim(v10, [1], True)
v12: f32[8, 1] = aten.add.Scalar(v11, 9.999999974752427e-07)
v13: f32[8, 1] = aten.rsqrt(v12)
v14: f32[8, 16] = aten.mul.Tensor(v9, v13)
v15: f32[16] = prims.convert_element_type(onw, torch.float32)
v16: f32[8, 16] = aten.mul.Tensor(v14, v15)
v17: bf16[8, 16] = prims.convert_element_type(v16, torch.bfloat16)
return (v17,)
""")
        self.assertEqual(rec.last.counts().get("attn_res_mix_list"), 1)
        torch.testing.assert_close(out, bf16_site(*args), atol=0, rtol=0)

        (out, tap), rec = compile_recorded(bf16_site_tapped, *args, lower_kimi_ops=False)
        self.assertExpectedInline(rec.last.text(), """\
input prefix: bf16[8, 16]
input pending: bf16[8, 16]
input bank: bf16[8, 3, 16]
input nw: bf16[16]
input qk: bf16[16]
input onw: bf16[16]
v0: f32[8, 16] = prims.convert_element_type(prefix, torch.float32)
v1: f32[8, 16] = prims.convert_element_type(pending, torch.float32)
v2: f32[8, 16] = aten.add.Tensor(v0, v1)
v3: bf16[8, 16] = aten.copy(prefix, v2)
v4: bf16[8, 16] = kimi.attn_res_mix(v3, bank, nw, qk, 2, 9.999999974752427e-07)
v5: f32[8, 16] = prims.convert_element_type(v4, torch.float32)
v6: f32[8, 1, 16] = aten.reshape(v5, [8, 1, 16])
v7: f32[8, 16, 1] = aten.permute(v6, [0, 2, 1])
v8: f32[8, 16] = aten.reshape(v7, [8, 16])
v9: f32[8, 16] = aten.pow.Tensor_Scalar(v8, 2)
v10: f32[8, 1] = aten.mean.dim(v9, [1], True)
v11: f32[8, 1] = aten.add.Scalar(v10, 9.999999974752427e-07)
v12: f32[8, 1] = aten.rsqrt(v11)
v13: f32[8, 16] = aten.mul.Tensor(v8, v12)
v14: f32[16] = prims.convert_element_type(onw, torch.float32)
v15: f32[8, 16] = aten.mul.Tensor(v13, v14)
v16: bf16[8, 16] = prims.convert_element_type(v15, torch.bfloat16)
return (v16, v4)
""")
        self.assertEqual(rec.last.counts()["attn_res_mix"], 1)
        self.assertEqual([r.fused for r in rec.aux_pass.last_rewrites], [True])
        x = (prefix.float() + pending.float()).bfloat16()
        torch.testing.assert_close(tap, OPS.attn_res_mix(x, bank, nw, qk, 2, EPS), atol=0, rtol=0)
        torch.testing.assert_close(out, bf16_site_tapped(*args)[0], atol=2e-2, rtol=2e-2)
        # Lowered to generated code (the default): the same values at the op tolerance.
        lowered, _ = compile_recorded(bf16_site, *args)
        torch.testing.assert_close(lowered, bf16_site(*args), atol=2e-2, rtol=2e-2)
        (lowered, ltap), _ = compile_recorded(bf16_site_tapped, *args)
        torch.testing.assert_close(ltap, tap, atol=2e-2, rtol=2e-2)


def bf16_site(prefix, pending, bank, nw, qk, onw):
    prefix = prefix.clone()  # updated in place by the site
    return attn_res_torch(prefix, pending, bank, nw, qk, onw, 2, -1, EPS, EPS)


def bf16_site_tapped(prefix, pending, bank, nw, qk, onw):
    tap = aux_tap(prefix + pending, 3)
    return bf16_site(prefix, pending, bank, nw, qk, onw), tap


# --------------------------------------------------------------------------- more spellings


def with_temperature(bank, prefix, norm_weight, query):
    """bank[:, 1:4] (not from slot 0), weight before the rsqrt, logits / sqrt(H)."""
    values = torch.cat([bank[:, 1:4], prefix.unsqueeze(1)], 1)
    rs = torch.rsqrt((values * values).sum(-1, keepdim=True) / H + EPS)
    logits = ((values * norm_weight) * rs * query).sum(-1) / H**0.5
    return (logits.softmax(-1).unsqueeze(-1) * values).sum(1)


def linear_bias_dim1(a, b, c, proj):
    """x / sqrt(mean + eps), nn.Linear(H, 1) with a bias (addmm), softmax(dim=1)."""
    values = torch.stack([a, b, c], 1)
    keys = values / torch.sqrt(values.pow(2).mean(-1, keepdim=True) + EPS)
    p = torch.softmax(proj(keys).squeeze(-1), dim=1)
    return torch.einsum("tn,tnh->th", p, values)


def transposed_sum(a, b, c, query):
    """exp / sum softmax without the max, weighted sum as values^T @ p."""
    values = torch.stack([a, b, c], 1)
    e = (F.rms_norm(values, (H,), eps=EPS) @ query).exp()
    p = e / e.sum(-1, keepdim=True)
    return (values.transpose(1, 2) @ p.unsqueeze(-1)).squeeze(-1)


def whole_bank(bank, query):
    """The bank itself is the stack of sources; softmax with dtype=float32."""
    p = torch.softmax(F.rms_norm(bank, (H,), eps=EPS) @ query, -1, dtype=torch.float32)
    return (p[..., None] * bank).sum(-2)


@pytest.mark.parametrize("fn,sources", [
    (with_temperature, 4), (linear_bias_dim1, 3), (transposed_sum, 3), (whole_bank, 5)])
def test_more_spellings_are_fused(fn, sources):
    bank, prefix, q = rnd(T, 5, H, seed=1), rnd(T, H, seed=2), rnd(H, seed=3, scale=0.5)
    a, b, c = (rnd(T, H, seed=s) for s in (4, 5, 6))
    proj = nn.Linear(H, 1).requires_grad_(False)
    args = {with_temperature: (bank, prefix, 1 + 0.1 * rnd(H, seed=7), q),
            linear_bias_dim1: (a, b, c, proj), transposed_sum: (a, b, c, q),
            whole_bank: (bank, q)}[fn]
    out, rec = compile_recorded(fn, *args)
    fp = fusion_pass(rec)
    assert fp.last_fused == 1, [str(m) for m in fp.last_misses]
    assert fp.last_sites[0].op == "kimi.attn_res_mix_list"
    assert fp.last_sites[0].num_sources == sources
    assert count(rec.last.after, aten.exp.default) == 0
    torch.testing.assert_close(out, fn(*args), **FP32)


# --------------------------------------------------------------------------- near misses


def softmax_over_hidden(a, b, c, query):
    values = torch.stack([a, b, c], dim=1)
    keys = F.rms_norm(values, (H,), None, EPS)
    p = (keys * query).softmax(-1)  # over H: not a mixture over the sources
    return (p * values).sum(1)


def other_values(a, b, c, d, query):
    keys = F.rms_norm(torch.stack([a, b, c], dim=1), (H,), None, EPS)
    p = (keys @ query).softmax(-1)
    return torch.einsum("tn,tnh->th", p, torch.stack([d, a, b], dim=1))  # other values


@pytest.mark.parametrize("fn,nargs,reason", [
    (softmax_over_hidden, 3, "softmax over the hidden axis"),
    (other_values, 4, "are not the tensor the logits were computed from"),
])
def test_near_miss_is_not_fused_and_logged(fn, nargs, reason, caplog, monkeypatch):
    monkeypatch.setenv(DEBUG_ENV, "1")
    args = [rnd(T, H, seed=s) for s in range(nargs)] + [rnd(H, seed=9)]
    with caplog.at_level(logging.INFO, logger="kimi_passes"):
        out, rec = compile_recorded(fn, *args)
    fp = fusion_pass(rec)
    assert fp.last_fused == 0
    counts = rec.last.counts()
    assert counts.get("attn_res_mix_list", 0) == counts["attn_res_mix"] == 0
    assert len(fp.last_misses) == 1 and reason in str(fp.last_misses[0])
    logged = [r.getMessage() for r in caplog.records if r.name == "kimi_passes"]
    assert any("fused 0 AttnRes mixing site(s)" in m for m in logged)
    assert any("not fused" in m and reason in m for m in logged), logged
    torch.testing.assert_close(out, fn(*args), **FP32)


def test_fuse_torch_mixing_false_leaves_the_graph_alone():
    args = (rnd(T, 4, H, seed=1), rnd(T, H, seed=2), rnd(H, seed=3))
    out, rec = compile_recorded(bank_manual_norm_matmul, *args, fuse_torch_mixing=False)
    assert not any(isinstance(p, AttnResFusionPass) for p in rec.backend.passes.passes)
    assert rec.last.counts()["attn_res_mix"] == 0
    assert count(rec.last.after, aten.cat.default) == 1
    torch.testing.assert_close(out, bank_manual_norm_matmul(*args), **FP32)


def test_pass_identity():
    p = AttnResFusionPass()
    assert p.index == 0
    assert p.uuid() and p.uuid() == AttnResFusionPass(debug=True).uuid()


# --------------------------------------------------------------------------- the list op


def list_reference(sources, norm_weight, qk_weight, eps):
    values = torch.stack([s.float() for s in sources], dim=-2)
    w = None if norm_weight is None else norm_weight.float()
    keys = F.rms_norm(values, values.shape[-1:], w, eps)
    p = (keys @ qk_weight.float()).softmax(-1)
    return (p[..., None] * values).sum(-2)


@pytest.mark.parametrize("shape,n,dtype,weighted", [
    ((5, 16), 3, torch.float32, True),
    ((2, 3, 16), 1, torch.float32, False),
    ((7, 32), 4, torch.bfloat16, True),
])
def test_mix_list_op(shape, n, dtype, weighted):
    sources = [rnd(*shape, dtype=dtype, seed=s) for s in range(n)]
    w = (1 + 0.1 * rnd(shape[-1], seed=10)).to(dtype) if weighted else None
    q = rnd(shape[-1], dtype=dtype, seed=11, scale=0.5)
    tol = FP32 if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    out = OPS.attn_res_mix_list(sources, w, q, EPS)
    assert out.dtype == dtype and out.shape == shape
    torch.testing.assert_close(out.float(), list_reference(sources, w, q, EPS), **tol)
    wide = OPS.attn_res_mix_list(sources, w, q, EPS, torch.float32)
    assert wide.dtype == torch.float32
    torch.testing.assert_close(wide, list_reference(sources, w, q, EPS), **FP32)
    torch.library.opcheck(OPS.attn_res_mix_list.default, (sources, w, q, EPS))
    torch.library.opcheck(OPS.attn_res_mix_list.default, (sources, w, q, EPS, torch.float32))


@pytest.mark.parametrize("case,message", [
    ("empty", "sources is empty"),
    ("shape", "sources[1] has shape (5, 8)"),
    ("dtype", "sources[1] dtype torch.bfloat16 differs"),
    ("weight", "qk_weight must be 1-D [H] with H=16"),
    ("eps", "eps=-1.0 must be a non-negative float"),
])
def test_mix_list_validation(case, message):
    s = [rnd(5, 16, seed=1), rnd(5, 16, seed=2)]
    w, q, eps = None, rnd(16), EPS
    if case == "empty":
        s = []
    elif case == "shape":
        s[1] = rnd(5, 8)
    elif case == "dtype":
        s[1] = s[1].bfloat16()
    elif case == "weight":
        q = rnd(8)
    elif case == "eps":
        eps = -1.0
    with pytest.raises(AttnResArgumentError) as info:
        OPS.attn_res_mix_list(s, w, q, eps)
    assert message in str(info.value)
    assert "kimi attn_res_mix_list" in str(info.value)


# --------------------------------------------------------------------------- mean of squares


def mean_square_site(spelling: str, hidden: int):
    """A stacked mixture whose mean of squares over the hidden axis is spelled ``spelling``."""

    def fn(a, b, c, query):
        values = torch.stack([a, b, c], dim=1)
        if spelling == "mean":
            ms = values.pow(2).mean(-1, keepdim=True)
        elif spelling == "sum_div_literal":  # 1/H written as a literal divisor
            ms = values.pow(2).sum(-1, keepdim=True) / hidden
        elif spelling == "sum_times_inverse":  # ... or as a literal factor 1/H
            ms = (values * values).sum(-1, keepdim=True) * (1 / hidden)
        elif spelling == "mean_times_2":
            ms = values.pow(2).mean(-1, keepdim=True) * 2
        keys = values * torch.rsqrt(ms + EPS)
        p = (keys @ query).softmax(-1)
        return torch.einsum("tn,tnh->th", p, values)

    return fn


@pytest.mark.parametrize("spelling,hidden,fused", [
    ("mean", H, True),
    ("sum_div_literal", 4096, True),
    ("sum_times_inverse", 7168, True),
    # (1 / 49) * 49 is 0.9999999999999999 in floats: the tolerance for a literal 1/H.
    ("sum_times_inverse", 49, True),
    ("mean_times_2", H, False),
    ("sum_div_literal", 2 * H, False),  # sum / 32 over H = 16: half the mean
])
def test_mean_of_squares_spellings(spelling, hidden, fused):
    width = hidden if fused or spelling == "mean_times_2" else H
    fn = mean_square_site(spelling, hidden)
    args = [rnd(T, width, seed=s) for s in range(3)] + [rnd(width, seed=9, scale=0.5)]
    torch._dynamo.reset()  # another H for the same code would make Dynamo mark H dynamic
    out, rec = compile_recorded(fn, *args)
    fp = fusion_pass(rec)
    if fused:
        assert fp.last_fused == 1, [str(m) for m in fp.last_misses]
        assert rec.last.counts()["attn_res_mix_list"] == 1
    else:
        assert fp.last_fused == 0
        assert len(fp.last_misses) == 1 and "not the mean" in str(fp.last_misses[0])
    # The logits are fp32 sums over H, summed in another order than eager's: their rounding
    # error grows like sqrt(H) (1e-5 holds to H = 256; measured 1.3e-5 at H = 4096).
    tol = 1e-5 * max(1.0, (width / 256) ** 0.5)
    torch.testing.assert_close(out, fn(*args), atol=tol, rtol=tol)


def test_literal_against_symbolic_hidden_size_is_not_the_mean():
    """``sum / 16`` is the mean only where H is 16: with H symbolic, the site is refused."""
    fn = mean_square_site("sum_div_literal", H)
    args = [rnd(T, H, seed=s) for s in range(3)] + [rnd(H, seed=9, scale=0.5)]
    for x in args:
        torch._dynamo.mark_dynamic(x, x.dim() - 1)
    torch._dynamo.reset()
    out, rec = compile_recorded(fn, *args)
    assert "Sym(" in rec.last.text()  # the hidden size stayed symbolic
    fp = fusion_pass(rec)
    assert fp.last_fused == 0
    assert len(fp.last_misses) == 1 and "not the mean" in str(fp.last_misses[0])
    torch.testing.assert_close(out, fn(*args), **FP32)


# --------------------------------------------------------------------------- dynamic shapes


def linear_query_batched(a, b, c, weight):
    """[B, T, H] sources stacked on dim 0; F.linear flattens [3, B, T, H] to [3*B*T, H]."""
    values = torch.stack([a, b, c], dim=0)
    keys = F.rms_norm(values, (values.shape[-1],), eps=EPS)
    p = F.linear(keys, weight).squeeze(-1).softmax(0)
    return (p[..., None] * values).sum(0)


def _dynamic_args(fn, t: int, seed: int):
    """``fn``'s inputs with ``t`` tokens, and the dims that hold the tokens (or batch)."""
    if fn is bank_manual_norm_matmul:
        return (rnd(t, 4, H, seed=seed), rnd(t, H, seed=seed + 1),
                rnd(H, seed=seed + 2, scale=0.5)), [(0,), (0,), ()]
    if fn is stack_rmsnorm_einsum:
        return ((rnd(t, H, seed=seed), rnd(t, H, seed=seed + 1), rnd(t, H, seed=seed + 2),
                 1 + 0.1 * rnd(H, seed=seed + 3), rnd(H, seed=seed + 4, scale=0.5)),
                [(0,), (0,), (0,), (), ()])
    return ((*(rnd(2, t, H, seed=seed + i) for i in range(3)),
             rnd(1, H, seed=seed + 3, scale=0.5)), [(0, 1)] * 3 + [()])


@pytest.mark.codegen
@pytest.mark.parametrize("fn,op", [
    (bank_manual_norm_matmul, "attn_res_mix"),
    (stack_rmsnorm_einsum, "attn_res_mix_list"),
    (linear_query_batched, "attn_res_mix_list"),
])
def test_dynamic_tokens_one_compile_matches_inductor(fn, op):
    """Tokens (and batch) marked dynamic: one compile, size checks on SymInts, fused."""
    token_counts = (5, 9, 17)
    rec = GraphRecorder(make_kimi_backend())
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=rec, fullgraph=True)
    outs = []
    for i, t in enumerate(token_counts):
        args, dyn = _dynamic_args(fn, t, seed=t)
        for x, dims in zip(args, dyn, strict=True):
            for d in dims:
                torch._dynamo.mark_dynamic(x, d)
        with torch.no_grad(), torch.compiler.set_stance(
                "fail_on_recompile" if i else "default"):
            outs.append((args, compiled(*args)))
    assert len(rec.graphs) == 1
    text = rec.last.text()
    assert "Sym(" in text, text  # the sizes the pass compared were symbolic
    fp = fusion_pass(rec)
    assert fp.last_fused == 1, [str(m) for m in fp.last_misses]
    assert rec.last.counts()[op] == 1
    assert count(rec.last.after, aten.cat.default) == 0
    torch._dynamo.reset()
    inductor = torch.compile(fn, fullgraph=True, dynamic=True)
    for args, out in outs:
        with torch.no_grad():
            torch.testing.assert_close(out, inductor(*args), **FP32)
