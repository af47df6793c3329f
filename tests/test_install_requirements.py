"""tools/vllm_requires.py, which tools/install_vllm.sh runs: the requirement list it
installs for a vLLM version (markers evaluated, the one substitute said) and the deviations
it accepts from ``pip check``. The registry and pip are stood in for; CI runs the script
itself (.ci/run installs vLLM 0.34.0, then swaps in 0.33.0)."""

from __future__ import annotations

import subprocess

import pytest

from tools import vllm_requires as vr

DECLARED = [
    "torch==2.14.0",
    "flashinfer-python==0.7.3",
    "mistral_common[image]>=1.13.0",
    "protobuf==7.36.1; platform_machine == \"s390x\"",
    "zentorch==2.14.0.2; extra == \"zen\"",
]


@pytest.fixture
def registry(monkeypatch):
    """vLLM 0.34.0's metadata as DECLARED; ``has`` holds what the registry serves."""
    has: set[str] = set()
    monkeypatch.setattr(vr, "requires_dist", lambda version: list(DECLARED))
    monkeypatch.setattr(vr, "_on_registry", lambda name, version: f"{name}=={version}" in has)
    return has


def test_markers_are_evaluated_and_the_missing_pin_substituted_and_said(registry):
    lines, said = vr.requirements("0.34.0")
    assert lines == ["torch==2.14.0", "flashinfer-python==0.7.4",
                     "mistral_common[image]>=1.13.0"]
    assert len(said) == 1 and "pins 0.7.3, which the registry lacks: installing 0.7.4" in said[0]


def test_a_substitute_the_registry_no_longer_needs_is_refused(registry):
    registry.add("flashinfer-python==0.7.3")
    with pytest.raises(vr.RequiresError, match="is on the registry now: drop its substitute"):
        vr.requirements("0.34.0")


def test_a_changed_pin_is_refused_not_substituted(registry, monkeypatch):
    monkeypatch.setattr(vr, "requires_dist", lambda version: ["flashinfer-python==0.7.5"])
    with pytest.raises(vr.RequiresError, match="update SUBSTITUTES"):
        vr.requirements("0.34.0")


def _pip_check(monkeypatch, out: str, rc: int) -> None:
    done = subprocess.CompletedProcess([], rc, stdout=out, stderr="")
    monkeypatch.setattr(vr, "_pip", lambda *args: done)


def test_pip_check_the_substitute_is_the_only_accepted_deviation(monkeypatch):
    sub = ("vllm 0.34.0 has requirement flashinfer-python==0.7.3, but you have "
           "flashinfer-python 0.7.4.")
    other = "vllm 0.34.0 has requirement transformers<5.23.0, but you have transformers 5.23.1."
    _pip_check(monkeypatch, sub + "\n", 1)
    assert vr.deviations("0.34.0") == ([sub], [])
    _pip_check(monkeypatch, f"{sub}\n{other}\n", 1)
    assert vr.deviations("0.34.0") == ([sub], [other])
    assert vr.main(["check", "0.34.0"]) == 1
    _pip_check(monkeypatch, "No broken requirements found.\n", 0)
    assert vr.deviations("0.33.0") == ([], [])
