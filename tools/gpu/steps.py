"""The GPU check's steps, in order: one ``Step`` each (name, cap in seconds, commands).

Another step is one more line. ``{py}`` is the check's Python, ``{json}`` the step's
scratch JSON (read back into results.json), ``{junit}`` a shard's JUnit file, ``{jobs}``
the CPU count less two. The CUDA tests are those marked ``@pytest.mark.gpu_check(shard)``
(pyproject.toml's marker, tests/helpers/gpu_marker.py's ``--gpu-shard``): each shard a process
of its own, run side by side, over the test files that mark a test with that shard (the dry
run, where every one skips, collects the four in one process).
``select`` picks a run's steps (``--only``, ``--cap``, ``--steps-json``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SKIP_RC = 3
MAX_FILES = 8
BUDGET_S = 330
DRY_BUDGET_S = 270  # the dry run ends within 5 minutes, start-up included
RESERVE_S = 5  # the driver's own end: the last writes
FILES = ("gpu_check.log", "summary.txt", "results.json", "junit.xml")
MARKER = "gpu_check"
CUDA_SHARDS = ("ops", "quant", "wide", "compiled")  # the cuda_tests step, side by side
GRAPHS_SHARD = "graphs"  # the cuda_graphs step

Argv = tuple[str, ...]


@dataclass(frozen=True)
class Step:
    """One step: ``cmds`` run side by side (several: pytest shards) from the repository
    root; placeholders as the module docstring says."""

    name: str
    cap_s: int
    cmds: tuple[Argv, ...]
    dry: tuple[Argv, ...] | None = None  # the dry run's commands (None: the same)
    dry_note: str = ""  # what the dry run fakes or shrinks
    needs: tuple[str, ...] = ()  # modules the step imports: skipped (with why) without them
    rows_re: str = ""  # more lines kept as rows (MET/MISS and pytest lines always are)
    dry_env: dict[str, str] = field(default_factory=dict)
    stop_on_failure: bool = False  # info: the machine cannot run the rest
    min_s: int = 0  # the least time worth starting it with (0: a third of the cap, >= 10)
    dry_cap_s: int = 0  # the dry run's cap where the CPU needs another (0: cap_s)

    def cap(self, dry: bool) -> int:
        return self.dry_cap_s if dry and self.dry_cap_s else self.cap_s


def bench(*args: str) -> Argv:
    return ("{py}", "-m", "kimi_passes", "bench", *args)


def tool(module: str, *args: str) -> Argv:
    return ("{py}", "-m", f"tools.{module}", *args)


def marked_files(shard: str, tests: Path = ROOT / "tests") -> tuple[str, ...]:
    """The test files that mark a test ``@pytest.mark.gpu_check("<shard>")``, relative to
    the repository root (a text scan: collecting only these keeps each shard cheap)."""
    mark = re.compile(rf"""pytest\.mark\.{MARKER}\(\s*["']{re.escape(shard)}["']""")
    return tuple(str(p.relative_to(ROOT)) for p in sorted(tests.glob("test_*.py"))
                 if mark.search(p.read_text(encoding="utf-8")))


def pytest_shard(*shards: str) -> Argv:
    """The CUDA tests of ``shards`` (one on the GPU) in one process, selected by the marker,
    every result on its line."""
    files = sorted({f for shard in shards for f in marked_files(shard)})
    return ("{py}", "-m", "pytest", "-v", "--tb=short", "-p", "no:cacheprovider",
            "-p", "no:xdist", "--junitxml", "{junit}", "-m", MARKER, "--gpu-shard",
            ",".join(shards), *files)


K3_OP = ("--H", "7168", "--blocks", "8", "--dtypes", "bfloat16", "--no-plot", "--out", "{json}")
TINY_OP = ("--device", "cpu", "--H", "256", "--blocks", "2", "--dtypes", "bfloat16",
           "--rounds", "1", "--block-ms", "1", "--no-plot", "--out", "{json}")
SWEEP_T = ("1", "8", "64", "65", "128", "255", "256", "1024", "4096")
OP_ROW = r"^(bfloat16|float16|float32)\s+(read|full)\s+\d+"  # a cell of the op bench, as it ends
ON_CPU_THEY_SKIP = "the same marked tests, collected; without CUDA each test skips"
#: On CPU every test skips: the shards share one process (each process costs a torch import).
ONE_PROCESS = ON_CPU_THEY_SKIP + " (the four shards in one process)"

STEPS: tuple[Step, ...] = (
    Step("info", 20, (tool("gpu", "info", "--json", "{json}"),),
         dry=(tool("gpu", "info", "--dry-run", "--json", "{json}"),),
         dry_note="CUDA not required; versions, the C compiler and imports checked",
         stop_on_failure=True),
    Step("op_headline", 40, (bench("--device", "cuda", "--only", "op", "--T", "8192",
                                   "--variants", "read", "full", *K3_OP),),
         dry=(bench("--only", "op", "--T", "64", "--variants", "read", "full", *TINY_OP),),
         dry_note="the op's CPU kernels at T=64 H=256 nb=2, one round", rows_re=OP_ROW),
    Step("decode_sweep", 55, (bench("--device", "cuda", "--only", "op", "--T", *SWEEP_T,
                                    "--variants", "full", "--rounds", "5", *K3_OP),),
         dry=(bench("--only", "op", "--T", *SWEEP_T, "--variants", "full", *TINY_OP),),
         dry_note="every T at H=256 nb=2 on CPU, one round", rows_re=OP_ROW),
    Step("quant", 35, (bench("--device", "cuda", "--only", "quant", "--quant-T", "1", "8",
                             "64", "1024", "--quant-H", "7168", "--quant-blocks", "8",
                             "--no-plot", "--out", "{json}"),),
         dry=(bench("--device", "cpu", "--only", "quant", "--quant-T", "1", "64", "--quant-H",
                    "256", "--quant-blocks", "2", "--rounds", "2", "--block-ms", "1",
                    "--no-plot", "--out", "{json}"),),
         dry_note="T=1, 64 at H=256 nb=2 on CPU (generated C++), two rounds",
         rows_re=r"^T=\s*\d+ H=\d+ nb=\d+"),
    Step("cuda_tests", 70, tuple(pytest_shard(s) for s in CUDA_SHARDS), needs=("pytest",),
         dry=(pytest_shard(*CUDA_SHARDS),), dry_note=ONE_PROCESS),
    Step("cuda_graphs", 20, (pytest_shard(GRAPHS_SHARD),), needs=("pytest",),
         dry_note=ON_CPU_THEY_SKIP),
    Step("eager_route", 20, (tool("gpu.eager_route", "--T", "1,8,64", "--json", "{json}"),),
         dry=(tool("gpu.eager_route", "--dry-run", "--json", "{json}"),),
         dry_note="CPU, H=64, T=1, 8, vLLM's kernel interpreted: the capture check, no graphs"),
    Step("whole_k3", 40, (bench("decode", "--device", "cuda", "--models", "k3", "--T", "1",
                                "8", "64", "--dynamic", "--no-ops", "--rounds", "7",
                                "--block-ms", "20"),),
         dry=(bench("decode", "--models", "site", "--T", "1", "8", "--dynamic", "--no-ops",
                    "--rounds", "1", "--block-ms", "1"),),
         dry_note="the one-site model, not K3 (two compiles of a tiny graph)",
         rows_re=r"^(k3|site)\s+T="),
    Step("vllm_k3", 10, (tool("gpu.vllm_k3", "--T", "1", "8", "256", "--json", "{json}"),),
         dry=(tool("gpu.vllm_k3", "--device", "cpu", "--hidden", "64", "--layers", "3", "--T",
                   "4", "--rounds", "1", "--reps", "1", "--json", "{json}"),),
         dry_note="CPU, H=64, 3 layers, vLLM's kernel interpreted; a skip without vLLM",
         min_s=5, dry_cap_s=60),
    Step("kernel_build", 20, (tool("kernel_build", "--ci", "--only", "bwd", "--jobs", "{jobs}",
                                   "--json", "{json}"),),
         dry=(tool("kernel_build", "--ci", "--only", "bwd:dw", "--jobs", "1", "--json",
                   "{json}"),),
         dry_note="real offline builds, the 36 of bwd:dw", dry_env={"TRITON_INTERPRET": "0"}),
)


def select(steps: tuple[Step, ...], steps_json: Path | None, only: str | None,
           caps: list[str]) -> list[Step]:
    """The steps a run takes: ``steps`` (or those of ``steps_json``, a JSON list of Step
    fields: tests), ``only`` those named (comma-separated; the ``stop_on_failure`` step
    always), each ``STEP=SECONDS`` of ``caps`` its new cap."""
    chosen = list(steps)
    if steps_json:
        chosen = [_step_from(d) for d in json.loads(steps_json.read_text())]
    names = [s.name for s in chosen]
    if only:
        want = {n.strip() for n in only.split(",") if n.strip()}
        bad = want - set(names)
        if bad:
            raise SystemExit(f"gpu_check: unknown step(s) {sorted(bad)}; the steps: {names}")
        chosen = [s for s in chosen if s.name in want or s.stop_on_failure]
    for c in caps:
        name, _, sec = c.partition("=")
        if name not in names or not sec.isdigit():
            raise SystemExit(f"gpu_check: --cap {c!r}: give STEP=SECONDS, a step of {names}")
        chosen = [replace(s, cap_s=int(sec), dry_cap_s=0) if s.name == name else s
                  for s in chosen]
    return chosen


def _step_from(d: dict[str, Any]) -> Step:
    """A Step from JSON: lists become the tuples the dataclass holds."""
    fields: dict[str, Any] = dict(d)
    for k in ("cmds", "dry"):
        if fields.get(k) is not None:
            fields[k] = tuple(tuple(argv) for argv in fields[k])
    fields["needs"] = tuple(fields.get("needs", ()))
    return Step(**fields)
