"""Shared by the Hypothesis fuzz modules (test_taps_fuzz.py, test_fusion_vs_inductor_fuzz.py)."""

from __future__ import annotations

from hypothesis import seed


def seeded(profile: str, seed_value: int):
    """A test decorator: the ``ci`` profile is derandomized (it takes no seed); any other
    profile runs from ``seed_value`` (Hypothesis reports it with a failure)."""
    def apply(test):
        return test if profile == "ci" else seed(seed_value)(test)
    return apply
