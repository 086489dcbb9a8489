"""`python -m benchmarks soak`: a long run of misbehaving agent programs against one
server, and what it left behind.

    python -m benchmarks soak --programs 64 --duration 1800 --json soak.json     # starts `agentserve serve`
    python -m benchmarks soak --url http://127.0.0.1:8000 --server-pid 1234 --duration 300

N programs run at once for the duration (benchmarks/soak_client.py: dropped
streams, tools that never return, invalid requests, several tenants with
--tenants on a server that takes several keys). Every `--sample-s` seconds it
reads the server's resident memory (/proc/PID/status, when the server's pid is
known) and its KV state from /metrics. After the run it ends the programs
still open, waits up to `--settle-s` for the requests to drain and the pins
of the quiet programs to expire, and reports: RSS over time and its slope
after the warm-up, KV blocks and pins at the end against the start, blocks
held by nobody (leaked), the server's failed block-accounting checks
(agentserve:kv_integrity_failures: the engine checks each time it goes idle),
lost and duplicated responses, and responses >= 500. A table, and JSON with
--json. It also reads /dashboard/state at each sample, as a person watching
would (its size shows the dashboard's memory stays bounded). The exit status
is 1 when anything leaked, was lost or duplicated, or a check or a response
failed."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import httpx

from benchmarks.fastpath import parse_prometheus
from benchmarks.soak_client import SoakClients, SoakConfig

P = "agentserve:"
METRICS = {"free": "kv_cache_free_blocks", "blocks": "kv_cache_blocks", "pinned_blocks": "pinned_blocks",
           "pinned_programs": "pinned_programs", "running": "num_requests_running",
           "waiting": "num_requests_waiting", "integrity_failures": "kv_integrity_failures"}


def rss_mb(pid: int) -> float | None:
    """Resident memory of process `pid` in MB (VmRSS), None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        return None
    return None


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per minute; None for fewer than 3."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    if var == 0:
        return None
    return 60.0 * sum((t - mx) * (v - my) for t, v in points) / var


async def kv_state(client: httpx.AsyncClient, headers: dict) -> dict:
    """The KV figures of /metrics ({} when it cannot be read)."""
    try:
        r = await client.get("/metrics", headers=headers)
    except httpx.HTTPError:
        return {}
    if r.status_code != 200:
        return {}
    m = parse_prometheus(r.text)
    return {k: m[P + name] for k, name in METRICS.items() if P + name in m}


class Sampler:
    def __init__(self, client: httpx.AsyncClient, headers: dict, pid: int | None, t0: float) -> None:
        self.client, self.headers, self.pid, self.t0 = client, headers, pid, t0
        self.samples: list[dict] = []

    async def sample(self) -> dict:
        s = {"t": round(time.monotonic() - self.t0, 1)}
        if self.pid is not None:
            s["rss_mb"] = rss_mb(self.pid)
        s.update(await kv_state(self.client, self.headers))
        try:  # the dashboard's state is read as a person would, to see it stay bounded
            r = await self.client.get("/dashboard/state", headers=self.headers)
            s["dashboard_status"], s["dashboard_kb"] = r.status_code, round(len(r.content) / 1024, 1)
        except httpx.HTTPError:
            s["dashboard_status"] = None
        self.samples.append(s)
        return s

    async def every(self, period: float, stop: asyncio.Event) -> None:
        while True:
            try:
                await asyncio.wait_for(stop.wait(), period)
                return
            except asyncio.TimeoutError:
                await self.sample()


async def settle(sampler: Sampler, timeout: float) -> dict:
    """Sample until nothing runs, waits or is pinned, or `timeout` passes; the last sample."""
    deadline = time.monotonic() + timeout
    while True:
        s = await sampler.sample()
        idle = s.get("running", 0) == 0 and s.get("waiting", 0) == 0
        if (idle and s.get("pinned_blocks", 0) == 0) or time.monotonic() >= deadline:
            return s
        await asyncio.sleep(1.0)


