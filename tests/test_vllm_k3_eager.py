"""vLLM 0.33.0's Kimi K3 as vLLM runs it: vLLM's config decides the mode, then the stream.

vLLM's own config code (``VllmConfig``'s breakable-CUDA-graph resolution for a K3
architecture, ``EngineArgs`` for the README's command) decides how K3 runs; the plan
(``kimi_passes.vllm.k3.plan``) serves or refuses it; the installed K3 forward runs in that
mode with the plugin loaded by vLLM's ``load_general_plugins``. The truth for every aux
state: the installed NVIDIA code's flag-on eager output, every call vLLM's own ``attn_res``.

Stand-ins (only for what needs a GPU): graphs/vllm_k3.py's attention, MoE/MLP,
embedding, norm/projection holders and PP group; vLLM's own ``attn_res`` is its installed
NVIDIA / ROCm Triton kernel, interpreted (``TRITON_INTERPRET=1``) at T = 1 and 8, and
``kimi::attn_res`` (``h.kimi_own``) at T = 300, where the interpreter takes ~7 s a call;
``KimiLinearModel.__init__`` builds GPU modules, so the test calls the plan it runs
(``startup``) on the harness's model; vLLM's platform is mocked (CUDA or ROCm)
where the resolution reads it; sequence parallelism's collectives are one rank's identity.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import threading
from pathlib import Path
from unittest import mock

import pytest

if importlib.util.find_spec("vllm") is None:  # test_vllm_required.py fails on CI then
    pytest.skip("vLLM is not installed (bash tools/install_vllm.sh installs it)",
                allow_module_level=True)

import torch  # noqa: E402
from helpers.vllm_harness import (  # noqa: E402
    BREAKABLE,
    K3,
    gpu_platform,
    resolved_k3,
    start_route,
)
from helpers.vllm_truth import FlagOnTruth, assert_aux  # noqa: E402

import kimi_passes.graphs.vllm_k3 as h  # noqa: E402
import kimi_passes.vllm.k3.route as route  # noqa: E402
from kimi_passes.config.stream import ENV_VAR  # noqa: E402
from kimi_passes.vllm.k3.eager import capture_call  # noqa: E402
from kimi_passes.vllm.k3.plan import serving_plan, startup  # noqa: E402
from kimi_passes.vllm.k3.stream import StreamConflict, VllmRouteError  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("aten_fallback", "caches_off")]

SPEC = h.Spec()  # 6 layers, H=64, blocks of 2
CAPTURE = (0, 2, 3, 5, 6)  # the embedding, a block boundary, mid-block, mid-block, L
FUSED = 4  # captures read out of a consumer's call (id 0 is the embedding itself)
SITES = 2 * SPEC.num_layers + 1  # two mixing calls per layer, the output aggregation
TS = (1, 8, 300)
ROOT = Path(__file__).resolve().parent.parent


def own_kernels(T: int):
    """vLLM's own ``attn_res`` (NVIDIA, ROCm) at token count ``T`` (see the docstring)."""
    if T > 8:
        return h.kimi_own, h.kimi_own
    return h.vllm_attn_res(), h.vllm_amd_attn_res()


@contextlib.contextmanager
def served(T: int, stream: str | None = "attn_res", calls: h.Calls | None = None,
           vllm_config=None):
    """The plugin loaded and the stream resolved as vLLM's K3 process does
    (``start_route``: ``$KIMI_PASSES_AUX_STREAM`` = ``stream``, vLLM's flag as set,
    ``vllm_config``'s drafter); vLLM's own kernels (counted) at non-consumers. Yields the
    process's ``EagerRoute``."""
    nvidia_fn, amd_fn = own_kernels(T)
    if calls is not None:
        nvidia_fn, amd_fn = calls.wrap(nvidia_fn), calls.wrap(amd_fn)
    with h.with_own_attn_res(nvidia_fn, amd_fn):
        try:
            yield start_route(stream, vllm_config)
        finally:
            route.unroute_attn_res()


#: The flag-on code, vLLM's own kernel everywhere (helpers/vllm_truth.py).
truth = FlagOnTruth(SPEC, CAPTURE, TS, kernels=own_kernels)


# ---------------------------------------------------------------- vLLM's config resolution

def platform(rocm: bool):
    """vLLM's platform as a CUDA or ROCm machine where its resolution reads it."""
    return gpu_platform("rocm" if rocm else "cuda")


