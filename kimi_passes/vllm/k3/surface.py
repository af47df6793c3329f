"""What the K3 route depends on in vLLM's K3, checked before it routes (``route.activate``).

Invariant: the route rebinds and wraps vLLM's K3 by name, so a vLLM whose K3 changed what
the route relies on is refused at startup with a ``K3SurfaceError`` naming each change,
never served with a wrong tap. Recorded as vLLM 0.33.0 and 0.34.0 have it (the same in
both), compared with the installed K3 for each vendor module imported:

- a module-level ``attn_res`` in each module the route rebinds, whose parameters are
  those of the function the route installs there (``AttnResArgs``; ROCm: and a keyword
  ``quant_dtype=None``);
- ``KimiLinearModel``'s wrapped methods (``METHODS``; ``OWN``: defined by the class, not
  inherited from vLLM's ``EagleModelMixin``) with their parameters (names, kinds,
  defaults; annotations are not compared);
- where vLLM's K3 package refers to the capture method (``CAPTURE``): it must be
  ``KimiLinearModel.forward``, whose captures the route checks (``REQUIRED``), and may
  only be one of ``KNOWN_SITES``: on NVIDIA, vLLM 0.34's specialized decode calls
  ``_capture_aux_hidden_stream`` in its wide and hybrid steps, outside ``forward``; it
  runs only under ``decode_backend=latency_specialized``, which the plan refuses.

Reads vLLM's source files for the call sites (``ast``; only files naming the method).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from kimi_passes.vllm import versions
from kimi_passes.vllm.k3.eager import TURN_OFF

#: The K3 model module of each vendor, and the method vLLM's forward captures through.
MODEL_MODULES = {"nvidia": "vllm.models.kimi_k3.nvidia.model",
                 "amd": "vllm.models.kimi_k3.amd.linear"}
CAPTURE = {"nvidia": "_capture_aux_hidden_stream", "amd": "_maybe_add_hidden_state"}
_COMMON = {
    "_set_aux_hidden_state_layers": "(self, layers)",
    "__init__": "(self, *, vllm_config, prefix='')",
}
#: ``KimiLinearModel``'s methods the route wraps, with the parameters it was written for.
METHODS = {
    "nvidia": {"_capture_aux_hidden_stream":
               "(self, layer_idx, prefix_sum, pending_mlp_out, block_residual)",
               "forward": "(self, input_ids, positions, intermediate_tensors, "
                          "inputs_embeds=None, **kwargs)", **_COMMON},
    "amd": {"_maybe_add_hidden_state":
            "(self, aux_hidden_states, layer_idx, hidden_states, residual)",
            "forward": "(self, input_ids, positions, intermediate_tensors, "
                       "inputs_embeds=None, step=None, **kwargs)", **_COMMON},
}
#: The methods ``KimiLinearModel`` defines itself (an inherited one is not K3's).
OWN = {"_capture_aux_hidden_stream", "_maybe_add_hidden_state", "forward", "__init__"}
#: Where the capture method must be referred to (``path:qualname`` in the K3 package).
REQUIRED = {"nvidia": "nvidia/model.py:KimiLinearModel.forward",
            "amd": "amd/linear.py:KimiLinearModel.forward"}
#: Every other place it may be referred to, and why that is safe.
KNOWN_SITES = {
    "nvidia/specialized_decode/runtime/decode.py:SpecializedDecode.run_wide":
        "the specialized decode (refused by the plan)",
    "nvidia/specialized_decode/runtime/hybrid.py:HybridStep.run":
        "the specialized decode (refused by the plan)",
    "amd/linear.py:KimiLinearModel._maybe_add_hidden_state": "its own super() call",
}


class K3SurfaceError(RuntimeError):
    """vLLM's K3 is not the one the route was written for; names each change."""


def parameters(fn: Callable) -> str:
    """``fn``'s parameters as ``(a, b=1, *, c)``: names, kinds, defaults, no annotations."""
    sig = inspect.signature(fn)
    return str(sig.replace(parameters=[p.replace(annotation=p.empty)
                                       for p in sig.parameters.values()],
                           return_annotation=sig.empty))


