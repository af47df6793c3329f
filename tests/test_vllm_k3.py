"""vLLM's own Kimi K3 forward (0.33.0, 0.34.0), as installed, compiled with the kimi passes (CPU).

The installed NVIDIA (``nvidia/model.py``) and ROCm (``amd/linear.py``) forward code runs
unmodified (``kimi_passes.graphs.vllm_k3``, graphs/vllm_k3.py, names the stand-ins:
attention, the MoE/MLP, the embedding, the norm/projection weight holders, the PP group, and
vLLM's GPU-only Triton import). vLLM's ``attn_res`` reaches the graph the way users get it:
the ``vllm.general_plugins`` entry point ``kimi_passes`` (``kimi_passes.vllm.k3.route``),
loaded by vLLM's own ``load_general_plugins`` with ``$KIMI_PASSES_AUX_STREAM`` set
(tests/helpers/vllm_harness.py ``load_vllm_plugins``). vLLM's configs are built on a CUDA
platform stand-in and its served drafter is its ``SpeculativeConfig`` without a checkpoint
(the harness's ``new_vllm_config``, ``speculative_config``).

The truth, for every aux state: the installed NVIDIA code's own eager output with
``VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1`` for the same weights (its capture k is layer k's
pre-norm AttnRes mixture, L's the output aggregation's), at the op's tolerance. The
compiled graphs: with ``kimi_backend``, and as vLLM compiles K3 in
``CompilationMode.STOCK_TORCH_COMPILE`` (``init_backend``, then
``model.compile(fullgraph=True, backend="kimi")``), the stream from the environment. One
dynamic compile serves T = 8, 300 and 1. Capture ids 0, 2 (a block-write layer's, a block
boundary), 3, 5 and L = 6. The flag-on graph makes no more mixing calls than the
flag-off graph.

Profiles: the default runs a sample of the matrix; ``KIMI_PASSES_VLLM_K3_PROFILE=full``
runs every vendor x dtype x flag (docs/testing.md).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from unittest import mock

import pytest

if importlib.util.find_spec("vllm") is None:  # test_vllm_required.py fails on CI then
    pytest.skip("vLLM is not installed (bash tools/install_vllm.sh installs it)",
                allow_module_level=True)

import torch  # noqa: E402
from helpers.fp8 import assert_rows_agree, gpu_rounding, vllm_amd  # noqa: E402
from helpers.op import OP_TOL, clone_args, make_args  # noqa: E402
from helpers.vllm_harness import (  # noqa: E402
    count_attn_res,
    load_vllm_plugins,
    new_vllm_config,
    start_route,
)
from helpers.vllm_truth import FlagOnTruth, assert_aux  # noqa: E402

import kimi_passes  # noqa: E402
import kimi_passes.graphs.vllm_k3 as h  # noqa: E402
import kimi_passes.vllm.k3.route as route  # noqa: E402
from kimi_passes.config.stream import ENV_VAR  # noqa: E402
from kimi_passes.fx.manager import PassObserver  # noqa: E402
from kimi_passes.ops import AttnResArgumentError  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("aten_fallback", "caches_off")]

FULL = os.environ.get("KIMI_PASSES_VLLM_K3_PROFILE") == "full"
SPEC = h.Spec()  # 6 layers, H=64, blocks of 2 (layers 0, 2, 4 write a block)
CAPTURE = (0, 2, 3, 5, 6)
TS = (8, 300, 1)  # one dynamic compile, T = 1 last (it must not recompile)
DRAFT = {"eagle_aux_hidden_state_layer_ids": list(CAPTURE)}


@pytest.fixture
def routed():
    """vLLM's K3 ``attn_res`` routed as a user's vLLM process routes it; in eager, the
    calls that are no capture's consumer run ``kimi::attn_res`` standing in for vLLM's own
    kernel (its interpreted launch takes ~7 s at T = 300; tests/test_vllm_k3_eager.py).

    The plugin imports the platform's K3 package (here the NVIDIA forward, as on CUDA);
    the ROCm module is imported first, as a ROCm process's package import does.
    """
    h.vllm_modules()
    with h.with_own_attn_res(h.kimi_own, h.kimi_own):  # vLLM's own kernel's stand-in
        start_route("attn_res")
        yield
        route.unroute_attn_res()


truth = FlagOnTruth(SPEC, CAPTURE, TS)  # the flag-on code (helpers/vllm_truth.py)


class MixingCalls(PassObserver):
    """The kimi AttnRes calls (``attn_res``, ``_capture``, ``_mix``) after the passes."""

    def __init__(self):
        self.counts: list[int] = []

    def after_passes(self, graph, seconds):
        self.counts.append(count_attn_res(graph))


def run_ts(model, dtype, what):
    """``model`` (compiled lazily: not called yet) at every T, against the truth."""
    truth(dtype, TS[0])  # first: a compiled truth resets Dynamo
    for T in TS:
        out = h.call(model, h.token_ids(SPEC, T), dynamic=True)
        assert_aux(h.aux_of(out), truth(dtype, T), dtype, f"{what}, T={T}")


def test_vllm_k3_plugin_routes_attn_res_only_when_enabled():
    nvidia, amd = h.vllm_modules()
    own = (nvidia.attn_res, amd.attn_res)
    assert own[0].__module__ == "vllm.models.kimi_k3.nvidia.ops.attn_res"
    try:
        start_route(None)  # no source asks for a stream: nothing changes
        assert (nvidia.attn_res, amd.attn_res) == own
    finally:
        route.unroute_attn_res()
    try:
        load_vllm_plugins("prefix")  # no K3 model built yet: nothing changes
        assert (nvidia.attn_res, amd.attn_res) == own
        start_route("prefix")  # a K3 model's init resolved the stream
        assert nvidia.attn_res is route.vllm_attn_res
        assert sys.modules["vllm.models.kimi_k3.nvidia.ops"].attn_res is route.vllm_attn_res
        assert amd.attn_res is route.vllm_attn_res_amd
    finally:
        route.unroute_attn_res()
    assert (nvidia.attn_res, amd.attn_res) == own
    with pytest.raises(ValueError, match=f"unknown aux stream 'attn-res' from \\${ENV_VAR}"):
        load_vllm_plugins("attn-res")
    assert (nvidia.attn_res, amd.attn_res) == own


def test_vllm_k3_stand_in_is_vllms_own_kernel():
    """``kimi::attn_res``, which stands in for vLLM's own ``attn_res`` where its
    interpreted kernel is too slow (``h.kimi_own``: this file's ``routed`` and the eager
    tests at T = 300), against vLLM's Triton ``attn_res`` (interpreted) on the installed
    NVIDIA forward, flag on: every aux state and the output."""
    T, dtype = 2, torch.float32  # the interpreter runs each of 17 launches row by row
    ids = h.token_ids(SPEC, T)
    with h.flag(True):
        model = h.build(SPEC, h.weights(SPEC), CAPTURE)
        with h.with_own_attn_res(h.kimi_own, h.kimi_own):
            kimi_out = h.call(model, ids)
        with h.vllm_kernel():
            own_out = h.call(model, ids)
    tol = OP_TOL[dtype]
    torch.testing.assert_close(kimi_out[0], own_out[0], atol=tol, rtol=tol)
    assert_aux(h.aux_of(kimi_out), h.aux_of(own_out), dtype, "kimi::attn_res vs vLLM's kernel")


@contextlib.contextmanager
def fp8_platform(fnuz: bool):
    """vLLM's platform answering ``is_fp8_fnuz()`` with ``fnuz`` (a ROCm MI300's FP8 is
    e4m3fnuz, bound 224; elsewhere e4m3fn's 448); yields ``get_fp8_min_max()[1]``."""
    from vllm.model_executor.layers.quantization.utils import quant_utils

    with mock.patch.object(quant_utils.current_platform, "is_fp8_fnuz", lambda: fnuz):
        yield quant_utils.get_fp8_min_max()[1]


