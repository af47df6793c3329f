"""kimi_passes inside vLLM's real compile path (vLLM 0.33.0, 0.34.0; CPU; helpers/vllm_harness.py).

Each model is compiled through ``@support_torch_compile`` and ``VllmBackend``: Dynamo's
graph is split at the attention custom op listed in ``splitting_ops`` (the number of
pieces is asserted), each piece goes through Inductor with vLLM's ``PostGradPassManager``,
which runs ``kimi_passes.vllm.make_vllm_pass``. Two model shapes x vLLM's default
functionalization (``auto_functionalized`` v1) and v2 x {attn_res fused, attn_res unfused,
prefix}, at Inductor's ``fallback_by_default``, and one case more with C++ kernels
(REAL_CODEGEN); one dynamic graph serves two token counts; every tap is compared with the
eager ground truth, and v1 and v2 taps must be bit-identical. Then: the split refusal, the
string route, and three processes sharing one vLLM cache root.

Without vLLM the module skips (``bash tools/install_vllm.sh`` installs it); with
``KIMI_PASSES_REQUIRE_VLLM=1`` (set by .ci/run) test_vllm_required.py then fails.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import logging
import os
import pickle
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:  # test_vllm_required.py fails on CI then
    pytest.skip("vLLM is not installed (bash tools/install_vllm.sh installs it)",
                allow_module_level=True)

import helpers.vllm_harness as h  # noqa: E402
import torch  # noqa: E402
from helpers.op import OP_TOL  # noqa: E402
from helpers.process import INDUCTOR_SETUP, one_after_another  # noqa: E402
from helpers.readme import bash_lines  # noqa: E402

from kimi_passes import AuxCaptureError  # noqa: E402
from kimi_passes.config.stream import StreamConflict  # noqa: E402
from kimi_passes.graphs.k3 import K3Config  # noqa: E402

HERE = Path(__file__).resolve().parent
TOL = OP_TOL[torch.float32]  # fp32 taps: the op's tolerance

MODELS = {
    # The reference tiny K3: 4 layers, 2 blocks of 2, H=64, taps 0, 2 (a write), 3, L=4.
    "k3_tiny": K3Config.tiny(),
    # Another shape: 3 layers, block size 1 (every layer writes a block), H=32, all taps.
    "l3_s1": K3Config(num_layers=3, hidden_size=32, attn_res_block_size=1, num_heads=4,
                      intermediate_size=64, vocab_size=64, aux_layer_ids=(0, 1, 2, 3),
                      seed=1),
}
# (stream, fuse_capture): fused and not in the attn_res stream; the prefix stream once
# per model, with the fuse option on for one and off for the other (it only keys the cache).
VARIANTS = {"k3_tiny": [("attn_res", True), ("attn_res", False), ("prefix", True)],
            "l3_s1": [("attn_res", True), ("attn_res", False), ("prefix", False)]}
TOKENS = (9, 5)  # two token counts on one dynamic graph
# What a serving process imports before it builds its config (h.main), then what its
# first compile sets up (tests/helpers/process.py).
VLLM_IMPORTS = ("torch", "kimi_passes", "vllm.compilation.decorators", "vllm.config",
                *INDUCTOR_SETUP)
# Every case compiles with Inductor's fallback_by_default, as the golden tests do: the
# split, the post-grad graph and the passes are a full compile's; the lowering calls ATen
# instead of building C++ kernels (about 4x cheaper). One case more builds C++ kernels, as
# served: the reference K3's fused attn_res stream under vLLM's default functionalization
# (v1). (v2's generated kernels are kimi_backend's default, tests/test_taps.py.)
REAL_CODEGEN = ("k3_tiny", False, "attn_res", True)


class _Rewrites(logging.Handler):
    """Collects the aux-stream pass's per-graph INFO line (one per compiled piece)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("AuxStreamPass(stream="):
            self.lines.append(msg)


_RESULTS: dict = {}


