"""kimi_passes: torch.compile ops and Inductor passes for Kimi K3 Attention Residuals."""

from kimi_passes import ops  # noqa: F401  (registers torch.ops.kimi.*)
from kimi_passes.errors import AuxCaptureError
from kimi_passes.tap import aux_tap

__all__ = ["AuxCaptureError", "aux_tap", "ops"]
