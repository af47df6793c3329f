import os

import pytest


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """Set-up for a process that runs tests. The pytest-xdist controller (``-n``: it hands
    out tests and runs none) skips it: importing torch there would delay every worker's
    start by the 3-4 s the import takes."""
    if config.pluginmanager.has_plugin("dsession"):
        return
    import torch

    # Without a GPU the Triton kernel runs on CPU under the interpreter. Triton reads the
    # variable when it is first imported, so one process is either interpreted or
    # compiled: on a GPU machine run the CUDA tests compiled (the default there). Test
    # modules are imported after this, when they are collected.
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # vLLM picks its platform once, on first use, in whichever test imports it first: the
    # harness's CPU platform (tests/helpers/vllm_harness.py) for every test in the process.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # vLLM imports humming (its quantized-GEMM kernels), which on import starts two
    # background processes that build its CUDA launcher: on a CPU machine each imports
    # torch and triton and fails (about 18 s of CPU each, beside the tests). humming's
    # own switch turns that prebuild off; nothing vLLM's compile path runs uses it.
    os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")

    import kimi_passes  # noqa: F401  (registers torch.ops.kimi.*)

    torch.manual_seed(0)
    # pytest's log capture attaches its handlers to every logger that does not propagate,
    # torch's structured-trace logger (``TORCH_TRACE``, tlparse) included. torch builds a
    # trace payload (each graph printed, its guards, ...) whenever that logger has a
    # handler, so under pytest every compile printed every graph for pytest to capture:
    # about 5% of the suite's CPU time. Propagating, the logger gets no handler of
    # pytest's and torch skips the payloads, as it does outside pytest.
    from torch._logging._internal import trace_log

    trace_log.propagate = True


@pytest.fixture(scope="module")
def one_thread():
    """Small shapes gain nothing from intra-op threads; on a shared machine they stall."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=["c", "torch"])
def cpu_path(request, monkeypatch):
    """Run the test on each CPU path of the kimi ops: the C kernel (``ops/cpu_rows.c``,
    which serves every call on one thread) and the torch path (larger calls on more
    threads). The C kernel must have built: a test on it fails rather than fall back."""
    from kimi_passes.ops import cpu_native

    monkeypatch.setattr(cpu_native, "ENABLED", request.param == "c")
    if request.param == "c":
        assert cpu_native._load() is not None, cpu_native._FAILED
    return request.param


@pytest.fixture
def caches_off():
    """The caches that hand back a compiled graph, off for the test: every compile runs
    the passes (``kimi_passes.debug.recording.graph_caches_off``: Inductor's kernel build
    cache stays on). A module whose tests inspect compiled graphs or count what a pass did
    uses it (``pytestmark = pytest.mark.usefixtures("caches_off")``): an FX graph or
    AOTAutograd cache hit would hand back a graph without running the passes.
    """
    from kimi_passes.debug.recording import graph_caches_off

    with graph_caches_off():
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
    import torch._inductor.config

    with torch._inductor.config.patch(fallback_by_default=True):
        yield


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.vllm``: the test imports vLLM. It skips where vLLM is not installed
    (tools/install_vllm.sh installs it), and its name says ``vllm``: the scheduler below
    runs every such test on the worker that imports vLLM for tests/test_vllm.py, so vLLM
    (about 14 s of imports) is imported once per run."""
    import importlib.util

    missing = importlib.util.find_spec("vllm") is None
    skip = pytest.mark.skip(reason="vLLM is not installed (bash tools/install_vllm.sh)")
    for item in items:
        if item.get_closest_marker("vllm") is None:
            continue
        if "vllm" not in item.name:
            raise pytest.UsageError(f"{item.nodeid} is marked vllm but its name does not say "
                                    "vllm: rename it (tests/conftest.py groups vLLM tests by "
                                    "name)")
        if missing:
            item.add_marker(skip)
    # Under pytest-xdist (each worker collects, and all must agree on the order) the tests
    # marked heavy go out first, after the shared-setup modules below: a 20 s test handed
    # out last keeps one worker busy while the other has nothing left to run.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


# Modules whose tests share one expensive module-scoped run (three serving processes, a
# group of ranks, an offline build of every kernel, vLLM compiles kept for the v1 == v2
# test): under pytest-xdist each runs whole on one worker, so the run happens once.
VLLM_MODULE = "tests/test_vllm.py"
SHARED_SETUP_MODULES = frozenset({"tests/test_cache_safety.py", "tests/test_distributed_stages.py",
                                  "tests/test_kernel_build.py", VLLM_MODULE})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """The README runs ``-n auto``: tests marked ``vllm`` join tests/test_vllm.py's unit;
    every other test is its own unit of work. Units go
    out largest first (xdist's default for scoped scheduling), so those modules start
    first and the single tests fill in around them. (``--dist loadgroup`` would say the
    same with markers, but pytest 9 ignores the node-id suffix it relies on.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SharedSetupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module, _, test = nodeid.partition("::")
            if module in SHARED_SETUP_MODULES:
                return module
            return VLLM_MODULE if "vllm" in test else nodeid

    return SharedSetupScheduling(config, log)


# The GPU check selects its CUDA tests by shard (tests/helpers/gpu_marker.py).
pytest_plugins = ("helpers.gpu_marker",)
