"""python -m benchmarks list | run NAME [--json PATH] [--base REF] [ARGS...] | table [--check] [--perf PATH]

  list    the registered benchmarks: name, where it runs, what it measures
  run     one benchmark; its own options follow its name (`run NAME -- --help` for them); --json PATH writes the
          record (benchmarks/registry.py: benchmark, date, machine, gpu, commit, command, figures); --base REF runs
          it first on REF's src (a git ref or a folder holding a src/) and prints both side by side
  table   rewrites docs/PERF.md's current-numbers table from the latest result JSONs (--check: fail if stale)
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__.strip())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "list":
        from .registry import REGISTRY

        width = max(len(n) for n in REGISTRY)
        for b in REGISTRY.values():
            print(f"{b.name:{width}s}  {b.device:7s}  {b.summary}")
        return 0
    if command == "run":
        from .runner import run

        return run(rest)
    if command == "table":
        from .table import main as table

        return table(rest)
    print(f"unknown command {command!r}\n\n{__doc__.strip()}", file=sys.stderr)
    return 2


sys.exit(main(sys.argv[1:]))
