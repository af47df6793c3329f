"""The stream a vLLM K3 process serves, from what the user and the drafter said.

Through vLLM's own code: ``EngineArgs.create_engine_config`` for a K3 ``config.json``
(graphs/configs/k3) on a CUDA platform stand-in (``vllm_plan.platform``) and a drafter
whose ``config.json`` declares each stream, for each method vLLM 0.33.0 and 0.34.0 accept with
K3 and feed aux states (eagle3; dflash, which serves DFlash2 drafters too; dspark, on
vLLM's V2 model runner, which a GPU with Triton picks; extract_hidden_states); vLLM's
plugin loader; ``KimiLinearModel.__init__`` as the plugin wraps it; the installed K3
forward. Stand-ins: the body of vLLM's ``__init__`` (it builds GPU modules) builds
nothing; the forward's attention, MoE and PP group are graphs/vllm_k3.py's. The expected
aux states are vLLM's own flag-on forward, unrouted, its kernel interpreted.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import sys
from pathlib import Path
from unittest import mock

import pytest

if importlib.util.find_spec("vllm") is None:  # test_vllm_required.py fails on CI then
    pytest.skip("vLLM is not installed (bash tools/install_vllm.sh installs it)",
                allow_module_level=True)

import torch  # noqa: E402
from helpers.op import OP_TOL  # noqa: E402
from helpers.vllm_harness import load_vllm_plugins  # noqa: E402

import kimi_passes.graphs.vllm_k3 as h  # noqa: E402
import kimi_passes.vllm.k3.route as route  # noqa: E402
from kimi_passes.config.stream import ENV_VAR  # noqa: E402
from kimi_passes.vllm.k3.stream import StreamConflict, VllmRouteError  # noqa: E402
from kimi_passes.vllm.vllm_plan import command  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("aten_fallback", "caches_off")]

ROOT = Path(__file__).resolve().parent.parent
K3 = ROOT / "graphs" / "configs" / "k3"
OTHER = {"attn_res": "prefix", "prefix": "attn_res"}
SMALL = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 163840,
         "max_position_embeddings": 4096}
#: Each method's drafter config (its architecture as vLLM's registry names it).
DRAFTERS = {
    "eagle3": {**SMALL, "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
               "eagle_aux_hidden_state_layer_ids": [2, 16, 31]},
    "dflash": {**SMALL, "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
               "block_size": 8, "dflash_config": {"target_layer_ids": [1, 15, 30]}},
    "dspark": {**SMALL, "architectures": ["K3DSparkModel"], "model_type": "qwen3",
               "dspark_target_layer_ids": [1, 15, 30]},
    "extract_hidden_states": {"eagle_aux_hidden_state_layer_ids": [2, 16, 31]},
}
CLEAN = {ENV_VAR: None, h.FLAG: None, "VLLM_USE_BREAKABLE_CUDAGRAPH": None}


@contextlib.contextmanager
def environ(**env):
    """``os.environ`` patched for the duration: ``None`` removes a variable."""
    with mock.patch.dict(os.environ):
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield


def serve_args(method: str, declared: str, tmp: Path, *extra: str) -> list[str]:
    """``vllm serve`` arguments serving ``method``'s drafter, which declares ``declared``."""
    config = {**DRAFTERS[method], "aux_hidden_stream": declared}
    spec = {"method": method, "num_speculative_tokens": 1}
    if method == "extract_hidden_states":  # no drafter model: vLLM takes its hf_config
        spec["draft_model_config"] = {"hf_config": config}
    else:
        folder = tmp / f"{method}_{declared}"
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config))
        spec["model"] = str(folder)
    return [str(K3), "--speculative-config", json.dumps(spec), *extra]


