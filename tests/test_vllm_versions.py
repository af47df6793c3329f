"""The vLLM versions kimi_passes is tested on, what it reads from each one's API, and the
route's refusal of a vLLM whose K3 changed (``kimi_passes.vllm.versions``, ``k3.surface``).

Run on the installed vLLM (CI: 0.34.0 whole, 0.33.0 in the compatibility step): each
version's facts are asserted where that version is installed, from the version's number
(the expected values are vLLM's documented behaviour, not what kimi_passes computes).

Stand-ins (no GPU here): an untested vLLM is ``versions.installed_version`` answering
another number (vLLM itself is the installed one); a changed K3 is a stand-in
``KimiLinearModel`` class (vLLM's own class with one method renamed or re-signed) put where
vLLM's module holds it, or a stand-in ``attn_res``; a changed call site is a small package
written here (never a copy of vLLM's files); the platform is a CUDA or ROCm stand-in and
the drafter vLLM's ``SpeculativeConfig`` without its checkpoint (tests/helpers/
vllm_harness.py).
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import sys
import types
from unittest import mock

import pytest

if importlib.util.find_spec("vllm") is None:  # test_vllm_required.py fails on CI then
    pytest.skip("vLLM is not installed (bash tools/install_vllm.sh installs it)",
                allow_module_level=True)

import helpers.vllm_harness as vh  # noqa: E402

import kimi_passes.graphs.vllm_k3 as h  # noqa: E402
import kimi_passes.vllm.k3.route as route  # noqa: E402
from kimi_passes.vllm import versions  # noqa: E402
from kimi_passes.vllm.k3 import surface  # noqa: E402
from kimi_passes.vllm.k3.plan import serving_plan  # noqa: E402
from kimi_passes.vllm.k3.stream import VllmRouteError  # noqa: E402

pytestmark = pytest.mark.vllm

#: What the installed vLLM is, by release: 0.33.0 or 0.34.x (CI installs one of them).
RELEASE = versions.release(versions.installed_version())
V34 = RELEASE[:2] == (0, 34)


def test_the_installed_vllm_is_a_tested_one():
    assert RELEASE[:2] in ((0, 33), (0, 34)), versions.installed_version()
    assert versions.untested_warning(versions.installed_version()) is None


@pytest.mark.parametrize("version", ["0.32.9", "0.35.0", "0.35.0rc1", "1.0.0"])
def test_an_untested_vllm_is_named_at_startup(version, monkeypatch, caplog):
    """Below 0.33.0 or above 0.34.x: the first K3 model's init logs a warning naming the
    installed and the tested versions, once per process; inside the range, none."""
    for tested in ("0.33.0", "0.34.0", "0.34.7.dev2+g1234"):
        assert versions.untested_warning(tested) is None, tested
    monkeypatch.setattr(versions, "installed_version", lambda: version)
    monkeypatch.setattr(versions, "_warned", set())
    h.vllm_modules()
    with caplog.at_level(logging.WARNING, logger="kimi_passes"):
        for _ in range(2):  # two K3 inits in one process
            vh.start_route("attn_res")
            route.unroute_attn_res()
    said = [r.getMessage() for r in caplog.records if "outside the versions" in r.getMessage()]
    assert len(said) == 1, said
    assert f"vLLM {version} is outside the versions kimi_passes is tested on (0.33.0, " \
           "0.34.0; 0.34.x)" in said[0]
    assert "bash tools/install_vllm.sh 0.34.0" in said[0]


def test_a_vllm_version_that_is_no_version_is_an_error():
    with pytest.raises(ValueError, match=r"cannot read vLLM's version 'dev' .*reinstall"):
        versions.release("dev")


# ------------------------------------------- a changed K3, refused at the first K3 init

def _renamed(cls: type, name: str, new: str) -> type:
    """vLLM's ``cls`` with method ``name`` renamed ``new`` (a stand-in class)."""
    body = {k: v for k, v in vars(cls).items() if k not in (name, "__dict__", "__weakref__")}
    return type(cls.__name__, cls.__bases__, {**body, new: vars(cls)[name]})


def _resigned(cls: type, name: str) -> type:
    """vLLM's ``cls`` whose method ``name`` takes one parameter more (a stand-in class)."""
    own = getattr(cls, name)

    def method(self, *args, stream=None, **kwargs):
        return own(self, *args, **kwargs)

    sig = inspect.signature(own)
    stream = inspect.Parameter("stream", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)
    method.__signature__ = sig.replace(  # type: ignore[attr-defined]
        parameters=[*sig.parameters.values(), stream])
    return type(cls.__name__, (cls,), {name: method, "__module__": cls.__module__})


