"""A drafter checkpoint's ``config.json``, read where it ships, and the stream it declares.

Invariant: one reader answers "which aux stream was this drafter trained on" for every
route (``kimi_backend(draft_config=...)``, vLLM's eager K3, ``KimiVllmPass``, ``vllm-plan``),
and it reads the checkpoint's own file, never a host's converted copy of it: vLLM turns a
speculators-format checkpoint into its ``SpeculatorsConfig``, which keeps only the fields
vLLM knows, so ``aux_hidden_stream`` is gone from ``draft_model_config.hf_config``.

Where a checkpoint is: a dict (given inline), a ``config.json`` path or its folder, or
what vLLM resolved ``draft_model_config.model`` to (a local folder, or a Hugging Face hub
id at ``revision`` in the local Hugging Face cache, where vLLM put it or found it
offline). A file that cannot be read where the checkpoint is said to be is an error
naming the path: never "no declaration".

Where in the file (``PLACES``): the top level (vLLM's format, and speculators' layout,
``speculators_model_type`` and ``speculators_config``, which has no field of its own for
it), ``dflash_config`` (vLLM's DFlash format, and where other engines' DFlash readers
look), ``eagle_config`` and ``speculators_config``. Two places that disagree are an error
naming both; agreeing places count once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: The key a drafter checkpoint declares its aux stream with.
DRAFT_KEY = "aux_hidden_stream"
#: The sections of a config.json that may hold ``DRAFT_KEY`` ("" is the top level).
PLACES = ("", "dflash_config", "eagle_config", "speculators_config")


class CheckpointError(ValueError):
    """A drafter checkpoint's config cannot be read, or it says two things."""


@dataclass(frozen=True)
class Declaration:
    """What a checkpoint says: ``value`` (as written; the caller checks it is a stream)
    at ``where`` (the file and key, for messages and the plan)."""

    value: object
    where: str


def load_draft_config(draft_config) -> dict:
    """A drafter config as a dict: given as a dict, a config.json path, or its folder."""
    if isinstance(draft_config, dict):
        return draft_config
    path = _config_path(Path(draft_config))
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"kimi_passes: drafter config {path} does not exist") from e
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"kimi_passes: drafter config {path} cannot be read ({e}); fix its permissions "
            "or point at a readable copy") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"kimi_passes: drafter config {path} is not valid JSON ({e.msg} at line "
            f"{e.lineno}); fix the file or pass aux_stream explicitly"
        ) from e
    if not isinstance(data, dict):
        raise CheckpointError(
            f"kimi_passes: drafter config {path} must hold a JSON object, got "
            f"{type(data).__name__}"
        )
    return data


def declaration(config: dict, source: str) -> Declaration | None:
    """The stream ``config`` (read from ``source``) declares, from any of ``PLACES``."""
    found: list[Declaration] = []
    for place in PLACES:
        section = config.get(place) if place else config
        if isinstance(section, dict) and DRAFT_KEY in section:
            key = f"{place}.{DRAFT_KEY}" if place else DRAFT_KEY
            found.append(Declaration(section[DRAFT_KEY], f"{source}: {key}"))
    if len({repr(d.value) for d in found}) > 1:
        said = "; ".join(f"{d.where} = {d.value!r}" for d in found)
        raise CheckpointError(
            f"kimi_passes: the drafter checkpoint declares two aux streams ({said}): it was "
            f"trained on one of them; remove the other {DRAFT_KEY!r} from its config.json")
    if not found:
        return None
    return Declaration(found[0].value, " and ".join(d.where for d in found))


def read(draft_config) -> Declaration | None:
    """The declaration of a checkpoint given as a dict, a config.json path or its folder."""
    if draft_config is None:
        return None
    source = "the drafter config (a dict)" if isinstance(draft_config, dict) else \
        f"the drafter config {_config_path(Path(draft_config))}"
    return declaration(load_draft_config(draft_config), source)


def _config_path(path: Path) -> Path:
    return path / "config.json" if path.is_dir() else path


def locate(model: str, revision: str | None) -> Path:
    """The ``config.json`` of the checkpoint ``model`` names, where vLLM found it: a local
    folder, else the Hugging Face cache entry of hub id ``model`` at ``revision``."""
    path = Path(model).expanduser()
    if path.exists():
        return _config_path(path)
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        found = try_to_load_from_cache(model, "config.json", revision=revision)
    except ValueError:  # not a hub id either (huggingface_hub's HFValidationError)
        found = None
    if isinstance(found, str):
        return Path(found)
    raise CheckpointError(
        f"kimi_passes: the drafter {model!r} (revision {revision or 'main'}) is neither a "
        f"local folder nor in the Hugging Face cache ({constants.HF_HUB_CACHE}), so its "
        "config.json, which says which aux stream it was trained on, cannot be read: "
        "download it (huggingface-cli download), or serve it from a local folder")


def served(model: str, revision: str | None, who: str = "the drafter") -> Declaration | None:
    """The declaration of the checkpoint a host serves as ``model`` at ``revision``
    (``who``: how messages name the drafter, e.g. "the dflash drafter")."""
    path = locate(model, revision)
    return declaration(load_draft_config(path), f"{who}'s config {path}")
