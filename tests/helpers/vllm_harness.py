"""The vLLM test harness: vLLM's real compile path on CPU, and vLLM's plugin loading.

Drives vLLM's compile path (``VllmBackend``, ``split_graph``, ``PiecewiseBackend``,
``PostGradPassManager``) with the reference K3 (tests/test_vllm.py). What it works around
is the CPU platform, never vLLM's compile pipeline:

1. schema-only stubs for the ``torch.ops._C`` ops vLLM's ``FixFunctionalizationPass``
   looks up by name (the CUDA extension that defines them does not load here);
2. ``pass_config={"fuse_rope_kvcache_cat_mla": False}`` (else a CUDA-only pass is named);
3. ``compile_sizes=[]``;
4. the config is built on a CUDA platform stand-in (``gpu_platform``), as vLLM's own
   CPU-less tests build theirs: vLLM 0.34.0's CPU platform refuses an x86 CPU without
   triton-cpu in ``VllmConfig.__post_init__`` (0.33.0's warns, then turns
   ``VLLM_COMPILE`` into ``DYNAMO_TRACE_ONCE``); the compile itself runs on vLLM's CPU
   platform.

Attention runs behind the custom op ``kimi_vllm_test::attention``, listed in
``splitting_ops`` the way vLLM lists its attention ops, so the graph really is split.
``main`` is one serving process of the shared-cache test. ``load_vllm_plugins`` loads the
``kimi_passes`` plugin as vLLM does (tests/test_vllm_k3*.py, which run vLLM's installed K3
forward: ``kimi_passes.graphs.vllm_k3``); ``resolved_k3`` is vLLM's config resolution for
a K3 checkpoint on a CUDA or ROCm platform stand-in, ``speculative_config`` vLLM's
``SpeculativeConfig`` serving a drafter without its checkpoint.
"""

from __future__ import annotations

import os

# vLLM picks its platform once, when first imported: the CPU one, also in a serving process
# (``main``) whose environment does not say (tests/conftest.py sets it under pytest).
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import contextlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import kimi_passes  # noqa: E402,F401
from helpers.k3 import token_ids  # noqa: E402
from kimi_passes.config.stream import ENV_VAR  # noqa: E402
from kimi_passes.graphs.k3 import K3Config, K3Model  # noqa: E402
from kimi_passes.vllm.vllm_plan import platform  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

ATTENTION_OP = "kimi_vllm_test::attention"

_C_OPS = ("rotary_embedding", "fused_add_rms_norm", "fused_add_rms_norm_static_fp8_quant",
          "rms_norm_dynamic_per_token_quant", "rms_norm", "rms_norm_static_fp8_quant",
          "silu_and_mul", "silu_and_mul_quant", "silu_and_mul_nvfp4_quant",
          "fused_qk_norm_rope")
_stub_lib = None


def _stub_c_ops() -> None:
    global _stub_lib
    missing = [n for n in _C_OPS if not hasattr(torch.ops._C, n)]
    if missing:
        _stub_lib = torch.library.Library("_C", "FRAGMENT")
        for name in missing:
            _stub_lib.define(f"{name}(Tensor x) -> Tensor")


@torch.library.custom_op(ATTENTION_OP, mutates_args=())
def attention(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
              num_heads: int) -> torch.Tensor:
    """Causal self-attention before ``o_proj`` (the part vLLM hides behind its attention op)."""
    T, H = x.shape
    q, k, v = (F.linear(x, w).view(T, num_heads, -1).transpose(0, 1) for w in (wq, wk, wv))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(0, 1).reshape(T, H).contiguous()


@attention.register_fake
def _(x, wq, wk, wv, num_heads):
    return torch.empty_like(x)


def _attention_forward(self, x):
    return self.o_proj(torch.ops.kimi_vllm_test.attention(
        x, self.q_proj.weight, self.k_proj.weight, self.v_proj.weight, self.num_heads))


def build_model(cfg: K3Config, end_layer: int | None = None) -> K3Model:
    """The reference K3 (layers ``[0, end_layer)``), attention behind ``ATTENTION_OP``."""
    model = K3Model(cfg, 0, end_layer).requires_grad_(False).eval()
    for layer in model.layers.values():
        layer.self_attn.forward = _attention_forward.__get__(layer.self_attn)
    return model


