"""`python -m benchmarks restart-replay`: `agentserve bench compare` with a
restart in the middle. `--restart-at SECONDS` into its replay, each server
named with `+restart` is restarted (SIGTERM: it drains its requests and saves
what it keeps; then the same command, its output appended to the same log);
no turn is sent while it is down and a turn the shutdown cut is sent again.
`+state` gives an agentserve server `--state-dir` of its own (under the peers
directory, emptied when the run starts). Every row adds the programs that
arrived from SECONDS on: how many completed, their mean JCT, and how long the
server was down.

    python -m benchmarks restart-replay --restart-at 120 --programs 40 --rate 0.2 --token-scale 0.1

takes every other option of `agentserve bench compare`; the docs' benchmarks
page, "A restart in the middle"."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import re
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from agentserve.bench.compare import add_compare_args, cmd_compare
from agentserve.bench.peers.running import RunningServer, spawn
from agentserve.bench.peers.specs import ServerSpec, default_peers_dir, server_spec
from agentserve.workload.trace import percentile

from benchmarks.common import run_main

# after an agentserve name (and its +host), in any order: `+state` keeps the learned state in a
# directory of its own under the peers dir (`serve --state-dir`), `+restart` restarts the server
RUN_SUFFIXES = ("+state", "+restart")
DEFAULT_SERVERS = ("agentserve-agentserve", "agentserve-agentserve+restart", "agentserve-agentserve+state+restart")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A server of the run: its spec (named with its suffixes), and what they ask."""
    spec: ServerSpec
    state_dir: Path | None = None  # `+state`: where the server keeps its learned state
    restart: bool = False  # `+restart`: restarted in the middle of the replay


def run_spec(name: str, kv_tokens: int, peers_dir: Path | str | None = None, **kwargs) -> RunSpec:
    """server_spec of `name` without its RUN_SUFFIXES (only an agentserve name takes them, anywhere
    before its options), then named with them, `--state-dir` added for `+state`."""
    base, colon, options = name.partition(":")
    found = [s for s in RUN_SUFFIXES if s in base] if base.startswith("agentserve-") else []
    for suffix in found:
        base = base.replace(suffix, "", 1)
    spec = server_spec(base + colon + options, kv_tokens, peers_dir=peers_dir, **kwargs)
    state_dir = None
    if "+state" in found:
        peers = Path(peers_dir) if peers_dir is not None else default_peers_dir()
        state_dir = peers / "state" / re.sub(r"[^A-Za-z0-9._+=,-]", "_", name)
        spec = dataclasses.replace(spec, argv=spec.argv + ("--state-dir", str(state_dir)))
    spec = dataclasses.replace(spec, name=name, log_path=spec.log_path.with_name(f"{name}.log"))
    return RunSpec(spec, state_dir, "+restart" in found)


def restart_server(srv: RunningServer, grace_s: float = 30.0) -> float:
    """Stop the server as `stop` does and start it again with the same command, its output appended
    to the same log; the seconds it was down (until it answers again). PeerServerError, with the
    log's tail, if it does not come back."""
    t0 = time.monotonic()
    srv.stop(grace_s)
    srv.started_at = time.monotonic()
    srv.process, srv.log_file = spawn(srv.spec, restart=True)
    srv.wait_ready()
    return time.monotonic() - t0


def restart_in_the_middle(at: float, restart: Callable[[], float], record: dict):
    """ReplayConfig.beside: `at` seconds into the replay, hold the turns while `restart()` (blocking,
    in a thread; the seconds the server was down) runs; `record` gets when it began and how long
    the server was down (or the error)."""
    async def beside(rep) -> None:
        await asyncio.sleep(max(0.0, at - rep.now()))
        rep.up.clear()
        record.update(at=rep.now(), down_s=None)
        try:
            record["down_s"] = await asyncio.to_thread(restart)
        except Exception as e:  # noqa: BLE001 - the turns then fail against the server that is not back
            record["error"] = str(e)
        finally:
            rep.up.set()

    return beside


def summarize_since(result: dict, since: float) -> dict:
    """The programs of `result` that arrived `since` seconds into the run or later (the half after
    a restart, or the same programs of a run without one): their count, completions, JCT, TTFT."""
    late = [r for r in result["program_results"] if r["arrival"] >= since]
    ids = {r["program_id"] for r in late}
    jct = [r["jct"] for r in late if r["completed"]]
    ttft = [t["ttft"] for t in result["turns"] if t["program_id"] in ids and t["error"] is None]
    return {"since_s": since, "programs": len(late), "completed": len(jct), "mean_jct": _mean(jct),
            "p95_jct": percentile(jct, 95), "mean_ttft": _mean(ttft)}


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def after_restart(result: dict, at: float, record: dict | None) -> dict:
    """A result's `after_restart`: the programs that arrived from `at` on, and the restart's record
    (None where the server was not restarted)."""
    return {**summarize_since(result, at), "restarted": record or None}


def widen_table(at: float, records: dict[str, dict]):
    """compare's `widen`: every result gets `after_restart`, every row and line its figures."""
    def widen(results: list[dict], rows: list[dict], lines: list[list[str]]) -> None:
        lines[0] += [f"arrived after {at:g} s: done", "mean JCT s", "restart down s"]
        for result, row, line in zip(results, rows, lines[1:]):
            after = result["after_restart"] = after_restart(result, at, records.get(result["server"]))
            down = (after["restarted"] or {}).get("down_s")
            row.update(after_s=at, after_done=f"{after['completed']}/{after['programs']}",
                       after_mean_jct=after["mean_jct"], restarted=down)
            line += [row["after_done"], f"{after['mean_jct']:.2f}", "-" if down is None else f"{down:.1f}"]

    return widen


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks restart-replay",
                                description=__doc__.split("\n\n")[0].replace(
                                    "`python -m benchmarks restart-replay`: ", ""))
    p.add_argument("--restart-at", type=float, required=True, metavar="SECONDS",
                   help="restart the servers named with +restart this many seconds into their replay and add "
                        "to every row the programs that arrived from then on")
    add_compare_args(p, DEFAULT_SERVERS)
    return p


def cmd_restart_replay(a) -> int:
    from agentserve.cli_errors import CliError

    if not a.restart_at > 0:
        raise CliError(f"--restart-at must be a number of seconds > 0, got {a.restart_at:g}")
    runs: dict[str, RunSpec] = {}
    records: dict[str, dict] = {}

    def specs_of(names, kv_tokens, **kwargs) -> list[ServerSpec]:
        runs.update((n, run_spec(n, kv_tokens, **kwargs)) for n in names)
        for run in runs.values():
            if run.state_dir is not None:  # +state: what it learns in this run only
                shutil.rmtree(run.state_dir, ignore_errors=True)
        return [runs[n].spec for n in names]

    def replay_kwargs(spec: ServerSpec, srv: RunningServer) -> dict:
        if not runs[spec.name].restart:
            return {}
        records[spec.name] = {}
        return {"beside": restart_in_the_middle(a.restart_at, lambda: restart_server(srv), records[spec.name]),
                "retry_failed_turns": 2}

    return cmd_compare(a, specs_of, replay_kwargs, widen_table(a.restart_at, records))


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), cmd_restart_replay, argv)


if __name__ == "__main__":
    sys.exit(main())
