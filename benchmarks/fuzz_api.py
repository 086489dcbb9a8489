"""Schema-driven fuzzing of a live server: schemathesis generates requests
from the server's own OpenAPI document (GET /openapi.json), valid ones and
deliberately invalid ones, sends each over HTTP and records what came back.
The claim it checks: no input gets a 5xx, none resets the connection, no
stream carries a server error, every answer is one the document describes
(schemathesis's checks: its status code is documented for the operation, its
content type too, its headers and its body, each event of a stream included,
conform to the schemas), and the server is still serving at the end.

    python -m benchmarks fuzz-api --examples 200            # starts `agentserve serve` on loopback
    python -m benchmarks fuzz-api --url http://127.0.0.1:8000 --api-key KEY

prints a table of operations by status and writes the counts, with every
failing request as a curl command, to JSON. tests/test_api_fuzz.py runs
`fuzz()` with a few examples per operation against the tiny test server.
schemathesis is a test dependency (pip install -e '.[test]')."""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.fuzz_rules import PromptBudget, register

MODES = ("positive", "negative")

# One valid streamed request per streaming operation (its model added): generated requests are
# seldom both valid and streamed, and the events of a stream are checked against the document too.
STREAMED = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "stream": True,
                             "stream_options": {"include_usage": True}},
    "/v1/completions": {"prompt": "Say hi.", "max_tokens": 8, "stream": True},
    "/v1/responses": {"input": "Say hi.", "max_output_tokens": 16, "stream": True},
    "/v1/messages": {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "stream": True},
}


@dataclass
class Failure:
    operation: str
    mode: str
    what: str  # "status 500", "connection error: ...", "server error event in the stream"
    curl: str


@dataclass
class FuzzReport:
    base_url: str
    examples: int  # per operation and mode, at most
    seed: int
    statuses: dict[str, Counter] = field(default_factory=dict)  # operation -> status -> count
    failures: list[Failure] = field(default_factory=list)
    refused: dict[str, Counter] = field(default_factory=dict)  # operation -> the param (or code) a 4xx named
    nonconforming: dict[str, Counter] = field(default_factory=dict)  # operation -> the checks an answer failed
    streams: Counter = field(default_factory=Counter)  # operation -> event streams answered (and checked)
    skipped: dict[str, str] = field(default_factory=dict)  # "operation mode" -> why none could be generated
    # valid-mode bodies mended to keep the rules no schema states, and those left unsent (prompt too long)
    generator: Counter = field(default_factory=Counter)
    alive_after: bool | None = None
    seconds: float = 0.0

    @property
    def requests(self) -> int:
        return sum(sum(c.values()) for c in self.statuses.values())

    @property
    def server_errors(self) -> int:
        return sum(n for c in self.statuses.values() for s, n in c.items() if s.isdigit() and int(s) >= 500)

    def to_json(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "examples_per_operation_and_mode": self.examples, "seed": self.seed,
                "requests": self.requests, "server_errors": self.server_errors, "seconds": round(self.seconds, 1),
                "alive_after": self.alive_after,
                "statuses": {op: dict(sorted(c.items())) for op, c in sorted(self.statuses.items())},
                "refused": {op: dict(c.most_common()) for op, c in sorted(self.refused.items())},
                "nonconforming": {op: dict(c.most_common()) for op, c in sorted(self.nonconforming.items())},
                "event_streams": dict(sorted(self.streams.items())),
                "valid_bodies_mended": self.generator["mended"],
                "valid_bodies_unsent_prompt_too_long": self.generator["too long"],
                "failures": [vars(f) for f in self.failures], "skipped": self.skipped}

    def table(self) -> str:
        codes = sorted({s for c in self.statuses.values() for s in c})
        width = max([len(op) for op in self.statuses] + [9])
        lines = [f"{'operation':<{width}}  " + "  ".join(f"{c:>5}" for c in codes) + "  total"]
        for op, c in sorted(self.statuses.items()):
            lines.append(f"{op:<{width}}  " + "  ".join(f"{c.get(s, 0):>5}" for s in codes)
                         + f"  {sum(c.values()):>5}")
        bad = sum(sum(c.values()) for c in self.nonconforming.values())
        lines.append(f"{self.requests} requests in {self.seconds:.0f} s; {self.server_errors} with status >= 500; "
                     f"{bad} answers not as the document says; {len(self.failures)} failures; server alive after: "
                     f"{self.alive_after}")
        lines.append(f"valid bodies mended to the rules no schema states: {self.generator['mended']}; left unsent "
                     f"(prompt longer than the context): {self.generator['too long']}")
        return "\n".join(lines)


# a server error's type in OpenAI's error shape, and in Anthropic's (on /v1/messages)
_SERVER_ERROR_TYPES = {"server_error", "api_error", "overloaded_error"}


