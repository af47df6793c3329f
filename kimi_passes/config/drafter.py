"""Which capture ids a drafter was trained on, read from its config in any shipped spelling.

A drafter reads hidden states from a fixed list of target layers, and its config says
which, in one of several spellings with two id conventions (README "Drafter configs"):

=============================================  ==========  =========================
key                                            ids are     capture id
=============================================  ==========  =========================
``eagle_aux_hidden_state_layer_ids``           capture     as is
``eagle_config.eagle_aux_hidden_state_...``    capture     as is
``eagle_config.layer_ids``                     capture     as is
``dflash_config.layer_ids``                    capture     as is
``dflash_config.target_layer_ids``             layer       id + 1
``dspark_target_layer_ids``                    layer       id + 1 (as is for deepseek_v41)
``target_layer_ids`` (dense DSpark)            layer       id + 1
``aux_hidden_state_layer_ids`` (speculators    capture     as is (vLLM's ``algos.py``
dflash, dflash2, dspark)                                   copies it)
=============================================  ==========  =========================

Capture id k is what layer k reads (vLLM's convention): 0 the embedding, ``num_layers``
what the final norm reads. vLLM reads these keys in a fixed order and silently takes the
first one present (its two readers even disagree on the order); here every spelling
present is converted and two that disagree are an error naming both. An empty or ``None``
list counts as absent, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from kimi_passes.config.checkpoint import load_draft_config

AS_IS = "capture ids, used as they are"
PLUS_ONE = "layer ids, capture id = layer id + 1"

#: speculators_model_type values whose raw ``aux_hidden_state_layer_ids`` vLLM's
#: ``algos.py`` copies to ``eagle_aux_hidden_state_layer_ids`` as they are.
SPECULATORS_AUX_TYPES = ("dflash", "dflash2", "dspark")
#: Formats whose drafter is handed the target's final state separately (speculators'
#: DFlash converter drops capture id ``num_layers`` for that reason): a tap at
#: ``num_layers`` the drafter does not declare is allowed for them.
FINAL_STATE_SEPARATE = ("dflash",)


@dataclass(frozen=True)
class Spelling:
    """One place a config names its layer list: ``key`` (dotted), offset, format."""

    key: str
    offset: int
    format: str

    @property
    def convention(self) -> str:
        return PLUS_ONE if self.offset else AS_IS


@dataclass(frozen=True)
class DrafterTaps:
    """The capture ids a drafter reads, and where in its config they came from."""

    #: vLLM's convention, in the config's order (the order the drafter concatenates them).
    capture_ids: tuple[int, ...]
    #: The key(s) read, e.g. ``"dflash_config.target_layer_ids"``; several when the
    #: config spells the list more than once and the spellings agree.
    key: str
    #: How that key's ids become capture ids (``AS_IS`` or ``PLUS_ONE``).
    convention: str
    #: ``"eagle3"``, ``"dflash"`` or ``"dspark"``.
    format: str
    #: Where the config came from (its path, or ``"a dict"``).
    source: str = "a dict"

    @property
    def final_state_separate(self) -> bool:
        """Does the drafter take the final state (capture id num_layers) separately?"""
        return self.format in FINAL_STATE_SEPARATE

    def describe(self) -> str:
        return f"{self.key} ({self.convention}) in the drafter config {self.source}"

    def key_options(self) -> dict:
        """What a compile depends on (part of the aux-stream pass's cache key)."""
        return {"drafter_capture_ids": list(self.capture_ids),
                "final_state_separate": self.final_state_separate}


def drafter_capture_ids(draft_config, num_layers: int | None = None,
                        source: str | None = None) -> DrafterTaps | None:
    """The capture ids ``draft_config`` declares (vLLM's convention), or None if it declares none.

    ``draft_config``: a dict, a ``config.json`` path or its folder, or a config object
    with ``to_dict()`` (a transformers ``PretrainedConfig``, vLLM's ``hf_config``).
    Raw speculators configs (``speculators_model_type``) are read as vLLM converts them.
    ``num_layers``: the target's layer count, when known (ids above it are an error).
    ``source``: how messages name the config (default: its path, or "a dict").

    Raises ``ValueError`` naming the key for a list that is not distinct non-negative ints
    (or above ``num_layers``), for two spellings that disagree, and for a raw
    ``aux_hidden_state_layer_ids`` whose convention the config does not say.
    """
    if draft_config is None:
        return None
    if hasattr(draft_config, "to_dict") and not isinstance(draft_config, dict):
        source = source or f"a {type(draft_config).__name__}"
        config = draft_config.to_dict()
    else:
        source = source or ("a dict" if isinstance(draft_config, dict) else str(draft_config))
        config = load_draft_config(draft_config)
    found = list(_spellings(config, source))
    if not found:
        return None
    first, ids = found[0]
    for other, other_ids in found[1:]:
        if other_ids != ids:
            raise ValueError(
                f"kimi_passes: the drafter config {source} spells its layer list twice and "
                f"the two disagree: {first.key} ({first.convention}) gives capture ids "
                f"{list(ids)}, {other.key} ({other.convention}) gives {list(other_ids)}. "
                "vLLM would silently take one of them (which one depends on its runner); "
                "fix the config so that both name the layers the drafter was trained on, "
                "or remove one")
    if num_layers is not None:
        beyond = [k for k in ids if k > num_layers]
        if beyond:
            raise ValueError(
                f"kimi_passes: {first.key} ({first.convention}) in the drafter config "
                f"{source} gives capture ids {beyond} beyond the target's num_layers="
                f"{num_layers} (capture ids run from 0, the embedding, to {num_layers}, what "
                "the final norm reads): the drafter was trained on another target model")
    formats = {s.format for s, _ in found}
    return DrafterTaps(
        capture_ids=ids,
        key=" = ".join(s.key for s, _ in found),
        convention=first.convention if len({s.convention for s, _ in found}) == 1 else (
            "; ".join(f"{s.key}: {s.convention}" for s, _ in found)),
        format=next(f for f in ("dflash", "dspark", "eagle3") if f in formats),
        source=source,
    )


def _spellings(config: dict, source: str):
    """Every (spelling, capture ids) the config holds, in vLLM's reading order."""
    for spelling, value in _candidates(config, source):
        if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
            continue  # vLLM: `if not layer_ids` -> absent
        yield spelling, _capture_ids(value, spelling, source)


def _candidates(config: dict, source: str):
    model_type = config.get("model_type")
    yield Spelling("eagle_aux_hidden_state_layer_ids", 0, "eagle3"), config.get(
        "eagle_aux_hidden_state_layer_ids")
    dflash = _section(config, "dflash_config", source)
    eagle = _section(config, "eagle_config", source)
    yield Spelling("dflash_config.target_layer_ids", 1, "dflash"), dflash.get(
        "target_layer_ids")
    yield Spelling("eagle_config.eagle_aux_hidden_state_layer_ids", 0, "eagle3"), eagle.get(
        "eagle_aux_hidden_state_layer_ids")
    dspark_offset = 0 if model_type == "deepseek_v41" else 1
    yield Spelling("dspark_target_layer_ids", dspark_offset, "dspark"), config.get(
        "dspark_target_layer_ids")
    yield Spelling("target_layer_ids", 1, "dspark"), config.get("target_layer_ids")
    yield Spelling("dflash_config.layer_ids", 0, "dflash"), dflash.get("layer_ids")
    yield Spelling("eagle_config.layer_ids", 0, "eagle3"), eagle.get("layer_ids")
    raw = config.get("aux_hidden_state_layer_ids")
    if raw is not None:
        kind = config.get("speculators_model_type")
        if kind not in SPECULATORS_AUX_TYPES:
            said = (f"speculators_model_type={kind!r}" if kind is not None
                    else "no speculators_model_type")
            raise ValueError(
                f"kimi_passes: the drafter config {source} has aux_hidden_state_layer_ids "
                f"but {said}, so its id convention is unknown (vLLM converts it only for "
                f"speculators_model_type in {list(SPECULATORS_AUX_TYPES)}). Set "
                "speculators_model_type, or write the list as "
                "eagle_aux_hidden_state_layer_ids (capture ids)")
        fmt = "dspark" if kind == "dspark" else "dflash"
        yield Spelling(f"aux_hidden_state_layer_ids (speculators {kind})", 0, fmt), raw


def _section(config: dict, name: str, source: str) -> dict:
    value = config.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(
            f"kimi_passes: {name} in the drafter config {source} must be a JSON object, got "
            f"{type(value).__name__} {value!r}")
    return value


def _capture_ids(value, spelling: Spelling, source: str) -> tuple[int, ...]:
    where = f"{spelling.key} in the drafter config {source}"
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"kimi_passes: {where} must be a list of ints, got {value!r}")
    ids = tuple(v + spelling.offset for v in value)
    if len(set(ids)) != len(ids):
        dup = sorted({v for v in value if list(value).count(v) > 1})
        raise ValueError(f"kimi_passes: {where} names {dup} more than once: {list(value)}")
    negative = [v for v, k in zip(value, ids, strict=True) if k < 0]
    if negative:
        lowest = -spelling.offset
        raise ValueError(
            f"kimi_passes: {where} holds {negative}, below {lowest} ({spelling.convention}: "
            "capture id 0 is the embedding)")
    return ids