@pytest.fixture(scope="module")
def drafters(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("drafters")


@pytest.fixture(scope="module")
def engine(drafters):
    """vLLM's resolved ``VllmConfig`` for ``(method, declared, *extra)``, built once."""
    tmp, built = drafters, {}

    def config(method: str, declared: str, *extra: str, **env):
        key = (method, declared, extra, tuple(sorted(env.items())))
        if key not in built:
            with environ(**{**CLEAN, "HF_HUB_OFFLINE": "1", "VLLM_USE_V2_MODEL_RUNNER": "1",
                            **env}):
                try:
                    built[key] = command.engine_config(
                        serve_args(method, declared, tmp, *extra), "cuda")
                finally:
                    route.unroute_attn_res()  # vLLM may have loaded our plugin
        return built[key]

    return config


@contextlib.contextmanager
def k3_process(config, **env):
    """vLLM's plugin loaded under ``env`` and ``KimiLinearModel(vllm_config=config)`` as
    the plugin wraps it; yields the model (vLLM's own ``__init__`` body a stand-in)."""
    nvidia, _ = h.vllm_modules()
    with environ(**{**CLEAN, **env}), mock.patch.object(
            nvidia.KimiLinearModel, "__init__", lambda self, *, vllm_config, prefix="": None):
        try:
            load_vllm_plugins(env.get(ENV_VAR))
            yield nvidia.KimiLinearModel(vllm_config=config)
        finally:
            route.unroute_attn_res()


METHODS = list(DRAFTERS)


@pytest.mark.parametrize("method", METHODS)
def test_vllm_k3_stream_is_the_drafters_or_refused(engine, method):
    """Each stream the drafter declares, with our variable unset (the drafter's stream),
    set the same (served, both named) and set the other (refused at init, both named)."""
    nvidia, _ = h.vllm_modules()
    before = dict(vars(nvidia.KimiLinearModel)), nvidia.attn_res, list(sys.meta_path)
    for declared in ("attn_res", "prefix"):
        config = engine(method, declared)
        where = f"the {method} drafter's config"
        for ours in (None, declared):
            with k3_process(config, **{ENV_VAR: ours}) as model:
                plan = model._kimi_passes_plan
                assert model._kimi_passes_route is route.current()
                assert (plan.stream, plan.route) == (declared, "eager"), (method, ours, plan)
                assert where in plan.source and (ours is None or ENV_VAR in plan.source)
        with pytest.raises(StreamConflict, match=re.escape(
                f"${ENV_VAR}={OTHER[declared]} asks for '{OTHER[declared]}', {where}")):
            with k3_process(config, **{ENV_VAR: OTHER[declared]}):
                pass
    # unroute_attn_res put every name back and dropped the import hook
    assert (dict(vars(nvidia.KimiLinearModel)), nvidia.attn_res, list(sys.meta_path)) == before


def test_vllm_k3_a_drafter_declaring_attn_res_gets_the_mixture(engine):
    """Only the plugin installed (no variable, vLLM's flag off): a drafter declaring
    attn_res is served the mixture, fused, with no pure mixing call; the startup line
    goes to vLLM's logger tree (``vllm``), the one vLLM's logging config prints."""
    T, spec, ids = 4, h.Spec(), (0, 2, 3, 5, 6)
    with h.with_own_attn_res(h.vllm_attn_res(), h.vllm_amd_attn_res()), h.flag(True):
        want = h.aux_of(h.call(h.build(spec, h.weights(spec), ids), h.token_ids(spec, T)))
    calls, lines = h.Calls(), []
    own = calls.wrap(h.vllm_attn_res())
    handler = logging.Handler()
    handler.emit = lines.append  # type: ignore[method-assign]
    vllm_log = logging.getLogger("vllm")  # the tree vLLM's logging config prints
    vllm_log.addHandler(handler)
    try:
        with h.with_own_attn_res(own, own), k3_process(engine("dflash", "attn_res")) as init:
            assert init._kimi_passes_plan.stream == "attn_res"
            model = h.build(spec, h.weights(spec), ids)
            with calls:
                got = h.aux_of(h.call(model, h.token_ids(spec, T)))
    finally:
        vllm_log.removeHandler(handler)
    assert any(r.getMessage().startswith("kimi_passes: aux stream attn_res (from the dflash")
               for r in lines), "the startup line did not reach vLLM's logger"
    assert calls.kimi == ["attn_res_capture"] * 4 and "pure" not in calls.own, calls.kimi
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=OP_TOL[torch.float32], rtol=OP_TOL[torch.float32],
                                   msg=lambda m, i=i: f"aux {i} is not the mixture: {m}")