def resolved(cc: dict, breakable: str | None, rocm: bool = False, extra=None,
             architecture: str = K3):
    """A K3 checkpoint's ``VllmConfig`` after vLLM's resolution, and the environment
    it left (``helpers.vllm_harness.resolved_k3``)."""
    return resolved_k3(cc, breakable, rocm=rocm, extra=extra, architecture=architecture)


def plan_for(config, env, stream="attn_res", sp=False):
    with mock.patch.dict(os.environ, env, clear=True):
        return serving_plan(config, stream=stream, sequence_parallel=sp)


STOCK = {"mode": 1, "backend": "kimi"}
CASES = [  # (-cc, VLLM_USE_BREAKABLE_CUDAGRAPH, ROCm) -> "eager" / "compiled" / refusal
    ({}, None, False, "eager"), ({"mode": 0}, None, False, "eager"),
    (STOCK, None, False, "eager"), ({"mode": 1, "backend": "inductor"}, None, False, "eager"),
    ({"mode": 3}, None, False, "eager"), (STOCK, "1", False, "eager"),
    (STOCK, "0", False, "compiled"), ({"mode": 3}, "0", False, "eager"),
    ({"mode": 1, "backend": "inductor"}, "0", False, "backend 'inductor'"),
    ({"mode": 0}, "0", False, "eager"),
    (STOCK, None, True, "compiled"), ({"mode": 1, "backend": "inductor"}, None, True,
                                      "backend 'inductor'"),
    ({}, None, True, "eager"), (STOCK, "1", True, "eager"),
]


@pytest.mark.parametrize(("cc", "breakable", "rocm", "want"), CASES,
                         ids=lambda v: re.sub(r"\W+", "", str(v)))
def test_vllm_config_resolution_decides_the_route(cc, breakable, rocm, want):
    """Every ``-cc`` mode a user may pass, with and without the variable, NVIDIA and ROCm:
    vLLM's resolution, then served (eager / the pass) or refused naming the fix."""
    config, env = resolved(cc, breakable, rocm)
    if want in ("eager", "compiled"):
        plan = plan_for(config, env)
        assert plan.route == want, (cc, breakable, rocm, plan)
        if want == "compiled":
            assert "FailOnRecompileLimitHit" in plan.why
        return
    with pytest.raises(VllmRouteError, match=rf"{want}.*Drop the -cc mode.*{ENV_VAR}"):
        plan_for(config, env)
    assert plan_for(config, env, stream="prefix").stream == "prefix"  # vLLM's own values


def test_vllm_k3_refusals_name_the_fix():
    """The specialized decode executor, and sequence parallelism compiled, are refused;
    sequence parallelism in eager is served."""
    config, env = resolved({}, None, extra={"decode_backend": "latency_specialized"})
    with pytest.raises(VllmRouteError, match=(
            r"specialized decode.*CuTe AttnRes kernels, whose aux variants \(bind_aux\) store "
            r"the running prefix.*Drop decode_backend .*or keep the specialized decode with a "
            r"drafter trained on the prefix stream")):
        plan_for(config, env)
    # The reason, as vLLM's installed code states it: its narrow steps' AttnRes kernels
    # store the prefix for an aux layer, and it refuses its own aux-stream flag there.
    import inspect

    from vllm.models.kimi_k3.nvidia.specialized_decode import runtime
    from vllm.models.kimi_k3.nvidia.specialized_decode.cutedsl.attn_res import prepared

    assert "store the updated prefix rows" in inspect.getdoc(prepared.PreparedAttnRes.bind_aux)
    unsupported = inspect.getsource(runtime.unsupported)
    assert "envs.VLLM_KIMI_K3_AUX_ATTN_RES_STREAM" in unsupported
    assert '"the AttnRes aux stream"' in unsupported
    config, env = resolved(STOCK, "0")
    with pytest.raises(VllmRouteError, match="sequence parallelism.*Drop the -cc"):
        plan_for(config, env, sp=True)
    config, env = resolved({}, None)
    assert plan_for(config, env, sp=True).route == "eager"


# ----------------------------------------------------------------- the eager route, served

