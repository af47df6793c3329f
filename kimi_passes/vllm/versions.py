"""The vLLM versions kimi_passes is tested on, and the facts it reads from each one's API.

Invariant: what kimi_passes takes from vLLM's config is read through the installed vLLM's
own API, the one its version has (never a copy of vLLM's logic, never a guess), and a vLLM
outside the tested range is named at startup:

- ``TESTED``: vLLM 0.33.0 and 0.34.0; below 0.33.0 or above 0.34.x, ``warn_if_untested``
  logs a warning naming the installed and the tested versions, once per process (the
  route at the first K3 model's init, ``k3.route.activate``, and the compile pass).
- ``breakable_cudagraphs(vllm_config)``: whether vLLM resolved breakable CUDA graphs on:
  0.34 keeps it in ``compilation_config.use_breakable_cudagraph``
  (``is_breakable_cudagraph_enabled(compilation_config)``); 0.33 in
  ``$VLLM_USE_BREAKABLE_CUDAGRAPH``, which its resolution writes
  (``is_breakable_cudagraph_enabled()``).
- ``drafter_reads_aux(speculative_config)``: whether the drafter vLLM serves reads the
  target's aux hidden states: 0.34 ``SpeculativeConfig.uses_aux_hidden_states`` (eagle3
  may opt out; DFlash2 drafters are method ``dflash``); 0.33 ``requires_aux_hidden_states``
  (``vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``).

A vLLM that has neither form of an API raises ``RuntimeError`` naming it. Imports vLLM
only when called.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import re

log = logging.getLogger(__name__)

#: The vLLM releases the route, the plan and the compile pass are tested on (CI).
TESTED = ("0.33.0", "0.34.0")
#: The tested range: ``[LOWEST, ABOVE)`` by release number (0.34.x included).
LOWEST, ABOVE = (0, 33, 0), (0, 35, 0)
_warned: set[str] = set()


def installed_version() -> str:
    """The installed vLLM's version string (its distribution metadata)."""
    return importlib.metadata.version("vllm")


def release(version: str) -> tuple[int, int, int]:
    """``"0.34.1.dev3+g..."`` -> ``(0, 34, 1)``: the leading release numbers."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if found is None:
        raise ValueError(f"kimi_passes: cannot read vLLM's version {version!r} (expected "
                         "MAJOR.MINOR.PATCH): reinstall vLLM from its release")
    major, minor, patch = found.groups()
    return int(major), int(minor), int(patch or 0)


def untested_warning(version: str) -> str | None:
    """The startup warning for vLLM ``version``, or None inside the tested range."""
    if LOWEST <= release(version) < ABOVE:
        return None
    return (f"kimi_passes: vLLM {version} is outside the versions kimi_passes is tested on "
            f"({', '.join(TESTED)}; 0.34.x): the route checks at startup that vLLM's K3 is "
            "the one it was written for, but the rest of vLLM is untested here. Install "
            f"vLLM {TESTED[-1]} (bash tools/install_vllm.sh {TESTED[-1]}) to run a tested "
            "pair")


def warn_if_untested() -> str | None:
    """Log ``untested_warning`` for the installed vLLM, once per process; returns it."""
    version = installed_version()
    message = untested_warning(version)
    if message is not None and version not in _warned:
        _warned.add(version)
        log.warning(message)
    return message


def breakable_cudagraphs(vllm_config) -> bool:
    """Whether ``vllm_config`` (resolved by vLLM) runs breakable CUDA graphs."""
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

    params = inspect.signature(is_breakable_cudagraph_enabled).parameters
    if "compilation_config" in params:  # vLLM 0.34: kept in the config
        return bool(is_breakable_cudagraph_enabled(vllm_config.compilation_config))
    if not params:  # vLLM 0.33: the variable its resolution writes
        return bool(is_breakable_cudagraph_enabled())
    raise RuntimeError(
        f"kimi_passes: vLLM {installed_version()}'s is_breakable_cudagraph_enabled takes "
        f"{list(params)}, neither () (vLLM 0.33) nor (compilation_config) (vLLM 0.34): "
        f"install a tested vLLM ({', '.join(TESTED)})")


def drafter_reads_aux(speculative_config) -> bool:
    """Whether the drafter ``speculative_config`` serves reads aux hidden states."""
    from vllm.config import SpeculativeConfig

    if hasattr(SpeculativeConfig, "uses_aux_hidden_states"):  # vLLM 0.34
        return bool(speculative_config.uses_aux_hidden_states)
    utils = importlib.import_module("vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils")
    requires = getattr(utils, "requires_aux_hidden_states", None)  # vLLM 0.33
    if requires is None:
        raise RuntimeError(
            f"kimi_passes: vLLM {installed_version()} has neither "
            "SpeculativeConfig.uses_aux_hidden_states (vLLM 0.34) nor eagle3_utils."
            "requires_aux_hidden_states (vLLM 0.33), so which drafters read aux hidden "
            f"states is unknown: install a tested vLLM ({', '.join(TESTED)})")
    return bool(requires(speculative_config))