def expect_capture(args):
    """Make the next ``attn_res`` call with ``args`` a capture's consumer (in eager only
    consumers run the route's kimi ops; ``k3.eager``)."""
    current = route.current()
    assert current is not None
    current.expect(args[3], args[0])


def test_vllm_k3_amd_route_quant_is_vllms_own_kernel(routed):
    """The ROCm route's ``quant_dtype`` at a capture's consumer
    (``kimi::attn_res_quant_capture``, the platform's bound)
    against vLLM's own AMD ``attn_res(..., quant_dtype=)`` (interpreted, rounding as a GPU
    does: tests/helpers/fp8.py) on the platform it would run on: the same in-place effects,
    and bytes and scales bit for bit on every row whose unquantized outputs agree. The
    e4m3fn quant on an fnuz platform takes the platform's 224, as vLLM's kernel does."""
    amd = sys.modules["vllm.models.kimi_k3.amd.linear"]
    assert amd.attn_res is route.vllm_attn_res_amd
    kernel = vllm_amd()
    fn, fnuz = torch.float8_e4m3fn, torch.float8_e4m3fnuz
    for qd, fnuz_platform, qmax in ((fn, False, 448.0), (fnuz, True, 224.0),
                                    (fn, True, 224.0)):
        args = make_args(6, 64, 4, 3, 3, torch.bfloat16, delta=True, onorm=True, seed=5,
                         scale=2.0)
        what = f"{qd}, fnuz platform {fnuz_platform}"
        with fp8_platform(fnuz_platform) as platform_max, gpu_rounding():
            assert platform_max == qmax, what
            kernel.QUANT_MAX = platform_max
            v_args, r_args = clone_args(args), clone_args(args)
            v_data, v_scale = kernel.attn_res(*v_args, quant_dtype=qd)
            expect_capture(r_args)  # a capture's consumer: the route's kimi quant op
            data, scale = amd.attn_res(*r_args, quant_dtype=qd)
            agree = (amd.attn_res(*clone_args(args))
                     == kernel.attn_res(*clone_args(args))).all(1)
        assert data.dtype == v_data.dtype == qd and scale.shape == v_scale.shape == (6, 1)
        for i in (0, 2):  # prefix += delta, the block write
            assert torch.equal(r_args[i], v_args[i]), f"{what}: argument {i}"
        assert int(agree.sum()) >= 3, f"{what}: only {int(agree.sum())} rows agree unquantized"
        assert_rows_agree(data, scale, v_data, v_scale, agree, what)
        peaks = data.float().abs().amax(1)  # each row's largest element lands on the bound
        assert torch.equal(peaks, torch.full_like(peaks, qmax)), f"{what}: {peaks.tolist()}"
    x = torch.zeros(2, SPEC.hidden)
    blocks, w = torch.zeros(2, 1, SPEC.hidden), torch.ones(SPEC.hidden)
    call = (x, None, blocks, w, w, None, 0, -1, 1e-6, 0.0)
    expect_capture(call)
    with pytest.raises(AttnResArgumentError, match="quant_dtype torch.float8_e5m2 is not "
                                                   "supported"):
        amd.attn_res(*call, quant_dtype=torch.float8_e5m2)
    expect_capture(call)
    with fp8_platform(False), pytest.raises(ValueError, match="FP8 bound is 448"):
        amd.attn_res(*call, quant_dtype=fnuz)
    current = route.current()
    assert current is not None
    current.pending().clear()


