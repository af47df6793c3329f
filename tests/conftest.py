import os

import pytest
import torch

# Without a GPU the Triton kernel runs on CPU under the interpreter. Triton reads the
# variable when it is first imported, so one process is either interpreted or compiled:
# on a GPU machine run the CUDA tests compiled (the default there).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kimi_passes  # noqa: E402,F401  (registers torch.ops.kimi.*)

torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread():
    """Small shapes gain nothing from intra-op threads; on a shared machine they stall."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def caches_off():
    """Inductor's caches off for the test (``force_disable_caches``): every compile runs
    the passes. A module whose tests inspect compiled graphs or count what a pass did
    uses it (``pytestmark = pytest.mark.usefixtures("caches_off")``): an FX graph or
    AOTAutograd cache hit would hand back a graph without running the passes."""
    with torch._inductor.config.patch(force_disable_caches=True):
        yield
