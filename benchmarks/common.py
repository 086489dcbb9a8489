"""What the benchmarks share: a former `agentserve bench` subcommand run as a
program (its user errors one line and exit status 2, as the CLI prints them),
and a run's results written beside the arguments it ran with."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def run_main(parser: argparse.ArgumentParser, command: Callable[[argparse.Namespace], int],
             argv: list[str] | None = None) -> int:
    """Parse `argv` with `parser` and run `command`; a CliError is printed as one line (exit 2)."""
    from agentserve.cli_errors import CliError

    args = parser.parse_args(argv)
    try:
        return command(args)
    except CliError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def write_run_json(args, results: list, path: str) -> None:
    """A benchmark's results beside the arguments it ran with (dataclasses as dicts)."""
    from dataclasses import asdict, is_dataclass

    from agentserve.bench.replay_results import write_json

    write_json({"args": vars(args), "results": [asdict(r) if is_dataclass(r) else r for r in results]}, path)
