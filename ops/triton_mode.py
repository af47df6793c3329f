"""The mode the Triton kernels of the op family are built in (interpreter or compiler).

``triton.jit`` picks interpreter or compiler from TRITON_INTERPRET when it decorates, and
triton.language's own jit helpers (``tl.sum``, ...) were decorated when triton was
imported; a kernel of the other mode cannot call them. So the kernels follow the mode
triton.language was built in, whatever the environment says now.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

INTERPRETED = not isinstance(tl.sum, JITFunction)


def jit(fn):
    """``triton.jit`` in the mode triton.language was built in (see ``INTERPRETED``)."""
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = INTERPRETED
        return triton.jit(fn)