async def run_soak(url: str, cfg: SoakConfig, server_pid: int | None, sample_s: float, settle_s: float,
                   warmup_s: float) -> dict:
    headers = {"Authorization": f"Bearer {cfg.keys[0]}"} if cfg.keys else {}
    limits = httpx.Limits(max_connections=cfg.programs + 16, max_keepalive_connections=cfg.programs + 16)
    async with httpx.AsyncClient(base_url=url, timeout=cfg.request_timeout_s, limits=limits) as client:
        for key in cfg.keys:  # every tenant's key must open the server, or the run says so at once
            r = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            if r.status_code != 200:
                raise RuntimeError(f"the server refused API key {key[:4]}... (HTTP {r.status_code}): it takes "
                                   f"{'only one key' if len(cfg.keys) > 1 else 'another key'}; run with fewer "
                                   f"--tenants or give the keys it has with --keys")
        t0 = time.monotonic()
        sampler = Sampler(client, headers, server_pid, t0)
        start = await sampler.sample()
        clients = SoakClients(cfg, client, uuid.uuid4().hex[:6])
        stop = asyncio.Event()
        sampling = asyncio.ensure_future(sampler.every(sample_s, stop))
        await clients.run(t0 + cfg.duration_s)
        ran_s = time.monotonic() - t0
        stop.set()
        await sampling
        end = await settle(sampler, settle_s)
    rss = [(s["t"], s["rss_mb"]) for s in sampler.samples if s.get("rss_mb") is not None]
    after_warmup = [p for p in rss if p[0] >= warmup_s and p[0] <= ran_s]
    held_end = end.get("blocks", 0) - end.get("free", 0)
    leaked = None
    if end.get("running", 0) == 0 and end.get("waiting", 0) == 0 and "blocks" in end:
        leaked = int(held_end - end.get("pinned_blocks", 0))  # held by no request and no pin
    t = clients.tally
    dashboard_5xx = sum(1 for s in sampler.samples if (s.get("dashboard_status") or 0) >= 500)
    return {
        "url": url, "server_pid": server_pid, "ran_s": round(ran_s, 1), "settled_s": end["t"],
        "config": asdict(cfg),
        "start": start, "end": end, "samples": sampler.samples, "tally": t.as_dict(),
        "quiet_programs": clients.quiet[:50],
        "figures": {
            "leaked_blocks": leaked, "pins_left": end.get("pinned_programs"),
            "pinned_blocks_left": end.get("pinned_blocks"),
            "integrity_failures": (end.get("integrity_failures", 0) - start.get("integrity_failures", 0))
            if "integrity_failures" in end else None,
            "lost": t.lost, "duplicated": t.duplicated,
            "server_errors": t.server_errors + dashboard_5xx,
            "dashboard_kb_max": max((s.get("dashboard_kb") or 0 for s in sampler.samples), default=None),
            "invalid_not_4xx": sum(n for s, n in t.invalid_status.items() if not 400 <= s < 500),
            "rss_start_mb": rss[0][1] if rss else None, "rss_end_mb": rss[-1][1] if rss else None,
            "rss_peak_mb": max(v for _, v in rss) if rss else None,
            "rss_slope_mb_per_min": slope_per_min(after_warmup), "warmup_s": warmup_s,
        },
    }


def passed(result: dict) -> bool:
    f = result["figures"]
    return (f["leaked_blocks"] == 0 and f["lost"] == 0 and f["duplicated"] == 0 and f["server_errors"] == 0
            and f["integrity_failures"] == 0 and f["invalid_not_4xx"] == 0)


def _fmt(x, spec: str = "") -> str:
    return "-" if x is None else format(x, spec)


