"""Run a function when vLLM imports one of its K3 model modules, without importing them.

Invariant: ``arm(names, then)`` puts one finder first on ``sys.meta_path``; it answers
only for ``names``, finds each with the finders behind it and, once the module has run,
calls ``then(module)``. A module already imported gets ``then`` at once. Every other
import is untouched, so a vLLM process that builds no K3 model never imports vLLM's K3
code because of us (``route.register``). ``disarm`` removes the finder.

``kimi_passes/layout.py``'s finder (``OwnTreeFinder``) is another job: it only decides
where our own modules (``kimi_passes``, ``.ops``, ``.graphs``) are found and runs nothing
after an import, while this one answers only vLLM's K3 module names and exists to run a
callback once they have executed; neither can stand in for the other.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable, Iterable
from types import ModuleType


class _Then(importlib.abc.Loader):
    """The module's own loader, then ``then(module)``; anything else is the loader's."""

    def __init__(self, loader, then: Callable[[ModuleType], None]):
        self._loader, self._then = loader, then

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._then(module)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


class K3ImportHook(importlib.abc.MetaPathFinder):
    """The finder ``arm`` installs: ``names`` only, ``then`` after each has run."""

    def __init__(self, names: Iterable[str], then: Callable[[ModuleType], None]):
        self.names, self.then = frozenset(names), then

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.names:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Then(spec.loader, self.then)
                return spec
        return None


def arm(names: Iterable[str], then: Callable[[ModuleType], None]) -> K3ImportHook:
    """Call ``then(module)`` for each of ``names`` once imported (now, if it is)."""
    hook = K3ImportHook(names, then)
    sys.meta_path.insert(0, hook)
    for name in sorted(hook.names):
        module = sys.modules.get(name)
        if module is not None:
            then(module)
    return hook


def disarm(hook: K3ImportHook | None) -> None:
    if hook is not None and hook in sys.meta_path:
        sys.meta_path.remove(hook)