@contextlib.contextmanager
def caches_off():
    """vLLM's compile cache and Inductor's caches off: every piece goes through the pass.

    ``force_disable_caches`` alone would make vLLM's AOT path refuse to precompile;
    ``VLLM_DISABLE_COMPILE_CACHE`` (read by vLLM on each use) switches that path off.
    """
    old = os.environ.get("VLLM_DISABLE_COMPILE_CACHE")
    os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    try:
        with torch._inductor.config.patch(force_disable_caches=True):
            yield
    finally:
        if old is None:
            del os.environ["VLLM_DISABLE_COMPILE_CACHE"]
        else:
            os.environ["VLLM_DISABLE_COMPILE_CACHE"] = old


def compiled(name: str, v2: bool, stream: str, fuse: bool, codegen: bool = False) -> dict:
    """Compile once per (model, functionalization, stream, fuse, codegen) and run both
    token counts."""
    key = (name, v2, stream, fuse, codegen)
    if key in _RESULTS:
        return _RESULTS[key]
    from kimi_passes.vllm import compile_config_entries

    cfg = MODELS[name]
    icc = compile_config_entries(stream, fuse_capture=fuse)
    if not codegen:
        icc["fallback_by_default"] = True
    else:
        # Inductor probes which vector ISAs the compiler builds, once per process, in its
        # cache directory: here, where the probes are kept like any kernel build, not in
        # the fresh directory force_disable_caches gives each compile below (6 builds).
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        pick_vec_isa()
    config = h.vllm_config(inductor_compile_config=icc, v2=v2)
    torch._dynamo.reset()
    model = h.compile_k3(cfg, config)
    logger = logging.getLogger("kimi_passes")
    handler, level = _Rewrites(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    counter = h.counter()
    before = counter.clone()
    got, want = {}, {}
    try:
        with caches_off():  # CI starts cold anyway
            for T in TOKENS:
                ids = h.token_ids(cfg, T, seed=T)
                got[T] = h.run(model, config, ids)[1]
                with torch.no_grad():
                    want[T] = (h.ground_truth(model, ids) if stream == "attn_res"
                               else list(model.k3(ids)[1]))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    _RESULTS[key] = {
        "cfg": cfg, "got": got, "want": want, "rewrites": handler.lines,
        "pieces": counter.num_piecewise_graphs_seen - before.num_piecewise_graphs_seen,
        "compiled_pieces": (counter.num_piecewise_capturable_graphs_seen
                            - before.num_piecewise_capturable_graphs_seen),
        "graphs": counter.num_graphs_seen - before.num_graphs_seen,
    }
    return _RESULTS[key]


CASES = [pytest.param(name, v2, stream, fuse, False,
                      id=f"{name}-{'v2' if v2 else 'v1'}-{stream}-{'fused' if fuse else 'unfused'}")
         for name in MODELS for v2 in (False, True) for stream, fuse in VARIANTS[name]]
CASES.append(pytest.param(*REAL_CODEGEN, True, id="k3_tiny-v1-attn_res-fused-codegen"))


@pytest.mark.parametrize("name,v2,stream,fuse,codegen", CASES)
def test_taps_through_vllm(name, v2, stream, fuse, codegen):
    r = compiled(name, v2, stream, fuse, codegen)
    cfg = r["cfg"]
    L = cfg.num_layers
    # One Dynamo graph, split at the L attention ops: 2L + 1 pieces, L + 1 of them compiled.
    assert r["graphs"] == 1
    assert r["pieces"] == 2 * L + 1
    assert r["compiled_pieces"] == L + 1
    worst = 0.0
    for T in TOKENS:
        got, want = r["got"][T], r["want"][T]
        assert len(got) == len(cfg.aux_layer_ids)
        for k, g, w in zip(cfg.aux_layer_ids, got, want, strict=True):
            assert g.shape == (T, cfg.hidden_size)
            err = (g - w).abs().max().item()
            assert err <= TOL, f"T={T} capture id {k}: max abs err {err:.3g}"
            worst = max(worst, err)
    print(f"{len(TOKENS) * len(cfg.aux_layer_ids)} taps checked, max abs err {worst:.3g}")
    # The pass ran in the pieces holding taps, once per piece, and rewrote every tap.
    ids = sorted(int(m) for line in r["rewrites"] for m in re.findall(r"id (\d+) <-", line))
    assert ids == sorted(cfg.aux_layer_ids)
    how = {"attn_res": "fused" if fuse else "separate attn_res_mix read",
           "prefix": "running prefix"}[stream]
    for line in r["rewrites"]:
        assert f"stream={stream})" in line
        line = re.sub(r" \([0-9.]+ ms\)$", "", line)  # the pass's own timing, logged last
        assert all(h_ == how for h_ in re.findall(r"\(([^()]*)\)(?:;|$)", line)), line


@pytest.mark.parametrize("name,stream,fuse", [
    pytest.param(name, stream, fuse, id=f"{name}-{stream}-{'fused' if fuse else 'unfused'}")
    for name in MODELS for stream, fuse in VARIANTS[name]])
def test_v1_and_v2_taps_bit_identical(name, stream, fuse):
    v1, v2 = compiled(name, False, stream, fuse), compiled(name, True, stream, fuse)
    for T in TOKENS:
        for a, b in zip(v1["got"][T], v2["got"][T], strict=True):
            assert torch.equal(a, b)


def test_split_at_attn_res_is_refused_naming_the_splitting_op():
    """``splitting_ops`` with kimi::attn_res cuts each tap off from its consumer."""
    from kimi_passes.vllm import compile_config_entries

    config = h.vllm_config(inductor_compile_config=compile_config_entries("attn_res"),
                           splitting_ops=(h.ATTENTION_OP, "kimi::attn_res"))
    text = _refusal(MODELS["l3_s1"], config)
    assert "capture id 0 has no consumer in this graph: vLLM's piecewise compilation" in text
    assert "kimi::attn_res" in text
    assert "remove ['kimi::attn_res'] from CompilationConfig.splitting_ops" in text
    assert "pipeline" not in text


def _refusal(cfg, config, end_layer=None) -> str:
    torch._dynamo.reset()
    model = h.compile_k3(cfg, config, end_layer)
    with caches_off(), pytest.raises(Exception) as info:
        h.run(model, config, h.token_ids(cfg, 5))
    text = str(info.value)
    assert "AuxCaptureError" in text or isinstance(info.value, AuxCaptureError), text
    return text


def test_boundary_tap_in_a_piece_names_both_causes():
    """A non-final stage's boundary tap, split at attention only: the message names the
    piecewise split and the pipeline stage, with both remedies."""
    from kimi_passes.vllm import compile_config_entries

    cfg = MODELS["k3_tiny"]
    icc = {**compile_config_entries("attn_res"), "fallback_by_default": True}  # cheap pieces
    text = _refusal(cfg, h.vllm_config(inductor_compile_config=icc), end_layer=2)
    assert ("capture id 2 has no consumer in this graph (it holds AttnRes calls of layers "
            "[1, 2)), one piece of vLLM's piecewise split at splitting_ops "
            f"['{h.ATTENTION_OP}']") in text
    assert "a splitting op sits between the tap and the AttnRes call" in text
    assert "tap capture id 2 on the stage that owns layer 2" in text


@pytest.mark.parametrize("stream", ["attn_res", "prefix"])
def test_split_at_the_tap_marker_is_refused(stream):
    """kimi::aux_tap in splitting_ops would leave every marker uncompiled (the identity)."""
    from kimi_passes.vllm import compile_config_entries

    config = h.vllm_config(inductor_compile_config=compile_config_entries(stream),
                           splitting_ops=(h.ATTENTION_OP, "kimi::aux_tap"))
    text = _refusal(MODELS["l3_s1"], config)
    assert "splitting_ops lists ['kimi::aux_tap']" in text
    assert "remove ['kimi::aux_tap'] from splitting_ops" in text


def test_adapter_object():
    from kimi_passes.pipeline import pass_manager
    from kimi_passes.vllm import InductorPass, KimiVllmPass, make_vllm_pass

    p = make_vllm_pass("prefix", fuse_capture=False)
    assert isinstance(p, InductorPass)
    assert p.uuid() == pass_manager(aux_stream="prefix", fuse_capture=False).uuid()
    assert len({make_vllm_pass(s, fuse_capture=f, fuse_torch_mixing=m, lower_kimi_ops=lo).uuid()
                for s in ("attn_res", "prefix") for f in (True, False)
                for m in (True, False) for lo in (True, False)}) == 16
    assert p.is_applicable_for_range(None)
    q = copy.deepcopy(p)  # vLLM deep-copies its config
    assert isinstance(q, KimiVllmPass) and q is not p and q.manager is not p.manager
    assert (q.config, q.serve_drafter, q.uuid()) == (p.config, True, p.uuid())
    r = pickle.loads(pickle.dumps(p))  # and sends it to worker processes
    assert (r.config, r.serve_drafter, r.uuid()) == (p.config, True, p.uuid())


def test_vllm_config_hash_covers_the_stream_and_options():
    """vLLM names its compile cache directory after the config's hash (``h.config_hash``:
    ``compute_hash`` on vLLM 0.33.0, ``hash_config`` of ``compile_factors`` on 0.34.0)."""
    from kimi_passes.vllm import compile_config_entries

    hashes = {h.config_hash(h.vllm_config(inductor_compile_config=compile_config_entries(
        s, fuse_capture=f))) for s in ("attn_res", "prefix") for f in (True, False)}
    assert len(hashes) == 4


def test_adapter_stream_resolution(monkeypatch, tmp_path):
    from kimi_passes.vllm import make_vllm_pass

    monkeypatch.delenv("KIMI_PASSES_AUX_STREAM", raising=False)
    monkeypatch.delenv("KIMI_PASSES_AUX_STREAM_AB", raising=False)
    draft = tmp_path / "config.json"
    draft.write_text(json.dumps({"aux_hidden_stream": "prefix"}))
    assert make_vllm_pass().aux_stream == "attn_res"
    assert make_vllm_pass(draft_config=str(draft)).aux_stream == "prefix"
    monkeypatch.setenv("KIMI_PASSES_AUX_STREAM", "attn_res")
    with pytest.raises(StreamConflict, match=r"set \$KIMI_PASSES_AUX_STREAM_AB=1"):
        make_vllm_pass(draft_config=str(draft))
    assert make_vllm_pass("prefix").aux_stream == "prefix"
    monkeypatch.setenv("KIMI_PASSES_AUX_STREAM_AB", "1")
    assert make_vllm_pass(draft_config=str(draft)).aux_stream == "attn_res"
    monkeypatch.setenv("KIMI_PASSES_AUX_STREAM", "post_norm")
    with pytest.raises(ValueError, match="unknown aux stream 'post_norm'"):
        make_vllm_pass()


def test_vllm_config_accepts_the_adapter_and_rejects_the_bare_pass():
    """What users write: the adapter is kept as is; a bare AuxStreamPass trips vLLM's assert."""
    from vllm.compilation.backends import VllmBackend

    from kimi_passes import AuxStreamPass
    from kimi_passes.vllm import KimiVllmPass, compile_config_entries

    config = h.vllm_config(inductor_compile_config=compile_config_entries("prefix"))
    installed = config.compilation_config.inductor_compile_config["post_grad_custom_post_pass"]
    assert isinstance(installed, KimiVllmPass) and installed.aux_stream == "prefix"
    VllmBackend(config).configure_post_pass()  # asserts the pass is vLLM's InductorPass
    bare = h.vllm_config(inductor_compile_config={
        "post_grad_custom_post_pass": AuxStreamPass("prefix")})
    with pytest.raises(AssertionError):
        VllmBackend(bare).configure_post_pass()


def test_fixed_stream_passes_keep_the_adapter():
    """``kimi_passes.vllm.<stream>_stream_pass`` given to vLLM: not re-wrapped, and keyed
    apart by stream."""
    import kimi_passes.vllm as kv
    from kimi_passes.vllm import KimiVllmPass

    uuids = set()
    for stream in ("attn_res", "prefix"):
        config = h.vllm_config(inductor_compile_config={
            "post_grad_custom_post_pass": getattr(kv, f"{stream}_stream_pass")})
        p = config.compilation_config.inductor_compile_config["post_grad_custom_post_pass"]
        assert isinstance(p, KimiVllmPass) and p.aux_stream == stream
        uuids.add(p.uuid())
    assert len(uuids) == 2


# A process forked from a parent that imported vLLM and nothing of ours; argv[1]: a JSON of
# the old names to try first, the (route, stream) steps in order, the README's names and
# its `-cc` argument. Prints, per step, whether the name's last word was bound in
# kimi_passes before, and what vLLM resolved it to.
NAMED_PASS_CHILD = r"""
import copy, json, sys
assert not [m for m in sys.modules if m.split(".")[0] == "kimi_passes"], "ours imported"
from vllm.config import CompilationConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

KEY = "post_grad_custom_post_pass"
job = json.loads(sys.argv[1])
out = {"old": {}, "steps": []}
for name in job["old"]:
    try:
        CompilationConfig(inductor_passes={KEY: name})
        out["old"][name] = "resolved"
    except KeyError as e:
        out["old"][name] = repr(e)

def serve(name):
    parser = FlexibleArgumentParser(prog="vllm")  # as `vllm serve` builds it
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    cc = job["cc"].replace(job["names"]["attn_res"], name)
    args = parser.parse_args(["serve", "<model>", "-cc", cc])
    config = AsyncEngineArgs.from_cli_args(args).compilation_config
    return copy.deepcopy(config)  # as create_engine_config takes it

for route, stream in job["steps"]:
    name = job["names"][stream]
    top = sys.modules.get("kimi_passes")
    bound = top is not None and name.rsplit(".", 1)[1] in vars(top)
    if route == "serve":
        config = serve(name)
    else:
        config = CompilationConfig(inductor_passes={KEY: name})
    p = config.inductor_compile_config[KEY]
    out["steps"].append({"route": route, "stream": stream, "bound before": bound,
                         "type": f"{type(p).__module__}.{type(p).__qualname__}",
                         "aux_stream": getattr(p, "aux_stream", None), "uuid": p.uuid()})
from kimi_passes.vllm import make_vllm_pass
out["want"] = {s: make_vllm_pass(aux_stream=s).uuid() for s in ("attn_res", "prefix")}
print(json.dumps(out))
"""


def readme_named_passes() -> tuple[dict[str, str], str]:
    """The README's pass name for each stream, and its ``vllm serve`` line's ``-cc``."""
    text = (HERE.parent / "README.md").read_text()
    names = {s: f"kimi_passes.{s}_stream_pass.{s}_stream_pass" for s in ("attn_res", "prefix")}
    missing = [n for n in names.values() if f'"{n}"' not in text]
    assert not missing, f"README documents no {missing}"
    serve = [line for line in bash_lines(text) if "vllm serve" in line and " -cc " in line]
    assert len(serve) == 1, serve
    words = shlex.split(serve[0])
    cc = words[words.index("-cc") + 1]
    assert names["attn_res"] in cc, cc
    return names, cc


def test_named_passes_resolve_in_a_fresh_vllm_process():
    """README's names, given to vLLM by name in processes that imported nothing of ours:
    the names under ``kimi_passes.vllm`` raise vLLM's ``KeyError`` naming the word it
    missed; each README name resolves, through ``CompilationConfig(inductor_passes=...)``
    and through ``vllm serve``'s parser (``-cc``, then ``AsyncEngineArgs`` and the deep copy
    ``create_engine_config`` makes), to our ``KimiVllmPass`` (not vLLM's
    ``CallableInductorPass``) with its stream's cache key, ``make_vllm_pass``'s; the two
    keys differ. Two processes: each route resolves each stream's name at its first use
    in one of them."""
    names, cc = readme_named_passes()
    old = [f"kimi_passes.vllm.{s}_stream_pass" for s in ("attn_res", "prefix")]
    steps = [[["serve", "attn_res"], ["config", "prefix"]],
             [["config", "attn_res"], ["serve", "prefix"]]]
    jobs = [{"old": old, "steps": steps[0]}, {"old": [], "steps": steps[1]}]
    path = os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}  # this checkout's kimi_passes, where -c runs
    imports = ("vllm.config", "vllm.engine.arg_utils", "vllm.entrypoints.cli.serve")
    outs = [json.loads(out.splitlines()[-1]) for out in one_after_another(
        [[sys.executable, "-c", NAMED_PASS_CHILD, json.dumps({**job, "names": names,
                                                              "cc": cc})] for job in jobs],
        env, timeout=300, imports=imports)]
    for name in old:
        word = name.rsplit(".", 1)[1]
        assert outs[0]["old"][name] == f"KeyError({word!r})", outs[0]["old"]
    for out in outs:
        want = out["want"]
        assert want["attn_res"] != want["prefix"], want
        for step in out["steps"]:
            assert not step["bound before"], step  # the first use of the name here
            assert step["type"] == "kimi_passes.vllm.compile_pass.KimiVllmPass", step
            assert step["aux_stream"] == step["stream"], step
            assert step["uuid"] == want[step["stream"]], (step, want)
    assert [[[s["route"], s["stream"]] for s in out["steps"]] for out in outs] == steps


