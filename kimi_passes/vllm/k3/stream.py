"""The aux stream a vLLM K3 process serves, resolved once at the model's init.

Invariant: four sources, read in this order; each asks for a stream or says nothing:

1. ``$KIMI_PASSES_AUX_STREAM`` (``attn_res`` or ``prefix``; unset or empty: nothing);
2. vLLM's own ``$VLLM_KIMI_K3_AUX_ATTN_RES_STREAM``, an integer as vLLM reads it (non-zero
   asks for ``attn_res``, which the route serves with its fused capture; ``0`` or unset:
   nothing);
3. the served drafter's ``aux_hidden_stream`` (``speculative_config.draft_model_config.
   hf_config``), for a method whose drafter reads aux states (``versions.drafter_reads_aux``);
4. none of them: vLLM's default, the running prefix, and the route stays out of the way.

Two sources asking for different streams is a ``StreamConflict`` naming both (a drafter
trained on one stream and fed the other loses about half its acceptance length); an
unknown value is a ``ValueError`` naming its source. Reads vLLM's config objects only;
imports no vLLM module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from kimi_passes.config.stream import DRAFT_KEY, ENV_VAR, check_stream, draft_stream

#: vLLM's own switch for its K3 aux stream (``vllm.envs``).
VLLM_FLAG = "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM"
OURS, FLAG, DRAFTER, DEFAULT = "ours", "vllm_flag", "drafter", "default"


class VllmRouteError(ValueError):
    """A vLLM configuration in which the asked stream cannot be served; names the fix."""


class StreamConflict(VllmRouteError):
    """Two sources ask for different aux streams."""


class Ask(NamedTuple):
    """One source asking for ``stream``: ``kind`` (``OURS`` ...), ``said`` (what it said,
    for messages), ``undo`` (how the user withdraws it)."""

    kind: str
    stream: str
    said: str
    undo: str


class StreamChoice(NamedTuple):
    """The stream served and every source that asked (``asked`` empty: vLLM's default)."""

    stream: str
    asked: tuple[Ask, ...] = ()

    @property
    def source(self) -> str:
        """Where the stream came from, for the startup line and the plan."""
        if not self.asked:
            return "vLLM's default (no source asks for a stream)"
        return " and ".join(a.said for a in self.asked)

    @property
    def undo(self) -> str:
        if not self.asked:
            return "nothing asks for it"
        return "; ".join(a.undo for a in self.asked)

    @classmethod
    def given(cls, stream: str) -> StreamChoice:
        """``stream`` as ``$KIMI_PASSES_AUX_STREAM`` would ask for it (tests, tools)."""
        return cls(check_stream(stream, "the caller"),
                   (Ask(OURS, stream, f"${ENV_VAR}={stream}", f"unset ${ENV_VAR}"),))


def ours(environ: Mapping[str, str]) -> Ask | None:
    value = environ.get(ENV_VAR)
    if not value:
        return None
    return Ask(OURS, check_stream(value, f"${ENV_VAR}"), f"${ENV_VAR}={value}",
               f"unset ${ENV_VAR}")


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


def drafter(speculative_config) -> Ask | None:
    """The served drafter's declared ``aux_hidden_stream``, if it reads aux states."""
    method = getattr(speculative_config, "method", None)
    draft = getattr(speculative_config, "draft_model_config", None)
    hf_config = getattr(draft, "hf_config", None)
    if hf_config is None:
        return None
    from kimi_passes.vllm import versions  # at model init only: the plugin imports stay small

    if not versions.drafter_reads_aux(speculative_config):
        return None
    config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else vars(hf_config)
    where = f"the {method} drafter's config ({getattr(draft, 'model', '?')}: {DRAFT_KEY})"
    stream = draft_stream(config, where)
    if stream is None:
        return None
    return Ask(DRAFTER, stream, f"{where} = {stream!r}",
               f"serve a drafter trained on the stream you want ({where} names the one it "
               "was trained on)")


def from_environment(environ: Mapping[str, str]) -> tuple[Ask, ...]:
    """The variables' asks (a bad value raises): what ``register`` checks at once."""
    return tuple(a for a in (ours(environ), vllm_flag(environ)) if a is not None)


def resolve(environ: Mapping[str, str], vllm_config) -> StreamChoice:
    """The stream for ``vllm_config`` (resolved) under ``environ``; see the module
    docstring. Raises ``StreamConflict`` when two sources disagree."""
    asked = from_environment(environ)
    declared = drafter(getattr(vllm_config, "speculative_config", None))
    asked += (declared,) if declared is not None else ()
    streams = {a.stream for a in asked}
    if len(streams) > 1:
        first = asked[0]
        other = next(a for a in asked if a.stream != first.stream)
        raise StreamConflict(
            f"kimi_passes: two sources ask for different aux streams: {first.said} asks for "
            f"{first.stream!r}, {other.said} asks for {other.stream!r}. A drafter fed the "
            "stream it was not trained on loses about half its acceptance length, silently, "
            f"so vLLM is stopped here. Make them agree: {first.undo}, or {other.undo}")
    if not asked:
        return StreamChoice("prefix")
    return StreamChoice(asked[0].stream, asked)
