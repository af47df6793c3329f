"""Thin runner for ``kimi_passes.bench.fusion``: plain-torch AttnRes models under kimi_backend
against plain Inductor (BENCHMARKS.md tables 5 and 6; options: ``--help``).

    python tools/bench_fusion.py --model k3 --tokens 512 --threads 1
    python tools/bench_fusion.py --train --model site --site-tokens 1024 --threads 1
"""

from kimi_passes.bench.fusion import main

if __name__ == "__main__":
    main()
