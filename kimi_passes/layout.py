"""Every ``kimi_passes`` module comes from the tree ``kimi_passes`` itself came from.

``ops/`` and ``graphs/`` are top-level folders of the checkout that setuptools maps into the
package (``package-dir``): a wheel puts them inside ``kimi_passes/``; an editable install
maps them with an import finder of its own, which knows one checkout only and answers for
any module it can find there. With checkout A installed editable, code run from checkout B
(B's root first on ``sys.path``, as ``python -m`` and ``python -c`` put it) would import
``kimi_passes`` from B and ``kimi_passes.ops`` (or any module B lacks) from A, with no error.

So, when ``kimi_passes`` is imported:

- from a source checkout (no ``ops/`` inside the package, ``ops/`` and ``graphs/`` beside
  it), the checkout's root joins the package's search path after the package's own folder,
  so ``kimi_passes.ops`` / ``kimi_passes.graphs`` resolve in that same checkout, installed
  or not (``map_checkout``);
- a finder ahead of every other resolves the modules of ``kimi_passes``, ``.ops`` and
  ``.graphs`` in their own packages' folders only; a module missing there is a
  ``ModuleNotFoundError`` naming the folder, never another tree's copy (``guard``);
- ``ops`` and ``graphs`` must then be found, else an ``ImportError`` says how to install
  (``check``).

Why it is still needed though the README and CI install: the GPU check runs a copy of the
checkout with no install at all (``tools/gpu_check.sh`` puts its root on ``PYTHONPATH``),
and a second checkout (a git worktree) is routinely run with the first one installed
editable. Why the vLLM plugin's import hook (``kimi_passes/vllm/k3/hook.py``) does not serve
here: it answers only for vLLM's K3 model modules and runs a callback after they execute; it
never says where a module of ours lives.
"""

from __future__ import annotations

import importlib.util
import sys
from importlib.machinery import PathFinder
from pathlib import Path

#: The subpackages that live in top-level folders of the checkout.
MAPPED = ("ops", "graphs")


def map_checkout(package) -> Path | None:
    """Add the checkout root to ``package.__path__`` when ``package`` is a source folder.

    Returns the root it added, or None (a wheel, or a copy that holds ``ops/`` inside).
    """
    here = Path(package.__file__).resolve().parent
    root = here.parent
    if (here / MAPPED[0]).is_dir():
        return None
    if not all((root / sub / "__init__.py").is_file() for sub in MAPPED):
        return None
    if str(root) not in package.__path__:
        package.__path__.append(str(root))
    return root


class OwnTreeFinder:
    """Finds the direct submodules of ``packages`` in those packages' own folders only.

    Put first on ``sys.meta_path``: other finders (an editable install's) are never asked
    for these names, so a module this tree lacks cannot come from another tree.
    """

    def __init__(self, packages: tuple[str, ...]):
        self.packages = packages

    def find_spec(self, fullname: str, path=None, target=None):
        parent_name = fullname.rpartition(".")[0]
        parent = sys.modules.get(parent_name)
        if parent_name not in self.packages or parent is None:
            return None
        spec = PathFinder.find_spec(fullname, list(parent.__path__))
        if spec is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r} in {list(parent.__path__)} (the tree "
                f"{self.packages[0]} was imported from)", name=fullname)
        return spec


def guard(package) -> None:
    """Install ``OwnTreeFinder`` for ``package`` and its mapped subpackages (once)."""
    names = (package.__name__, *(f"{package.__name__}.{sub}" for sub in MAPPED))
    if not any(isinstance(f, OwnTreeFinder) and f.packages == names for f in sys.meta_path):
        sys.meta_path.insert(0, OwnTreeFinder(names))


def check(package) -> None:
    """Raise ``ImportError`` naming the fix unless every mapped subpackage can be found."""
    here = Path(package.__file__).resolve().parent
    for sub in MAPPED:
        name = f"{package.__name__}.{sub}"
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ImportError(
                f"{name} cannot be found: {package.__name__} was imported from {here}, with no "
                f"{sub}/ inside it or beside it. Install the checkout (`pip install -e .`), or "
                "run from a checkout that has ops/ and graphs/ next to kimi_passes/.")
