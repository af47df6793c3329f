import os

import torch

# Without a GPU the Triton kernel runs on CPU under the interpreter. Triton reads the
# variable when it is first imported, so one process is either interpreted or compiled:
# on a GPU machine run the CUDA tests compiled (the default there).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kimi_passes  # noqa: E402,F401  (registers torch.ops.kimi.*)

torch.manual_seed(0)
