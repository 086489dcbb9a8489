"""Every command's `--help` ends with examples, and every example parses."""

from __future__ import annotations

import shlex

import pytest

from agentserve.cli import build_parser
from agentserve.cli_examples import EXAMPLES, commands


def test_every_command_has_examples_and_every_example_names_a_command():
    paths = {" ".join(path) for path, _ in commands(build_parser())}
    assert paths == set(EXAMPLES), (paths ^ set(EXAMPLES))


@pytest.mark.parametrize("line", [line for lines in EXAMPLES.values() for line in lines if "--help" not in line])
def test_example_parses(line):
    argv = shlex.split(line)
    assert argv[0] == "agentserve"
    args = build_parser().parse_args(argv[1:])
    assert args.command == argv[1]


def test_help_ends_with_its_examples(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "compare", "--help"])
    out = capsys.readouterr().out
    assert out.rstrip().endswith(EXAMPLES["bench compare"][-1][-40:])
    assert "examples:\n  agentserve bench compare --servers" in out