def test_vllm_k3_stream_refusals(engine):
    """vLLM's flag against a drafter declaring prefix; a flag vLLM cannot read; the kimi
    backend compiling another stream than the drafter's: each refused naming the fix."""
    config = engine("eagle3", "prefix")
    with pytest.raises(StreamConflict, match=re.escape(
            f"${h.FLAG}=1 asks for 'attn_res', the eagle3 drafter's config")):
        with k3_process(config, **{h.FLAG: "1"}):
            pass
    with pytest.raises(ValueError, match=rf"\${h.FLAG}='yes' is not an integer"):
        with k3_process(config, **{h.FLAG: "yes"}):
            pass
    stock = engine("eagle3", "prefix", "-cc", '{"mode": 1, "backend": "kimi"}',
                   VLLM_USE_BREAKABLE_CUDAGRAPH="0")
    with pytest.raises(VllmRouteError, match=(
            rf"backend 'kimi' gets no options.*Set \${ENV_VAR}=prefix")):
        with k3_process(stock, VLLM_USE_BREAKABLE_CUDAGRAPH="0"):
            pass


def test_vllm_k3_plugins_without_kimi_passes_run_nothing_of_ours(engine, capsys):
    """``VLLM_PLUGINS`` set without kimi_passes, our variable set: vLLM loads no code of
    ours (README: the documented limit), so vLLM's own ``attn_res`` stays; the plan says
    so and exits 1."""
    nvidia, _ = h.vllm_modules()
    own = nvidia.attn_res
    with environ(**{**CLEAN, "VLLM_PLUGINS": "other", ENV_VAR: "attn_res"}):
        load_vllm_plugins("attn_res")
        assert route.current() is None and nvidia.attn_res is own
        with mock.patch.object(command, "engine_config",
                               lambda argv, kind: engine("dflash", "attn_res")):
            assert command.main([str(K3)]) == 1
    out = capsys.readouterr().out
    assert "$VLLM_PLUGINS='other' omits kimi_passes" in out and "refused" in out, out


def test_vllm_plan_refuses_what_startup_refuses(drafters, capsys):
    """``vllm-plan`` with our variable against the drafter's declaration: exit 1, the
    refusal printed as startup would raise it."""
    with environ(**{**CLEAN, ENV_VAR: "prefix"}):
        assert command.main(serve_args("dflash", "attn_res", drafters)) == 1
    out = capsys.readouterr().out
    assert re.search(r"refused +kimi_passes: two sources ask for different aux streams", out)


def test_vllm_plan_resolves_for_the_platform_named(drafters, capsys):
    """No GPU here: ``vllm-plan`` resolves for the platform ``--platform`` names, as that
    server's vLLM would: NVIDIA (the default) K3's breakable CUDA graphs force mode NONE;
    ROCm has none and keeps vLLM's mode. A platform that is not one is refused (exit 2)."""
    args = serve_args("dflash", "attn_res", drafters)
    for platform, graphs in (([], "mode NONE (breakable CUDA graphs)"),
                             (["--platform", "rocm"], "(no breakable CUDA graphs)")):
        with environ(**CLEAN), mock.patch("torch.cuda.is_available", lambda: False):
            assert command.main([*platform, *args]) == 0
            route.unroute_attn_res()  # vLLM may have loaded our plugin
        out = capsys.readouterr().out
        kind = "ROCM" if platform else "CUDA"
        assert f"resolved for a {kind} platform stand-in (no GPU here)" in out, out
        assert re.search(r"route +eager: .*" + re.escape(graphs), out), out
    assert command.main(["--platform", "tpu", *args]) == 2
    assert "--platform 'tpu': pass one of cuda, rocm" in capsys.readouterr().err
