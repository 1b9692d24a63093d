"""`python -m benchmarks --list` / `python -m benchmarks CASE [ARGS...]` (the package docstring)."""

from __future__ import annotations

import importlib
import sys

from benchmarks import CASES

USAGE = "usage: python -m benchmarks --list | CASE [ARGS...] (CASE --help for its arguments)"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    if argv[0] == "--list":
        width = max(map(len, CASES))
        for name, what in CASES.items():
            print(f"{name:<{width}}  {what}")
        return 0
    case, args = argv[0], argv[1:]
    if case not in CASES:
        print(f"benchmarks: unknown case {case!r} (python -m benchmarks --list names them)", file=sys.stderr)
        return 2
    module = importlib.import_module(f"benchmarks.{case}")
    sys.argv[0] = f"python -m benchmarks {case}"  # the case's argparse usage line names the runner
    return module.main(args) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
