"""Thin runner for ``kimi_passes.bench`` (the same as ``python -m kimi_passes bench``).

    python tools/bench.py --quick
    python tools/bench.py --out bench_out/cpu.json
"""

from kimi_passes.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
