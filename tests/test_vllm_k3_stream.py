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
from helpers.vllm_harness import load_vllm_plugins, vllm_log_records  # noqa: E402

import kimi_passes.graphs.vllm_k3 as h  # noqa: E402
import kimi_passes.vllm.k3.route as route  # noqa: E402
from kimi_passes.config.checkpoint import CheckpointError  # noqa: E402
from kimi_passes.config.stream import AB_VAR, ENV_VAR  # noqa: E402
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
            built[key] = resolved(serve_args(method, declared, tmp, *extra), **env)
        return built[key]

    return config


def resolved(args: list[str], **env):
    """vLLM's resolved ``VllmConfig`` for ``vllm serve args`` on a CUDA stand-in, offline."""
    with environ(**{**CLEAN, "HF_HUB_OFFLINE": "1", "VLLM_USE_V2_MODEL_RUNNER": "1", **env}):
        try:
            return command.engine_config(args, "cuda")
        finally:
            route.unroute_attn_res()  # vLLM may have loaded our plugin


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
    calls = h.Calls()
    own = calls.wrap(h.vllm_attn_res())
    with vllm_log_records() as lines, h.with_own_attn_res(own, own), \
            k3_process(engine("dflash", "attn_res")) as init:
        assert init._kimi_passes_plan.stream == "attn_res"
        model = h.build(spec, h.weights(spec), ids)
        with calls:
            got = h.aux_of(h.call(model, h.token_ids(spec, T)))
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


# ------------------------------------------------- the checkpoint's word, as it ships

SPECULATORS = ROOT / "tests" / "data" / "speculators"
#: The speculators 0.9.0 formats vLLM detects and serves with K3, and the method it picks.
DETECTED = {"eagle3": "eagle3", "dflash": "dflash", "dflash2": "dflash", "dspark": "dspark"}


def speculators_folder(tmp: Path, fmt: str, declared: str | None, **places) -> Path:
    """A speculators-format drafter checkpoint (``tests/data/speculators``, as speculators
    writes it) declaring ``declared`` at its top level (None: no declaration); ``places``:
    sections given an ``aux_hidden_stream`` too."""
    config = json.loads((SPECULATORS / fmt / "config.json").read_text())
    if declared is not None:
        config["aux_hidden_stream"] = declared
    for section, value in places.items():
        config.setdefault(section, {})["aux_hidden_stream"] = value
    folder = tmp / f"speculators-{fmt}-{declared}-{'-'.join(places)}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def served_config(model: str, **spec):
    """``resolved`` for K3 serving the drafter ``model`` (``spec``: more of its config)."""
    return resolved([str(K3), "--speculative-config",
                     json.dumps({"model": model, "num_speculative_tokens": 3, **spec})])


@pytest.mark.parametrize("fmt", list(DETECTED))
def test_vllm_k3_speculators_drafter_declares_from_its_file(drafters, fmt):
    """A speculators-format drafter: vLLM detects its method and converts its config,
    dropping ``aux_hidden_stream``; the stream is still the one its ``config.json``
    declares (None: vLLM's default), and the plan names that file."""
    for declared in ("attn_res", "prefix", None):
        folder = speculators_folder(drafters, fmt, declared)
        config = served_config(str(folder))
        spec = config.speculative_config
        assert spec.method == DETECTED[fmt]
        assert "aux_hidden_stream" not in spec.draft_model_config.hf_config.to_dict()
        with k3_process(config) as model:
            plan = model._kimi_passes_plan
        if declared is None:
            assert (plan.stream, plan.source) == (
                "prefix", "vLLM's default (no source asks for a stream)"), plan
        else:
            assert plan.stream == declared, (fmt, plan)
            assert plan.source == (f"the {DETECTED[fmt]} drafter's config "
                                   f"{folder / 'config.json'}: aux_hidden_stream = "
                                   f"{declared!r}"), plan.source


def test_vllm_k3_speculators_peagle_is_vllms_to_decide(drafters):
    """P-EAGLE's speculators layout: vLLM 0.34.0 refuses it itself, before any code of
    ours; 0.33.0 serves it as method ``eagle``, which it feeds no aux states, so nothing
    reads the declaration and vLLM's default stays."""
    from kimi_passes.vllm import versions

    folder = speculators_folder(drafters, "peagle", "attn_res")
    if versions.release(versions.installed_version())[:2] == (0, 34):
        with pytest.raises(ValueError, match="P-EAGLE .* is not supported"):
            served_config(str(folder))
        return
    config = served_config(str(folder))
    assert config.speculative_config.method == "eagle"
    assert not versions.drafter_reads_aux(config.speculative_config)
    with k3_process(config) as model:
        assert model._kimi_passes_plan.source == "vLLM's default (no source asks for a stream)"


