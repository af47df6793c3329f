"""``LowerKimiOps``: on CPU a compiled graph calls no kimi op; every effect stays exact.

Structure: the generated code of a CPU graph compiled with ``kimi_backend`` (and with
``AuxStreamPass`` installed alone) holds no ``torch.ops.kimi`` call; with
``lower_kimi_ops=False`` it does. Numbers: each op compiled alone against the eager op
(outputs at the op tolerance, the in-place prefix update and block write bit for bit),
over dtypes, output norm or none, and block writes inside and outside the mixed slots;
the reference K3 taps against the eager ground truth, static and dynamic shapes; and an
AOTInductor package of the reference K3 with ``AuxStreamPass`` alone.
"""

from __future__ import annotations

import pytest
import torch
from helpers.k3 import assert_taps_close, inference_model, small_config, token_ids
from helpers.op import DTYPES, OP_TOL, clone_args, make_args, mix_args
from torch._inductor.utils import run_and_get_code

from kimi_passes import AuxStreamPass, make_kimi_backend, pass_manager
from kimi_passes.graphs.k3 import K3Model

pytestmark = pytest.mark.usefixtures("caches_off")
OPS = torch.ops.kimi


def kimi_calls(code: list[str]) -> int:
    return sum(c.count("torch.ops.kimi") for c in code)


def compile_run(fn, *args, backend=None, dynamic=False):
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend or make_kimi_backend(), fullgraph=True,
                             dynamic=dynamic)
    return run_and_get_code(compiled, *args)


# (NB, num_blocks, block_write_idx): a write into a mixed slot (read back as the prefix),
# a write past the mixed slots, no write, no completed block.
GEOMETRIES = [(4, 3, 2), (4, 2, 2), (4, 3, -1), (2, 0, 0)]
# Every (op, geometry, output norm) in one compiled graph per dtype: one compile each.
CASES = [(op, g, onorm) for op in ("attn_res", "attn_res_capture") for g in GEOMETRIES
         for onorm in (True, False)]


