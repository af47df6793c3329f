"""The source a pass's cache key covers: its module and every kimi_passes module it imports.

Inductor's FX graph cache keys a compiled graph on the graph before the post-grad passes
and on each custom pass's ``uuid()``. A pass whose key missed a module its rewrite runs
(an edit to ``taps/consumer.py`` changes which node a tap reads) would get a stale graph
served. So the key is not a hand-kept file list: ``dependencies(module)`` reads the
module's source, follows every ``kimi_passes.*`` import in it (module level or inside a
function, absolute or relative) and every package ``__init__`` importing it runs first
(a package's ``__init__`` runs, with its imports, whenever one of its modules is
imported), and repeats on what it finds. The ops package is in every pass's closure (the
passes emit and propagate ``torch.ops.kimi.*``), so the key also changes with the ops'
schemas and fake kernels.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import sys
from pathlib import Path

PACKAGE = "kimi_passes"

# (path, mtime_ns, size) -> the modules a file imports, so a key is cheap to recompute.
_imports_cache: dict[tuple, tuple[str, ...]] = {}


def module_path(name: str) -> Path:
    """The source file of module ``name`` (through the package's folder mapping)."""
    loaded = getattr(sys.modules.get(name), "__file__", None)
    origin = loaded or getattr(importlib.util.find_spec(name), "origin", None)
    if not origin or not origin.endswith(".py"):
        raise ImportError(f"cache key: no Python source for module {name!r} ({origin}); "
                          "install kimi_passes from a source checkout (`pip install -e .`)")
    return Path(origin)


def _in_package(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent is not a package
        return False


def _package_of(name: str) -> str:
    """The package relative imports in module ``name`` start from."""
    module = sys.modules.get(name)
    if module is not None:
        is_package = hasattr(module, "__path__")
    else:
        is_package = bool(getattr(importlib.util.find_spec(name), "submodule_search_locations",
                                  None))
    return name if is_package else name.rpartition(".")[0]


def imports_of(name: str, locate=None) -> tuple[str, ...]:
    """The ``kimi_passes`` modules module ``name``'s source imports, sorted.

    ``locate``: module name -> source path (default ``module_path``).
    """
    path = (locate or module_path)(name)
    stat = path.stat()
    key = (str(path), stat.st_mtime_ns, stat.st_size, name)
    if key in _imports_cache:
        return _imports_cache[key]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = importlib.util.resolve_name("." * node.level + base,
                                                   _package_of(name))
            if not _in_package(base):
                continue
            for alias in node.names:
                # ``from pkg import mod`` imports the module pkg.mod; ``from pkg import f``
                # runs pkg itself.
                sub = f"{base}.{alias.name}"
                found.add(sub if alias.name != "*" and _is_module(sub) else base)
    result = tuple(sorted(m for m in found if _in_package(m)))
    _imports_cache[key] = result
    return result


def packages_above(name: str) -> list[str]:
    """The packages importing ``name`` runs first (``a.b.c``: ``a``, ``a.b``)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def dependencies(module: str, locate=None) -> list[str]:
    """``module`` and every kimi_passes module importing it runs, sorted: the modules it
    imports, directly or not, and each package ``__init__`` on the way to any of them
    (importing ``a.b.c`` runs ``a`` and ``a.b`` first, and so whatever they import)."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(imports_of(name, locate))
        todo.extend(p for p in packages_above(name) if _in_package(p))
    return sorted(seen)


def source_hash(modules, extra: str = "", locate=None) -> str:
    """sha256 over ``extra`` and each module's name and source (in the given order)."""
    locate = locate or module_path
    h = hashlib.sha256(extra.encode())
    for name in modules:
        h.update(f"\0{name}\0".encode())
        h.update(locate(name).read_bytes())
    return h.hexdigest()
