"""The OpenAPI document (GET /openapi.json) and schemathesis against the
live tiny server on loopback: requests generated from that document, valid
and invalid by it, a bounded number per operation so the test fits CI, and
one valid streamed request per streaming operation; not one answer >= 500,
no reset connection, no error event inside a stream, every answer as the
document says (schemathesis's status code, content type, header and schema
conformance checks, each event of a stream included), and the server still
serves afterwards with its KV accounting intact.
`python -m agentserve.bench.fuzz_api` runs the same with many more examples."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from server_fixtures import start_tiny_server

pytest.importorskip("schemathesis")

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = 20  # per operation and generation mode: about 480 requests with every check, ~2 min on 2 cores
OPERATIONS = {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models",
              "POST /v1/programs/{program_id}/release", "POST /v1/programs/{program_id}/end", "GET /health",
              "GET /metrics", "POST /v1/responses", "GET /v1/responses/{response_id}",
              "DELETE /v1/responses/{response_id}", "GET /v1/responses/{response_id}/input_items",
              "POST /v1/messages", "POST /v1/messages/count_tokens"}


@pytest.fixture(scope="module")
def server():
    # room for the tools' prompt (so forced calls reach the grammar), short enough that a
    # generated request without max_tokens ends soon (the tiny model: ~1000 tokens/s)
    srv, llm, _ = start_tiny_server(api_key=KEY, max_model_len=1024)
    srv.llm, srv.engine = llm, srv.app.state.server.engine
    yield srv
    srv.stop()


def test_openapi_document_describes_the_api(server):
    validator = pytest.importorskip("openapi_spec_validator")
    r = httpx.get(server.url + "/openapi.json")  # no key needed: it describes, it serves nothing
    assert r.status_code == 200
    doc = r.json()
    validator.validate(doc)
    assert doc["openapi"].startswith("3.")
    ops = {f"{m.upper()} {p}" for p, item in doc["paths"].items() for m in item}
    assert OPERATIONS | {"GET /openapi.json"} == ops
    schemas = doc["components"]["schemas"]
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")
    assert chat["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletion")
    assert {"400", "401", "404", "413", "503"} <= set(chat["responses"])
    assert "Retry-After" in chat["responses"]["503"]["headers"]
    assert chat["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    # the pydantic models' constraints are the document's: OpenAI's ranges, id limits, per-role messages
    temp = next(s for s in schemas["ChatCompletionRequest"]["properties"]["temperature"]["anyOf"]
                if s.get("type") == "number")
    assert (temp["minimum"], temp["maximum"]) == (0.0, 2.0)
    assert schemas["ToolMessage"]["required"] == ["role", "content", "tool_call_id"]
    assert schemas["ToolMessage"]["properties"]["tool_call_id"]["maxLength"] == 256
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert chat["security"] == [{"bearer": []}] and doc["paths"]["/health"]["get"]["security"] == []


def test_schemathesis_finds_no_5xx(server):
    from agentserve.bench.fuzz_api import fuzz

    report = fuzz(server.url, api_key=KEY, examples=EXAMPLES, seed=14)
    assert set(report.statuses) == OPERATIONS, report.statuses
    # every schemathesis check; the only failures left are valid-by-the-document requests refused by a rule
    # that spans items of a list (a tool result answers a call before it, the last Messages message is the
    # user's) or the tokenized prompt (the context): no JSON Schema can state those (see the report)
    unstated = [f for f in report.failures if not _unstatable(f.what)]
    assert report.server_errors == 0 and not unstated, "\n".join(
        f"{f.operation} ({f.mode}): {f.what}\n{f.curl}" for f in unstated)
    assert report.alive_after and server.thread.is_alive() and server.engine.alive
    assert {check for c in report.nonconforming.values() for check in c} <= {"Schema-valid request rejected"}
    # each streaming operation's events were checked against the document
    assert set(report.streams) == {"POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses",
                                   "POST /v1/messages"}, report.streams
    # it reached the model, not only the validation: some generated requests were served
    assert report.statuses["POST /v1/chat/completions"]["200"] > 0
    assert report.statuses["POST /v1/messages"]["200"] > 0
    assert report.statuses["POST /v1/messages/count_tokens"]["200"] > 0
    assert report.statuses["POST /v1/responses"]["200"] > 0
    assert sum(c.get("400", 0) for c in report.statuses.values()) > 0
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=30,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2})
    assert r.status_code == 200
    deadline = time.monotonic() + 10
    while server.engine.call_sync(lambda: server.llm.engine.has_unfinished):
        assert time.monotonic() < deadline, "requests still in the engine"
        time.sleep(0.02)
    kv = server.llm.kv
    server.engine.call_sync(server.llm.check_integrity)
    free, total, held = server.engine.call_sync(lambda: (kv.num_free_blocks, kv.num_blocks, kv.num_pinned_blocks))
    assert free == total - held


# the rules of a request no JSON Schema can state, by the server's words: ids that must match across
# messages, the role of the last message, the rendered prompt's length in tokens
UNSTATABLE = ("must answer a call", "must be followed by tool messages", "is not an unanswered call",
              "answers no unanswered tool_use", "has no tool_result", "answers no call", "no tool output found",
              "the conversation ends with an assistant message", "maximum context length",
              "does not fit the KV cache", "is already declared by", "which is not among the tools")


def _unstatable(what: str) -> bool:
    return what.startswith("status 400: Schema-valid request rejected") and any(u in what for u in UNSTATABLE)


def test_fuzz_command_writes_its_report(server, tmp_path, capsys):
    from agentserve.bench.fuzz_api import main

    out = tmp_path / "fuzz.json"
    main(["--url", server.url, "--api-key", KEY, "--examples", "2", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "POST /v1/chat/completions" in printed and "0 with status >= 500" in printed
    report = json.loads(out.read_text())
    assert report["server_errors"] == 0 and report["alive_after"] is True and report["requests"] > 0
    assert set(report["statuses"]) == OPERATIONS
