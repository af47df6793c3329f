"""How vLLM will run Kimi K3, read at the model's init: served, or refused with the fix.

Invariant: under ``$KIMI_PASSES_AUX_STREAM=attn_res`` every configuration vLLM 0.33.0
accepts either gets a ``ServingPlan`` (logged once, kept on the model) or raises
``VllmRouteError`` from ``KimiLinearModel.__init__``, before the first request; none
serves the running prefix. The plan reads vLLM's resolved ``VllmConfig`` (after its
breakable-CUDA-graph override):

- mode NONE (K3's default on NVIDIA: breakable CUDA graphs), VLLM_COMPILE or
  DYNAMO_TRACE_ONCE (no K3 class is ``@support_torch_compile``): eager, ``k3_eager``;
- STOCK_TORCH_COMPILE with backend ``kimi``: compiled, the pass; another backend is
  refused, as is sequence parallelism there (its gathered aux states are not recognised);
- the specialized decode executor (``decode_backend=latency_specialized``): refused.

Under ``prefix`` every configuration is vLLM's own values and is only logged.
docs/design.md section 11.
"""

from __future__ import annotations

import dataclasses
import logging

from kimi_passes.config.stream import ENV_VAR
from kimi_passes.vllm import versions

log = logging.getLogger(__name__)

EAGER, COMPILED = "eager", "compiled"
KIMI_BACKENDS = ("kimi",)
FULLGRAPH_NOTE = (
    "vLLM 0.33.0's MLA and KDA cores read the forward context and branch on its metadata "
    "in Python, so under fullgraph each new metadata value recompiles until Dynamo's "
    "recompile limit (8) raises FailOnRecompileLimitHit; K3 served eagerly (no -cc mode) "
    "has the stream too")


class VllmRouteError(ValueError):
    """A vLLM configuration in which the attn_res stream cannot be served; names the fix."""


@dataclasses.dataclass(frozen=True)
class ServingPlan:
    """How the stream is served: ``route`` ``eager`` (``k3_eager``) or ``compiled``."""

    stream: str
    route: str
    why: str


def _mode_name(mode) -> str:
    return getattr(mode, "name", str(mode))


def _refuse(why: str, fix: str) -> VllmRouteError:
    return VllmRouteError(
        f"kimi_passes: ${ENV_VAR}=attn_res cannot be served: {why}. {fix}; or unset "
        f"${ENV_VAR} to serve vLLM's own aux states")


def serving_plan(vllm_config, *, stream: str, sequence_parallel: bool) -> ServingPlan:
    """The plan for ``vllm_config`` (resolved), or ``VllmRouteError``."""
    cc = vllm_config.compilation_config
    mode = _mode_name(cc.mode) if cc.mode is not None else "NONE"
    extra = vllm_config.additional_config
    decode = extra.get("decode_backend", "auto") if isinstance(extra, dict) else "auto"
    graphs = ("breakable CUDA graphs" if versions.breakable_cudagraphs(vllm_config)
              else "no breakable CUDA graphs")
    route = COMPILED if mode == "STOCK_TORCH_COMPILE" else EAGER
    if stream != "attn_res":
        return ServingPlan(stream, route, f"stream {stream!r}: vLLM's own aux states")
    if decode == "latency_specialized":
        raise _refuse("vLLM's K3 specialized decode executor "
                      "(additional_config decode_backend=latency_specialized) runs its own "
                      "decode loop and captures the running prefix",
                      "Drop decode_backend (vLLM's stock decode serves the stream)")
    if route == EAGER:
        if mode == "NONE":
            why = f"compilation mode NONE ({graphs}): K3 runs eagerly"
        else:
            why = (f"compilation mode {mode}, but vLLM 0.33.0 compiles no K3 class (none is "
                   f"@support_torch_compile): K3 runs eagerly ({graphs})")
        return ServingPlan(stream, EAGER, why + "; each aux capture is read out of its "
                           "consumer's AttnRes call (kimi::attn_res_capture), every other "
                           "AttnRes call is vLLM's own attn_res")
    backend = cc.backend if isinstance(cc.backend, str) else type(cc.backend).__name__
    if backend not in KIMI_BACKENDS:
        raise _refuse(
            f"vLLM compiles K3 (STOCK_TORCH_COMPILE) with backend {backend!r}: no kimi pass "
            "runs there, and every capture would be vLLM's running prefix",
            "Drop the -cc mode (K3 then runs eagerly and the stream is served), or pass "
            "-cc '{\"mode\": \"STOCK_TORCH_COMPILE\", \"backend\": \"kimi\"}' with "
            f"VLLM_USE_BREAKABLE_CUDAGRAPH=0 ({FULLGRAPH_NOTE})")
    if sequence_parallel:
        raise _refuse(
            "sequence parallelism under STOCK_TORCH_COMPILE: the kimi pass does not "
            "recognise the gathered and split aux states",
            "Drop the -cc mode (the eager route serves sequence parallelism)")
    return ServingPlan(stream, COMPILED, "STOCK_TORCH_COMPILE with backend 'kimi': the kimi "
                       f"pass serves the stream in the compiled graph. Note: {FULLGRAPH_NOTE}")


def startup(model, vllm_config, stream: str) -> ServingPlan:
    """The plan for ``model`` (a K3 ``KimiLinearModel`` just built), logged and kept."""
    plan = serving_plan(vllm_config, stream=stream,
                        sequence_parallel=bool(getattr(model, "use_sequence_parallel", False)))
    model._kimi_passes_plan = plan
    log.log(logging.WARNING if plan.route == COMPILED and stream == "attn_res" else logging.INFO,
            "kimi_passes: %s=%s, %s route: %s", ENV_VAR, stream, plan.route, plan.why)
    return plan


def checked_init(own, stream: str):
    """``KimiLinearModel.__init__``, then ``startup`` with the config it was built from."""

    def __init__(self, *args, **kwargs):
        own(self, *args, **kwargs)
        config = kwargs.get("vllm_config", args[0] if args else None)
        if config is None:
            from vllm.config import get_current_vllm_config

            config = get_current_vllm_config()
        startup(self, config, stream)

    return __init__
