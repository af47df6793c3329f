"""``python -m tools.gpu check|prepare|info|fill-benchmarks ...`` (tools/gpu/__init__.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

USAGE = ("usage: python -m tools.gpu check [--dry-run ...] | prepare | info [--dry-run] "
         "[--json FILE] | fill-benchmarks results.json (each command's --help says more)")


def main(argv: list[str]) -> int:
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "check":
        from tools.gpu import runner

        return runner.main(rest)
    if command == "prepare":
        from tools.gpu import prepare

        return prepare.main(rest)
    if command == "info":
        from tools.gpu import info

        return info.main(rest)
    if command == "fill-benchmarks" and len(rest) == 1:
        from tools.gpu import report

        print(report.fill_benchmarks(json.loads(Path(rest[0]).read_text())), end="")
        return 0
    print(f"tools.gpu: unknown or incomplete command {argv!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