@pytest.mark.heavy
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mutating_ops_compiled_match_eager(dtype):
    argsets = [make_args(5, 32, nb_total, nb, write, dtype, delta=True, onorm=onorm, seed=i)
               for i, (_, (nb_total, nb, write), onorm) in enumerate(CASES)]
    eager = [clone_args(a) for a in argsets]
    compiled = [clone_args(a) for a in argsets]
    want = [getattr(OPS, op)(*a) for (op, _, _), a in zip(CASES, eager, strict=True)]

    def f(flat):
        return [getattr(OPS, op)(*a) for (op, _, _), a in zip(CASES, flat, strict=True)]

    got, code = compile_run(f, compiled)
    assert kimi_calls(code) == 0
    tol = OP_TOL[dtype]
    for case, g, w, ca, ea in zip(CASES, got, want, compiled, eager, strict=True):
        for gi, wi in zip(g if isinstance(g, tuple) else (g,),
                          w if isinstance(w, tuple) else (w,), strict=True):
            torch.testing.assert_close(gi, wi, atol=tol, rtol=tol,
                                       msg=lambda m, c=case: f"{c}: {m}")
        # The in-place effects are exact: one rounded add, one copy.
        assert torch.equal(ca[0], ea[0]), case
        assert torch.equal(ca[2], ea[2]), case


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mix_ops_compiled_match_eager(dtype):
    argsets = [mix_args(make_args(6, 32, 3, nb, -1, dtype, delta=False, onorm=False, seed=nb))
               for nb in (0, 1, 3)]

    def f(flat):
        mixes = [OPS.attn_res_mix(*a) for a in flat]
        lists = [OPS.attn_res_mix_list([a[1][:, j] for j in range(a[4])] + [a[0]], None, a[3],
                                       1e-6, torch.float32) for a in flat]
        return mixes, lists

    (mixes, lists), code = compile_run(f, argsets)
    assert kimi_calls(code) == 0
    want_mixes, want_lists = f(argsets)
    tol = OP_TOL[dtype]
    for g, w in zip(mixes + lists, want_mixes + want_lists, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mix_list_backward_compiled_matches_eager(dtype):
    """A training step through ``attn_res_mix_list`` (three sources, one of them a view):
    the backward graph calls no kimi op, and every gradient equals the eager op's; with
    only the weights requiring grad, ``dsources`` is not asked for."""
    g = torch.Generator().manual_seed(0)
    bank = torch.randn(6, 2, 32, generator=g).to(dtype)
    leaves = [bank, torch.randn(6, 32, generator=g).to(dtype),
              (1 + 0.1 * torch.randn(32, generator=g)).to(dtype),
              (torch.randn(32, generator=g) / 4).to(dtype)]

    def step(fn, need_sources):
        params = [t.clone().requires_grad_(need_sources or i >= 2)
                  for i, t in enumerate(leaves)]
        out = fn(params[0], params[1], params[2], params[3])
        wanted = [p for p in params if p.requires_grad]
        return torch.autograd.grad(out.float().square().sum(), wanted)

    def mix(bank, x, nw, qk):
        return OPS.attn_res_mix_list([bank[:, 0], bank[:, 1], x], nw, qk, 1e-6, None)

    torch._dynamo.reset()
    compiled = torch.compile(mix, backend=make_kimi_backend(), fullgraph=True)
    tol = OP_TOL[dtype]
    for need_sources in (True, False):
        got, code = run_and_get_code(step, compiled, need_sources)
        assert kimi_calls(code) == 0
        for gi, wi in zip(got, step(mix, need_sources), strict=True):
            assert gi.dtype == wi.dtype
            torch.testing.assert_close(gi.float(), wi.float(), atol=tol, rtol=tol)


@pytest.mark.heavy
@pytest.mark.parametrize("mixing,dynamic", [("op", False), ("torch", True)],
                         ids=["op-static", "torch-dynamic"])
def test_k3_taps_with_no_kimi_call(mixing, dynamic):
    cfg = small_config(3, 2, taps=(0, 2, 3))  # a block write (layer 2), a partial block
    model = inference_model(cfg, mixing=mixing)
    ids = token_ids(cfg)
    with torch.no_grad():
        (out, taps), code = compile_run(model, ids, dynamic=dynamic)
        want_out, want = model.ground_truth(ids)
    assert kimi_calls(code) == 0
    assert_taps_close(taps, want, torch.float32)
    torch.testing.assert_close(out, want_out, atol=OP_TOL[torch.float32],
                               rtol=OP_TOL[torch.float32])


def test_the_switch_keeps_the_ops():
    cfg = small_config(2, 1, taps=(0, 2))
    model = inference_model(cfg)
    with torch.no_grad():
        _, code = compile_run(model, token_ids(cfg),
                              backend=make_kimi_backend(lower_kimi_ops=False))
    assert kimi_calls(code) > 0


def test_fallback_by_default_keeps_the_ops():
    """Every op an ATen call: the statement would be tens of ATen calls, so the op stays
    (the mode most of the suite compiles in, tests/conftest.py ``aten_fallback``)."""
    cfg = small_config(2, 1, taps=(0, 2))
    model = inference_model(cfg)
    ids = token_ids(cfg)
    with torch.no_grad(), torch._inductor.config.patch(fallback_by_default=True):
        (_, taps), code = compile_run(model, ids)
        want = model.ground_truth(ids)[1]
    assert kimi_calls(code) > 0
    assert_taps_close(taps, want, torch.float32)


def test_the_pass_manager_installed_alone_lowers():
    """The public route for a stack with its own backend: ``pass_manager`` as Inductor's
    ``post_grad_custom_post_pass``."""
    cfg = small_config(2, 1, taps=(0, 1, 2))
    model = inference_model(cfg)
    ids = token_ids(cfg)
    with torch.no_grad(), torch._inductor.config.patch(
            post_grad_custom_post_pass=pass_manager(aux_stream="attn_res")):
        (_, taps), code = compile_run(model, ids, backend="inductor")
        want = model.ground_truth(ids)[1]
    assert kimi_calls(code) == 0
    assert_taps_close(taps, want, torch.float32)


def test_aux_stream_pass_alone_warns_once_naming_the_manager(monkeypatch):
    """``AuxStreamPass`` alone rewrites the taps only: on CPU it says, once, that the kimi
    calls stay op calls and names the route that lowers them."""
    import kimi_passes.taps.aux_stream as aux_stream

    monkeypatch.setattr(aux_stream, "_warned_alone", False)
    cfg = small_config(2, 1, taps=(0, 1, 2))
    model = inference_model(cfg)
    ids = token_ids(cfg)
    with torch.no_grad(), torch._inductor.config.patch(
            post_grad_custom_post_pass=AuxStreamPass("attn_res"), fallback_by_default=True), \
            pytest.warns(UserWarning, match=r"kimi_passes\.pass_manager\(") as caught:
        (_, taps), _ = compile_run(model, ids, backend="inductor")
        torch._dynamo.reset()
        compile_run(model, ids, backend="inductor")  # a second compile: no second warning
        want = model.ground_truth(ids)[1]
    assert sum("AuxStreamPass installed alone" in str(w.message) for w in caught) == 1
    assert_taps_close(taps, want, torch.float32)


@pytest.mark.heavy
@pytest.mark.codegen
def test_aoti_package_of_the_reference_k3(tmp_path):
    """AOTInductor export with the pass manager: the package's taps are the mixtures.

    Two layers (a block write, a layer adding its delta, the output aggregation) with a tap
    at each kind of consumer: the package's C++ is compiled whole, so each layer costs."""
    cfg = small_config(2, 2, taps=(0, 1, 2))
    model = K3Model(cfg).eval()
    ids = token_ids(cfg, 16)
    ep = torch.export.export(model, (ids,), strict=False)
    path = torch._inductor.aoti_compile_and_package(
        ep, package_path=str(tmp_path / "k3.pt2"),
        inductor_configs={"post_grad_custom_post_pass": pass_manager(aux_stream="attn_res")})
    runner = torch._inductor.aoti_load_package(path)
    with torch.no_grad():
        out, taps = runner(ids)
        want_out, want = model.ground_truth(ids)
    assert_taps_close(list(taps), want, torch.float32)
    torch.testing.assert_close(out, want_out, atol=OP_TOL[torch.float32],
                               rtol=OP_TOL[torch.float32])


@pytest.mark.heavy
def test_training_step_lowers_the_backward():
    """K3 training (``mixing="op"``) under kimi_backend: neither the forward nor the
    backward graph calls a kimi op, and the gradients equal eager's."""
    # A block write (layer 0), a layer that adds its delta (layer 1), the output aggregation.
    cfg = small_config(2, 2, taps=(0, 1, 2))
    model = K3Model(cfg, mixing="op", trainable=True)
    ids = token_ids(cfg)

    def loss_and_grads(fn):
        out, taps = fn(ids)
        loss = out.square().sum() + sum(t.sum() for t in taps)
        return torch.autograd.grad(loss, list(model.parameters()))

    want = loss_and_grads(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=make_kimi_backend(), fullgraph=True)
    got, code = run_and_get_code(loss_and_grads, compiled)
    assert kimi_calls(code) == 0
    scale = max(float(w.abs().max()) for w in want)
    for (name, _), g, w in zip(model.named_parameters(), got, want, strict=True):
        assert float((g - w).abs().max()) <= 1e-5 * scale, name


def test_wired_stack_one_dynamic_graph_every_T(monkeypatch):
    """A plain-torch K3-wired stack (bench.decode's ``WiredStack``) compiled once with a
    dynamic T: every site is fused and lowered (the statement has no size-dependent
    branch), no recompile, and the output matches eager at T from 2 to 33; T=1, which
    Dynamo specialises, compiles its own graph and matches too."""
    from kimi_passes.bench.decode import WiredStack
    from kimi_passes.lowering.lower import LowerKimiOps

    lowered: list[int] = []
    run = LowerKimiOps.run

    def counting(self, graph):
        msgs = run(self, graph)
        lowered.append(self.last_lowered)
        return msgs

    monkeypatch.setattr(LowerKimiOps, "run", counting)
    model = WiredStack(2, 32, 1, "tanh", torch.float32).eval()  # 5 sites, 2 blocks
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=make_kimi_backend(), fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(0)
    tol = OP_TOL[torch.float32]
    with torch.no_grad():
        for T in (2, 3, 8, 33, 1):
            x = torch.randn(T, 32, generator=g)
            torch.testing.assert_close(compiled(x), model(x), atol=tol, rtol=tol,
                                       msg=lambda m, T=T: f"T={T}: {m}")
    assert lowered == [5, 5], lowered  # one graph for T >= 2, one for T = 1


# (dtype, NB, num_blocks, block_write_idx, output norm, quant dtype, quant form)
QUANT_CASES = [(dtype, *rest) for dtype in (torch.float32, torch.bfloat16) for rest in (
    (4, 3, 2, True, torch.float8_e4m3fn, "amd"),
    (4, 2, -1, False, torch.float8_e4m3fnuz, "quant_fp8_ub"),
    (2, 0, 0, True, torch.float8_e4m3fn, "cuda_op"))] + [
    (torch.float16, 4, 3, 2, True, torch.float8_e4m3fnuz, "amd")]


def test_quant_ops_lower_to_the_cpu_paths_quant():
    """``attn_res_quant`` / ``attn_res_quant_capture`` lowered (no kimi call, the fp8 cast in
    Inductor's C++ code): the bytes and scales are the CPU path's quant statement applied to
    the lowered ``attn_res`` output, bit for bit, in fp32, bf16 and fp16 (the 16-bit output
    read back rounded, not the fp32 value Inductor's C++ kernel would otherwise reuse); against the
    eager op, equal on every row whose unquantized outputs are equal; the in-place effects
    as the eager op's, bit for bit, and the captured mixture at the op tolerance."""
    from kimi_passes.ops import quant_fp8_constants
    from kimi_passes.ops.attn_res_args import AttnResQuantArgs
    from kimi_passes.ops.fp8_quant import quantize_rows

    def form(qd, name):
        return {"amd": {}, "cuda_op": dict(quant_fp8_constants(qd), divide_values=True),
                "quant_fp8_ub": dict(quant_fp8_constants(qd), scale_ub=torch.tensor([0.5]))}[name]

    argsets = [make_args(5, 32, nbt, nb, w, dtype, delta=True, onorm=on, seed=i, scale=3.0)
               for i, (dtype, nbt, nb, w, on, _, _) in enumerate(QUANT_CASES)]

    def f(flat):
        res = []
        for (_, _, _, _, _, qd, name), a in zip(QUANT_CASES, flat, strict=True):
            plain = [x.clone() if isinstance(x, torch.Tensor) else x for x in a]
            op = OPS.attn_res_quant_capture if len(res) % 4 == 0 else OPS.attn_res_quant
            res.append(op(*a, qd, **form(qd, name)))
            res.append(OPS.attn_res(*plain))
        return res

    compiled = [clone_args(a) for a in argsets]
    got, code = compile_run(f, compiled)
    assert kimi_calls(code) == 0
    assert sum(c.count("float8_e4m3fn") for c in code) > 0  # the fp8 cast, in the C++ code
    for i, (case, a, ca) in enumerate(zip(QUANT_CASES, argsets, compiled, strict=True)):
        _, _, _, _, _, qd, name = case
        q = AttnResQuantArgs.from_args(*a, qd, **form(qd, name))
        quant, out = got[2 * i], got[2 * i + 1]
        data, scale = quant[:2]
        want = quantize_rows(out, q)
        assert torch.equal(data.view(torch.uint8), want[0].view(torch.uint8)), case
        assert torch.equal(scale, want[1]), case
        ea = clone_args(a)
        eager = OPS.attn_res_quant_capture(*ea, qd, **form(qd, name))
        agree = (out == OPS.attn_res(*clone_args(a))).all(1)
        bad = ((data.view(torch.uint8) != eager[0].view(torch.uint8)).any(1)
               | (scale != eager[1]).any(1))
        assert not (bad & agree).any(), case
        if len(quant) == 3:  # the mixture, at the op tolerance (as the plain ops' lowering)
            tol = OP_TOL[case[0]]
            torch.testing.assert_close(quant[2], eager[2], atol=tol, rtol=tol)
        assert torch.equal(ca[0], ea[0]) and torch.equal(ca[2], ea[2]), case


def test_quant_lowering_rounds_to_bf16_as_the_cast():
    """The lowering's bf16 rounding on fp32 bits (``_rounded_bf16``) is ``v.to(bf16).float()``
    bit for bit: random bit patterns (every class: NaN payloads, subnormals, infs) and the
    edges (a tie each way, the carry past bf16's largest into inf, a NaN whose payload the
    addition would carry into inf)."""
    from kimi_passes.lowering.decompositions import _rounded_bf16

    g = torch.Generator().manual_seed(0)
    edges = torch.tensor([0x7F800001, 0x7FFFFFFF, -1, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF,
                          0x3F808000, 0x3F818000, 0x00008000, 0x7F800000, -0x800000, 0],
                         dtype=torch.int64).to(torch.int32)
    bits = torch.cat([torch.randint(-2**31, 2**31 - 1, (1 << 16,), generator=g,
                                    dtype=torch.int32), edges])
    v = bits.view(torch.float32)
    got, want = _rounded_bf16(v), v.to(torch.bfloat16).float()
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    assert same.all(), v[~same]
