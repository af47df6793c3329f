"""A shared on-disk Inductor cache never serves a graph compiled under another stream.

Three separate Python processes share one cache directory (``TORCHINDUCTOR_CACHE_DIR=
tmp_path``; FX graph cache and AOTAutograd cache on, ``force_disable_caches`` off) and
compile one after another: a small K3 in the attn_res stream, then the prefix stream,
then attn_res again, each forked, once the one before it has exited, from one parent that
did the imports (tests/helpers/process.py). Each prints, as JSON, how far its taps are from each
stream's expected values (``ground_truth`` for attn_res, the eager forward's running
prefix for prefix) and its ``counters["inductor"]`` / ``counters["aot_autograd"]``.

Asserted: every process gets its own stream's taps; no cache bypass anywhere (the pass
manager is a ``CustomGraphPass`` with a ``uuid()``); the first two miss; the third is
served from the cache (``fxgraph_cache_hit >= 1``) and still gets attn_res taps.

The key also covers the code: each pass's ``uuid()`` hashes its module, every
kimi_passes module it imports and every package ``__init__`` on the way. The last tests
point the hash at copies of the sources and edit one: each module of the closure,
``__init__`` files included, edited alone changes the key.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch
from helpers.op import OP_TOL
from helpers.process import one_after_another

from kimi_passes.fusion import AttnResFusionPass
from kimi_passes.fx import cache_key
from kimi_passes.pipeline import pass_manager
from kimi_passes.taps.aux_stream import AuxStreamPass

SCRIPT = r"""
import json, sys
import torch
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config

import kimi_passes
from kimi_passes.graphs.k3 import K3Config, K3Model

stream = sys.argv[1]
inductor_config.fx_graph_cache = True
inductor_config.force_disable_caches = False
inductor_config.compile_threads = 1
inductor_config.fallback_by_default = True  # ATen calls: which graph is served is the question
torch._functorch.config.enable_autograd_cache = True

cfg = K3Config(num_layers=2, hidden_size=16, attn_res_block_size=1, num_heads=2,
               intermediate_size=32, vocab_size=64, aux_layer_ids=(0, 1, 2))
model = K3Model(cfg)
x = torch.arange(7) % cfg.vocab_size
with torch.no_grad():
    _, prefix = model(x)  # eager aux_tap is the identity: the running prefix
    _, mixed = model.ground_truth(x)
    backend = kimi_passes.make_kimi_backend(aux_stream=stream)
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    _, got = compiled(x)

def err(a, b):
    return [float((p - q).abs().max()) for p, q in zip(a, b, strict=True)]

print("RESULT " + json.dumps({
    "stream": stream,
    "capture_ids": list(model.capture_ids),
    "err_vs_attn_res": err(got, mixed),
    "err_vs_prefix": err(got, prefix),
    "attn_res_vs_prefix": err(mixed, prefix),
    "inductor": dict(counters["inductor"]),
    "aot_autograd": dict(counters["aot_autograd"]),
}))
"""

TOL = OP_TOL[torch.float32]  # fp32 taps: the op's tolerance
TIMEOUT_S = 300


def result(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, stdout
    return json.loads(lines[0].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHINDUCTOR_", "KIMI_PASSES_"))}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor_cache"))
    streams = ("attn_res", "prefix", "attn_res")
    outputs = one_after_another([[sys.executable, "-c", SCRIPT, s] for s in streams], env,
                                TIMEOUT_S)
    return [result(out) for out in outputs]


def test_each_process_gets_its_own_streams_taps(runs):
    for i, r in enumerate(runs):
        own = r["err_vs_attn_res"] if r["stream"] == "attn_res" else r["err_vs_prefix"]
        other = r["err_vs_prefix"] if r["stream"] == "attn_res" else r["err_vs_attn_res"]
        assert max(own) <= TOL, f"process {i} ({r['stream']}): {r}"
        # The two streams are told apart: some tap differs by far more than the tolerance.
        assert max(other) > 1e-2, f"process {i}: streams indistinguishable: {r}"


def test_no_bypass_and_the_third_process_hits_the_cache(runs):
    first, second, third = (r["inductor"] for r in runs)
    for i, c in enumerate((first, second, third)):
        assert c.get("fxgraph_cache_bypass", 0) == 0, f"process {i} bypassed: {runs[i]}"
    assert first.get("fxgraph_cache_miss", 0) >= 1 and first.get("fxgraph_cache_hit", 0) == 0
    # Another stream, another uuid(), another key: the attn_res graph is not served.
    assert second.get("fxgraph_cache_miss", 0) >= 1 and second.get("fxgraph_cache_hit", 0) == 0
    assert third.get("fxgraph_cache_hit", 0) >= 1, runs[2]
    assert third.get("fxgraph_cache_miss", 0) == 0, runs[2]


def test_aot_autograd_cache_agrees(runs):
    """Recorded alongside: the AOTAutograd cache (keyed on the same pass uuid) never
    bypasses, and whatever it serves in the third process is the attn_res graph."""
    for i, r in enumerate(runs):
        assert r["aot_autograd"].get("autograd_cache_bypass", 0) == 0, f"process {i}: {r}"
    assert runs[1]["aot_autograd"].get("autograd_cache_hit", 0) == 0, runs[1]


# --------------------------------------------------------------------------- code in the key

PASSES = {"aux_stream": lambda: AuxStreamPass("attn_res"), "fusion": AttnResFusionPass,
          "manager": lambda: pass_manager(aux_stream="attn_res")}


@pytest.fixture
def source_copies(tmp_path, monkeypatch):
    """Hash copies of the sources (made on first use) instead of the installed files."""
    copies = {}
    real = cache_key.module_path

    def locate(name):
        if name not in copies:
            copies[name] = tmp_path / f"{name}.py"
            copies[name].write_bytes(real(name).read_bytes())
        return copies[name]

    monkeypatch.setattr(cache_key, "module_path", locate)
    return locate


@pytest.mark.parametrize("edited", ["kimi_passes.fx.kimi_calls",
                                    "kimi_passes.fx.fx_toolkit"])
@pytest.mark.parametrize("which", sorted(PASSES))
def test_an_edit_to_a_dependency_changes_the_key(source_copies, which, edited):
    p = PASSES[which]()
    before = p.uuid()
    assert p.uuid() == before  # stable while nothing changes
    path = source_copies(edited)
    path.write_text(path.read_text() + "\n# an edit\n")
    assert p.uuid() != before, f"{which}'s key ignores an edit to {edited}"


@pytest.mark.parametrize("which", ["aux_stream", "fusion"])
def test_an_edit_elsewhere_keeps_the_key(source_copies, which):
    """The key follows imports: a module no pass's import runs (the main job) is not in it."""
    p = PASSES[which]()
    before = p.uuid()
    path = source_copies("kimi_passes.__main__")
    path.write_text(path.read_text() + "\n# an edit\n")
    assert p.uuid() == before