def attn_res_changes(routes: Mapping[str, Callable]) -> list[str]:
    """Each imported module of ``routes`` whose ``attn_res`` the route cannot replace."""
    changes = []
    for name, ours in routes.items():
        module = sys.modules.get(name)
        if module is None:
            continue
        theirs = vars(module).get("attn_res")
        if theirs is None:
            changes.append(f"{name} has no module-level attn_res")
        elif theirs is not ours and parameters(theirs) != parameters(ours):
            changes.append(f"{name}.attn_res takes {parameters(theirs)}, the route's "
                           f"{parameters(ours)}")
    return changes


def method_changes(vendor: str, cls: type) -> list[str]:
    """Each wrapped method of ``cls`` missing (of its own, where ``OWN`` says so), or
    taking other parameters than recorded."""
    where = f"{cls.__module__}.{cls.__qualname__}"
    changes = []
    for name, want in METHODS[vendor].items():
        owner = next((c for c in cls.__mro__ if name in vars(c)), None)
        if owner is None or (name in OWN and owner.__name__ != cls.__name__):
            inherited = "" if owner is None else f"; {owner.__name__}'s is inherited"
            changes.append(f"{where} has no method {name} (renamed or removed{inherited})")
            continue
        own = inspect.unwrap(getattr(cls, name))  # the route's wrapper is functools.wraps'
        if parameters(own) != want:
            changes.append(f"{where}.{name} takes {parameters(own)}, written for {want}")
    return changes


class _References(ast.NodeVisitor):
    """Every ``.name`` read in a module, by the qualified name of the code reading it."""

    def __init__(self, name: str):
        self.name = name
        self.scope: list[str] = []
        self.found: set[str] = set()

    def _enter(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _enter

    def visit_Attribute(self, node):
        if node.attr == self.name:
            self.found.add(".".join(self.scope) or "<module>")
        self.generic_visit(node)


def call_sites(root: Path, name: str) -> set[str]:
    """``path:qualname`` of every reference to ``.name`` in the package at ``root``."""
    sites = set()
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if name not in text:
            continue
        refs = _References(name)
        refs.visit(ast.parse(text, str(path)))
        sites |= {f"{path.relative_to(root).as_posix()}:{q}" for q in refs.found}
    return sites


def site_changes(vendor: str, root: Path) -> list[str]:
    """The capture method's references in ``root`` that are not the ones recorded."""
    name = CAPTURE[vendor]
    sites = call_sites(root, name)
    changes = []
    if REQUIRED[vendor] not in sites:
        changes.append(f"{REQUIRED[vendor]} no longer calls {name}: its captures would "
                       "not reach the route")
    unknown = sorted(s for s in sites if s != REQUIRED[vendor] and s not in KNOWN_SITES)
    if unknown:
        changes.append(f"{name} is called from {unknown}, where the route does not check "
                       "that each capture found its consumer")
    return changes


def package_root() -> Path:
    """The installed vLLM's K3 package folder."""
    spec = importlib.util.find_spec("vllm.models.kimi_k3")
    if spec is None or spec.origin is None:
        raise K3SurfaceError("kimi_passes: the attn_res stream is asked for but this vLLM "
                             f"has no vllm.models.kimi_k3 package: {TURN_OFF}")
    return Path(spec.origin).parent


def check(routes: Mapping[str, Callable], root: Path | None = None) -> None:
    """Refuse the route (``K3SurfaceError``) if the imported K3 changed (see the module)."""
    root = package_root() if root is None else root
    changes = attn_res_changes(routes)
    for vendor, name in MODEL_MODULES.items():
        module = sys.modules.get(name)
        if module is None:
            continue
        cls = getattr(module, "KimiLinearModel", None)
        if cls is None:
            changes.append(f"{name} has no KimiLinearModel")
            continue
        changes += method_changes(vendor, cls) + site_changes(vendor, root)
    if changes:
        raise K3SurfaceError(
            f"kimi_passes: vLLM {versions.installed_version()}'s Kimi K3 is not the one the "
            f"route was written for (vLLM {', '.join(versions.TESTED)}): "
            + "; ".join(changes) + ". Routed, it could hand the drafter a wrong aux state. "
            f"Install a tested vLLM ({', '.join(versions.TESTED)}), or {TURN_OFF}")
