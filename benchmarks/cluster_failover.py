"""`python -m benchmarks cluster-failover`: kill one engine replica of an
`agentserve cluster` mid-run and count what the agents saw.

    python -m benchmarks cluster-failover --programs 4 --rate 0.5 --token-scale 0.05 --time-scale 0.3 --kill-after 5 --baseline

Starts `agentserve cluster` (cluster_compare.py's `cluster-<router>`, 2 replicas, in
its own Ray under a private RAY_TMPDIR so no other Ray on the machine is
touched), replays an agent workload against it with the replay client of
`agentserve bench run`, and `--kill-after` seconds into the replay kills one
replica actor with `ray.kill(..., no_restart=False)` (Ray restarts it).
`--baseline` first replays the same workload and seed without a kill.

The report: programs completed / total; turns sent, answered and failed;
responses per turn (one record per sent turn: duplicates and turns sent with
no answer and no error, `lost`, are counted from the per-turn records);
streams cut by the kill (a stream that had begun on the dying replica ends
with the ingress's `replica_failed` error event, by design; the replay client
sends that turn again, `--client-retries` times at most, as an agent framework
would; with 0 the cut turn ends its program);
the ingress's /metrics counters (retried, cut, 503) over the run; and the
re-prefill cost: prompt tokens not served from cache in turns sent after the
kill, against the same turns (program, turn) of the baseline run, with both mean JCTs.

`--shared-disk-kv` runs the kill twice, on two clusters that differ in one
thing: the first as today, the second with one disk KV directory the replicas
share (`agentserve cluster --disk-kv-dir`, a temporary directory); both with
the host tier that directory needs (`--host-kv-tokens`). A program moved off
the killed replica reloads its context from the directory instead of
re-prefilling it; the report sets the uncached prompt tokens after each kill
side by side, with the blocks the replicas reloaded from the directory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.fastpath import parse_prometheus
from agentserve.bench.peers.running import http_text

COUNTERS = ("retries", "failed_streams", "unavailable")
CUT_MARK = "replica serving this stream failed"  # the ingress's replica_failed error event


def parse_counters(text: str) -> dict[str, float]:
    """The ingress's failover counters from a /metrics page (0 when absent)."""
    samples = parse_prometheus(text)
    return {key: samples.get(f"agentserve:cluster_{key}", 0.0) for key in COUNTERS}


def turn_counts(result: dict) -> dict:
    """Per-turn accounting of one replay result (its `turns` and `program_results`)."""
    turns, programs = result["turns"], result["program_results"]
    seen: dict[tuple[str, int], int] = {}  # answers per sent turn (a resent turn counts once)
    for t in turns:
        key = (t["program_id"], t["turn"])
        seen[key] = seen.get(key, 0) + (t["error"] is None)
    ok = [t for t in turns if t["error"] is None]
    errors = [t for t in turns if t["error"] is not None]
    cut = [t for t in errors if CUT_MARK in t["error"]]
    planned = sum(p["turns"] for p in programs)
    return {"programs": len(programs), "completed": sum(1 for p in programs if p["completed"]),
            "turns_planned": planned, "turns_sent": len(seen), "turns_ok": len(ok), "turns_error": len(errors),
            "streams_cut": len(cut), "other_errors": len(errors) - len(cut),
            "turns_resent": sum(1 for t in turns if t.get("attempt")),
            "duplicates": sum(n - 1 for n in seen.values() if n > 1),
            "lost": sum(1 for t in ok if not t["completion_tokens"]),
            "not_sent": planned - len(seen),
            "responses_per_turn": len(ok) / len(seen) if seen else float("nan")}


def uncached_after(result: dict, t: float, keys: set | None = None) -> dict:
    """Prompt tokens (all, and not cached) of the answered turns sent at or after `t` (replay
    seconds), or with `keys`, of the answered turns whose (program_id, turn) is in keys."""
    after = [r for r in result["turns"] if r["error"] is None
             and ((r["program_id"], r["turn"]) in keys if keys is not None else r["t_send"] >= t)]
    prompt = sum(r["prompt_tokens"] for r in after)
    return {"turns": len(after), "prompt_tokens": prompt,
            "uncached_tokens": prompt - sum(r["cached_tokens"] for r in after)}


