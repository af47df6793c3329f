import os

# The Triton kernel runs on CPU under the interpreter; set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import kimi_passes  # noqa: E402,F401  (registers torch.ops.kimi.*)

torch.manual_seed(0)
