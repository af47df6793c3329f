"""Whole models at decode and prefill sizes, kimi_backend against plain Inductor (CPU).

A thin entry point: ``python tools/bench_decode.py [options]`` is
``python -m kimi_passes.bench.decode [options]`` (see that module).
"""

import sys

from kimi_passes.bench.decode import main

if __name__ == "__main__":
    sys.exit(main())