@pytest.mark.heavy
def test_vllm_k3_nvidia_as_vllm_stock_torch_compile_flag_off_and_on(routed, monkeypatch):
    """``CompilationMode.STOCK_TORCH_COMPILE`` with ``backend="kimi"``: vLLM resolves the
    backend (``init_backend``) and compiles the model as its GPU model runner does; the
    stream is ``$KIMI_PASSES_AUX_STREAM`` (set, as the route needs); the drafter is the one
    vLLM serves (``served_config``: the capture ids declared), read by the backend under
    vLLM's current config as in vLLM's profile run."""
    from vllm.config import CompilationConfig, CompilationMode, set_current_vllm_config

    import kimi_passes.backend
    from kimi_passes import pipeline

    monkeypatch.setenv(ENV_VAR, "attn_res")
    cc = CompilationConfig(mode=CompilationMode.STOCK_TORCH_COMPILE, backend="kimi")
    config = served_config(new_vllm_config(compilation_config=cc), CAPTURE)
    backend = cc.init_backend(config)
    assert backend == "kimi"
    calls = {}
    for on in (False, True):
        counter = MixingCalls()

        def pass_manager(config, counter=counter):  # the backend's, observed
            manager = pipeline.pass_manager(config)
            manager.observe(counter)
            return manager

        torch._dynamo.reset()
        with h.flag(on), mock.patch.object(kimi_passes.backend, "pass_manager", pass_manager), \
                torch.fx.experimental._config.patch(backed_size_oblivious=True), \
                set_current_vllm_config(config):
            model = h.build(SPEC, h.weights(SPEC), CAPTURE)
            model.compile(fullgraph=True, backend=backend)
            run_ts(model, torch.float32, f"STOCK_TORCH_COMPILE, flag {on}")
        assert len(counter.counts) == 1, f"flag {on}: {len(counter.counts)} compiles"
        calls[on] = counter.counts[0]
    assert calls[True] <= calls[False], (
        f"the flag-on graph makes {calls[True]} AttnRes calls, the flag-off graph "
        f"{calls[False]}: vLLM's separate capture mixing was not merged into its consumer")


KIMI_BACKEND_CASES = [
    (vendor, dtype, on)
    for vendor in ("nvidia", "amd") for dtype in (torch.float32, torch.bfloat16)
    for on in (False, True)
] if FULL else [("amd", torch.float32, True), ("nvidia", torch.bfloat16, False)]


