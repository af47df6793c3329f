"""The aux stream a vLLM K3 process serves, resolved once at the model's init.

Invariant: ``config/stream.py``'s one rule (``settle``) over three sources, each asking for
a stream or saying nothing:

1. ``$KIMI_PASSES_AUX_STREAM`` (``attn_res`` or ``prefix``; unset or empty: nothing);
2. vLLM's own ``$VLLM_KIMI_K3_AUX_ATTN_RES_STREAM``, an integer as vLLM reads it (non-zero
   asks for ``attn_res``, which the route serves with its fused capture; ``0`` or unset:
   nothing);
3. the served drafter's declaration, for a method whose drafter reads aux states
   (``versions.drafter_reads_aux``), read from the checkpoint's own ``config.json``
   (``config/checkpoint.py``: the folder, or the Hugging Face cache entry, vLLM resolved
   ``draft_model_config.model`` and its revision to), in vLLM's format or speculators';
   a method with no drafter checkpoint (``extract_hidden_states``) has only the config the
   user gave inline;
4. none of them: vLLM's default, the running prefix, and the route stays out of the way.

The two variables disagreeing, or one disagreeing with the drafter, is a
``StreamConflict`` naming both (a drafter trained on one stream and fed the other loses
about half its acceptance length), unless ``$KIMI_PASSES_AUX_STREAM_AB=1`` asks for an
A/B run against the declaration (served, warned at startup); an unknown value is a
``ValueError`` naming its source. Reads vLLM's config objects only; imports no vLLM module.
"""

from __future__ import annotations

from collections.abc import Mapping

from kimi_passes.config import checkpoint
from kimi_passes.config.stream import (
    AB_VAR,
    DRAFTER,
    ENV_VAR,
    FLAG,
    OURS,
    Ask,
    StreamChoice,
    StreamConflict,
    ab_switch,
    declared,
    ours,
    settle,
)

#: vLLM's own switch for its K3 aux stream (``vllm.envs``).
VLLM_FLAG = "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM"
DEFAULT = "default"
#: Speculative methods with no drafter checkpoint: the config is the one given inline.
NO_CHECKPOINT = ("extract_hidden_states",)

__all__ = ["AB_VAR", "DRAFTER", "ENV_VAR", "FLAG", "OURS", "REFUSALS", "Ask", "StreamChoice",
           "StreamConflict", "VllmRouteError", "declaration", "drafter", "from_environment",
           "ours", "resolve", "vllm_flag"]


class VllmRouteError(ValueError):
    """A vLLM configuration in which the asked stream cannot be served; names the fix."""


#: What stops a K3 process at model init, and what ``vllm-plan`` reports as refused.
REFUSALS = (VllmRouteError, StreamConflict, checkpoint.CheckpointError)


def vllm_flag(environ: Mapping[str, str]) -> Ask | None:
    """vLLM's flag, read as ``vllm.envs`` reads it (``bool(int(value))``)."""
    value = environ.get(VLLM_FLAG)
    if value is None:
        return None
    try:
        on = bool(int(value))
    except ValueError:
        raise ValueError(
            f"kimi_passes: ${VLLM_FLAG}={value!r} is not an integer, as vLLM reads it (its "
            f"envs.py: bool(int(...))): set it to 1 (the attn_res stream) or 0") from None
    if not on:
        return None
    return Ask(FLAG, "attn_res", f"${VLLM_FLAG}={value}", f"unset ${VLLM_FLAG}")


def declaration(speculative_config) -> checkpoint.Declaration | None:
    """What the served drafter's checkpoint declares, if its method reads aux states."""
    draft = getattr(speculative_config, "draft_model_config", None)
    if draft is None:
        return None
    from kimi_passes.vllm import versions  # at model init only: the plugin imports stay small

    if not versions.drafter_reads_aux(speculative_config):
        return None
    method = getattr(speculative_config, "method", None)
    if method in NO_CHECKPOINT:
        config = draft.hf_config.to_dict() if hasattr(draft.hf_config, "to_dict") \
            else vars(draft.hf_config)
        return checkpoint.declaration(config, f"the {method} drafter's config (given inline)")
    return checkpoint.served(str(draft.model), getattr(draft, "revision", None),
                             f"the {method} drafter")


def drafter(speculative_config) -> Ask | None:
    """The served drafter's declared ``aux_hidden_stream`` as an ask."""
    return declared(declaration(speculative_config))


def from_environment(environ: Mapping[str, str]) -> tuple[Ask, ...]:
    """The variables' asks (a bad value raises): what ``register`` checks at once."""
    ab_switch(environ)
    return tuple(a for a in (ours(environ), vllm_flag(environ)) if a is not None)


def resolve(environ: Mapping[str, str], vllm_config) -> StreamChoice:
    """The stream for ``vllm_config`` (resolved) under ``environ``; see the module
    docstring. Raises ``StreamConflict`` when sources disagree without the A/B switch."""
    choice = settle(from_environment(environ),
                    drafter(getattr(vllm_config, "speculative_config", None)), environ)
    return StreamChoice("prefix") if choice is None else choice
