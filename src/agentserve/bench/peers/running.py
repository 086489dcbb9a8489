"""Running a peer server: started in its own session with its output in its log
file, ready once its health path answers and /v1/models lists the model name,
stopped with SIGTERM to its process group and SIGKILL after a grace period.
Errors carry the log's tail. `each_server` is the loop every comparison runs:
start each server in turn, skip one that is not installed, measure, stop."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

from agentserve.bench.peers.specs import PeerServerError, ServerSpec

T = TypeVar("T")


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def http_text(url: str, timeout_s: float = 30.0) -> str:
    """GET; the reply's text. Raises urllib errors (OSError)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.read().decode()


def http_json(url: str, body: dict | None = None, timeout_s: float = 10.0) -> dict:
    """GET (body None) or POST JSON; the decoded reply. Raises urllib errors."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read() or b"null")


class RunningServer:
    """A started server. stop() (or leaving a `with` block) ends it and its children."""

    def __init__(self, spec: ServerSpec, process: subprocess.Popen, log_file, started_at: float):
        self.spec = spec
        self.process = process
        self.log_file = log_file
        self.started_at = started_at
        self.ready_s: float | None = None  # seconds from start to answering

    @property
    def base_url(self) -> str:
        return self.spec.base_url

    @property
    def api_base(self) -> str:
        return self.spec.api_base

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return _log_tail(self.spec.log_path, lines)

    def wait_ready(self, timeout_s: float | None = None, poll_s: float = 0.5) -> float:
        """Wait until the health path answers 200 and /v1/models lists the model
        name; the seconds since start. PeerServerError (with the log tail) if the
        process exits or the time runs out."""
        timeout = self.spec.startup_timeout_s if timeout_s is None else timeout_s
        url = self.base_url + self.spec.health_path
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while True:
            code = self.process.poll()
            if code is not None:
                raise PeerServerError(f"{self.spec.name} exited with code {code} before answering {url}; "
                                      f"last lines of {self.spec.log_path}:\n{self.log_tail()}")
            try:
                urllib.request.urlopen(url, timeout=5.0).close()  # raises HTTPError unless 2xx
                models = http_json(self.api_base + "/models", timeout_s=5.0)
                ids = [m.get("id") for m in (models or {}).get("data", [])]
                if self.spec.model_name not in ids:
                    raise PeerServerError(f"{self.spec.name} at {self.base_url} serves {ids}, not "
                                          f"{self.spec.model_name!r}")
                self.ready_s = time.monotonic() - self.started_at
                return self.ready_s
            except (urllib.error.URLError, ConnectionError, TimeoutError, socket.timeout, ValueError) as e:
                last = str(getattr(e, "reason", e))
            if time.monotonic() >= deadline:
                raise PeerServerError(f"{self.spec.name} did not answer {url} within {timeout:.0f} s ({last}); "
                                      f"last lines of {self.spec.log_path}:\n{self.log_tail()}")
            time.sleep(poll_s)

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM to the server's process group (vLLM's engine process too),
        SIGKILL after grace_s; its exit code."""
        try:
            if self.process.poll() is None:
                _signal_group(self.process, signal.SIGTERM)
                try:
                    self.process.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    _signal_group(self.process, signal.SIGKILL)
                    self.process.wait(timeout=30)
            # Children that outlived the leader (an engine process) go too.
            _signal_group(self.process, signal.SIGKILL)
        finally:
            if self.log_file and not self.log_file.closed:
                self.log_file.close()
        return self.process.returncode

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    # The server was started in its own session, so its process group id is its pid.
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def spawn(spec: ServerSpec, restart: bool = False):
    """(the server's process, its log file): in its own session (its group is stopped as one), its
    output in spec.log_path after the command line (a restart appends to the log, a start empties it)."""
    log = open(spec.log_path, "ab" if restart else "wb")
    log.write(f"# {'restarted: ' if restart else ''}{spec.shell_command()}\n".encode())
    log.flush()
    return subprocess.Popen(spec.argv, env=spec.child_env(), stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True), log


def start_server(spec: ServerSpec, *, wait: bool = True, timeout_s: float | None = None) -> RunningServer:
    """Start `spec` (its output goes to spec.log_path, overwritten) and, with
    wait, return once it answers. Raises PeerServerError when it is not
    installed, the port is taken, it exits, or it does not answer in time (the
    process is stopped then)."""
    missing = spec.missing()
    if missing:
        raise PeerServerError(f"{spec.name} is not installed (missing {', '.join(missing)}); "
                              f"run: {spec.install_hint}")
    if _port_in_use(spec.host, spec.port):
        raise PeerServerError(f"{spec.host}:{spec.port} is already in use; pass another port for {spec.name}")
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    proc, log = spawn(spec)
    server = RunningServer(spec, proc, log, started)
    if wait:
        try:
            server.wait_ready(timeout_s)
        except BaseException:
            server.stop(grace_s=10.0)
            raise
    return server


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """While inside: a SIGTERM (a `timeout`, a job runner) raises SystemExit, so the
    with-blocks stop the servers on the way out. Without it the process would die
    at once and leave each server running in its own session, its port taken."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_now(signum, frame):
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def each_server(specs: Iterable[ServerSpec], measure: Callable[[ServerSpec, RunningServer], T],
                errors: tuple[type[BaseException], ...] = (),
                log: Callable[[str], None] = _to_stderr) -> Iterator[tuple[ServerSpec, T | None, str | None]]:
    """Each server in turn, one running at a time: one that is not installed is skipped, the
    others started, measured with `measure(spec, server)` and stopped. Yields (spec, result, None),
    or (spec, None, why) where it was skipped or failed (PeerServerError, OSError or one of
    `errors`, while it started or was measured), so one server's failure does not end the run;
    each step is logged in a line."""
    for spec in specs:
        missing = spec.missing()
        if missing:
            why = f"not installed ({spec.install_hint or ', '.join(missing)})"
            log(f"skipping {spec.name}: {why}")
            yield spec, None, why
            continue
        log(f"starting {spec.name}: {spec.shell_command()}")
        try:
            with sigterm_as_exit(), start_server(spec) as srv:
                result = measure(spec, srv)
        except (PeerServerError, OSError, *errors) as e:
            log(f"{spec.name} failed: {e}")
            yield spec, None, str(e)
            continue
        yield spec, result, None
