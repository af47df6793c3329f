"""Benchmarks: the AttnRes op, the cost of a tap, the cost of the pass, compile scaling.

One entry point, ``python -m kimi_passes bench`` (:mod:`.cli`). Its sections
(``--only op,tap,pass,compile,quant``), one module each, say in their docstrings what
they measure:

``op``        :mod:`.op`: ``torch.ops.kimi.attn_res`` against plain torch and a copy
``tap``       :mod:`.tap`: a compiled K3 step with its taps served three ways
``pass``      :mod:`.pass_cost`: the passes' share of a cold compile, and alone
``compile``   :mod:`.compile_time`: cold compile time against depth
``quant``     :mod:`.quant`: an AttnRes site + per-token FP8 quant, fused or not

Its subcommands have tables and options of their own: ``bench decode`` (:mod:`.decode`)
and ``bench fusion`` (:mod:`.fusion`), whole models under ``kimi_backend`` against plain
Inductor (:mod:`.models`); ``bench cpu-op`` (:mod:`.cpu_op`) and ``bench call-cost``
(:mod:`.call_cost`), the eager CPU op against its plain-torch statement.

:mod:`.harness` holds what they share: the one timer (``Timer``), the statistics, the one
error metric (``rel_err``) and the op's argument builder (``op_args``, an ``AttnResArgs``);
:mod:`.report` the text report and the plot.
"""

from kimi_passes.bench.cli import SECTIONS, SUBCOMMANDS, main
from kimi_passes.bench.compile_time import bench_compile
from kimi_passes.bench.harness import Timer, linear_fit, op_args, rel_err, summary
from kimi_passes.bench.op import DTYPES, bench_op, op_bytes
from kimi_passes.bench.pass_cost import bench_pass
from kimi_passes.bench.quant import bench_quant
from kimi_passes.bench.tap import bench_tap

__all__ = [
    "DTYPES", "SECTIONS", "SUBCOMMANDS", "Timer", "bench_compile", "bench_op", "bench_pass",
    "bench_quant", "bench_tap", "linear_fit", "main", "op_args", "op_bytes", "rel_err",
    "summary",
]
