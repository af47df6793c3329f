"""``KimiPassConfig``: every option of the kimi passes, resolved once, as one frozen record.

The backend (``KimiBackend``), the pass manager (``kimi_passes.pass_manager``) and the vLLM
pass (``kimi_passes.vllm.KimiVllmPass``) take this record; none of them spells an option
again. Each option is documented here, on its field (``OPTIONS``); the README's options
list is generated from it (``options_doc``) and a test holds the two together.
``key()`` is what every ``uuid()`` of a pass manager hashes: two records that compile
differently never share a cache entry.

Built once, from keyword options (``build``), or from a ``torch.compile`` options dict
that also holds Inductor config patches (``split``): the stream from the ``aux_stream``
option, else ``$KIMI_PASSES_AUX_STREAM``, else the drafter config's ``aux_hidden_stream``,
else ``"attn_res"``; the drafter's capture ids read from ``draft_config``. Nothing is read
later (inside ``forward`` or a compile), except the drafter vLLM serves (``with_drafter``).
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kimi_passes.config.drafter import DrafterTaps, drafter_capture_ids
from kimi_passes.config.stream import STREAMS, resolve_aux_stream


def _option(default: Any, doc: str, *, name: str | None = None, shown: str | None = None):
    """A field documented once: ``doc``; ``name``: the option users pass, when it is not the
    field's (``draft_config`` builds ``drafter``); ``shown``: the default as documented."""
    return field(default=default, metadata={"doc": doc, "option": name, "shown": shown})


@dataclass(frozen=True)
class KimiPassConfig:
    """The kimi passes' options (see the module docstring). Build with ``build(**options)``."""

    aux_stream: str = _option(
        "attn_res",
        '`"attn_res"` (each tap reads the pre-norm mixture its consumer reads) or `"prefix"` '
        "(the legacy running prefix); resolved once: this option wins; else "
        "`$KIMI_PASSES_AUX_STREAM` and the drafter config's `aux_hidden_stream`, which must "
        "agree unless `$KIMI_PASSES_AUX_STREAM_AB=1` (an A/B run: the variable's, warned); "
        "else `\"attn_res\"`",
        shown="resolved")
    drafter: DrafterTaps | None = _option(
        None,
        "a drafter config dict, or the path of its `config.json` (or folder): every compiled "
        "graph must tap exactly the capture ids it declares (docs/reference.md, "
        '"Drafter configs"), and its `aux_hidden_stream` names the stream',
        name="draft_config")
    fuse_capture: bool = _option(
        True,
        "a tap is read out of its consumer's kernel (`attn_res_capture`, one extra `[T, H]` "
        "write); False reads it with a separate `attn_res_mix` (a second read of the bank, "
        "as vLLM's flag does)")
    fuse_torch_mixing: bool = _option(
        True,
        "AttnRes mixing written in plain torch becomes a kimi op first (`AttnResFusionPass`, "
        "docs/design.md section 8); False leaves it to Inductor")
    fuse_quant: bool = _option(
        True,
        "an AttnRes output read only by a dynamic per-token FP8 quant (vLLM's `QuantFP8`, "
        "the AMD kernel's formula) is quantized in the AttnRes kernel (`attn_res_quant`, "
        "`FuseQuantPass`, docs/design.md section 10); False leaves the quant separate")
    lower_kimi_ops: bool = _option(
        True,
        "on CPU, once the passes have run, every kimi op call becomes generated code fused "
        "with its neighbours (docs/design.md section 9); False keeps the op calls")

    def __post_init__(self) -> None:
        if self.aux_stream not in STREAMS:
            raise ValueError(f"KimiPassConfig: unknown aux_stream {self.aux_stream!r}; use one "
                             f"of {list(STREAMS)}")
        if self.drafter is not None and not isinstance(self.drafter, DrafterTaps):
            raise TypeError(
                f"KimiPassConfig: drafter must be a DrafterTaps, got "
                f"{type(self.drafter).__name__}; pass the drafter's config as "
                "KimiPassConfig.build(draft_config=...)")
        for f in dataclasses.fields(self):
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise TypeError(f"KimiPassConfig: {f.name} must be True or False, got "
                                f"{getattr(self, f.name)!r}")

    # -- building ---------------------------------------------------------------------------

    @classmethod
    def build(cls, **options) -> KimiPassConfig:
        """The record for ``options`` (the names of ``option_names()``), resolved once.

        Raises ``TypeError`` naming an unknown option and ``ValueError`` for an unknown
        stream or a drafter config that cannot be read (even when ``aux_stream`` overrides
        its stream: a malformed config is an error, not a surprise on the next run).
        """
        unknown = sorted(set(options) - set(cls.option_names()))
        if unknown:
            raise TypeError(f"KimiPassConfig: unknown option(s) {unknown}; the options are "
                            f"{list(cls.option_names())}")
        draft_config = options.pop("draft_config", None)
        stream = resolve_aux_stream(options.pop("aux_stream", None), draft_config)
        return cls(aux_stream=stream, drafter=drafter_capture_ids(draft_config), **options)

    @classmethod
    def split(cls, options: Mapping[str, Any]) -> tuple[KimiPassConfig, dict[str, Any]]:
        """``(record, the rest)``: ``torch.compile(..., options=)`` holds both the kimi
        options and Inductor config patches."""
        names = set(cls.option_names())
        ours = {k: v for k, v in options.items() if k in names}
        return cls.build(**ours), {k: v for k, v in options.items() if k not in names}

    def with_drafter(self, drafter: DrafterTaps | None) -> KimiPassConfig:
        """This record checking ``drafter`` instead (the one a host such as vLLM serves)."""
        return dataclasses.replace(self, drafter=drafter)

    # -- what it is -------------------------------------------------------------------------

    def key(self) -> dict[str, Any]:
        """Every option as JSON-able values: what a pass manager's ``uuid()`` hashes."""
        key: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                               if f.name != "drafter"}
        key["drafter"] = None if self.drafter is None else self.drafter.key_options()
        return key

    def __repr__(self) -> str:
        fields = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                  if f.name != "drafter"]
        if self.drafter is not None:
            fields.insert(1, f"drafter_capture_ids={list(self.drafter.capture_ids)}")
        return f"KimiPassConfig({', '.join(fields)})"

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The options users pass (``draft_config`` for the ``drafter`` field)."""
        return tuple(f.metadata["option"] or f.name for f in dataclasses.fields(cls))

    @classmethod
    def options_doc(cls) -> str:
        """The options as a Markdown list, wrapped to 92 columns (the README's, generated
        from the fields): one item per option, its default, then what it does."""
        items = []
        for f in dataclasses.fields(cls):
            default = f.metadata["shown"] or repr(f.default)
            head = f"- `{f.metadata['option'] or f.name}` (default: {default}): "
            items.append(textwrap.fill(head + f.metadata["doc"], width=92,
                                       subsequent_indent="  ", break_on_hyphens=False,
                                       break_long_words=False))
        return "\n".join(items)


#: The options users pass, in the record's order.
OPTIONS = KimiPassConfig.option_names()
