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
    """The caches that hand back a compiled graph, off for the test: every compile runs
    the passes. A module whose tests inspect compiled graphs or count what a pass did
    uses it (``pytestmark = pytest.mark.usefixtures("caches_off")``): an FX graph or
    AOTAutograd cache hit would hand back a graph without running the passes.

    Inductor's kernel build cache stays on: it is keyed by a kernel's generated source,
    so a hit (the same C++ kernel in another compile) skips only the C++ compiler, after
    the passes and codegen have run. (``force_disable_caches`` would turn it off too.)
    """
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@pytest.fixture
def aten_fallback(request):
    """Inductor's cheap setting, the one the goldens use: ``fallback_by_default`` lowers
    every op to an ATen call. Dynamo's graph, the post-grad graph and the kimi passes are
    the same (fallbacks are chosen when lowering, after the passes); no C++ kernel is
    built. For modules whose subject is the passes, not codegen
    (``pytestmark = pytest.mark.usefixtures("aten_fallback")``); a test marked
    ``codegen`` there keeps Inductor's full codegen, so generated kernels stay exercised.
    """
    if request.node.get_closest_marker("codegen") is not None:
        yield
        return
    with torch._inductor.config.patch(fallback_by_default=True):
        yield


# Modules whose tests share one expensive module-scoped run (three serving processes, a
# group of ranks, an offline build of every kernel, vLLM compiles kept for the v1 == v2
# test): under pytest-xdist each runs whole on one worker, so the run happens once.
SHARED_SETUP_MODULES = frozenset({"tests/test_cache_safety.py", "tests/test_distributed_stages.py",
                                  "tests/test_kernel_build.py", "tests/test_vllm.py"})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """The README runs ``-n auto``: every other test is its own unit of work. Units go
    out largest first (xdist's default for scoped scheduling), so those modules start
    first and the single tests fill in around them. (``--dist loadgroup`` would say the
    same with markers, but pytest 9 ignores the node-id suffix it relies on.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SharedSetupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in SHARED_SETUP_MODULES else nodeid

    return SharedSetupScheduling(config, log)
