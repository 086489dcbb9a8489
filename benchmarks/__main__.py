"""`python -m benchmarks NAME [args]`: run one benchmark (`--help` lists them)."""

from __future__ import annotations

import importlib
import sys

from benchmarks import BENCHMARKS


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in BENCHMARKS.items()]
    return ("usage: python -m benchmarks NAME [args]   (python -m benchmarks NAME --help: its options)\n\n"
            "benchmarks:\n" + "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    by_module = {module: name for name, (module, _) in BENCHMARKS.items()}
    name = by_module.get(argv[0], argv[0])
    if name not in BENCHMARKS:
        print(f"python -m benchmarks: unknown benchmark {argv[0]!r}; choose from {', '.join(BENCHMARKS)}",
              file=sys.stderr)
        return 2
    module = importlib.import_module(f"benchmarks.{BENCHMARKS[name][0]}")
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
