"""Which aux stream is served: one rule for every route, resolved once, never in ``forward``.

Sources, each asking for a stream or saying nothing:

- the drafter checkpoint's declaration (``config/checkpoint.py``): the seed's contract, the
  checkpoint says which stream it was trained on;
- the user's variables: ``$KIMI_PASSES_AUX_STREAM`` and, on vLLM's K3, vLLM's own
  ``$VLLM_KIMI_K3_AUX_ATTN_RES_STREAM``;
- under ``kimi_backend``, the ``aux_stream=`` argument.

Invariant (``settle``): the variables that ask must agree with each other, else
``StreamConflict``. A variable that disagrees with the drafter's declaration is a
``StreamConflict`` naming the A/B switch, unless ``$KIMI_PASSES_AUX_STREAM_AB=1`` asks for
the A/B deliberately: then the variable's stream is served and a WARNING names the
declaration and the override, on every route. ``kimi_backend``'s ``aux_stream=`` argument
is the caller's code beside its ``draft_config``, so it wins over both, unwarned. Nothing
asking: the route's default (``kimi_backend``: attn_res; vLLM: vLLM's own, the prefix).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import NamedTuple

from kimi_passes.config import checkpoint

#: The streams a tap can read: the consumer's pre-norm mixture, or the legacy running prefix.
STREAMS = ("attn_res", "prefix")
ENV_VAR = "KIMI_PASSES_AUX_STREAM"
#: ``1``: a variable's stream overrides the drafter's declaration (an A/B run), warned.
AB_VAR = "KIMI_PASSES_AUX_STREAM_AB"
DEFAULT_STREAM = "attn_res"
DRAFT_KEY = checkpoint.DRAFT_KEY
OURS, FLAG, DRAFTER, ARGUMENT = "ours", "vllm_flag", "drafter", "argument"

log = logging.getLogger(__name__)


class StreamConflict(ValueError):
    """Two sources ask for different aux streams; names both and the fix."""


class Ask(NamedTuple):
    """One source asking for ``stream``: ``kind`` (``OURS`` ...), ``said`` (what it said,
    for messages), ``undo`` (how the user withdraws it)."""

    kind: str
    stream: str
    said: str
    undo: str


class StreamChoice(NamedTuple):
    """The stream served, every source that asked for it (``asked`` empty: the route's
    default) and the drafter's declaration an A/B run overrides (``overridden``)."""

    stream: str
    asked: tuple[Ask, ...] = ()
    overridden: Ask | None = None

    @property
    def source(self) -> str:
        """Where the stream came from, for the startup line and the plan."""
        if not self.asked:
            return "vLLM's default (no source asks for a stream)"
        said = " and ".join(a.said for a in self.asked)
        if self.overridden is None:
            return said
        return (f"{said}, overriding {self.overridden.said} for an A/B run "
                f"(${AB_VAR}=1)")

    @property
    def undo(self) -> str:
        if not self.asked:
            return "nothing asks for it"
        return "; ".join(a.undo for a in self.asked)

    def override_warning(self) -> str | None:
        """The WARNING an A/B run logs at startup, or None."""
        if self.overridden is None:
            return None
        return (f"kimi_passes: A/B run (${AB_VAR}=1): serving the {self.stream} stream "
                f"({' and '.join(a.said for a in self.asked)}) to a drafter whose checkpoint "
                f"declares {self.overridden.stream!r} ({self.overridden.said}); it was "
                "trained on the other stream, so expect a lower acceptance length. Unset "
                f"${AB_VAR} to serve the declared stream")

    @classmethod
    def given(cls, stream: str) -> StreamChoice:
        """``stream`` as ``$KIMI_PASSES_AUX_STREAM`` would ask for it (tests, tools)."""
        return cls(check_stream(stream, "the caller"),
                   (Ask(OURS, stream, f"${ENV_VAR}={stream}", f"unset ${ENV_VAR}"),))


def check_stream(value, source: str) -> str:
    """``value`` if it names a stream, else a ``ValueError`` naming ``source``."""
    if value not in STREAMS:
        raise ValueError(
            f"kimi_passes: unknown aux stream {value!r} from {source}; use one of "
            f"{list(STREAMS)} ('attn_res': the pre-norm AttnRes mixture each consumer reads, "
            "'prefix': the legacy running prefix)"
        )
    return value