def run_eager(vendor, dtype, T, on, *, ids=CAPTURE, at_capture=None, stream="attn_res",
              **build):
    """One eager forward of the installed code under the plugin; its aux and its calls.

    ``at_capture``: a list that gets, at each capture's consumer call and before it runs,
    what vLLM's flag-on capture computes there: vLLM's own ``attn_res`` of ``prefix +
    pending`` with no delta and no output norm, over the consumer's bank, weights and
    ``num_blocks`` (``_capture_aux_hidden_stream``). ``stream``: ``$KIMI_PASSES_AUX_STREAM``
    (None: unset).
    """
    calls = h.Calls()
    config, env = resolved({}, None)
    own = own_kernels(T)[vendor == "amd"]

    def record(args, kwargs):
        if at_capture is not None:
            with torch.utils._python_dispatch._disable_current_modes():  # not the forward's
                at_capture.append(own(*capture_call(args, kwargs)))

    with h.flag(on), served(T, stream=stream, calls=calls) as served_route, \
            served_route.watch(record):
        model = h.build(SPEC, h.weights(SPEC, dtype), ids, amd=vendor == "amd", **build)
        plan = startup(model, config, served_route.choice)  # what __init__ runs
        assert plan.route == "eager", plan
        calls.own.clear()
        with calls:
            out = h.call(model, h.token_ids(SPEC, T), pp=build.get("pp", h.Stage()))
    return out, calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("vendor", ["nvidia", "amd"])
def test_vllm_k3_eager_route_serves_the_stream(vendor, dtype):
    """vLLM's flag off and on, T = 1, 8, 300: every aux state is its consumer's pre-norm
    mixture, every forward makes the flag-off number of AttnRes calls (one per site), the
    captures' consumers are ``kimi::attn_res_capture`` and no pure mixing call is left."""
    for T in TS:
        for on in (False, True):
            at_capture: list = []
            out, calls = run_eager(vendor, dtype, T, on, at_capture=at_capture)
            what = f"{vendor} {dtype} T={T} flag {on}"
            aux = h.aux_of(out)
            # Each capture against vLLM's flag-on capture at that point of this forward;
            # fp32 also against vLLM's whole flag-on forward (in bf16 the stand-ins amplify
            # the consumers' last-bit differences with depth: docs/testing.md, Tolerances).
            assert_aux(aux[1:], at_capture, dtype, f"{what}, at each capture")
            if dtype == torch.float32:
                assert_aux(aux, truth(dtype, T), dtype, what)
            assert calls.kimi == ["attn_res_capture"] * FUSED, (what, calls.kimi)
            assert calls.own == ["site"] * (SITES - FUSED), (what, calls.own)


def test_vllm_k3_eager_route_pp_stages():
    """Two PP stages of the installed NVIDIA code, eager: layers [0, 4) pack captures 0, 2
    and 3 into vLLM's carry, [4, 6) collects them and adds 5 and 6."""
    first, last = h.Stage(is_last_rank=False, world_size=2), \
        h.Stage(is_first_rank=False, world_size=2)
    w = h.weights(SPEC)
    config, env = resolved({}, None)
    for T in (1, 8):
        for on in (False, True):
            calls = h.Calls()
            with h.flag(on), served(T, calls=calls):
                stages = [h.build(SPEC, w, CAPTURE, start=0, end=4, pp=first),
                          h.build(SPEC, w, CAPTURE, start=4, end=6, pp=last)]
                for m in stages:
                    startup(m, config, "attn_res")
                ids = h.token_ids(SPEC, T)
                calls.own.clear()
                with calls:
                    carry = h.call(stages[0], ids, pp=first)
                    assert len(h.aux_of(carry)) == 3
                    out = h.call(stages[1], ids, pp=last, carry=carry)
            assert_aux(h.aux_of(out), truth(torch.float32, T), torch.float32,
                       f"PP stages, T={T}, flag {on}")
            assert len(calls.kimi) == FUSED and len(calls.own) == SITES - FUSED


def test_vllm_k3_eager_route_sequence_parallel():
    """Sequence parallelism (NVIDIA), its collectives one rank's identity: the captures
    are fused on the shard and gathered by vLLM as its flag-on values are."""
    nvidia, _ = h.vllm_modules()
    identity = {name: (lambda x, *a, **k: x) for name in
                ("sp_shard", "sp_all_gather", "sp_reduce_scatter")}
    with mock.patch.multiple(nvidia, **identity):
        calls = h.Calls()
        config, env = resolved({}, None)
        with h.flag(False), served(8, calls=calls):
            model = h.build(SPEC, h.weights(SPEC), CAPTURE)
            model.use_sequence_parallel = True
            for layer in model.layers:
                layer.use_sequence_parallel = True
            assert plan_for(config, env, sp=True).route == "eager"
            with calls:
                out = h.call(model, h.token_ids(SPEC, 8))
    assert_aux(h.aux_of(out), truth(torch.float32, 8), torch.float32, "sequence parallel")
    assert len(calls.kimi) == FUSED


