"""Lowering: the kimi ops as generated code on CPU, once the other passes have run.

- ``decompositions``: each op's math as plain ATen, written for Inductor;
- ``lower``: ``LowerKimiOps``, which swaps CPU kimi calls for those statements.
"""

from kimi_passes.lowering.lower import LowerKimiOps

__all__ = ["LowerKimiOps"]
