"""kimi_passes: torch.compile ops and Inductor passes for Kimi K3 Attention Residuals.

    model = torch.compile(model, backend=kimi_passes.kimi_backend)

compiles a K3 graph so that every ``aux_tap`` reads the pre-norm AttnRes
mixture its consumer layer reads (see ``AuxStreamPass``). The options are
``KimiPassConfig``'s; a stack with a backend of its own installs
``pass_manager(**options)`` as Inductor's ``post_grad_custom_post_pass``.
"""

import sys

from kimi_passes import layout

# First: ops/ and graphs/ must come from this package's own tree (layout.py says why).
layout.map_checkout(sys.modules[__name__])
layout.guard(sys.modules[__name__])
layout.check(sys.modules[__name__])

from kimi_passes import ops  # noqa: E402,F401  (registers torch.ops.kimi.*)
from kimi_passes.backend import (  # noqa: E402
    KimiBackend,
    kimi_backend,
    make_kimi_backend,
    register,
)
from kimi_passes.config import DrafterTaps, KimiPassConfig, drafter_capture_ids  # noqa: E402
from kimi_passes.debug.graph_text import graph_text  # noqa: E402
from kimi_passes.errors import AuxCaptureError  # noqa: E402
from kimi_passes.fx.manager import KimiPassManager  # noqa: E402
from kimi_passes.pipeline import pass_manager  # noqa: E402
from kimi_passes.taps import AuxStreamPass, aux_tap  # noqa: E402

register()

__all__ = [
    "AuxCaptureError",
    "AuxStreamPass",
    "DrafterTaps",
    "KimiBackend",
    "KimiPassConfig",
    "KimiPassManager",
    "aux_tap",
    "drafter_capture_ids",
    "graph_text",
    "kimi_backend",
    "make_kimi_backend",
    "ops",
    "pass_manager",
]
