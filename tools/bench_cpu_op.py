"""Thin runner for ``kimi_passes.bench.cpu_op``: CPU speed of ``kimi.attn_res`` against its
plain-torch statement (options: ``--help``).

    python tools/bench_cpu_op.py --threads 1
"""

from kimi_passes.bench.cpu_op import main

if __name__ == "__main__":
    main()
