"""kimi_passes: torch.compile ops and Inductor passes for Kimi K3 Attention Residuals.

    model = torch.compile(model, backend=kimi_passes.kimi_backend)

compiles a K3 graph so that every ``aux_tap`` reads the pre-norm AttnRes
mixture its consumer layer reads (see ``AuxStreamPass``).
"""

from kimi_passes import (
    layout,  # noqa: F401  (first: refuses an unmapped source folder)
    ops,  # noqa: F401  (registers torch.ops.kimi.*)
)
from kimi_passes.aux_stream import AuxStreamPass
from kimi_passes.backend import KimiBackend, kimi_backend, make_kimi_backend, register
from kimi_passes.errors import AuxCaptureError
from kimi_passes.graph_text import graph_text
from kimi_passes.tap import aux_tap

register()

__all__ = [
    "AuxCaptureError",
    "AuxStreamPass",
    "KimiBackend",
    "aux_tap",
    "graph_text",
    "kimi_backend",
    "make_kimi_backend",
    "ops",
]
