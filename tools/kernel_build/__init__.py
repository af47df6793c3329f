"""Offline build of the AttnRes Triton kernels for sm_90 / sm_100 (and AMD): registers,
spills, occupancy. No GPU and no driver are needed: Triton's wheel carries the toolchain.

:mod:`.variants` holds the matrix (every variant the op family launches: the forward, the
quant and its capture, each non-empty set of backward gradients ``bwd:*``, the decode
path's launches ``dec-*``) and the static occupancy model; :mod:`.nvidia` builds a cubin
and reads its resources; :mod:`.hip` the same for AMD (and vLLM's AMD K3 kernel);
:mod:`.tables` prints them.

Run (the whole matrix, 1944 builds, 1596 distinct; ``--ci`` is the subset that
tests/test_kernel_build.py builds: every forward variant (the quant ones included) at
H = 7168 and 8192, elsewhere three of the forward's, and every backward variant and each
decode launch's superset variant at every width, 864 builds, 594 of them distinct):

    python -m tools.kernel_build [--ci] [--only quant] [--jobs 2] [--json out.json] \
                                 [--target gfx942]

``--target gfx942`` (or ``gfx950``) builds the same matrix for one AMD arch. It prints
one row per build and a summary per (target, dtype, H), and exits 1 when any build
spills. TRITON_INTERPRET must be unset or 0: under the interpreter ``triton.jit`` builds
no compilable kernel (the tool refuses).
"""

from .hip import build_hip, build_vllm_amd, run_hip, vllm_amd_module
from .nvidia import _kernel_module, build, build_config, launch, resource_usage, run, sass
from .tables import decode_static, summary, table
from .variants import is_backward, is_decode, matrix, occupancy, variants

__all__ = [
    "_kernel_module", "build", "build_config", "build_hip", "build_vllm_amd", "decode_static",
    "is_backward", "is_decode", "launch", "matrix", "occupancy", "resource_usage", "run",
    "run_hip", "sass", "summary", "table", "variants", "vllm_amd_module",
]
