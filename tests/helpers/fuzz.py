"""Shared by the Hypothesis fuzz modules (test_taps_fuzz.py, test_fusion_vs_inductor_fuzz.py)."""

from __future__ import annotations

import os
from typing import NamedTuple

from hypothesis import seed


class FuzzEnv(NamedTuple):
    """A fuzz module's knobs, read from ``<PREFIX>_PROFILE``, ``_SEED``, ``_LOG``,
    ``_KEEP_GOING`` and ``_EXAMPLES``."""

    profile: str  # "ci" (default) or "long"
    seed: int
    log: str | None  # a file each example appends one JSON line to
    keep_going: bool  # log a failing example and go on (long runs count every failure)
    examples: int  # the long profile's example count


def fuzz_env(prefix: str, default_seed: int, default_examples: int) -> FuzzEnv:
    profile = os.environ.get(f"{prefix}_PROFILE", "ci")
    if profile not in ("ci", "long"):
        raise ValueError(f"{prefix}_PROFILE={profile!r}: use 'ci' or 'long'")
    return FuzzEnv(profile, int(os.environ.get(f"{prefix}_SEED", default_seed)),
                   os.environ.get(f"{prefix}_LOG"),
                   os.environ.get(f"{prefix}_KEEP_GOING") == "1",
                   int(os.environ.get(f"{prefix}_EXAMPLES", default_examples)))


def seeded(profile: str, seed_value: int):
    """A test decorator: the ``ci`` profile is derandomized (it takes no seed); any other
    profile runs from ``seed_value`` (Hypothesis reports it with a failure)."""
    def apply(test):
        return test if profile == "ci" else seed(seed_value)(test)
    return apply