def build_report(killed: dict, kill_t: float | None, victim: str | None, before: dict, after: dict,
                 baseline: dict | None = None, healthy_again_s: float | None = None,
                 client_retries: int = 0) -> dict:
    """The report dict: the killed run's counts, the ingress counters over it, and the re-prefill cost."""
    t = kill_t if kill_t is not None else float("inf")
    rep = {"victim": victim, "kill_t_s": kill_t, "healthy_again_s": healthy_again_s,
           "killed": {**turn_counts(killed), "mean_jct": killed["mean_jct"], "after_kill": uncached_after(killed, t)},
           "ingress": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS},
           "client_retries": client_retries}
    if baseline is not None:  # the same turns (program, turn) as the killed run's after the kill
        keys = {(r["program_id"], r["turn"]) for r in killed["turns"] if r["error"] is None and r["t_send"] >= t}
        rep["baseline"] = {**turn_counts(baseline), "mean_jct": baseline["mean_jct"],
                           "after_kill": uncached_after(baseline, t, keys)}
        rep["extra_uncached_tokens"] = (rep["killed"]["after_kill"]["uncached_tokens"]
                                        - rep["baseline"]["after_kill"]["uncached_tokens"])
    return rep


SHARED_COUNTERS = ("shared_kv_blocks_imported", "shared_kv_blocks_written", "shared_kv_files_rejected")


def shared_report(rep: dict, result: dict, kill_t: float | None, before: dict, after: dict,
                  metrics: dict[str, float]) -> dict:
    """`rep` with the run on the cluster with a shared disk KV directory (`shared`) beside
    today's kill run: its counts, the uncached prompt tokens after its kill, the ingress
    counters over it, and the replicas' shared_kv counters (`metrics`: parse_prometheus of
    /metrics after the run; a replica that was restarted counts from its restart)."""
    t = kill_t if kill_t is not None else float("inf")
    rep["shared"] = {**turn_counts(result), "mean_jct": result["mean_jct"], "kill_t_s": kill_t,
                     "after_kill": uncached_after(result, t),
                     "ingress": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS},
                     **{k: metrics.get("agentserve:" + k, 0.0) for k in SHARED_COUNTERS}}
    rep["shared_saved_tokens"] = (rep["killed"]["after_kill"]["uncached_tokens"]
                                  - rep["shared"]["after_kill"]["uncached_tokens"])
    return rep


def format_report(rep: dict) -> str:
    runs = [("kill", rep["killed"])] + ([("baseline", rep["baseline"])] if "baseline" in rep else [])
    runs += [("kill+shared", rep["shared"])] if "shared" in rep else []
    rows = [("programs completed", lambda r: f"{r['completed']}/{r['programs']}"),
            ("turns sent / planned", lambda r: f"{r['turns_sent']}/{r['turns_planned']}"),
            ("turns with errors", lambda r: str(r["turns_error"])),
            ("  streams cut by the kill", lambda r: str(r["streams_cut"])),
            ("  other errors", lambda r: str(r["other_errors"])),
            ("turns resent by the client", lambda r: str(r["turns_resent"])),
            ("responses per sent turn", lambda r: f"{r['responses_per_turn']:.3f}"),
            ("duplicated responses", lambda r: str(r["duplicates"])),
            ("lost responses", lambda r: str(r["lost"])),
            ("turns after the kill (same)", lambda r: str(r["after_kill"]["turns"])),
            ("  prompt tokens", lambda r: str(r["after_kill"]["prompt_tokens"])),
            ("  uncached (prefilled)", lambda r: str(r["after_kill"]["uncached_tokens"])),
            ("mean JCT (completed) s", lambda r: f"{r['mean_jct']:.2f}")]
    w = max(len(n) for n, _ in rows)
    lines = [f"{'':{w}}  " + "  ".join(f"{n:>10}" for n, _ in runs)]
    lines += [f"{name:{w}}  " + "  ".join(f"{fn(r):>10}" for _, r in runs) for name, fn in rows]
    kt = rep["kill_t_s"]
    lines.append(f"\nkilled replica {rep['victim']} at {kt:.1f} s of the replay" if kt is not None
                 else "\nno replica was killed (the replay ended before --kill-after)")
    if rep.get("healthy_again_s") is not None:
        lines.append(f"cluster healthy again {rep['healthy_again_s']:.1f} s after the run")
    ing = rep["ingress"]
    lines.append(f"ingress: {ing['retries']:.0f} requests retried on another replica, "
                 f"{ing['failed_streams']:.0f} streams cut, {ing['unavailable']:.0f} answered 503")
    if "extra_uncached_tokens" in rep:
        lines.append(f"re-prefill cost: {rep['extra_uncached_tokens']:+d} uncached prompt tokens after the kill "
                     "against the baseline")
    if "shared" in rep:
        sh = rep["shared"]
        lines.append(f"with a shared disk KV directory: {sh['after_kill']['uncached_tokens']} uncached prompt tokens "
                     f"after its kill against {rep['killed']['after_kill']['uncached_tokens']} without "
                     f"({rep['shared_saved_tokens']:+d} fewer); {sh['shared_kv_blocks_imported']:.0f} blocks reloaded "
                     f"from the directory, {sh['shared_kv_blocks_written']:.0f} written, "
                     f"{sh['shared_kv_files_rejected']:.0f} files rejected")
    if rep["killed"]["streams_cut"] and not rep.get("client_retries"):
        lines.append("the replay client did not resend a cut turn (--client-retries 0): it ended its program")
    return "\n".join(lines)


