"""Refuse to import from a source folder where ``ops/`` and ``graphs/`` are not mapped.

``kimi_passes.ops`` and ``kimi_passes.graphs`` live in the checkout's top-level ``ops/`` and
``graphs/`` folders and exist only through the installed package mapping (setuptools
``package-dir``). A checkout's root on ``sys.path`` without an editable install (running
from the root after ``pip install .``, or with no install at all) would otherwise fail with
a misleading circular-import message.
"""

import importlib.util

for _sub in ("ops", "graphs"):
    if importlib.util.find_spec(f"kimi_passes.{_sub}") is None:
        _pkg = importlib.util.find_spec("kimi_passes")
        _where = list(_pkg.submodule_search_locations or ()) if _pkg else []
        raise ImportError(
            f"kimi_passes.{_sub} cannot be found: kimi_passes was imported from the source "
            f"folder {_where}, where ops/ and graphs/ are not mapped into the package. "
            "Install the checkout with `pip install -e .`, or run from another directory "
            "when it is installed with `pip install .`.")