def _changed(vendor: str, change: str):
    """``(module, name, stand-in, the change the error must name)`` for one changed K3."""
    nvidia, amd = h.vllm_modules()
    module = nvidia if vendor == "nvidia" else amd
    cls = module.KimiLinearModel
    capture = surface.CAPTURE[vendor]
    where = f"{module.__name__}.KimiLinearModel"
    if change == "renamed":
        return (module, "KimiLinearModel", _renamed(cls, capture, capture + "_v2"),
                rf"{where} has no method {capture} \(renamed or removed")
    if change == "new parameter":
        return (module, "KimiLinearModel", _resigned(cls, capture),
                rf"{where}.{capture} takes \(self, .*, stream=None\), written for \(self, ")
    return (module, "attn_res", lambda prefix, delta, blocks: prefix,
            rf"{module.__name__}.attn_res takes \(prefix, delta, blocks\), the route's "
            r"\(prefix, delta, blocks, norm_weight")


@pytest.mark.parametrize("vendor", ["nvidia", "amd"])
@pytest.mark.parametrize("change", ["renamed", "new parameter", "attn_res"])
def test_vllm_startup_refuses_a_changed_k3(vendor, change):
    """A renamed capture method, one with a new parameter, an ``attn_res`` with other
    parameters: the first K3 init under the stream (``k3.route.activate``) raises naming
    the change and the tested versions, and nothing of vLLM's is routed or wrapped."""
    module, name, stand_in, says = _changed(vendor, change)
    own_attn_res = {m: vars(sys.modules[m])["attn_res"] for m in route.ROUTES}
    with mock.patch.object(module, name, stand_in), pytest.raises(
            surface.K3SurfaceError, match=rf"Kimi K3 is not the one the route was written "
                                             rf"for \(vLLM 0.33.0, 0.34.0\): .*{says}.*"
                                             r"unset \$KIMI_PASSES_AUX_STREAM"):
        vh.start_route("attn_res")
    routed = route.current()
    assert {m: vars(sys.modules[m])["attn_res"] for m in route.ROUTES} == own_attn_res
    assert routed is not None and not routed.originals and not routed.own
    # Only the init wrap (armed at the K3 import, before any stream is asked) is installed.
    assert {attr for _, attr in routed.class_originals} <= {"__init__"}
    route.unroute_attn_res()


def test_vllm_k3_record_is_what_the_route_wraps():
    """``surface.METHODS`` names exactly the methods the route wraps, per vendor."""
    for vendor in ("nvidia", "amd"):
        wrapped = {*route._methods(route.EagerRoute(), vendor), "__init__"}
        assert set(surface.METHODS[vendor]) == wrapped
        assert surface.CAPTURE[vendor] in surface.METHODS[vendor]


# ------------------------------------------------------------------- the capture call sites

def test_the_installed_vllm_k3_capture_call_sites():
    """vLLM's K3 captures in ``KimiLinearModel.forward``; 0.34.0's specialized decode also
    calls the NVIDIA capture in its wide and hybrid steps (a backend the plan refuses)."""
    root = surface.package_root()
    nvidia = {"nvidia/model.py:KimiLinearModel.forward"}
    if V34:
        nvidia |= {"nvidia/specialized_decode/runtime/decode.py:SpecializedDecode.run_wide",
                   "nvidia/specialized_decode/runtime/hybrid.py:HybridStep.run"}
    assert surface.call_sites(root, "_capture_aux_hidden_stream") == nvidia
    assert surface.call_sites(root, "_maybe_add_hidden_state") == {
        "amd/linear.py:KimiLinearModel.forward",
        "amd/linear.py:KimiLinearModel._maybe_add_hidden_state"}
    with pytest.raises(VllmRouteError, match="specialized decode"):
        config, env = vh.resolved_k3({}, None, extra={"decode_backend": "latency_specialized"})
        with mock.patch.dict("os.environ", env, clear=True):
            serving_plan(config, stream="attn_res", sequence_parallel=False)


FORWARD = """
class KimiLinearModel:
    def forward(self, x):
        return self._capture_aux_hidden_stream(0, x, None, x)
"""
ELSEWHERE = """
def draft_step(backbone, x):
    return backbone._capture_aux_hidden_stream(0, x, None, x)
"""


def test_vllm_k3_new_capture_call_site_is_refused(tmp_path):
    """A stand-in K3 package (written here): a capture called from a new function, and a
    ``forward`` that no longer calls it, are each named."""
    (tmp_path / "nvidia").mkdir()
    (tmp_path / "nvidia" / "model.py").write_text(FORWARD)
    assert surface.site_changes("nvidia", tmp_path) == []
    (tmp_path / "nvidia" / "draft.py").write_text(ELSEWHERE)
    assert surface.site_changes("nvidia", tmp_path) == [
        "_capture_aux_hidden_stream is called from ['nvidia/draft.py:draft_step'], where the "
        "route does not check that each capture found its consumer"]
    (tmp_path / "nvidia" / "model.py").write_text(FORWARD.replace("_capture", "_take"))
    assert surface.site_changes("nvidia", tmp_path)[0] == (
        "nvidia/model.py:KimiLinearModel.forward no longer calls _capture_aux_hidden_stream: "
        "its captures would not reach the route")
    h.vllm_modules()
    with pytest.raises(surface.K3SurfaceError, match=r"nvidia/draft.py:draft_step"):
        surface.check(route.ROUTES, root=tmp_path)


