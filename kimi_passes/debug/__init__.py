"""Seeing what the passes did: depyf dumps, the golden printer, the graph recorder.

- ``depyf_dump``: ``dump(dir)``, depyf's ``prepare_debug`` with the passes' before/after
  graphs, caches off (also ``kimi_passes.debug.dump``);
- ``graph_text`` / ``graph_names``: the normalised graph text the goldens use
  (``kimi_passes.graph_text``) and how it names inputs, targets and symbols;
- ``recording``: ``GraphRecorder``, a backend that records each graph around the passes.
"""

from kimi_passes.debug.depyf_dump import compat_load_by_key_path, dump, pass_dumps

__all__ = ["compat_load_by_key_path", "dump", "pass_dumps"]