def print_report(result: dict, out=None) -> None:
    out = sys.stdout if out is None else out
    cfg, t, f, s0, s1 = result["config"], result["tally"], result["figures"], result["start"], result["end"]
    w = lambda *a: print(*a, file=out)  # noqa: E731
    w(f"soak: {cfg['programs']} programs, new turns for {cfg['duration_s']:.0f} s (the last answered at "
      f"{result['ran_s']:.0f} s, settled at {result['settled_s']:.0f} s) against {result['url']} "
      f"({len(cfg['keys']) or 'no'} API key(s))")
    w(f"  requests        {t['requests']} valid: {t['complete']} complete, {t['dropped_by_client']} dropped by the "
      f"client, {sum(t['http_errors'].values())} HTTP errors {t['http_errors']}, {t['error_events']} error events")
    w(f"  invalid         {t['invalid_sent']} sent: statuses {t['invalid_status']}")
    w(f"  programs        {t['programs_started']} started, {t['programs_ended']} ended, "
      f"{t['programs_quiet']} went quiet (their tool never returned)")
    w(f"  lost            {t['lost']}    duplicated {t['duplicated']}    responses >= 500: {t['server_errors']}")
    w(f"  KV blocks       start: {_fmt(s0.get('free'), '.0f')} free of {_fmt(s0.get('blocks'), '.0f')}, "
      f"{_fmt(s0.get('pinned_blocks'), '.0f')} pinned by {_fmt(s0.get('pinned_programs'), '.0f')} programs")
    w(f"                  end:   {_fmt(s1.get('free'), '.0f')} free of {_fmt(s1.get('blocks'), '.0f')}, "
      f"{_fmt(s1.get('pinned_blocks'), '.0f')} pinned by {_fmt(s1.get('pinned_programs'), '.0f')} programs, "
      f"{_fmt(s1.get('running'), '.0f')} running, {_fmt(s1.get('waiting'), '.0f')} waiting")
    w(f"  leaked blocks   {_fmt(f['leaked_blocks'])}    failed integrity checks {_fmt(f['integrity_failures'], '.0f')}"
      f"    /dashboard/state at most {_fmt(f['dashboard_kb_max'])} kB")
    w(f"  RSS MB          start {_fmt(f['rss_start_mb'], '.1f')}, peak {_fmt(f['rss_peak_mb'], '.1f')}, "
      f"end {_fmt(f['rss_end_mb'], '.1f')}; slope after {f['warmup_s']:.0f} s warm-up "
      f"{_fmt(f['rss_slope_mb_per_min'], '+.2f')} MB/min")
    samples = result["samples"]
    step = max(1, len(samples) // 12)
    w(f"  {'t s':>7} {'RSS MB':>8} {'free':>6} {'pinned':>7} {'pins':>5} {'running':>8} {'waiting':>8}")
    for s in samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else []):
        w(f"  {s['t']:>7.0f} {_fmt(s.get('rss_mb'), '.1f'):>8} {_fmt(s.get('free'), '.0f'):>6} "
          f"{_fmt(s.get('pinned_blocks'), '.0f'):>7} {_fmt(s.get('pinned_programs'), '.0f'):>5} "
          f"{_fmt(s.get('running'), '.0f'):>8} {_fmt(s.get('waiting'), '.0f'):>8}")
    for e in t["examples"][:10]:
        w(f"  ! {e}")
    w("  PASS" if passed(result) else "  FAIL")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, keys: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    """`agentserve serve` on a free loopback port, ready when /health answers."""
    port = _free_port()
    cmd = [sys.executable, "-m", "agentserve.cli", "serve", "--port", str(port), "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    if args.kv_cache_tokens:
        cmd += ["--kv-cache-tokens", str(args.kv_cache_tokens)]
    for key in keys:
        cmd += ["--api-key", key]
    cmd += args.server_arg or []
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}; its log: {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server did not answer in {args.startup_s:.0f} s; its log: {log_path}")
        time.sleep(0.5)


def build_parser() -> argparse.ArgumentParser:
    from agentserve.argtypes import csv_list

    p = argparse.ArgumentParser(prog="python -m benchmarks soak",
                                description=__doc__.split("\n\n")[0].replace("`python -m benchmarks soak`: ", ""))
    p.add_argument("--url", default=None, help="a running server (default: start `agentserve serve` on loopback)")
    p.add_argument("--server-pid", type=int, default=None, help="with --url: the server's pid, for its RSS")
    p.add_argument("--model", default=None, help="the model the started server serves (default: its default)")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="KV cache of the started server")
    p.add_argument("--server-arg", action="append", help="one more argument for the started server (repeatable)")
    p.add_argument("--startup-s", type=float, default=300.0, help="how long the started server may take to answer")
    p.add_argument("--programs", type=int, default=64, help="programs running at once (default 64)")
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic (default 1800)")
    p.add_argument("--max-turns", type=int, default=6, help="turns of a program at most (default 6)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each turn (default 16)")
    p.add_argument("--tenants", type=int, default=2, help="API keys the programs take in turn (default 2; the "
                   "started server gets each as --api-key; 0: no key)")
    p.add_argument("--keys", type=csv_list(str), default=None,
                   help="with --url: the server's API keys, comma-separated")
    p.add_argument("--p-disconnect", type=float, default=0.08, help="share of streams dropped mid-way (default 0.08)")
    p.add_argument("--p-quiet", type=float, default=0.04, help="share of turns after which the tool never returns")
    p.add_argument("--p-invalid", type=float, default=0.05, help="share of turns preceded by an invalid request")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS and KV samples (default 10)")
    p.add_argument("--settle-s", type=float, default=120.0, help="after the run, how long to wait for requests to "
                   "drain and pins to expire (default 120)")
    p.add_argument("--warmup-s", type=float, default=None, help="RSS slope from this second on (default: a fifth "
                   "of the duration, at most 300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results here")
    return p


