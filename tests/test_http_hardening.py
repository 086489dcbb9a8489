"""The HTTP layer under clients that misbehave (http_limits.py), on a real
server over raw sockets: uploads dropped mid-body are quiet and leave the
server healthy, a body that stops arriving gets a 408 in the API's shape
and its connection closed while one that keeps arriving slowly is never cut,
and connections past the bounds (per client address, in total) get 503 with
Retry-After while other clients are served."""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import pytest

from agentserve.server.http_limits import HttpLimits
from server_fixtures import idle, start_tiny_server

KEY = "test-key"
BODY_TIMEOUT = 2.0  # the first server's --request-body-timeout
PER_CLIENT, TOTAL = 4, 8  # the second server's bounds
BODY_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
              "/v1/messages/count_tokens"]


def _serve(config: dict):
    srv, llm, scripted = start_tiny_server(api_key=KEY, config=config)
    srv.llm, srv.scripted, srv.engine = llm, scripted, srv.app.state.server.engine
    return srv


@pytest.fixture(scope="module")
def server():
    srv = _serve({"request_body_timeout": BODY_TIMEOUT})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def bounded():
    srv = _serve({"request_body_timeout": 120.0, "max_connections": TOTAL, "max_connections_per_client": PER_CLIENT})
    yield srv
    srv.stop()