def test_vllm_k3_eager_route_prefix_stream_is_vllms_own():
    """``$KIMI_PASSES_AUX_STREAM=prefix``: vLLM's values, bit for bit, flag off; with vLLM's
    flag on the two variables disagree, and the init refuses naming both."""
    with h.with_own_attn_res(*own_kernels(8)), h.flag(False):
        want = h.aux_of(h.call(h.build(SPEC, h.weights(SPEC), CAPTURE), h.token_ids(SPEC, 8)))
    with h.flag(False), served(8, stream="prefix"):
        got = h.aux_of(h.call(h.build(SPEC, h.weights(SPEC), CAPTURE), h.token_ids(SPEC, 8)))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    with h.flag(True), pytest.raises(StreamConflict, match=(
            rf"\${ENV_VAR}=prefix asks for 'prefix', \${h.FLAG}=1 asks for 'attn_res'")):
        with served(8, stream="prefix"):
            pass


def test_vllm_k3_eager_route_quant_consumer():
    """A ROCm consumer with FP8 output (``quant_dtype``): ``kimi::attn_res_quant_capture``,
    its bytes and scales ``attn_res_quant``'s, the capture ``attn_res_capture``'s mixture."""
    from helpers.op import clone_args, make_args

    _, amd = h.vllm_modules()
    args = make_args(6, 64, 4, 3, 3, torch.bfloat16, delta=True, onorm=True, seed=5)
    fp8 = torch.float8_e4m3fn
    with served(8) as served_route, \
            mock.patch.object(route, "_platform_quant_max", lambda dtype: 448.0):
        want_data, want_scale = torch.ops.kimi.attn_res_quant(*clone_args(args), fp8,
                                                              quant_max=448.0)
        want_mixed = torch.ops.kimi.attn_res_capture(*clone_args(args))[1]
        got_args = clone_args(args)
        aux = served_route.expect(got_args[3], got_args[0])
        data, scale = amd.attn_res(*got_args, quant_dtype=fp8)
    assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))
    assert torch.equal(scale, want_scale) and torch.equal(aux, want_mixed)


def test_vllm_k3_eager_plan_refuses_a_dynamo_trace():
    """A forward vLLM's config runs eagerly but Dynamo traces (a user's own
    ``torch.compile`` of the model) is refused at the capture, not served the prefix."""
    config, env = resolved({}, None)
    with h.flag(False), served(8):
        model = h.build(SPEC, h.weights(SPEC), CAPTURE)
        startup(model, config, "attn_res")
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        with pytest.raises(Exception, match="traced by Dynamo though vLLM's config runs it "
                                            "eagerly"):
            h.call(compiled, h.token_ids(SPEC, 8))
    torch._dynamo.reset()


def test_vllm_k3_init_runs_the_plan():
    """``KimiLinearModel.__init__`` (vLLM's own, replaced by a stand-in that builds
    nothing) is followed by the plan for the config it was given, kept on the model."""
    nvidia, _ = h.vllm_modules()
    config, env = resolved({"mode": 1, "backend": "inductor"}, "0")
    with mock.patch.object(nvidia.KimiLinearModel, "__init__",
                           lambda self, *, vllm_config, prefix="": None), \
            mock.patch.dict(os.environ, env, clear=True):
        with served(1):
            with pytest.raises(VllmRouteError, match="backend 'inductor'"):
                nvidia.KimiLinearModel(vllm_config=config)
            config, env = resolved({}, None)
            model = nvidia.KimiLinearModel(vllm_config=config)
            assert model._kimi_passes_plan.route == "eager"
        assert not hasattr(nvidia.KimiLinearModel.__init__, "__wrapped__")  # unrouted


# ------------------------------------------------------------------- the README's command

def readme_vllm_command() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## With vLLM", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?vllm serve .*?)\n```", section, re.S)
    assert commands, "README's 'With vLLM' section has no `vllm serve` command"
    return commands[0]


