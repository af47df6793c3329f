"""``python -m kimi_passes vllm-plan [--platform cuda|rocm] <vllm serve arguments>``.

Invariant: the arguments go through vLLM's own ``EngineArgs.create_engine_config``, for
this machine's GPU or, without one, for ``--platform`` (default ``cuda``: vLLM's platform
as that machine, ``platform``), on any machine (a CPU one included: the
checkpoint's and the drafter's ``config.json``, no weights, no tokenizer), then through
what a K3 process runs at model init: the stream (``k3.stream.resolve``), the plan
(``k3.plan.serving_plan``), the drafter's capture ids and the pipeline-stage check. The
printout is that startup's; the exit status is 1 where startup would refuse, or where a
source asks for a stream and no code of ours would run (``$VLLM_PLUGINS`` without
``kimi_passes``), 2 where vLLM rejects the arguments. What the plan cannot see is printed
with it (README, "With vLLM").
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import sys
from importlib import metadata

from kimi_passes.config import checkpoint
from kimi_passes.config.drafter import drafter_capture_ids
from kimi_passes.vllm import versions
from kimi_passes.vllm.k3 import boundary, stream, surface
from kimi_passes.vllm.k3.plan import COMPILED, ServingPlan, serving_plan, startup_line
from kimi_passes.vllm.vllm_plan import platform

K3_ARCHITECTURES = ("KimiK3ForConditionalGeneration", "KimiLinearForCausalLM")
#: vLLM's K3 model modules (the package, then each vendor's).
K3_MODULES = ("vllm.models.kimi_k3", *surface.MODEL_MODULES.values())
PLUGIN = "kimi_passes"
UNSEEN = ("the GPU: vLLM resolved this config for {platform}; "
          "NVIDIA and ROCm differ only where README's table says; the server's own "
          "environment, if it is not this shell's; the other nodes of a prefill/decode "
          "deployment (run the plan for each: every prefill node must serve the same "
          "stream); kernels and weights")


@dataclasses.dataclass
class Plan:
    """What the command found: ``rows`` (label, text), ``refusals``, the exit status."""

    rows: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    refusals: list[str] = dataclasses.field(default_factory=list)

    def add(self, label: str, text: str) -> None:
        self.rows.append((label, text))

    def text(self) -> str:
        lines = [f"{label:<13}{text}" for label, text in self.rows]
        lines += [f"{'refused':<13}{r}" for r in self.refusals] or [f"{'refused':<13}nothing"]
        return "\n".join(lines)


def serve_args(argv: list[str]) -> list[str]:
    """``vllm serve``'s arguments as ``EngineArgs`` parses them: the positional model as
    ``--model``, ``--skip-tokenizer-init`` added (the plan needs no tokenizer)."""
    args = list(argv)
    if args and not args[0].startswith("-"):
        args = ["--model", args[0], *args[1:]]
    if "--skip-tokenizer-init" not in args:
        args.append("--skip-tokenizer-init")
    return args


def plugin_status(environ) -> tuple[bool, str]:
    """Whether vLLM will load our ``vllm.general_plugins`` entry point, and why."""
    found = [e for e in metadata.entry_points(group="vllm.general_plugins") if e.name == PLUGIN]
    if not found:
        return False, ("the entry point kimi_passes is not installed (pip install -e . or the "
                       "wheel): vLLM loads no code of ours")
    allowed = environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN not in allowed.split(","):
        return False, (f"$VLLM_PLUGINS={allowed!r} omits kimi_passes: vLLM loads no code of "
                       "ours; add kimi_passes to it")
    return True, "vLLM loads kimi_passes (entry point installed" + (
        ", listed in $VLLM_PLUGINS)" if allowed is not None else ", $VLLM_PLUGINS unset)")


def engine_config(argv: list[str], kind: str | None):
    """vLLM's resolved ``VllmConfig`` for ``vllm serve argv``, for a ``kind`` machine
    (``cuda``, ``rocm``: ``platform.stand_in``; None: this machine's)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="kimi-passes vllm-plan"))
    args = EngineArgs.from_cli_args(parser.parse_args(serve_args(argv)))
    if kind:
        # vLLM inspects the model class while it resolves; imported under the stand-in,
        # K3's modules would reach for the absent GPU (CUDA's flash-attention extension,
        # ROCm's architecture query): imported here, on this machine's platform.
        for name in K3_MODULES:
            importlib.import_module(name)
    with platform.stand_in(kind) if kind else contextlib.nullcontext():
        return args.create_engine_config()


def split_platform(argv: list[str]) -> tuple[str | None, list[str]]:
    """``--platform KIND`` (or ``--platform=KIND``) taken out of ``argv``: ours, not vLLM's."""
    rest, kind, words = [], None, iter(argv)
    for word in words:
        if word == "--platform":
            kind = next(words, None)
            if kind is None:
                raise ValueError("--platform needs a value: cuda or rocm")
        elif word.startswith("--platform="):
            kind = word.split("=", 1)[1]
        else:
            rest.append(word)
    if kind is not None and kind not in platform.KINDS:
        raise ValueError(f"--platform {kind!r}: pass one of {', '.join(platform.KINDS)}")
    return kind, rest


def sequence_parallel(config) -> bool:
    """K3's own rule (``KimiDecoderLayer.use_sequence_parallel``, vLLM 0.33.0 and 0.34.0)."""
    p = config.parallel_config
    mega = getattr(config.kernel_config, "moe_backend", None) == "deep_gemm_mega_moe"
    return (p.pipeline_parallel_size == 1 and p.enable_expert_parallel
            and p.tensor_parallel_size > 1 and (mega or p.data_parallel_size > 1))


def drafter_rows(plan: Plan, config, choice, num_layers, served: ServingPlan | None,
                 rocm: bool) -> None:
    """The drafter's method and capture ids; a capture id ending a non-final stage, served
    or refused (``boundary.refusal_for``)."""
    spec = config.speculative_config
    if spec is None:
        plan.add("drafter", "none (no --speculative-config)")
        return
    if not versions.drafter_reads_aux(spec):
        plan.add("drafter", f"{spec.method}: reads no aux states")
        return
    plan.add("declaration", declaration_row(spec))
    taps = drafter_capture_ids(spec.draft_model_config.hf_config, num_layers,
                               source=str(spec.draft_model_config.model))
    if taps is None:
        plan.add("drafter", f"{spec.method}: declares no capture ids (vLLM's default ids)")
        return
    plan.add("drafter", f"{spec.method}: capture ids {list(taps.capture_ids)} "
                        f"({taps.describe()})")
    stages = config.parallel_config.pipeline_parallel_size
    if choice.stream == "attn_res" and stages > 1 and num_layers:
        from vllm.distributed.utils import get_pp_indices

        for rank in range(stages - 1):
            start, end = get_pp_indices(num_layers, rank, stages)
            if end not in taps.capture_ids:
                continue
            why = boundary.refusal_for(
                over_pp=not rocm, compiled=served is not None and served.route == COMPILED)
            if why is None:
                plan.add("stage end", boundary.served_text(end, start, end))
            else:
                plan.refusals.append(boundary.refused_text(end, start, end, why))


def declaration_row(spec) -> str:
    """Where the drafter's stream declaration was read, and what it says."""
    try:
        found = stream.declaration(spec)
    except stream.REFUSALS as e:
        return f"unreadable: {e}"
    if found is not None:
        return f"{found.value!r}, read from {found.where}"
    if spec.method in stream.NO_CHECKPOINT:
        return (f"none (the {spec.method} drafter's config, given inline, has no "
                "aux_hidden_stream)")
    draft = spec.draft_model_config
    path = checkpoint.locate(str(draft.model), getattr(draft, "revision", None))
    return f"none ({path} has no aux_hidden_stream)"


def k3_rows(plan: Plan, config, environ, rocm: bool) -> None:
    """The stream, the route and the drafter for a K3 ``config`` (resolved for ROCm or
    NVIDIA: ``rocm``)."""
    try:
        choice = stream.resolve(environ, config)
    except stream.REFUSALS as e:
        plan.refusals.append(str(e))
        return
    plan.add("stream", f"{choice.stream}, from {choice.source}")
    warning = choice.override_warning()
    if warning:
        plan.add("A/B run", warning)
    try:
        served = serving_plan(config, stream=choice,
                              sequence_parallel=sequence_parallel(config))
    except stream.REFUSALS as e:
        plan.refusals.append(str(e))
        served = None
    if served is not None:
        plan.add("route", f"{served.route}: {served.why}")
        plan.add("startup line", startup_line(served))
    num_layers = getattr(config.model_config.hf_text_config, "num_hidden_layers", None)
    drafter_rows(plan, config, choice, num_layers, served, rocm)
    loads, why = plugin_status(environ)
    plan.add("plugin", why)
    if choice.asked and not loads:
        plan.refusals.append(f"{choice.source} asks for the {choice.stream} stream, but {why}")


def run(argv: list[str], environ=os.environ) -> tuple[Plan, int]:
    """The plan for ``vllm serve argv`` and its exit status (see the module docstring).

    With no GPU here, vLLM's CPU platform is the one vLLM picks (``$VLLM_TARGET_DEVICE``
    unset) and the resolution is for ``--platform``'s stand-in (default ``cuda``); the
    "vLLM" row names the platform resolved for.
    """
    import torch

    kind, argv = split_platform(argv)
    here = torch.cuda.is_available()
    if not here:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM picks its platform
        kind = kind or "cuda"
    import vllm
    from vllm.platforms import current_platform

    plan = Plan()
    stream.from_environment(environ)  # a bad value: the ValueError, as vLLM would stop
    try:
        config = engine_config(argv, kind)
    except (Exception, SystemExit) as e:  # noqa: BLE001  (vLLM's own rejection, reported)
        plan.add("vLLM", f"{vllm.__version__} rejects these arguments: {e}")
        plan.refusals.append("by vLLM itself (above), before any code of ours runs")
        return plan, 2
    why = "--platform" if here else "no GPU here"
    resolved_for = (f"a {kind.upper()} platform stand-in ({why})" if kind
                    else f"this machine ({type(current_platform).__name__})")
    mode = config.compilation_config.mode
    arch = list(config.model_config.architectures or ())
    plan.add("vLLM", f"{vllm.__version__}, resolved for {resolved_for}")
    plan.add("model", f"{config.model_config.model} ({', '.join(arch)})")
    plan.add("compilation", f"mode {getattr(mode, 'name', mode)}, backend "
                            f"{config.compilation_config.backend or 'inductor'}")
    if not set(arch) & set(K3_ARCHITECTURES):
        plan.add("K3", "not a Kimi K3 model: the plugin builds nothing and wraps nothing")
        return plan, 0
    k3_rows(plan, config, environ, kind == "rocm" if kind else current_platform.is_rocm())
    plan.add("not seen", UNSEEN.format(platform=resolved_for))
    return plan, 1 if plan.refusals else 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m kimi_passes vllm-plan [--platform cuda|rocm] "
              "<the arguments of your `vllm serve`>\n"
              + (__doc__ or "").split("\n\n")[1])
        return 0 if argv else 2
    try:
        plan, status = run(argv)
    except ValueError as e:
        print(f"kimi-passes vllm-plan: {e}", file=sys.stderr)
        return 2
    print(plan.text())
    return status