@pytest.mark.heavy
@pytest.mark.parametrize(("vendor", "dtype", "on"), KIMI_BACKEND_CASES,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_vllm_k3_kimi_backend(routed, vendor, dtype, on):
    """``kimi_backend`` (attn_res stream, the drafter's ids declared), the whole model."""
    counter = MixingCalls()
    backend = kimi_passes.make_kimi_backend(aux_stream="attn_res", draft_config=DRAFT)
    backend.passes.observe(counter)
    torch._dynamo.reset()
    with h.flag(on), torch.fx.experimental._config.patch(backed_size_oblivious=True):
        model = h.build(SPEC, h.weights(SPEC, dtype), CAPTURE, amd=vendor == "amd")
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        run_ts(compiled, dtype, f"{vendor} {dtype} flag {on}")
    assert len(counter.counts) == 1, f"{len(counter.counts)} compiles for T={TS}, want one"
    assert counter.counts[0] <= 13, (  # 2 per layer + the output aggregation
        f"{counter.counts[0]} AttnRes calls: a capture kept a mixing call of its own")


@pytest.mark.heavy
@pytest.mark.parametrize("on", [False, True] if FULL else [True])
def test_vllm_k3_nvidia_pp_stages_kimi_backend(routed, on):
    """Two PP stages of the installed NVIDIA code, each compiled: layers [0, 4) (not the
    last: it returns vLLM's carry and its captures 0, 2, 3) and [4, 6) (captures 5, 6).
    The carry's prefix is no capture (its consumer is on the next stage): left as vLLM
    computes it."""
    dtype, w = torch.float32, h.weights(SPEC)
    first, last = h.Stage(is_last_rank=False, world_size=2), \
        h.Stage(is_first_rank=False, world_size=2)
    tol = OP_TOL[dtype]
    torch._dynamo.reset()
    with h.flag(on), torch.fx.experimental._config.patch(backed_size_oblivious=True):
        stages = [h.build(SPEC, w, CAPTURE, start=0, end=4, pp=first),
                  h.build(SPEC, w, CAPTURE, start=4, end=6, pp=last)]
        compiled = [torch.compile(m, backend=kimi_passes.make_kimi_backend(
            aux_stream="attn_res"), fullgraph=True) for m in stages]
        for T in TS:
            ids = h.token_ids(SPEC, T)
            eager_carry = h.call(stages[0], ids, pp=first)
            carry = h.call(compiled[0], ids, pp=first, dynamic=True)
            torch.testing.assert_close(carry["hidden_states"], eager_carry["hidden_states"],
                                       atol=tol, rtol=tol, msg="the carry is vLLM's prefix")
            out = h.call(compiled[1], ids, pp=last, carry=carry, dynamic=True)
            assert_aux(h.aux_of(out), truth(dtype, T), dtype, f"PP stages, flag {on}, T={T}")


# ------------------------------------------------------- vLLM's attn_res left unrouted

def _hop_graph(kernel, functional: bool) -> torch.fx.GraphModule:
    """A graph holding ``kernel``'s launch as Dynamo records a Triton launch: the
    higher-order op, the kernel found through ``kernel_side_table`` (Dynamo cannot trace
    the interpreted kernel on CPU, so the graph is built in that form directly)."""
    from torch._higher_order_ops.triton_kernel_wrap import (
        kernel_side_table,
        triton_kernel_wrapper_functional,
        triton_kernel_wrapper_mutation,
    )

    g = torch.fx.Graph()
    x = g.placeholder("x")
    kw = {"kernel_idx": kernel_side_table.add_kernel(kernel),
          "constant_args_idx": kernel_side_table.add_constant_args({}),
          "grid": [(1, 1, 1)], "tma_descriptor_metadata": {}, "kwargs": {"prefix_ptr": x}}
    if functional:
        out = g.call_function(triton_kernel_wrapper_functional,
                              kwargs={**kw, "tensors_to_clone": ["prefix_ptr"]})
        g.output(g.call_function(__import__("operator").getitem, (out, "prefix_ptr")))
    else:
        g.call_function(triton_kernel_wrapper_mutation, kwargs=kw)
        g.output(x)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _c_op_graph() -> tuple[torch.fx.GraphModule, object]:
    """vLLM's SM100 op ``_C::kimi_k3_attn_res`` (a stand-in registered under that name:
    vLLM's CPU build does not define it), functionalized, as a post-grad graph holds it."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    assert not hasattr(torch.ops._C, "kimi_k3_attn_res"), "_C::kimi_k3_attn_res exists here"
    lib = torch.library.Library("_C", "FRAGMENT")  # noqa: TOR901
    lib.define("kimi_k3_attn_res(Tensor(a!) prefix, Tensor delta) -> Tensor")
    g = torch.fx.Graph()
    x, d = g.placeholder("x"), g.placeholder("d")
    af = g.call_function(auto_functionalized, (torch.ops._C.kimi_k3_attn_res.default,),
                         {"prefix": x, "delta": d})
    g.output(g.call_function(__import__("operator").getitem, (af, 0)))
    return torch.fx.GraphModule(torch.nn.Module(), g), lib


def test_vllm_k3_unrouted_attn_res_refused_under_attn_res_stream():
    """vLLM's own K3 ``attn_res`` in a graph (its Triton kernel as the HOP, both forms;
    its SM100 op): an ``AuxCaptureError`` under the attn_res stream (the pass and the
    backend's Dynamo-level check), nothing under the prefix stream. Another kernel named
    ``_attn_res_kernel`` (not vLLM's) is no alarm."""
    import triton
    import triton.language as tl

    from kimi_passes import AuxCaptureError, AuxStreamPass, KimiBackend
    from kimi_passes.taps.unrouted import unrouted_calls

    kernel = h.vllm_attn_res().__globals__["_attn_res_kernel"]  # vLLM's, as installed
    assert kernel.fn.__code__.co_filename.endswith("kimi_k3/nvidia/ops/attn_res.py")

    @triton.jit
    def _attn_res_kernel(prefix_ptr, N: tl.constexpr):  # a user's own, same name
        pass

    c_gm, lib = _c_op_graph()
    try:
        found = {"HOP functional": _hop_graph(kernel, True),
                 "HOP mutation": _hop_graph(kernel, False), "_C op": c_gm}
        for what, gm in found.items():
            assert len(unrouted_calls(gm.graph)) == 1, what
            with pytest.raises(AuxCaptureError, match=(
                    rf"calls vLLM's Kimi K3 attn_res as vLLM ships it .*running prefix.*"
                    rf"\${ENV_VAR}=attn_res.*VLLM_PLUGINS.*kimi_passes")):
                AuxStreamPass("attn_res").run(gm.graph)
            AuxStreamPass("prefix").run(gm.graph)  # vLLM's own values are the ones asked
            with pytest.raises(AuxCaptureError, match=r"kimi_k3_attn_res|_attn_res_kernel"):
                KimiBackend(aux_stream="attn_res")(gm, [])
        other = _hop_graph(_attn_res_kernel, True)
        assert unrouted_calls(other.graph) == []
        AuxStreamPass("attn_res").run(other.graph)
    finally:
        lib._destroy()


def served_config(config, ids):
    """``config`` serving an eagle3 drafter that declares capture ids ``ids``
    (``helpers.vllm_harness.speculative_config``: vLLM's, without the drafter's checkpoint)."""
    import types

    from helpers.vllm_harness import speculative_config

    hf = types.SimpleNamespace(to_dict=lambda: {"eagle_aux_hidden_state_layer_ids": list(ids)})
    object.__setattr__(config, "speculative_config", speculative_config("eagle3", hf))
    return config


def test_vllm_k3_kimi_backend_reads_vllms_served_drafter():
    """``backend="kimi"`` as vLLM's STOCK_TORCH_COMPILE hands it (the name, no options),
    first called under vLLM's current config (as vLLM's profile run is): the drafter vLLM
    serves is checked (the heavy STOCK_TORCH_COMPILE test serves a matching one)."""
    from helpers.k3 import inference_model, small_config, token_ids
    from vllm.config import CompilationConfig, CompilationMode, set_current_vllm_config

    from kimi_passes import AuxCaptureError

    cc = CompilationConfig(mode=CompilationMode.STOCK_TORCH_COMPILE, backend="kimi")
    config = new_vllm_config(compilation_config=cc)
    backend = cc.init_backend(config)
    cfg = small_config(2, 1, taps=(0, 1, 2))
    ids = token_ids(cfg, 5)
    # Declared (0, 2); the model taps 0, 1, 2: refused, naming vLLM's speculative config.
    served_config(config, (0, 2))
    torch._dynamo.reset()
    compiled = torch.compile(inference_model(cfg), backend=backend, fullgraph=True)
    with set_current_vllm_config(config), torch.no_grad(), pytest.raises(
            AuxCaptureError, match=r"declares capture ids \[0, 2\] .*vLLM serves \(eagle3"):
        compiled(ids)