class Records(logging.Handler):
    """Every record of the loggers it is attached to (uvicorn's do not reach pytest's caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def records(caplog):
    caplog.set_level(logging.INFO, logger="agentserve.server")
    handler = Records()
    loggers = [logging.getLogger(n) for n in ("agentserve", "uvicorn", "uvicorn.error", "uvicorn.access")]
    for lg in loggers:
        lg.addHandler(handler)
    yield handler.records
    for lg in loggers:
        lg.removeHandler(handler)


def limits_of(srv) -> HttpLimits:
    node = srv.app.middleware_stack
    while not isinstance(node, HttpLimits):
        node = node.app
    return node


def wait_until(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def head(path: str, length: int | None = 100, extra: str = "") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\n{extra}{size}\r\n").encode()


def connect(srv, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((source, 0))
    except OSError:
        s.close()
        pytest.skip(f"cannot bind a socket to {source} on this machine")
    s.settimeout(60)
    s.connect(("127.0.0.1", srv.port))
    return s


def read_reply(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one reply with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"the connection closed before a reply: {data!r}"
        data += chunk
    top, _, rest = data.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    size = int(headers["content-length"])
    while len(rest) < size:
        chunk = s.recv(65536)
        assert chunk, "the connection closed mid-reply"
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:size]


def closed_by_server(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def chat_ok(srv, pid: str = "hardening-probe") -> None:
    srv.scripted.script(pid, "fine")
    r = httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}", "X-Program-Id": pid},
                   json={"model": "tiny", "messages": [{"role": "user", "content": "ok?"}], "max_tokens": 8},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "fine"


# --- clients that go away ----------------------------------------------------------------


def test_dropped_uploads_log_no_traceback_and_one_line_a_second(server, records):
    limits = limits_of(server)
    gone_before = limits.clients_gone
    t0 = time.monotonic()
    for i in range(50):
        path = BODY_PATHS[i % len(BODY_PATHS)]
        s = connect(server)
        s.sendall(head(path) + (b"{" if i % 2 == 0 else b""))  # one byte of 100, or none
        s.close()
    wait_until(lambda: limits.clients_gone - gone_before == 50 and limits.in_progress == 0,
               "the dropped uploads are not all seen as clients gone")
    elapsed = time.monotonic() - t0
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    chat_ok(server)
    idle(server)

    assert not [r for r in records if r.exc_info or r.levelno >= logging.WARNING], \
        [r.getMessage() for r in records if r.exc_info or r.levelno >= logging.WARNING]
    gone = [r.getMessage() for r in records if "client went away" in r.getMessage()]
    assert 1 <= len(gone) <= int(elapsed) + 1, (elapsed, gone)
    assert gone[0].startswith("client went away before its response: POST /v1/")
    assert " of 100 bytes of its body" in gone[0]
    assert all(r.levelno == logging.INFO for r in records if "client went away" in r.getMessage())


def test_a_client_gone_while_its_reply_is_computed_is_quiet(server, records):
    """Not mid-body: the whole body arrived, and the client leaves before the reply starts."""
    pid = "gone-before-reply"
    server.scripted.script(pid, "x" * 900)  # long enough to be seen running
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 900}).encode()
    limits = limits_of(server)
    gone_before = limits.clients_gone
    s = connect(server)
    s.sendall(head("/v1/chat/completions", len(body), extra=f"X-Program-Id: {pid}\r\n") + body)
    wait_until(lambda: server.engine.call_sync(lambda: server.llm.engine.has_unfinished), "never admitted")
    s.close()
    wait_until(lambda: limits.in_progress == 0, "still in progress")
    assert limits.clients_gone == gone_before + 1
    idle(server)
    assert not [r for r in records if r.exc_info or r.levelno >= logging.WARNING]
    chat_ok(server)


# --- bodies that stop ----------------------------------------------------------------------


def test_a_stalled_body_gets_408_in_the_apis_shape_and_its_connection_closed(server):
    stalled = {
        "chat": connect(server), "messages": connect(server), "chunked": connect(server), "none": connect(server)}
    t0 = time.monotonic()
    stalled["chat"].sendall(head("/v1/chat/completions") + b'{"model": "tiny"')
    stalled["messages"].sendall(head("/v1/messages") + b'{"model"')
    stalled["chunked"].sendall(head("/v1/responses", None) + b'5\r\n{"mod\r\n')
    stalled["none"].sendall(head("/v1/completions"))  # a declared body of which nothing comes
    replies = {name: read_reply(s) for name, s in stalled.items()}
    elapsed = time.monotonic() - t0
    assert elapsed >= BODY_TIMEOUT * 0.9  # silence is what is timed: nothing came before the timeout

    for name, (status, headers, body) in replies.items():
        assert status == 408, (name, body)
        assert headers["connection"] == "close"
        assert headers["content-type"] == "application/json"
        err = json.loads(body)
        if name == "messages":
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
            assert "--request-body-timeout" in err["error"]["message"]
        else:
            assert err["error"]["code"] == "request_timeout" and err["error"]["type"] == "invalid_request_error"
            assert f"for {BODY_TIMEOUT:g} s" in err["error"]["message"]
        assert closed_by_server(stalled[name])
        stalled[name].close()
    assert "(16 of 100 bytes received)" in json.loads(replies["chat"][2])["error"]["message"]
    assert limits_of(server).in_progress == 0
    chat_ok(server)
    idle(server)


def test_a_slow_body_that_keeps_coming_is_never_cut(server):
    pid = "slow-upload"
    server.scripted.script(pid, "patience")
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "slowly " * 20}],
                       "max_tokens": 12}).encode()
    pieces = 8
    step = -(-len(body) // pieces)
    s = connect(server)
    t0 = time.monotonic()
    s.sendall(head("/v1/chat/completions", len(body), extra=f"X-Program-Id: {pid}\r\n"))
    for i in range(0, len(body), step):
        time.sleep(BODY_TIMEOUT / 4)  # each pause well within the timeout; all of them well beyond it
        s.sendall(body[i:i + step])
    status, _, reply = read_reply(s)
    s.close()
    assert time.monotonic() - t0 > BODY_TIMEOUT * 1.5
    assert status == 200, reply
    assert json.loads(reply)["choices"][0]["message"]["content"] == "patience"
    idle(server)


# --- bounds on connections -----------------------------------------------------------------


def test_connections_past_the_bounds_get_503_while_others_are_served(bounded):
    limits = limits_of(bounded)
    flood = [connect(bounded, "127.0.0.2") for _ in range(PER_CLIENT)]
    try:
        for s in flood:
            s.sendall(head("/v1/chat/completions") + b"{")  # stalled: the body's other 99 bytes never come
        wait_until(lambda: limits.by_client["127.0.0.2"] == PER_CLIENT, "the stalled connections are not counted")

        for path, status, shape in [("/v1/chat/completions", 503, "openai"), ("/v1/messages", 529, "anthropic")]:
            s = connect(bounded, "127.0.0.2")
            s.sendall(head(path, 2) + b"{}")
            got, headers, body = read_reply(s)
            assert got == status, body
            assert headers["retry-after"] == "1" and headers["connection"] == "close"
            err = json.loads(body)
            if shape == "openai":
                assert err["error"]["code"] == "too_many_connections" and err["error"]["type"] == "server_error"
                assert "--max-connections-per-client" in err["error"]["message"]
            else:
                assert err["type"] == "error" and err["error"]["type"] == "overloaded_error"
            assert closed_by_server(s)
            s.close()

        # another client address is served as usual, and its requests are not refused
        chat_ok(bounded)
        assert httpx.get(bounded.url + "/health").status_code == 200

        # up to the total: another address's stalled connections fill it; then everyone gets 503
        flood += [connect(bounded, "127.0.0.3") for _ in range(TOTAL - PER_CLIENT)]
        for s in flood[PER_CLIENT:]:
            s.sendall(head("/v1/completions") + b"{")
        wait_until(lambda: limits.in_progress == TOTAL, "the total is not reached")
        r = httpx.get(bounded.url + "/health")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "(--max-connections)" in r.json()["error"]["message"]
    finally:
        for s in flood:
            s.close()
    wait_until(lambda: limits.in_progress == 0, "the stalled connections were not released")
    chat_ok(bounded)
    idle(bounded)



# --- what the OpenAPI document says, the server does ---------------------------------------


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_a_405_names_the_methods_its_path_has(server):
    for method, path, allow in [("TRACE", "/v1/models", "GET, HEAD"), ("PUT", "/v1/responses/resp_x", "DELETE, GET, HEAD"),
                                ("GET", "/v1/chat/completions", "POST"), ("TRACE", "/v1/messages", "POST"),
                                ("GET", "/v1/programs/a/b/release", "POST")]:
        r = httpx.request(method, server.url + path, headers=AUTH)
        assert r.status_code == 405 and r.headers["allow"] == allow, (method, path, r.headers)
        err = r.json()
        assert (err["error"]["type"] == "invalid_request_error" if path == "/v1/messages"
                else err["error"]["code"] == "method_not_allowed")


def test_program_ids_in_paths_are_percent_decoded_and_checked(server):
    for path in ("/v1/programs/team%2Fagent-7/release", "/v1/programs/team/agent-7/release",
                 "/v1/programs/team%2Fagent-7/end"):
        r = httpx.post(server.url + path, headers=AUTH)
        assert r.status_code == 200 and r.json()["program_id"] == "team/agent-7", (path, r.text)
    # control characters (a line feed too: it once matched no route, a 404), only spaces, too long: a 400
    for bad in ("a%0Ab", "a%01b", "a%7Fb", "a%C2%85b", "%20%20", "%E3%80%80", "x" * 257):
        r = httpx.post(f"{server.url}/v1/programs/{bad}/release", headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "program_id", (bad, r.text)
    r = httpx.get(server.url + "/v1/responses/a%0Ab", headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_id"


def test_header_hints_are_read_as_the_document_says(server):
    import re

    doc = httpx.get(server.url + "/openapi.json").json()
    params = {p["name"]: p for p in doc["paths"]["/v1/completions"]["post"]["parameters"]}
    ttl, release = params["X-Program-TTL"], params["X-Program-Release"]
    assert "names none" in ttl["description"] and "names none" in release["description"]

    def status(headers: dict) -> int:
        r = httpx.post(server.url + "/v1/completions", headers={**AUTH, **headers}, timeout=60,
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
        return r.status_code

    for value in ("60", "2.5", "1e3", "-1", "5.", "inf", "soon", "1_000"):
        documented = re.fullmatch(ttl["schema"]["pattern"], value) is not None
        assert status({"X-Program-Id": "hinted", "X-Program-TTL": value}) == (200 if documented else 400), value
    for value in ("true", "FALSE", "1", "0", "Yes", "no", "on", "OFF", "", "maybe", "2", "tru"):
        documented = re.fullmatch(release["schema"]["pattern"], value) is not None
        assert status({"X-Program-Id": "hinted", "X-Program-Release": value,
                       "X-Program-End": value}) == (200 if documented else 400), value
    # a retention hint names no program by itself: without one it is ignored, as the description says (a
    # rule between the body and the headers, which no schema can state, would be a 400 the document hides)
    assert status({"X-Program-TTL": "60"}) == 200 and status({"X-Program-Release": "true"}) == 200
    assert status({"X-Program-Release": "false"}) == 200 and status({"X-Program-End": "true"}) == 200
    idle(server)


def test_completions_prompt_schema_and_server_agree(server):
    jsonschema = pytest.importorskip("jsonschema")

    doc = httpx.get(server.url + "/openapi.json").json()
    schema = doc["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    for prompt in ("", [], [[]], ["a", "b"], [""], "hi", [104, 105], ["hi"], [[104, 105]]):
        documented = jsonschema.Draft202012Validator(schema).is_valid(prompt)
        r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
        assert r.status_code == (200 if documented else 400), (prompt, r.text)
    idle(server)


def test_the_document_lists_every_status_an_operation_answers(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    ops = {f"{m.upper()} {p}": op for p, item in doc["paths"].items() for m, op in item.items()}
    for label, op in ops.items():
        codes = set(op["responses"])
        overloaded = "529" if label.startswith("POST /v1/messages") else "503"
        assert overloaded in codes and "Retry-After" in op["responses"][overloaded]["headers"], label
        if "requestBody" in op:
            assert {"400", "401", "404", "408", "413"} <= codes, label
    assert {"404", "400"} <= set(ops["GET /v1/responses/{response_id}"]["responses"])
    for label in ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "POST /v1/messages"):
        stream = ops[label]["responses"]["200"]["content"]["text/event-stream"]["schema"]
        assert stream["type"] == "object" and stream["properties"]["data"]
    release = ops["POST /v1/programs/{program_id}/release"]["parameters"][0]
    assert "a%2Fb" in release["description"] and release["schema"]["pattern"]


# --- the flags -------------------------------------------------------------------------------


def test_serve_flags_set_the_limits():
    import argparse

    from agentserve.cli_errors import CliError
    from agentserve.cli_serve import add_serve, build_server, check_serve_args
    from server_fixtures import tiny_llm

    ap = argparse.ArgumentParser(prog="agentserve")
    add_serve(ap.add_subparsers(dest="command"))
    args = ap.parse_args(["serve"])
    assert (args.request_body_timeout, args.max_connections, args.max_connections_per_client) == (10.0, 2048, 0)
    help_text = ap._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in ("--request-body-timeout", "--max-connections", "--max-connections-per-client"):
        assert flag in help_text

    for argv, want in [(["--request-body-timeout", "2.5", "--max-connections", "100",
                         "--max-connections-per-client", "8"], (2.5, 100, 8)),
                       (["--request-body-timeout", "0", "--max-connections", "0"], (None, None, None))]:
        args = ap.parse_args(["serve", *argv])
        check_serve_args(args)
        app, _, config = build_server(args, lambda a: tiny_llm())
        assert (config.request_body_timeout, config.max_connections, config.max_connections_per_client) == want
    for bad in ("-1", "nan"):
        with pytest.raises(CliError, match="--request-body-timeout"):
            check_serve_args(ap.parse_args(["serve", "--request-body-timeout", bad]))
    with pytest.raises(SystemExit):
        ap.parse_args(["serve", "--max-connections", "-3"])
