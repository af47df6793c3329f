"""Benchmarks: the AttnRes op, the cost of a tap, the cost of the pass, compile scaling.

Run as ``python -m kimi_passes bench`` (examples and options in :mod:`.cli`). One module
per section (``--only op,tap,pass,compile,quant``), each saying in its docstring what it
measures:

``op``        :mod:`.op`: ``torch.ops.kimi.attn_res`` against plain torch and a copy
``tap``       :mod:`.tap`: a compiled K3 step with its taps served three ways
``pass``      :mod:`.pass_cost`: the passes' share of a cold compile, and alone
``compile``   :mod:`.compile_time`: cold compile time against depth
``quant``     :mod:`.quant`: an AttnRes site + per-token FP8 quant, fused or not

:mod:`.harness` holds the timers and statistics, :mod:`.report` the text report and the
plot, :mod:`.cli` the command line. Two benchmarks have command lines of their own:
:mod:`.fusion` (plain-torch AttnRes models under ``kimi_backend`` against plain Inductor,
``python -m kimi_passes.bench.fusion``, also ``tools/bench_fusion.py``) and :mod:`.cpu_op`
(the CPU op against its plain-torch statement, ``python -m kimi_passes.bench.cpu_op``). The
names below are the ones ``kimi_passes.bench`` has always exported.
"""

from kimi_passes.bench.cli import SECTIONS, Config, main, parse_args
from kimi_passes.bench.compile_time import (
    bench_compile,
    capture_graph,
    cold_compile,
    k3_depth,
    k3_ids,
    warm_up_compiler,
)
from kimi_passes.bench.harness import (
    CpuTimer,
    CudaTimer,
    linear_fit,
    machine_info,
    ratio_summary,
    summary,
)
from kimi_passes.bench.op import (
    DTYPES,
    EPS,
    OP_HEADER,
    PEERS,
    TARGET_ROOFLINE,
    VARIANTS,
    bench_op,
    make_op_args,
    op_bytes,
    plain_torch,
)
from kimi_passes.bench.pass_cost import TARGET_PASS_SHARE, bench_pass, time_pass
from kimi_passes.bench.quant import bench_quant
from kimi_passes.bench.report import format_report, plot
from kimi_passes.bench.tap import TARGET_TAP_VS_PREFIX, bench_tap, eagle3_ids

__all__ = [
    "DTYPES", "EPS", "OP_HEADER", "PEERS", "SECTIONS", "TARGET_PASS_SHARE", "TARGET_ROOFLINE",
    "TARGET_TAP_VS_PREFIX", "VARIANTS", "Config", "CpuTimer", "CudaTimer", "bench_compile",
    "bench_op", "bench_pass", "bench_quant", "bench_tap", "capture_graph", "cold_compile",
    "eagle3_ids", "format_report", "k3_depth", "k3_ids", "linear_fit", "machine_info", "main",
    "make_op_args", "op_bytes", "parse_args", "plain_torch", "plot", "ratio_summary",
    "summary", "time_pass", "warm_up_compiler",
]