def _event_stream(response) -> bool:
    """Whether the answer is an event stream (schemathesis's responses hold each header's values as a list)."""
    value = response.headers.get("content-type", "")
    return "text/event-stream" in (",".join(value) if isinstance(value, list) else value)


def _stream_error(response) -> bool:
    """Whether a 200 event stream carried an error event (a server error sent after the status)."""
    if not _event_stream(response):
        return False
    for line in response.text.splitlines():
        if line.startswith("data: {") and '"error"' in line:
            try:
                err = json.loads(line[6:]).get("error") or {}
            except ValueError:
                return True
            if err.get("type") in _SERVER_ERROR_TYPES:
                return True
    return False


def _refused_for(response) -> str:
    try:
        err = response.json()["error"]
        return str(err.get("param") or err.get("code") or err.get("type"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return "(not an OpenAI error body)"


def _said(response) -> str:
    """The message of an error reply (OpenAI's shape or Anthropic's), or the start of the body."""
    try:
        err = response.json()["error"]
        return str(err["message"])[:300]
    except (ValueError, KeyError, TypeError, AttributeError):
        return response.text[:300]


def health_ok(base_url: str, timeout_s: float = 10.0) -> bool:
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


def fuzz(base_url: str, *, api_key: str | None = None, examples: int = 20, seed: int = 0,
         modes: tuple[str, ...] = MODES, timeout_s: float = 60.0, operations: list[str] | None = None) -> FuzzReport:
    """Generate up to `examples` requests per operation and mode from the
    server's OpenAPI document and send them; every outcome is counted. A
    failure is recorded, not raised, so one run shows all of them."""
    import hypothesis
    import schemathesis
    from schemathesis import GenerationMode

    report = FuzzReport(base_url, examples, seed)
    t0 = time.monotonic()
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # valid-mode bodies keep the rules the document states in words (fuzz_rules.py)
    report.generator = register(schema, prompt_budget(base_url, headers, timeout_s))
    settings = hypothesis.settings(max_examples=examples, deadline=None, database=None, derandomize=False,
                                   phases=[hypothesis.Phase.generate], print_blob=False,
                                   suppress_health_check=list(hypothesis.HealthCheck),
                                   verbosity=hypothesis.Verbosity.quiet)
    for result in schema.get_all_operations():
        op = result.ok()
        label = f"{op.method.upper()} {op.path}"
        if operations is not None and label not in operations:
            continue
        report.statuses.setdefault(label, Counter())
        for mode in modes:
            try:
                strategy = op.as_strategy(generation_mode=GenerationMode(mode))
            except Exception as e:  # noqa: BLE001 - nothing of this kind can be generated for the operation
                report.skipped[f"{label} {mode}"] = f"{type(e).__name__}: {e}"[:300]
                continue

            send = _sender(report, label, mode, headers, timeout_s)
            run = hypothesis.seed(seed)(settings(hypothesis.given(strategy)(send)))
            try:
                run()
            except hypothesis.errors.Unsatisfiable as e:
                report.skipped[f"{label} {mode}"] = f"Unsatisfiable: {e}"[:300]
        streamed = STREAMED.get(op.path) if op.method.upper() == "POST" else None
        if streamed is not None:
            body = {"model": _served_model(base_url, headers, timeout_s), **streamed}
            _sender(report, label, "stream", headers, timeout_s)(op.Case(body=body, media_type="application/json"))
    report.alive_after = health_ok(base_url)
    report.seconds = time.monotonic() - t0
    return report


def _served_model(base_url: str, headers: dict[str, str], timeout_s: float) -> str:
    return _model_card(base_url, headers, timeout_s)["id"]


def _model_card(base_url: str, headers: dict[str, str], timeout_s: float) -> dict[str, Any]:
    req = urllib.request.Request(base_url + "/v1/models", headers=headers)
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())["data"][0]


def prompt_budget(base_url: str, headers: dict[str, str], timeout_s: float) -> PromptBudget:
    """The served model's context, and the tokens of its smallest prompt with a tool (count_tokens)."""
    card = _model_card(base_url, headers, timeout_s)
    body = {"model": card["id"], "messages": [{"role": "user", "content": ""}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}]}
    req = urllib.request.Request(base_url + "/v1/messages/count_tokens", data=json.dumps(body).encode(),
                                 headers={**headers, "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        fixed = json.loads(r.read())["input_tokens"]
    return PromptBudget(card["max_model_len"], fixed)


def all_checks() -> list:
    """Every check schemathesis has (its CLI's `--checks all`): no 5xx; status code, content type, headers
    and body as documented; a request valid by the document accepted (no 4xx but 401/403/404/409/429), an
    invalid one refused; a required header's absence refused; an undocumented method answered 405 with
    `Allow`; auth not ignored; resources gone after a delete. A check that does not apply to a case passes."""
    from schemathesis.checks import CHECKS, load_all_checks

    load_all_checks()
    return CHECKS.get_all()


def _sender(report: FuzzReport, label: str, mode: str, headers: dict[str, str], timeout_s: float):
    """The test body: send one generated case and count its outcome."""
    from schemathesis.core.failures import FailureGroup

    counts = report.statuses[label]
    checks = all_checks()

    def send(case) -> None:
        try:
            r = case.call(base_url=report.base_url, headers=headers, timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - a reset connection or a timeout is a finding
            counts["error"] += 1
            report.failures.append(Failure(label, mode, f"{type(e).__name__}: {e}"[:300],
                                           case.as_curl_command(headers=headers)))
            return
        counts[str(r.status_code)] += 1
        if _event_stream(r):
            report.streams[label] += 1
        if 400 <= r.status_code < 500:
            report.refused.setdefault(label, Counter())[_refused_for(r)] += 1
        if r.status_code >= 500:
            report.failures.append(Failure(label, mode, f"status {r.status_code}: {r.text[:300]}",
                                           case.as_curl_command(headers=headers)))
        elif r.status_code == 200 and _stream_error(r):
            counts["200+stream error"] += 1
            report.failures.append(Failure(label, mode, "a server error event in the stream",
                                           case.as_curl_command(headers=headers)))
        try:
            case.validate_response(r, checks=checks, headers=headers)
        except FailureGroup as group:
            said = f" (the server said: {_said(r)})" if 400 <= r.status_code < 500 else ""
            for f in group.exceptions:
                report.nonconforming.setdefault(label, Counter())[f.title] += 1
                report.failures.append(Failure(label, mode, f"status {r.status_code}: {f.title}: {f.message}"
                                               f"{said}"[:900], case.as_curl_command(headers=headers)))

    return send


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(args: argparse.Namespace, key: str):
    """`agentserve serve` (the default model) on a free loopback port, contexts cut to
    --max-model-len so that a generated request without max_tokens ends soon."""
    from agentserve.bench.peers.running import start_server
    from agentserve.bench.peers.specs import server_spec

    spec = server_spec("agentserve-continuum", args.kv_tokens, port=_free_port(), threads=args.threads,
                       log_dir=args.log_dir, extra_args=["--max-model-len", str(args.max_model_len),
                                                         "--api-key", key, "--log-level", "warning"])
    server = start_server(spec, wait=False)  # its readiness probe reads /v1/models, which wants the key
    deadline = time.monotonic() + spec.startup_timeout_s
    while not health_ok(spec.base_url, 2.0):
        if not server.alive or time.monotonic() > deadline:
            server.stop(grace_s=5.0)
            raise SystemExit(f"agentserve did not start; last lines of {spec.log_path}:\n{server.log_tail()}")
        time.sleep(0.5)
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks fuzz-api", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start `agentserve serve` on loopback)")
    p.add_argument("--api-key", default=None, help="the key of the server at --url")
    p.add_argument("--examples", type=int, default=100, help="requests per operation and generation mode, at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds one request may take (a generated request without max_tokens decodes to the "
                        "end of the context: minutes on a busy CPU)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: positive (valid by the schema), "
                                                            "negative (invalid by it)")
    p.add_argument("--max-model-len", type=int, default=256, help="context of the started server")
    p.add_argument("--kv-tokens", type=int, default=8192, help="KV cache of the started server")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of the started server")
    p.add_argument("--log-dir", default="fuzz-logs", help="where the started server's log goes")
    p.add_argument("--json", default="fuzz_api.json", help="where the report goes")
    args = p.parse_args(argv)
    try:
        import schemathesis  # noqa: F401
    except ImportError:
        print("schemathesis is not installed: pip install -e '.[test]'", file=sys.stderr)
        return 2
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    server = None
    url, key = args.url, args.api_key
    if url is None:
        key = key or "fuzz-key"
        server = _serve(args, key)
        url = server.base_url
    try:
        report = fuzz(url.rstrip("/"), api_key=key, examples=args.examples, seed=args.seed, modes=modes,
                      timeout_s=args.timeout)
        if server is not None and not server.alive:
            report.alive_after = False
    finally:
        if server is not None:
            server.stop(grace_s=10.0)
    print(report.table())
    for f in report.failures[:20]:
        print(f"\n{f.operation} ({f.mode}): {f.what}\n  {f.curl[:1000]}")
    Path(args.json).write_text(json.dumps(report.to_json(), indent=1, ensure_ascii=False) + "\n")
    print(f"\nwrote {args.json}")
    return 0 if not report.failures and report.alive_after else 1


if __name__ == "__main__":
    sys.exit(main())