def ours(environ: Mapping[str, str]) -> Ask | None:
    """``$KIMI_PASSES_AUX_STREAM`` (unset or empty: nothing)."""
    value = environ.get(ENV_VAR)
    if not value:
        return None
    return Ask(OURS, check_stream(value, f"${ENV_VAR}"), f"${ENV_VAR}={value}",
               f"unset ${ENV_VAR}")


def ab_switch(environ: Mapping[str, str]) -> bool:
    """``$KIMI_PASSES_AUX_STREAM_AB``: ``1`` on, ``0``, empty or unset off."""
    value = environ.get(AB_VAR, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"kimi_passes: ${AB_VAR}={value!r}: set it to 1 (a variable's "
                         "stream overrides the drafter's declaration, warned) or unset it")
    return value == "1"


def declared(decl: checkpoint.Declaration | None) -> Ask | None:
    """The drafter checkpoint's declaration as an ask (a bad value names its place)."""
    if decl is None:
        return None
    stream = check_stream(decl.value, decl.where)
    return Ask(DRAFTER, stream, f"{decl.where} = {stream!r}",
               f"serve a drafter trained on the stream you want ({decl.where} names the "
               "one it was trained on)")


def settle(variables: tuple[Ask, ...], drafter: Ask | None,
           environ: Mapping[str, str]) -> StreamChoice | None:
    """The module's rule for the variables' asks and the drafter's; None: nothing asks."""
    ab = ab_switch(environ)
    _agree(variables)
    if drafter is None or not variables:
        asked = variables or ((drafter,) if drafter is not None else ())
        return StreamChoice(asked[0].stream, asked) if asked else None
    if variables[0].stream == drafter.stream:
        return StreamChoice(drafter.stream, (*variables, drafter))
    if not ab:
        _agree((*variables, drafter), f"; or, for a deliberate A/B run against the "
                                      f"declaration, set ${AB_VAR}=1")
    return StreamChoice(variables[0].stream, variables, overridden=drafter)


def _agree(asked: tuple[Ask, ...], ab: str = "") -> None:
    other = next((a for a in asked if a.stream != asked[0].stream), None) if asked else None
    if other is None:
        return
    first = asked[0]
    raise StreamConflict(
        f"kimi_passes: two sources ask for different aux streams: {first.said} asks for "
        f"{first.stream!r}, {other.said} asks for {other.stream!r}. A drafter fed the "
        "stream it was not trained on loses about half its acceptance length, silently, "
        f"so this is stopped here. Make them agree: {first.undo}, or {other.undo}{ab}")


def check_fixed(stream: str, who: str, drafter: Ask | None,
                environ: Mapping[str, str] = os.environ) -> str | None:
    """A stream fixed before the drafter was known (``who``, e.g. a compiled pass) against
    that drafter's declaration: ``settle``'s rule, the fixed stream asking as a variable
    does. Returns the A/B run's WARNING (the caller logs it once), or None."""
    fixed = Ask(ARGUMENT, stream, f"{who} serves {stream!r}",
                f"build {who} for the declared stream")
    choice = settle((fixed,), drafter, environ)
    return None if choice is None else choice.override_warning()


def choose_aux_stream(aux_stream: str | None = None, draft_config=None,
                      environ: Mapping[str, str] = os.environ) -> StreamChoice:
    """``kimi_backend``'s stream: the ``aux_stream`` argument, else ``settle`` over
    ``$KIMI_PASSES_AUX_STREAM`` and the drafter's declaration, else attn_res.

    The drafter config is read and checked even when the argument overrides it, so a
    malformed one is an error rather than a surprise on the next run without it.
    """
    drafter = declared(checkpoint.read(draft_config))
    if aux_stream is not None:
        stream = check_stream(aux_stream, "the aux_stream argument")
        return StreamChoice(stream, (Ask(ARGUMENT, stream, f"aux_stream={stream!r}",
                                         "drop the aux_stream argument"),))
    variable = ours(environ)
    choice = settle((variable,) if variable else (), drafter, environ)
    if choice is None:
        return StreamChoice(DEFAULT_STREAM)
    warning = choice.override_warning()
    if warning:
        log.warning("%s", warning)
    return choice


def resolve_aux_stream(aux_stream: str | None = None, draft_config=None) -> str:
    """The stream ``choose_aux_stream`` serves, by name."""
    return choose_aux_stream(aux_stream, draft_config).stream