def cmd_soak(args) -> int:
    from agentserve.cli_errors import CliError

    if args.programs < 1 or args.duration <= 0 or args.max_turns < 2 or args.max_tokens < 1 or args.tenants < 0:
        raise CliError("--programs, --duration, --max-tokens must be positive, --max-turns >= 2, --tenants >= 0")
    keys = args.keys if args.keys else [f"soak-tenant-{i}-{uuid.uuid4().hex[:8]}" for i in range(args.tenants)]
    proc = None
    if args.url is None:
        log_path = Path(args.json).with_suffix(".server.log") if args.json else Path(os.devnull)
        try:
            proc, url = start_server(args, keys, log_path)
        except RuntimeError as e:
            raise CliError(str(e)) from None
        pid = proc.pid
    else:
        url, pid = args.url.rstrip("/"), args.server_pid
        if not args.keys:
            keys = []
    try:
        model = _model_name(url, keys)
        cfg = SoakConfig(model=model, programs=args.programs, duration_s=args.duration, max_turns=args.max_turns,
                         max_tokens=args.max_tokens, p_disconnect=args.p_disconnect, p_quiet=args.p_quiet,
                         p_invalid=args.p_invalid, keys=keys, seed=args.seed)
        warmup = args.warmup_s if args.warmup_s is not None else min(300.0, args.duration / 5)
        result = asyncio.run(run_soak(url, cfg, pid, args.sample_s, args.settle_s, warmup))
    except RuntimeError as e:
        raise CliError(str(e)) from None
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    print_report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if passed(result) else 1


def _model_name(url: str, keys: list[str]) -> str:
    headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
    r = httpx.get(url + "/v1/models", headers=headers, timeout=30)
    if r.status_code != 200:
        raise RuntimeError(f"GET /v1/models answered HTTP {r.status_code}: {r.text[:200]}")
    return r.json()["data"][0]["id"]


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import run_main

    return run_main(build_parser(), cmd_soak, argv)


if __name__ == "__main__":
    sys.exit(main())
