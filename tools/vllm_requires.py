"""vLLM's declared requirements, as tools/install_vllm.sh installs and checks them.

pip cannot replace one pinned requirement of a package (``pip install vllm==0.34.0
flashinfer-python==0.7.4`` is ResolutionImpossible), so the install reads vLLM's
``Requires-Dist`` from the registry, evaluates each marker for this interpreter, and
installs that list with ``-r``, then vLLM itself with ``--no-deps``. Where the registry
lacks a version vLLM pins, the list names the nearest available one instead (SUBSTITUTES)
and says so; nothing else deviates, and ``check`` holds the installed environment to that
with ``pip check``.

    python -m tools.vllm_requires requirements VERSION OUT   write the list to OUT
    python -m tools.vllm_requires check VERSION              exit 1 on any other deviation
"""

from __future__ import annotations

import json
import subprocess
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

VERSIONS = ("0.34.0", "0.33.0")

# vLLM version -> {requirement name: (version vLLM pins, the one installed instead)}: only
# pins the registry does not have (checked on every install; an unneeded entry is an error).
SUBSTITUTES: dict[str, dict[str, tuple[str, str]]] = {
    "0.34.0": {"flashinfer-python": ("0.7.3", "0.7.4")},
    "0.33.0": {},
}


class RequiresError(RuntimeError):
    pass


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True,
                          text=True)


def _on_registry(name: str, version: str) -> bool:
    r = _pip("install", "-q", "--dry-run", "--no-deps", "--ignore-installed",
             f"{name}=={version}")
    return r.returncode == 0


def requires_dist(version: str) -> list[str]:
    """vLLM ``version``'s Requires-Dist, as the registry serves it (its metadata only)."""
    r = _pip("install", "-q", "--dry-run", "--no-deps", "--ignore-installed", "--report",
             "-", f"vllm=={version}")
    if r.returncode != 0:
        raise RequiresError(f"pip could not read vllm=={version}'s metadata from the registry "
                            f"(exit {r.returncode}): {r.stderr.strip()}; check the network "
                            f"and that vLLM {version} is on the registry")
    installs = json.loads(r.stdout)["install"]
    return list(installs[0]["metadata"].get("requires_dist", []))


def requirements(version: str) -> tuple[list[str], list[str]]:
    """The requirement lines to install for vLLM ``version`` on this interpreter, and one
    line of output per substituted pin."""
    subs = SUBSTITUTES[version]
    lines, said = [], []
    for text in requires_dist(version):
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        req.marker = None
        if name in subs:
            pinned, instead = subs[name]
            if str(req.specifier) != f"=={pinned}":
                raise RequiresError(f"vLLM {version} requires {text}, not {name}=={pinned}: "
                                    f"update SUBSTITUTES in {__file__}")
            if _on_registry(name, pinned):
                raise RequiresError(f"{name} {pinned}, which vLLM {version} pins, is on the "
                                    f"registry now: drop its substitute in {__file__} and "
                                    f"pin {name}=={pinned} in "
                                    f"tools/constraints-vllm-{version}.txt")
            extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
            lines.append(f"{req.name}{extras}=={instead}")
            said.append(f"{name}: vLLM {version} pins {pinned}, which the registry lacks: "
                        f"installing {instead}, the nearest available (the only deviation "
                        f"from vLLM's declared requirements)")
            continue
        lines.append(str(req))
    missing = set(subs) - {canonicalize_name(Requirement(t).name) for t in lines}
    if missing:
        raise RequiresError(f"vLLM {version} no longer requires {', '.join(sorted(missing))}:"
                            f" drop it from SUBSTITUTES in {__file__}")
    return lines, said


def deviations(version: str) -> tuple[list[str], list[str]]:
    """``pip check``'s lines for this environment: (the substitutes', any other)."""
    r = _pip("check")
    found = [ln.strip() for ln in r.stdout.splitlines() if ln.strip()]
    if r.returncode != 0 and not found:
        raise RequiresError(f"pip check exited {r.returncode} without a finding: {r.stderr}")
    if found == ["No broken requirements found."]:
        return [], []
    expected = {f"vllm {version} has requirement {name}=={pinned}, but you have {name} "
                f"{instead}." for name, (pinned, instead) in SUBSTITUTES[version].items()}
    return ([ln for ln in found if ln in expected],
            [ln for ln in found if ln not in expected])


def main(argv: list[str]) -> int:
    want = {"requirements": 3, "check": 2}
    if len(argv) < 2 or want.get(argv[0]) != len(argv) or argv[1] not in VERSIONS:
        print(f"usage: python -m tools.vllm_requires requirements VERSION OUT | check "
              f"VERSION, VERSION one of {', '.join(VERSIONS)}", file=sys.stderr)
        return 2
    cmd, version = argv[0], argv[1]
    try:
        if cmd == "requirements":
            lines, said = requirements(version)
            with open(argv[2], "w") as f:
                f.write("\n".join(lines) + "\n")
            for s in said:
                print(s)
            return 0
        known, other = deviations(version)
    except RequiresError as e:
        print(f"tools/vllm_requires.py: {e}", file=sys.stderr)
        return 1
    for ln in known:
        print(f"deviation (substituted, above): {ln}")
    for ln in other:
        print(f"deviation NOT expected: {ln}", file=sys.stderr)
    if other:
        print(f"{len(other)} installed version(s) deviate from what vLLM {version} and its "
              f"dependencies declare: install with tools/constraints-vllm-{version}.txt "
              f"pins that satisfy them (pip freeze of a clean install)", file=sys.stderr)
        return 1
    print(f"vLLM {version}: every other requirement as declared (pip check)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