def vllm_config(inductor_compile_config=None, inductor_passes=None, v2=False,
                splitting_ops=(ATTENTION_OP,), cache_dir=""):
    """A ``VllmConfig`` compiling with ``VllmBackend`` on CPU (see the module docstring)."""
    _stub_c_ops()
    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode

    icc = dict(inductor_compile_config or {})
    if v2:
        icc["enable_auto_functionalized_v2"] = True
    cc = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE, backend="inductor",
        cudagraph_mode=CUDAGraphMode.NONE, custom_ops=["none"],
        splitting_ops=list(splitting_ops), compile_sizes=[],
        pass_config={"fuse_rope_kvcache_cat_mla": False},
        inductor_compile_config=icc, inductor_passes=dict(inductor_passes or {}),
        cache_dir=cache_dir,
    )
    config = new_vllm_config(compilation_config=cc)
    assert config.compilation_config.mode == CompilationMode.VLLM_COMPILE
    return config


def config_hash(config) -> str:
    """The hash vLLM names its compile cache directory after: ``VllmConfig.compute_hash``
    (vLLM 0.33.0) or ``vllm.config.utils.hash_config`` of its ``compile_factors`` (0.34.0,
    where ``compute_hash`` is gone)."""
    from vllm.config import utils

    if hasattr(utils, "hash_config"):
        return utils.hash_config(config)
    return config.compute_hash()


class VllmK3(nn.Module):
    """A K3 stage as vLLM compiles it; ``forward`` returns ``(hidden, *taps)``."""

    def __init__(self, *, vllm_config, prefix: str = "", k3: K3Config,
                 end_layer: int | None = None):
        super().__init__()
        self.k3 = build_model(k3, end_layer)

    def forward(self, input_ids: torch.Tensor):
        result, taps = self.k3(input_ids)
        if isinstance(result, tuple):  # a non-final stage: (prefix + pending, bank)
            return (result[0], *taps)
        return (result, *taps)


def compile_k3(cfg: K3Config, config, end_layer: int | None = None):
    """``VllmK3`` under ``@support_torch_compile``; call it (under ``run``) to compile."""
    from vllm.compilation.decorators import support_torch_compile
    from vllm.config import set_current_vllm_config

    # A fresh decorated class per model: the decorator keeps per-class compile state.
    cls = support_torch_compile(type("VllmK3Compiled", (VllmK3,), {}),
                                dynamic_arg_dims={"input_ids": 0})
    with set_current_vllm_config(config):
        return cls(vllm_config=config, k3=cfg, end_layer=end_layer)


def run(model, config, input_ids):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config), torch.no_grad():
        out = model(input_ids)
    return out[0], list(out[1:])


def ground_truth(model, input_ids):
    with torch.no_grad():
        return model.k3.ground_truth(input_ids)[1]


def counter():
    from vllm.compilation.counter import compilation_counter

    return compilation_counter


def callable_route_module(stream: str) -> str:
    """A top-level module holding a plain ``AuxStreamPass``, for the string route.

    One name, ``aux_pass``, whose stream comes from ``$KIMI_PASSES_AUX_STREAM`` (set to
    ``stream`` while the pass is built, then restored: the stream is resolved then, and a
    variable left set would steer every later compile in the process): the way a
    deployment A/Bs streams without touching its config. vLLM wraps it in
    ``CallableInductorPass``.
    """
    import types

    from kimi_passes import AuxStreamPass
    from kimi_passes.config.stream import resolve_aux_stream

    name = "kimi_vllm_callable_route"
    module = types.ModuleType(name)
    with mock.patch.dict(os.environ, {ENV_VAR: stream}):
        module.aux_pass = AuxStreamPass(resolve_aux_stream())
    sys.modules[name] = module
    return f"{name}.aux_pass"


def count_attn_res(graph: torch.fx.Graph) -> int:
    """``kimi::attn_res`` family calls (functionalized or not) in a post-grad graph."""
    n = 0
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        target = node.args[0] if "auto_functionalized" in str(node.target) else node.target
        name = str(getattr(target, "_name", target))
        if name.startswith("kimi::attn_res"):
            n += 1
    return n


# --------------------------------------------- the kimi_passes plugin, as vLLM loads it

def entry_point():
    """Our ``vllm.general_plugins`` entry point, as pyproject.toml declares it."""
    import importlib.metadata as md

    text = (ROOT / "pyproject.toml").read_text()  # tomllib is 3.11+; the section is one line
    found = re.search(r'\[project\.entry-points\."vllm\.general_plugins"\]\n'
                      r'(\w+) = "([\w.:]+)"\n', text)
    assert found, "pyproject.toml declares no vllm.general_plugins entry point"
    name, value = found.groups()
    return md.EntryPoint(name=name, value=value, group="vllm.general_plugins")