@pytest.mark.heavy
def test_readme_vllm_command_through_vllms_engine_args(tmp_path):
    """The README's ``vllm serve`` command, parsed by vLLM's own ``EngineArgs`` and
    resolved by ``create_engine_config`` (a K3 ``config.json`` for ``<K3-checkpoint>``,
    graphs/configs/dflash_attn_res, which declares attn_res, for ``<drafter>``; no
    tokenizer here: ``--skip-tokenizer-init`` added), NVIDIA and ROCm platforms: served
    eagerly; the installed forward then returns the stream with no pure mixing call."""
    import vllm.plugins
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    words = shlex.split(readme_vllm_command())
    env = dict(w.split("=", 1) for w in words[:words.index("vllm")])
    assert env.get(ENV_VAR) == "attn_res", env
    args = words[words.index("serve") + 1:]
    assert args[0] == "<K3-checkpoint>" and "--speculative-config" in args, args
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3"}))
    drafter = str(ROOT / "graphs" / "configs" / "dflash_attn_res")
    args = ["--model", str(tmp_path), *(a.replace("<drafter>", drafter) for a in args[1:]),
            "--skip-tokenizer-init"]
    clean = {k: v for k, v in os.environ.items() if k != BREAKABLE}
    h.vllm_modules()  # imported on vLLM's CPU platform: the platform stand-in has no _C ops
    for rocm in (False, True):
        with mock.patch.dict(os.environ, {**clean, **env, "HF_HUB_OFFLINE": "1"}, clear=True), \
                platform(rocm), mock.patch.object(vllm.plugins, "plugins_loaded", False):
            parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
            try:
                config = EngineArgs.from_cli_args(parser.parse_args(args)).create_engine_config()
                # vLLM loaded our entry point itself (pip install -e . declares it).
                assert route.current() is not None, "vLLM did not load kimi_passes"
            finally:
                route.unroute_attn_res()
            plan = serving_plan(config, stream=os.environ[ENV_VAR],
                                        sequence_parallel=False)
        assert plan.route == "eager", (rocm, plan)
    out, calls = run_eager("nvidia", torch.float32, 8, False)
    assert_aux(h.aux_of(out), truth(torch.float32, 8), torch.float32, "README command")
    assert "pure" not in calls.own and len(calls.kimi) == FUSED


# ------------------------------------------------- vLLM's flag alone; forwards in threads

def test_vllm_k3_vllms_flag_alone_is_served_fused():
    """vLLM's own flag on, our variable unset, no drafter: the stream it asks for is served
    fused, NVIDIA and ROCm: as many AttnRes calls as vLLM's flag-off forward makes
    (counted unrouted), none of them a pure mixing call."""
    flag_off = h.Calls()
    with h.with_own_attn_res(*(flag_off.wrap(k) for k in own_kernels(8))), h.flag(False):
        h.call(h.build(SPEC, h.weights(SPEC), CAPTURE), h.token_ids(SPEC, 8))
    for vendor, T in (("nvidia", 8), ("amd", 1)):
        out, calls = run_eager(vendor, torch.float32, T, True, stream=None)
        assert_aux(h.aux_of(out), truth(torch.float32, T), torch.float32, f"{vendor}, flag")
        assert calls.kimi == ["attn_res_capture"] * FUSED, (vendor, calls.kimi)
        assert len(calls.own) + len(calls.kimi) == len(flag_off.own) and \
            "pure" not in calls.own, (vendor, calls.own)


def test_vllm_k3_eager_route_two_threads():
    """Two forwards in two threads: the first paused while its capture 3 waits for its
    consumer (at layer 3's norm-weight read, a stand-in), the second run whole meanwhile;
    each thread's captures are its own, and both forwards return the stream."""
    paused, resume = threading.Event(), threading.Event()

    class PausingNorm(h.Weights):
        def __getattr__(self, name):
            pending = route.current().pending()  # type: ignore[union-attr]
            if name == "weight" and threading.current_thread().name == "first" and pending:
                paused.set()
                resume.wait(120)
            return super().__getattr__(name)

    config, env = resolved({}, None)
    results: dict = {}

    def forward(T):
        try:
            results[T] = h.aux_of(h.call(model, h.token_ids(SPEC, T)))
        except Exception as e:  # noqa: BLE001  (reported by the assertion below)
            results[T] = e

    with h.flag(False), served(8) as served_route:
        model = h.build(SPEC, h.weights(SPEC), CAPTURE)
        startup(model, config, served_route.choice)
        model.layers[3].self_attention_res_norm.__class__ = PausingNorm
        first = threading.Thread(target=forward, args=(8,), name="first")
        first.start()
        assert paused.wait(120), "the first forward never reached its pause"
        forward(1)
        resume.set()
        first.join(120)
    for T in (8, 1):
        assert not isinstance(results[T], Exception), results[T]
        assert_aux(results[T], truth(torch.float32, T), torch.float32, f"thread T={T}")