def _wait_healthy(url: str, timeout: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            http_text(url + "/health", 5.0)
            return time.monotonic() - t0
        except OSError:
            time.sleep(0.5)
    return None


def replica_actors() -> list[tuple[str, str]]:
    """(name, namespace) of the engine replicas' actors on the connected Ray, sorted by name."""
    import ray

    return sorted((a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
                  if "EngineReplica" in a["name"])


def pick_replica(index: int = 0):
    """(actor name, handle) of one engine replica actor on the connected Ray."""
    import ray

    actors = replica_actors()
    if not actors:
        raise RuntimeError("no EngineReplica actor on this Ray")
    name, ns = actors[index % len(actors)]
    return name, ray.get_actor(name, namespace=ns)


def _replay(programs, cfg, url: str, kill_after: float | None, victim_index: int):
    """One replay; with kill_after, a timer kills a replica that many seconds after it starts."""
    from agentserve.bench.replay_client import replay

    import ray

    killed: dict = {}
    name, handle = pick_replica(victim_index) if kill_after is not None else (None, None)

    def kill() -> None:
        killed["t"] = time.perf_counter()
        try:
            ray.kill(handle, no_restart=False)  # Ray restarts the replica
            killed["name"] = name
        except Exception as e:  # noqa: BLE001 - reported, the run goes on
            killed["error"] = f"{type(e).__name__}: {e}"

    before = parse_counters(http_text(url + "/metrics"))
    timer = threading.Timer(kill_after, kill) if kill_after is not None else None
    if timer:
        timer.start()
    try:
        result = replay(programs, cfg)
    finally:
        if timer:
            timer.cancel()
    t0 = time.perf_counter() - result["wall_s"]  # when the replay's clock started (after calibration)
    kill_t = killed["t"] - t0 if "t" in killed else None
    if "error" in killed:
        print(f"kill failed: {killed['error']}", file=sys.stderr)
    return result, kill_t, killed.get("name"), before


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster_runs(a, programs, extra_args: list[str], baseline: bool, port: int) -> dict:
    """Start the cluster (with `extra_args`), replay (first without a kill if `baseline`),
    then replay with a kill; stop it. What each replay and /metrics gave."""
    import ray

    from agentserve.bench.peers.running import start_server
    from agentserve.bench.replay_client import ReplayConfig
    from benchmarks.cluster_compare import cluster_spec

    ray_tmp = tempfile.mkdtemp(prefix="asfo", dir="/tmp")  # short: Ray's socket paths live under it
    logs = Path(tempfile.gettempdir()) / "agentserve-failover"
    spec = cluster_spec(f"cluster-{a.router}", a.kv_tokens, port=port, log_dir=logs,
                        extra_env={"RAY_TMPDIR": ray_tmp}, extra_args=extra_args)
    print(f"starting {spec.name} {' '.join(extra_args)} on port {spec.port} (log {spec.log_path})...",
          file=sys.stderr)
    server = start_server(spec)
    out: dict = {"base": None}
    try:
        os.environ["RAY_TMPDIR"] = ray_tmp
        ray.init(address="auto", logging_level="warning", log_to_driver=False)
        print(f"replica actors: {[n for n, _ in replica_actors()]}", file=sys.stderr)

        def cfg(label: str) -> ReplayConfig:
            return ReplayConfig(url=server.base_url, workload=a.workload, rate=a.rate, seed=a.seed,
                                token_scale=a.token_scale, time_scale=a.time_scale,
                                request_timeout=a.request_timeout, label=label, progress=False,
                                retry_failed_turns=a.client_retries)

        if baseline:
            print("baseline run (no kill)...", file=sys.stderr)
            out["base"], _, _, _ = _replay(programs, cfg("baseline"), server.base_url, None, a.victim)
        print(f"run with a kill at {a.kill_after:g} s...", file=sys.stderr)
        out["res"], out["kill_t"], out["victim"], out["before"] = _replay(programs, cfg("kill"), server.base_url,
                                                                          a.kill_after, a.victim)
        page = http_text(server.base_url + "/metrics")
        out["after"], out["metrics"] = parse_counters(page), parse_prometheus(page)
        out["healthy"] = _wait_healthy(server.base_url, 120.0)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        server.stop()
        shutil.rmtree(ray_tmp, ignore_errors=True)  # Ray's session files (the cluster's own log stays)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks cluster-failover", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="swebench")
    ap.add_argument("--programs", type=int, default=4)
    ap.add_argument("--rate", type=float, default=1.0, help="program arrivals per second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--token-scale", type=float, default=0.05)
    ap.add_argument("--time-scale", type=float, default=0.1)
    ap.add_argument("--kill-after", type=float, default=5.0,
                    help="seconds after the replay is called (its calibration probes included) to kill a replica")
    ap.add_argument("--victim", type=int, default=0, help="which replica actor (sorted by name) to kill")
    ap.add_argument("--baseline", action="store_true", help="first replay the same workload without a kill")
    ap.add_argument("--router", default="program")
    ap.add_argument("--kv-tokens", type=int, default=16384, help="the cluster's KV tokens (split over 2 replicas)")
    ap.add_argument("--shared-disk-kv", action="store_true",
                    help="then run the kill again on a cluster whose replicas share a disk KV directory, and set "
                         "the re-prefilled tokens after each kill side by side")
    ap.add_argument("--host-kv-tokens", type=int, default=None,
                    help="with --shared-disk-kv, both clusters' host tier in tokens (default 4x --kv-tokens)")
    ap.add_argument("--disk-kv-bytes", type=int, default=8 << 30,
                    help="with --shared-disk-kv, the shared directory's budget, the cluster's total (default 8 GiB)")
    ap.add_argument("--port", type=int, default=None,
                    help="default: a free port (with --shared-disk-kv, the second cluster takes the next one)")
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--client-retries", type=int, default=2,
                    help="times the replay client sends a turn the server failed again (default 2, as an agent "
                         "framework's OpenAI client would; 0: a cut turn ends its program)")
    ap.add_argument("--json", default=None, help="write the report (and both runs' results) here")
    a = ap.parse_args(argv)
    if a.shared_disk_kv and a.disk_kv_bytes < 1:
        ap.error("--disk-kv-bytes must be > 0")

    from agentserve.bench.replay_results import write_json
    from agentserve.workload.load import load_workload

    programs = load_workload(a.workload, a.programs, a.rate, a.seed)
    tiers = ["--host-kv-tokens", str(a.host_kv_tokens or 4 * a.kv_tokens)] if a.shared_disk_kv else []
    today = _cluster_runs(a, programs, tiers, a.baseline, a.port or _free_port())
    res, base = today["res"], today["base"]
    rep = build_report(res, today["kill_t"], today["victim"], today["before"], today["after"], base,
                       today["healthy"], a.client_retries)
    shared = None
    if a.shared_disk_kv:
        kv_dir = tempfile.mkdtemp(prefix="agentserve-shared-kv-")
        try:
            # (another port: Serve's proxy of the first cluster may hold its port a while after the stop)
            shared = _cluster_runs(a, programs, tiers + ["--disk-kv-dir", kv_dir, "--disk-kv-bytes",
                                                         str(a.disk_kv_bytes)], False,
                                   a.port + 1 if a.port else _free_port())
        finally:
            shutil.rmtree(kv_dir, ignore_errors=True)
        shared_report(rep, shared["res"], shared["kill_t"], shared["before"], shared["after"], shared["metrics"])
    rep["settings"] = {k: v for k, v in vars(a).items() if k != "json"}
    print(format_report(rep))
    if a.json:
        write_json({**rep, "runs": {"kill": res, "baseline": base,
                                    "kill+shared": shared["res"] if shared else None}}, a.json)
        print(f"wrote {a.json}", file=sys.stderr)
    runs = [rep["killed"]] + ([rep["shared"]] if shared else [])
    return 0 if all(r["completed"] == r["programs"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
