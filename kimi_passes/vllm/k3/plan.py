"""How vLLM will run Kimi K3, read at the model's init: served, or refused with the fix.

Invariant: when the stream resolved for the process (``stream.resolve``) is attn_res,
every configuration vLLM (0.33.0, 0.34.0) accepts either gets a ``ServingPlan`` (logged
once, kept on the model) or raises ``VllmRouteError`` from ``KimiLinearModel.__init__``,
before the first request; none serves the running prefix. The plan reads vLLM's resolved
``VllmConfig`` (after its breakable-CUDA-graph override):

- mode NONE (K3's default on NVIDIA: breakable CUDA graphs), VLLM_COMPILE or
  DYNAMO_TRACE_ONCE (no K3 class is ``@support_torch_compile``): eager (``eager``);
- STOCK_TORCH_COMPILE with backend ``kimi``: compiled, the pass (``compile_pass``; its
  stream is ``$KIMI_PASSES_AUX_STREAM``'s, so another source's stream there is refused);
  another backend is refused, as is sequence parallelism there;
- the specialized decode executor (``decode_backend=latency_specialized``): refused.

Under ``prefix``, or with no source asking, every configuration is vLLM's own values and
is only logged. docs/design.md section 11.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

from kimi_passes.config.stream import ENV_VAR, resolve_aux_stream
from kimi_passes.vllm import versions
from kimi_passes.vllm.k3.stream import StreamChoice, VllmRouteError

#: The startup line's logger: under ``vllm``, the one tree vLLM's logging config prints
#: (its handler is on ``vllm``, which does not propagate; ``kimi_passes.*`` INFO is dropped).
log = logging.getLogger("vllm.kimi_passes")

EAGER, COMPILED = "eager", "compiled"
KIMI_BACKENDS = ("kimi",)
FULLGRAPH_NOTE = (
    "vLLM's MLA and KDA cores read the forward context and branch on its metadata "
    "in Python, so under fullgraph each new metadata value recompiles until Dynamo's "
    "recompile limit (8) raises FailOnRecompileLimitHit; K3 served eagerly (no -cc mode) "
    "has the stream too")


SPECIALIZED_WHY = (
    "vLLM's K3 specialized decode executor (additional_config "
    "decode_backend=latency_specialized) runs its own decode steps on vLLM's CuTe AttnRes "
    "kernels, whose aux variants (bind_aux) store the running prefix, not the mixture, and "
    "no Python call is left to route; vLLM refuses its own aux-stream flag there too "
    "(\"Kimi K3 specialized decode does not support the AttnRes aux stream\")")
SPECIALIZED_FIX = (
    "Drop decode_backend (vLLM's stock decode, eager, serves the stream), or keep the "
    "specialized decode with a drafter trained on the prefix stream")


@dataclasses.dataclass(frozen=True)
class ServingPlan:
    """How the stream is served: ``route`` ``eager`` (``eager``) or ``compiled``."""

    stream: str
    route: str
    why: str
    #: Where the stream came from (``StreamChoice.source``).
    source: str = ""


def _mode_name(mode) -> str:
    return getattr(mode, "name", str(mode))


def _refuse(choice: StreamChoice, why: str, fix: str) -> VllmRouteError:
    return VllmRouteError(
        f"kimi_passes: the {choice.stream} stream ({choice.source}) cannot be served: {why}. "
        f"{fix}; or serve vLLM's own aux states: {choice.undo}")


def _eager_why(mode: str, graphs: str) -> str:
    if mode == "NONE":
        why = f"compilation mode NONE ({graphs}): K3 runs eagerly"
    else:
        why = (f"compilation mode {mode}, but vLLM compiles no K3 class (none is "
               f"@support_torch_compile): K3 runs eagerly ({graphs})")
    return why + ("; each aux capture is read out of its consumer's AttnRes call "
                  "(kimi::attn_res_capture), every other AttnRes call is vLLM's own attn_res")


def serving_plan(vllm_config, *, stream: str | StreamChoice,
                 sequence_parallel: bool) -> ServingPlan:
    """The plan for ``vllm_config`` (resolved) and ``stream`` (a name: the caller's), or
    ``VllmRouteError``."""
    choice = stream if isinstance(stream, StreamChoice) else StreamChoice.given(stream)
    cc = vllm_config.compilation_config
    mode = _mode_name(cc.mode) if cc.mode is not None else "NONE"
    extra = vllm_config.additional_config
    decode = extra.get("decode_backend", "auto") if isinstance(extra, dict) else "auto"
    graphs = ("breakable CUDA graphs" if versions.breakable_cudagraphs(vllm_config)
              else "no breakable CUDA graphs")
    route = COMPILED if mode == "STOCK_TORCH_COMPILE" else EAGER
    plan = functools.partial(ServingPlan, choice.stream, source=choice.source)
    if route == COMPILED and _backend(cc) in KIMI_BACKENDS \
            and resolve_aux_stream() != choice.stream:
        raise _refuse(
            choice, f"backend 'kimi' gets no options from vLLM and compiles the stream "
            f"${ENV_VAR} names or defaults to ({resolve_aux_stream()!r} now)",
            f"Set ${ENV_VAR}={choice.stream}, or drop the -cc mode (the eager route)")
    if choice.stream != "attn_res":
        return plan(route, f"stream {choice.stream!r}: vLLM's own aux states")
    if decode == "latency_specialized":
        raise _refuse(choice, SPECIALIZED_WHY, SPECIALIZED_FIX)
    if route == EAGER:
        return plan(EAGER, _eager_why(mode, graphs))
    return plan(COMPILED, _compiled_why(choice, cc, sequence_parallel))


def _backend(cc) -> str:
    return cc.backend if isinstance(cc.backend, str) else type(cc.backend).__name__


def _compiled_why(choice: StreamChoice, cc, sequence_parallel: bool) -> str:
    backend = _backend(cc)
    if backend not in KIMI_BACKENDS:
        raise _refuse(
            choice,
            f"vLLM compiles K3 (STOCK_TORCH_COMPILE) with backend {backend!r}: no kimi pass "
            "runs there, and every capture would be vLLM's running prefix",
            "Drop the -cc mode (K3 then runs eagerly and the stream is served), or pass "
            "-cc '{\"mode\": \"STOCK_TORCH_COMPILE\", \"backend\": \"kimi\"}' with "
            f"VLLM_USE_BREAKABLE_CUDAGRAPH=0 ({FULLGRAPH_NOTE})")
    if sequence_parallel:
        raise _refuse(
            choice, "sequence parallelism under STOCK_TORCH_COMPILE: the kimi pass does not "
            "recognise the gathered and split aux states",
            "Drop the -cc mode (the eager route serves sequence parallelism)")
    return ("STOCK_TORCH_COMPILE with backend 'kimi': the kimi pass serves the stream in the "
            f"compiled graph. Note: {FULLGRAPH_NOTE}")


def startup(model, vllm_config, stream: str | StreamChoice) -> ServingPlan:
    """The plan for ``model`` (a K3 ``KimiLinearModel`` just built), logged and kept."""
    choice = stream if isinstance(stream, StreamChoice) else StreamChoice.given(stream)
    plan = serving_plan(vllm_config, stream=choice,
                        sequence_parallel=bool(getattr(model, "use_sequence_parallel", False)))
    model._kimi_passes_plan = plan
    warning = choice.override_warning()
    if warning:
        log.warning("%s", warning)
    log.log(logging.WARNING if plan.route == COMPILED and plan.stream == "attn_res"
            else logging.INFO, "%s", startup_line(plan))
    return plan


def startup_line(plan: ServingPlan) -> str:
    """The line a K3 process logs at model init (README, "With vLLM")."""
    return (f"kimi_passes: aux stream {plan.stream} (from {plan.source}), {plan.route} "
            f"route: {plan.why}")