def load_vllm_plugins(env: str | None) -> None:
    """vLLM's ``load_general_plugins`` in a process whose metadata holds our entry point.

    (The editable install's metadata holds it after ``pip install -e .``; here it is
    added to what ``importlib.metadata.entry_points`` answers.)
    """
    import importlib.metadata as md

    import vllm.plugins as vp

    real = md.entry_points

    def entry_points(**kw):
        if kw.get("group") == vp.DEFAULT_PLUGINS_GROUP:
            return md.EntryPoints([*real(**kw), entry_point()])
        return real(**kw)

    environ = {} if env is None else {ENV_VAR: env}
    with mock.patch.object(md, "entry_points", entry_points), \
            mock.patch.object(vp, "plugins_loaded", False), \
            mock.patch.dict(os.environ, environ):
        if env is None:
            os.environ.pop(ENV_VAR, None)
        vp.load_general_plugins()


# ------------------------------------------------- vLLM's config resolution, no GPU here

#: Kimi K3's architectures, and those vLLM 0.34.0 added (K3.1: the same K3 classes).
K3 = "KimiK3ForConditionalGeneration"
K31 = "KimiK31ForConditionalGeneration"
BREAKABLE = "VLLM_USE_BREAKABLE_CUDAGRAPH"


#: vLLM's platform as a CUDA or ROCm machine where its config resolution reads it (the
#: package's, which ``vllm-plan`` uses too).
gpu_platform = platform.stand_in


def new_vllm_config(**fields):
    """``VllmConfig(**fields)`` built on a CUDA platform stand-in (``gpu_platform``): vLLM
    0.34.0's CPU platform refuses an x86 CPU without triton-cpu there. What uses it runs
    on vLLM's CPU platform."""
    from vllm.config import VllmConfig

    with gpu_platform("cuda"):
        return VllmConfig(**fields)


def k3_model_config(architecture: str = K3):
    """Stand-in for vLLM's ``ModelConfig`` of a K3 checkpoint (building one reads the
    checkpoint): what the breakable-CUDA-graph resolution reads, ``architectures`` and
    ``hf_text_config.architectures`` (K3's text config names none), ``enforce_eager``."""
    text = types.SimpleNamespace(architectures=None, model_type="kimi_linear")
    return types.SimpleNamespace(architectures=[architecture], hf_text_config=text,
                                 enforce_eager=False)


def resolved_k3(cc: dict, breakable: str | None, *, rocm: bool = False, extra=None,
                architecture: str = K3):
    """A ``VllmConfig`` for a K3 checkpoint after vLLM's breakable-CUDA-graph resolution,
    on a CUDA (or ROCm) platform stand-in; returns it and the environment it left.

    Built without ``$VLLM_USE_BREAKABLE_CUDAGRAPH`` (its ``__post_init__`` has no model to
    read), given the model config, then resolved by vLLM's own method with the variable as
    the user set it. vLLM 0.33.0 writes its answer to ``os.environ`` (returned, then
    restored), 0.34.0 to ``compilation_config.use_breakable_cudagraph``."""
    from vllm.config import CompilationConfig, VllmConfig

    env = {k: v for k, v in os.environ.items() if k != BREAKABLE}
    with mock.patch.dict(os.environ, env, clear=True), \
            gpu_platform("rocm" if rocm else "cuda"):
        config = VllmConfig(compilation_config=CompilationConfig(**cc),
                            additional_config=extra or {})
        object.__setattr__(config, "model_config", k3_model_config(architecture))
        if breakable is not None:
            os.environ[BREAKABLE] = breakable
        config._maybe_enable_breakable_cudagraph()
        resolved_env = dict(os.environ)
    return config, resolved_env


