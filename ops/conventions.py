"""Conventions the op family, the model and the passes share (no torch, no passes).

- ``MUTATED_ARGS``: the arguments ``kimi.attn_res`` / ``attn_res_capture`` mutate, in
  schema order (functionalization returns their new values after the op's own outputs).
- ``cdiv(i, S)``: the number of completed blocks layer ``i`` reads with block size ``S``.
"""

from __future__ import annotations

MUTATED_ARGS = ("prefix", "blocks")


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, without floats."""
    return -(-a // b)
