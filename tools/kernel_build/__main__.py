"""``python -m tools.kernel_build [--ci] [--only ...] [--target ...]`` (tools/kernel_build)."""

import sys

from .cli import main

sys.exit(main())