def speculative_config(method: str, hf_config, speculator_class: str | None = None):
    """vLLM's ``SpeculativeConfig`` serving ``method`` with a drafter whose ``hf_config``
    is given: a stand-in for building one, which loads the drafter's checkpoint. vLLM's
    own properties read it (0.34.0's ``uses_aux_hidden_states``; 0.33.0's
    ``requires_aux_hidden_states`` reads ``method`` and ``hf_config``); its hash is the
    method and the drafter's config (``compute_hash``, ``compile_factors``).
    ``speculator_class``: the config class the drafter's model declares (0.34.0)."""
    from vllm.config import SpeculativeConfig

    spec = object.__new__(SpeculativeConfig)
    # The drafter's checkpoint folder: its config.json, which the route reads the
    # drafter's declared stream from, as it ships.
    folder = Path(tempfile.mkdtemp(prefix=f"{method}-drafter-"))
    (folder / "config.json").write_text(json.dumps(hf_config.to_dict()))
    draft = types.SimpleNamespace(hf_config=hf_config, model=str(folder), revision=None,
                                  speculator_config_class=speculator_class)
    key = f"{method} {hf_config.to_dict()}"
    for name, value in {"method": method, "custom_method": None, "draft_model_config": draft,
                        "compute_hash": lambda: key, "compile_factors": lambda: {"key": key},
                        "use_ngram_gpu": lambda: False}.items():
        object.__setattr__(spec, name, value)
    return spec


def start_route(env: str | None, vllm_config=None):
    """The plugin loaded as vLLM loads it (``load_vllm_plugins``), then the stream resolved
    as a K3 model's init resolves it (``k3.route.activate``), with
    ``$KIMI_PASSES_AUX_STREAM`` = ``env`` (None: unset), vLLM's flag as the environment
    has it and ``vllm_config``'s drafter. Returns the process's ``EagerRoute``; undo with
    ``k3.route.unroute_attn_res()``."""
    import kimi_passes.vllm.k3.route as route

    load_vllm_plugins(env)
    current = route.current()
    assert current is not None, "vLLM did not load the kimi_passes plugin"
    with mock.patch.dict(os.environ, {} if env is None else {ENV_VAR: env}):
        if env is None:
            os.environ.pop(ENV_VAR, None)
        route.activate(current, vllm_config)
    return current


# ---------------------------------------------------------------- one serving process

SERVE = "import sys; from helpers.vllm_harness import main; sys.exit(main())"


def main(argv=None) -> int:
    """One serving process: ``python -c SERVE STREAM OUT.json`` with tests/ on
    ``PYTHONPATH`` (or ``python -m helpers.vllm_harness ...`` run from tests/).

    The kimi pass reaches vLLM through ``kimi_passes.vllm.compile_config_entries``.
    vLLM's compile cache is on, rooted at ``$VLLM_CACHE_ROOT``. Writes the taps' errors,
    any error and the cache counters to ``OUT.json``.

    The pieces are lowered with Inductor's ``fallback_by_default`` (ATen calls, no C++
    build): what a process is served from the cache is the question, not codegen.
    """
    from kimi_passes.vllm import compile_config_entries

    stream, out = (argv or sys.argv[1:])[:2]
    cfg = K3Config.tiny()
    fast = {"fallback_by_default": True}
    config = vllm_config(inductor_compile_config={**compile_config_entries(stream), **fast})
    model = compile_k3(cfg, config)
    c = counter()
    before = c.clone()
    ids = token_ids(cfg, 9)
    result: dict = {"stream": stream}
    try:
        _, taps = run(model, config, ids)
    except Exception as e:  # reported to the parent test, which decides
        result["error"] = f"{type(e).__name__}: {e}"
        taps = None
    result["loaded"] = c.num_compiled_artifacts_loaded - before.num_compiled_artifacts_loaded
    result["saved"] = c.num_compiled_artifacts_saved - before.num_compiled_artifacts_saved
    result["inductor_compiles"] = c.num_inductor_compiles - before.num_inductor_compiles
    with torch.no_grad():
        want = {"attn_res": ground_truth(model, ids), "prefix": list(model.k3(ids)[1])}
    if taps is not None:
        result["taps"] = len(taps)
        for name, ref in want.items():
            result[f"err_vs_{name}"] = [float((a - b).abs().max())
                                        for a, b in zip(taps, ref, strict=True)]
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())


@contextlib.contextmanager
def vllm_log_records():
    """The records logged to vLLM's logger tree (``vllm``: the one vLLM's logging config
    prints, at INFO in a server) while the block runs."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    vllm_log = logging.getLogger("vllm")
    level = vllm_log.level
    vllm_log.addHandler(handler)
    vllm_log.setLevel(logging.INFO)
    try:
        yield records
    finally:
        vllm_log.removeHandler(handler)
        vllm_log.setLevel(level)