# ------------------------------------------------- each vLLM's own API: graphs, drafters

@pytest.mark.parametrize("rocm", [False, True])
def test_the_startup_line_says_what_vllm_resolved(rocm):
    """Breakable CUDA graphs as vLLM resolved them (0.34.0: the config; 0.33.0: the
    variable it wrote): K3's default on NVIDIA, off with the variable 0 or on ROCm."""
    for breakable, want in ((None, not rocm), ("0", False), ("1", True)):
        config, env = vh.resolved_k3({}, breakable, rocm=rocm)
        with mock.patch.dict("os.environ", env, clear=True):
            assert versions.breakable_cudagraphs(config) is want, (breakable, rocm)
            why = serving_plan(config, stream="attn_res", sequence_parallel=False).why
        assert ("(no breakable CUDA graphs)" not in why) is want, why
        if V34:  # the variable is not where 0.34.0 keeps its answer
            assert config.compilation_config.use_breakable_cudagraph is want
            assert env.get(vh.BREAKABLE) == breakable


def test_k3_architectures_as_vllm_registers_them():
    """K3 on every tested vLLM; K3.1 from 0.34.0 on, served by the same K3 classes and
    resolved as K3 is (breakable CUDA graphs on NVIDIA: the eager route)."""
    from vllm.model_executor.models.registry import ModelRegistry

    kimi = {a for a in ModelRegistry.get_supported_archs() if a.startswith("KimiK3")}
    assert kimi == ({vh.K3, vh.K31} if V34 else {vh.K3}) | {"KimiK3MTPModel"}
    for arch in sorted(kimi - {"KimiK3MTPModel"}):
        entry = ModelRegistry.models[arch]
        assert (entry.module_name, entry.class_name) == ("vllm.models.kimi_k3", vh.K3), arch
        config, env = vh.resolved_k3({"mode": 1, "backend": "kimi"}, None, architecture=arch)
        with mock.patch.dict("os.environ", env, clear=True):
            plan = serving_plan(config, stream="attn_res", sequence_parallel=False)
        assert plan.route == "eager" and "(breakable CUDA graphs)" in plan.why, (arch, plan)


DFLASH2 = "vllm.v1.worker.gpu.spec_decode.dflash2.config.DFlash2SpeculatorConfig"


def _drafter(method: str, speculator_class: str | None = None, **hf):
    ids = {"eagle_aux_hidden_state_layer_ids": [1, 3], **hf}
    return vh.speculative_config(method, types.SimpleNamespace(to_dict=lambda: ids, **ids),
                                 speculator_class)


def test_a_dflash2_drafter_is_vllms_dflash_reading_aux_states():
    """A DFlash2 drafter is served as method ``dflash``; on 0.34.0 its model declares
    ``DFlash2SpeculatorConfig``, which vLLM resolves and which reads aux states."""
    spec = _drafter("dflash", DFLASH2 if V34 else None)
    if V34:
        assert type(spec.speculator_config).__name__ == "DFlash2SpeculatorConfig"
    assert versions.drafter_reads_aux(spec) is True


@pytest.mark.parametrize(("method", "hf", "reads"), [
    ("eagle3", {}, True),
    ("eagle3", {"eagle_config": {"use_aux_hidden_state": False}}, False),
    ("dflash", {}, True), ("dspark", {}, True), ("extract_hidden_states", {}, True),
    ("eagle", {}, False)], ids=["eagle3", "eagle3-opted-out", "dflash", "dspark",
                                "extract_hidden_states", "eagle"])
def test_the_served_drafter_as_vllm_decides_it(method, hf, reads):
    """The compile pass checks the drafter vLLM serves where vLLM feeds it aux hidden
    states (0.34.0 ``uses_aux_hidden_states``, 0.33.0 ``requires_aux_hidden_states``):
    an eagle3 drafter opting out (``use_aux_hidden_state: false``) is not checked; DFlash2
    drafters are served as method ``dflash``."""
    from vllm.config import set_current_vllm_config

    from kimi_passes.vllm import served_drafter

    spec = _drafter(method, **hf)
    assert versions.drafter_reads_aux(spec) is reads
    config = vh.vllm_config()
    object.__setattr__(config, "speculative_config", spec)
    with set_current_vllm_config(config):
        drafter = served_drafter()
    assert (drafter.capture_ids if drafter else None) == ((1, 3) if reads else None)
