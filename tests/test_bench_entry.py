"""`python -m benchmarks`: the benchmarks outside the package, each run by name
with the options it had as an `agentserve bench` subcommand or a module."""

from __future__ import annotations

import importlib
import os
import pathlib
import subprocess
import sys

import pytest

from benchmarks import BENCHMARKS
from benchmarks.__main__ import main

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_help_lists_every_benchmark(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in BENCHMARKS)
    assert main([]) == 2  # no name: the list, and a usage error


def test_an_unknown_name_is_one_line(capsys):
    assert main(["nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown benchmark 'nope'" in err and "agentic" in err


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_each_benchmark_has_its_options_under_its_name(name, capsys):
    module = importlib.import_module(f"benchmarks.{BENCHMARKS[name][0]}")
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m benchmarks {name} ")
    with pytest.raises(SystemExit):  # the module's own entry point takes the same options
        module.main(["--help"])
    # a module name works as the name too
    with pytest.raises(SystemExit):
        main([BENCHMARKS[name][0], "--help"])


def test_the_former_subcommands_take_their_options_and_say_a_user_error_in_one_line(capsys):
    from benchmarks import agentic, burst_prefill, sched_overhead, soak

    assert agentic.build_parser().parse_args(["--workload", "repeat", "--servers", "vllm-cpu"]).servers == "vllm-cpu"
    assert burst_prefill.build_parser().parse_args(["--budgets", "512,4096"]).budgets == [512, 4096]
    assert soak.build_parser().parse_args(["--programs", "4"]).programs == 4
    assert agentic.main(["--runs", "0"]) == 2
    assert capsys.readouterr().err == "python -m benchmarks agentic: error: --runs must be at least 1\n"
    assert burst_prefill.main(["--agents", "0"]) == 2
    assert "python -m benchmarks burst: error: --agents" in capsys.readouterr().err
    assert sched_overhead.main(["--policies", "nope"]) == 2
    assert soak.main(["--programs", "0"]) == 2


def test_python_dash_m_from_the_repository_root():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 0 and "runner-speed" in run.stdout
    run = subprocess.run([sys.executable, "-m", "benchmarks.sched_overhead", "--policies", "nope"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 2 and "unknown policy 'nope'" in run.stderr