def test_vllm_k3_declaration_places_and_unreadable_file(drafters):
    """Top level and ``speculators_config`` agreeing: one declaration, both named; one
    that disagrees: refused naming both; the file gone after vLLM read it: refused
    naming the path, never "no declaration"."""
    folder = speculators_folder(drafters, "dflash", "attn_res", speculators_config="attn_res")
    with k3_process(served_config(str(folder))) as model:
        assert model._kimi_passes_plan.source.endswith(
            "aux_hidden_stream and the dflash drafter's config "
            f"{folder / 'config.json'}: speculators_config.aux_hidden_stream = 'attn_res'")
    folder = speculators_folder(drafters, "dflash", "attn_res", dflash_config="prefix")
    config = served_config(str(folder))
    with pytest.raises(CheckpointError, match=(
            r"declares two aux streams \(.*: aux_hidden_stream = 'attn_res'; .*: "
            r"dflash_config.aux_hidden_stream = 'prefix'\)")):
        with k3_process(config):
            pass
    folder = speculators_folder(drafters, "eagle3", "attn_res")
    config = served_config(str(folder))
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match=re.escape(
            f"drafter config {folder / 'config.json'} does not exist")):
        with k3_process(config):
            pass


def test_vllm_k3_hub_drafter_from_an_offline_cache(tmp_path):
    """A drafter named by hub id, resolved by vLLM from the Hugging Face cache offline:
    the declaration is read from the snapshot of the revision vLLM resolved."""
    import huggingface_hub.constants as hub

    repo = tmp_path / "models--kimi-test--dflash-drafter"
    shas = {"attn_res": "a" * 40, "prefix": "b" * 40}
    for declared, sha in shas.items():
        speculators_folder(repo / "snapshots", "dflash", declared).rename(
            repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(shas["attn_res"])
    # huggingface_hub read both variables at import: the cache and offline mode patched
    with mock.patch.multiple(hub, HF_HUB_CACHE=str(tmp_path), HF_HUB_OFFLINE=True):
        for revision, declared in (({}, "attn_res"), ({"revision": shas["prefix"]}, "prefix")):
            config = served_config("kimi-test/dflash-drafter", **revision)
            with k3_process(config) as model:
                plan = model._kimi_passes_plan
            sha = shas[declared]
            assert plan.stream == declared
            assert f"{repo / 'snapshots' / sha / 'config.json'}: aux_hidden_stream" in \
                plan.source, plan.source


def test_vllm_k3_speculators_drafter_is_served_its_stream(drafters):
    """Only the plugin installed: a speculators DFlash drafter declaring attn_res gets the
    mixture (vLLM's own flag-on forward, unrouted), 4 fused captures; one declaring
    prefix gets vLLM's own values, bit for bit, and nothing of ours runs."""
    T, spec, ids = 4, h.Spec(), (0, 2, 3, 5, 6)
    tokens = h.token_ids(spec, T)
    for declared, flag in (("attn_res", True), ("prefix", False)):
        with h.with_own_attn_res(h.vllm_attn_res(), h.vllm_amd_attn_res()), h.flag(flag):
            want = h.aux_of(h.call(h.build(spec, h.weights(spec), ids), tokens))
        calls = h.Calls()
        own = calls.wrap(h.vllm_attn_res())
        config = served_config(str(speculators_folder(drafters, "dflash", declared)))
        with h.with_own_attn_res(own, own), k3_process(config) as init:
            assert init._kimi_passes_plan.stream == declared
            model = h.build(spec, h.weights(spec), ids)
            with calls:
                got = h.aux_of(h.call(model, tokens))
        if declared == "attn_res":
            assert calls.kimi == ["attn_res_capture"] * 4 and "pure" not in calls.own
            tol = OP_TOL[torch.float32]
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, atol=tol, rtol=tol)
        else:
            assert calls.kimi == [], calls.kimi
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w)


def test_vllm_k3_ab_switch(drafters, capsys):
    """Our variable against the drafter's declaration: refused, naming the switch; with
    ``$KIMI_PASSES_AUX_STREAM_AB=1`` the variable's stream is served, a WARNING names the
    declaration and the override, and ``vllm-plan`` shows the A/B run."""
    folder = speculators_folder(drafters, "dflash", "attn_res")
    config = served_config(str(folder))
    with pytest.raises(StreamConflict, match=re.escape(
            f"${ENV_VAR}=prefix asks for 'prefix', the dflash drafter's config "
            f"{folder / 'config.json'}: aux_hidden_stream = 'attn_res' asks for 'attn_res'")
            + f".*set \\${AB_VAR}=1"):
        with k3_process(config, **{ENV_VAR: "prefix"}):
            pass
    with vllm_log_records() as lines, \
            k3_process(config, **{ENV_VAR: "prefix", AB_VAR: "1"}) as model:
        plan = model._kimi_passes_plan
    assert plan.stream == "prefix" and "overriding the dflash drafter's config" in plan.source
    [warning] = [r.getMessage() for r in lines if r.levelno == logging.WARNING
                 and "A/B run" in r.getMessage()]
    assert warning.startswith(f"kimi_passes: A/B run (${AB_VAR}=1): serving the prefix stream "
                              f"(${ENV_VAR}=prefix) to a drafter whose checkpoint declares "
                              f"'attn_res' (the dflash drafter's config {folder}"), warning
    args = [str(K3), "--speculative-config",
            json.dumps({"model": str(folder), "num_speculative_tokens": 3})]
    with environ(**{**CLEAN, ENV_VAR: "prefix", AB_VAR: "1"}):
        assert command.main(args) == 0
        route.unroute_attn_res()
    out = capsys.readouterr().out
    assert re.search(r"A/B run +kimi_passes: A/B run", out), out
    assert re.search(r"declaration +'attn_res', read from the dflash drafter's config "
                     + re.escape(str(folder / "config.json")), out), out