def test_the_key_names_the_modules_a_rewrite_runs():
    aux, fusion = AuxStreamPass().source_modules(), AttnResFusionPass().source_modules()
    for needed in ("kimi_passes.fx.kimi_calls", "kimi_passes.fx.fx_toolkit",
                   "kimi_passes.fx.base", "kimi_passes.ops.library"):
        assert needed in aux and needed in fusion, needed
    assert {"kimi_passes.fusion.evaluator", "kimi_passes.fusion.rewrite"} <= set(fusion)
    assert "kimi_passes.taps.aux_stream" in aux and "kimi_passes.__main__" not in aux
    assert {"kimi_passes", "kimi_passes.taps"} <= set(aux)  # the packages on the way
    assert "kimi_passes.taps.consumer" in aux


def test_options_and_pass_name_are_in_the_key():
    assert AuxStreamPass("attn_res").uuid() != AuxStreamPass("prefix").uuid()
    assert AuxStreamPass(fuse=True).uuid() != AuxStreamPass(fuse=False).uuid()
    assert AttnResFusionPass(debug=True).uuid() == AttnResFusionPass(debug=False).uuid()


def test_every_option_of_the_record_is_in_the_managers_key():
    """KimiPassConfig's key is part of the manager's uuid(): each option, flipped alone,
    changes it (lower_kimi_ops and the drafter's ids included)."""
    from kimi_passes.config import KimiPassConfig

    base = KimiPassConfig()
    flipped = [dataclasses.replace(base, **{f.name: not getattr(base, f.name)})
               for f in dataclasses.fields(base) if f.type == "bool"]
    flipped += [dataclasses.replace(base, aux_stream="prefix"),
                KimiPassConfig.build(draft_config={"eagle_aux_hidden_state_layer_ids": [1, 2]})]
    assert len(flipped) == len(dataclasses.fields(base))  # every field, once
    keys = {pass_manager(c).uuid() for c in [base, *flipped]}
    assert len(keys) == len(flipped) + 1
    assert pass_manager(base).uuid() == pass_manager(KimiPassConfig()).uuid()  # stable



def _closure() -> list[str]:
    """Every module in the manager's key (each of its passes' closure) and every package
    ``__init__`` on the way to one, named here, not by the code under test."""
    manager = PASSES["manager"]()
    passes = manager.passes + ([manager.lowering] if manager.lowering is not None else [])
    modules = {m for p in passes for m in p.source_modules()}
    return sorted(modules | {m.rsplit(".", i)[0] for m in modules
                             for i in range(1, m.count(".") + 1)})


def test_the_closure_holds_every_package_init_on_the_way():
    """Importing ``a.b.c`` runs ``a`` and ``a.b`` first: their ``__init__`` is in the key."""
    for make in (PASSES["aux_stream"], PASSES["fusion"]):
        modules = set(make().source_modules())
        missing = {p for m in modules for p in cache_key.packages_above(m)} - modules
        assert not missing, f"{type(make()).__name__}'s key misses the packages {missing}"
        assert {"kimi_passes", "kimi_passes.taps"} <= modules


@pytest.fixture(scope="module")
def keys_now():
    """Each pass and its key on the sources as they are."""
    passes = {name: make() for name, make in PASSES.items()}
    return passes, {name: p.uuid() for name, p in passes.items()}


@pytest.mark.parametrize("edited", _closure())
def test_an_edit_to_any_module_in_the_closure_changes_the_key(keys_now, tmp_path, monkeypatch,
                                                               edited):
    """Each module (``__init__`` files included) edited alone changes the key of every pass
    whose closure holds it; the manager's key holds them all. Only the edited module is
    read from a copy (the others keep their parsed imports: the test stays cheap)."""
    passes, before = keys_now
    real = cache_key.module_path
    copy = tmp_path / f"{edited}.py"
    copy.write_bytes(real(edited).read_bytes() + b"\n# an edit\n")
    monkeypatch.setattr(cache_key, "module_path", lambda name: copy if name == edited
                        else real(name))
    after = {name: p.uuid() for name, p in passes.items()}
    assert after["manager"] != before["manager"], f"the manager's key ignores {edited}"
    for name in ("aux_stream", "fusion"):
        if edited in passes[name].source_modules():
            assert after[name] != before[name], f"{name}'s key ignores an edit to {edited}"