def test_callable_string_route_is_refused():
    """A plain kimi pass named in ``inductor_passes`` gets vLLM's class-source cache key:
    compiling under it is refused, so no graph is ever cached under a key that ignores
    the stream."""
    qualname = h.callable_route_module("prefix")
    config = h.vllm_config(inductor_passes={"post_grad_custom_post_pass": qualname})
    p = config.compilation_config.inductor_compile_config["post_grad_custom_post_pass"]
    assert type(p).__name__ == "CallableInductorPass"
    cfg = MODELS["l3_s1"]
    torch._dynamo.reset()
    model = h.compile_k3(cfg, config)
    with caches_off(), pytest.raises(Exception) as info:
        h.run(model, config, h.token_ids(cfg, 5))
    text = str(info.value)
    assert "AuxStreamPass reached the compiler wrapped in CallableInductorPass" in text
    assert "kimi_passes.vllm.compile_config_entries" in text


def test_import_kimi_passes_does_not_import_vllm_and_adapter_names_the_install():
    code = ("import sys, kimi_passes; assert 'vllm' not in sys.modules, 'imported vllm'\n"
            "sys.modules['vllm'] = None\n"
            "import kimi_passes.vllm.k3.route\n"  # the plugin module imports no vLLM
            "try:\n    from kimi_passes.vllm import compile_config_entries\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert "kimi_passes.vllm needs vLLM: install it" in out


def test_three_processes_share_one_vllm_cache_root(tmp_path):
    """attn_res, prefix, attn_res: each served its own stream; the third from the cache.

    Each process is forked, once the one before it has exited, from one parent that has
    imported vLLM (most of a process's time; tests/helpers/process.py).
    """
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "PYTHONPATH": path}  # h.SERVE imports helpers.vllm_harness
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    env.pop("VLLM_DISABLE_COMPILE_CACHE", None)
    streams = ("attn_res", "prefix", "attn_res")
    outs = [tmp_path / f"out{i}.json" for i in range(len(streams))]
    one_after_another([[sys.executable, "-c", h.SERVE, stream, str(out)]
                       for stream, out in zip(streams, outs, strict=True)],
                      env, timeout=600, imports=VLLM_IMPORTS)
    results = [json.loads(out.read_text()) for out in outs]
    for r in results:
        assert "error" not in r, r
        assert r["taps"] == 4
        assert max(r[f"err_vs_{r['stream']}"]) <= TOL, r
        other = "prefix" if r["stream"] == "attn_res" else "attn_res"
        assert max(r[f"err_vs_{other}"]) > 1.0, r  # the streams really differ
    first, second, third = results
    assert first["loaded"] == 0 and first["saved"] == 5 and first["inductor_compiles"] == 5
    assert second["loaded"] == 0 and second["inductor_compiles"] == 5  # not attn_res's graph
    assert third["loaded"] == 5 and third["inductor_compiles"] == 0  # the cache hit
