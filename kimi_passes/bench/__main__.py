"""``python -m kimi_passes.bench``: the same as ``python -m kimi_passes bench``."""

from kimi_passes.bench.cli import main

raise SystemExit(main())
