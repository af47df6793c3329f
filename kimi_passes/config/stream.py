"""Which aux stream a compile serves: argument, environment, drafter config, default.

Resolved once, at backend construction: nothing is read inside ``forward``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

#: The streams a tap can read: the consumer's pre-norm mixture, or the legacy running prefix.
STREAMS = ("attn_res", "prefix")
ENV_VAR = "KIMI_PASSES_AUX_STREAM"
DEFAULT_STREAM = "attn_res"
DRAFT_KEY = "aux_hidden_stream"


def check_stream(value, source: str) -> str:
    """``value`` if it names a stream, else a ``ValueError`` naming ``source``."""
    if value not in STREAMS:
        raise ValueError(
            f"kimi_passes: unknown aux stream {value!r} from {source}; use one of "
            f"{list(STREAMS)} ('attn_res': the pre-norm AttnRes mixture each consumer reads, "
            "'prefix': the legacy running prefix)"
        )
    return value


def load_draft_config(draft_config) -> dict:
    """A drafter config as a dict: given as a dict, a config.json path, or its folder."""
    if isinstance(draft_config, dict):
        return draft_config
    path = Path(draft_config)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ValueError(f"kimi_passes: drafter config {path} does not exist") from e
    except json.JSONDecodeError as e:
        raise ValueError(
            f"kimi_passes: drafter config {path} is not valid JSON ({e.msg} at line "
            f"{e.lineno}); fix the file or pass aux_stream explicitly"
        ) from e
    if not isinstance(data, dict):
        raise ValueError(
            f"kimi_passes: drafter config {path} must hold a JSON object, got "
            f"{type(data).__name__}"
        )
    return data


def draft_stream(draft_config, source: str | None = None) -> str | None:
    """The stream a drafter checkpoint declares (``aux_hidden_stream``), if any; a bad
    value is an error naming ``source`` (default: "the drafter config's ...")."""
    if draft_config is None:
        return None
    config = load_draft_config(draft_config)
    if DRAFT_KEY not in config:
        return None
    return check_stream(config[DRAFT_KEY], source or f"the drafter config's {DRAFT_KEY!r}")


def resolve_aux_stream(aux_stream: str | None = None, draft_config=None) -> str:
    """Argument, else ``$KIMI_PASSES_AUX_STREAM``, else the drafter's declaration, else attn_res.

    The drafter config is read and validated even when overridden, so a malformed
    one is an error rather than a surprise on the next run without the override.
    """
    declared = draft_stream(draft_config)
    if aux_stream is not None:
        return check_stream(aux_stream, "the aux_stream argument")
    env = os.environ.get(ENV_VAR)
    if env:
        return check_stream(env, f"${ENV_VAR}")
    if declared is not None:
        return declared
    return DEFAULT_STREAM
