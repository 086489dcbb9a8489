"""The OpenAPI document (GET /openapi.json) and schemathesis against the
live tiny server on loopback: requests generated from that document, valid
and invalid by it, a bounded number per operation so the test fits CI, and
one valid streamed request per streaming operation; not one answer >= 500,
no reset connection, no error event inside a stream, every answer as the
document says (schemathesis's status code, content type, header and schema
conformance checks, each event of a stream included), and the server still
serves afterwards with its KV accounting intact.
`python -m benchmarks fuzz-api` runs the same with many more examples."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from server_fixtures import start_tiny_server

pytest.importorskip("schemathesis")

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = 12  # per operation and generation mode: about 300 requests with every check, ~1.5 min on 2 cores
CONTEXT = 2048  # room for most generated conversations; an output without a cap decodes ~6 s at most
BODY_BYTES = 64 * 1024
OPERATIONS = {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models",
              "POST /v1/programs/{program_id}/release", "POST /v1/programs/{program_id}/end", "GET /health",
              "GET /metrics", "POST /v1/responses", "GET /v1/responses/{response_id}",
              "DELETE /v1/responses/{response_id}", "GET /v1/responses/{response_id}/input_items",
              "POST /v1/messages", "POST /v1/messages/count_tokens"}


@pytest.fixture(scope="module")
def server():
    # a context that holds the conversations schemathesis draws (the generator leaves out those whose
    # prompt could exceed it: fuzz_rules.PromptBudget), short enough that an output decoded to the
    # context's end (ignore_eos, no cap) ends within seconds (the tiny model: ~350 tokens/s)
    srv, llm, _ = start_tiny_server(api_key=KEY, max_body_bytes=BODY_BYTES, positions=CONTEXT,
                                    max_model_len=CONTEXT, kv_cache_tokens=2 * CONTEXT)
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
    # what no JSON Schema can state is said in words where it binds: ids across messages, the prefill,
    # the context in tokens, the body's bytes; a cap beyond the context is out of range
    req = schemas["ChatCompletionRequest"]["properties"]
    assert "followed by one tool message per call" in req["messages"]["description"]
    assert f"shorter than the model's context ({CONTEXT} tokens)" in req["messages"]["description"]
    assert "Tool names are unique" in req["tools"]["description"]
    assert req["max_completion_tokens"]["anyOf"][0]["maximum"] == CONTEXT - 1
    anthropic = schemas["MessagesRequest"]["properties"]["messages"]["description"]
    assert "answers each tool_use block of the assistant message right before it" in anthropic
    assert "is a prefill: the reply continues that message's text" in anthropic
    assert "before the next message or group of calls" in schemas["ResponsesRequest"]["properties"]["input"][
        "description"]
    assert chat["requestBody"]["description"] == f"a JSON object of at most {BODY_BYTES} bytes (a larger body is a 413)"


def test_schemathesis_finds_no_5xx(server):
    from benchmarks.fuzz_api import fuzz

    report = fuzz(server.url, api_key=KEY, examples=EXAMPLES, seed=14)
    assert set(report.statuses) == OPERATIONS, report.statuses
    # every schemathesis check, nothing tolerated: valid-mode bodies keep the rules the document states in
    # words (fuzz_rules.py), and every answer is one the document describes
    assert report.server_errors == 0 and not report.failures, "\n".join(
        f"{f.operation} ({f.mode}): {f.what}\n{f.curl}" for f in report.failures)
    assert report.alive_after and server.thread.is_alive() and server.engine.alive
    assert not report.nonconforming, report.nonconforming
    # only an operation with nothing to break (no parameter, no body, no key) has no invalid requests
    assert set(report.skipped) <= {"GET /health negative"}, report.skipped
    assert report.generator["mended"] > 0  # the generator did draw inconsistent conversations, and mended them
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


def test_fuzz_command_writes_its_report(server, tmp_path, capsys):
    from benchmarks.fuzz_api import main

    out = tmp_path / "fuzz.json"
    main(["--url", server.url, "--api-key", KEY, "--examples", "2", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "POST /v1/chat/completions" in printed and "0 with status >= 500" in printed
    report = json.loads(out.read_text())
    assert report["server_errors"] == 0 and report["alive_after"] is True and report["requests"] > 0
    assert set(report["statuses"]) == OPERATIONS


def test_generator_mends_conversations_the_server_would_refuse(server):
    """fuzz_rules.consistent() turns bodies that break the rules stated in words into ones the server
    serves: each body below is refused as it is, and answered 200 once mended."""
    from benchmarks.fuzz_rules import PromptBudget, consistent

    call = {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tool = {"type": "function", "function": {"name": "f"}}
    use = {"type": "tool_use", "id": "u", "name": "f", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "zz"}
    cases = [
        ("/v1/chat/completions", {"max_tokens": 2, "tools": [tool, tool], "messages": [
            {"role": "tool", "content": "orphan", "tool_call_id": "x"},
            {"role": "assistant", "content": None, "tool_calls": [call, call]},
            {"role": "tool", "content": "r", "tool_call_id": "nope"}, {"role": "user", "content": "go"}]}),
        ("/v1/messages", {"max_tokens": 2, "messages": [
            {"role": "user", "content": [result]}, {"role": "assistant", "content": [use, use]},
            {"role": "assistant", "content": [use]}]}),
        ("/v1/messages/count_tokens", {"output_config": {"format": {"type": "json_schema", "schema": {}}},
                                       "messages": [{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": "{"}]}),
        ("/v1/responses", {"max_output_tokens": 2, "tool_choice": {"type": "custom", "name": "g"},
                           "tools": [{"type": "function", "name": "g"}, {"type": "function", "name": "g"}], "input": [
            {"type": "function_call_output", "call_id": "o", "output": "x"},
            {"type": "function_call", "call_id": "c", "name": "g", "arguments": "{}"},
            {"role": "user", "content": "next"}]}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": CONTEXT - 1}),
    ]
    budget = PromptBudget(CONTEXT, 500)
    for path, body in cases:
        body["model"] = "tiny"
        r = httpx.post(server.url + path, json=body, headers=AUTH, timeout=60)
        assert r.status_code == 400, (path, r.text)
        mended = consistent(path, json.loads(json.dumps(body)), budget)
        r = httpx.post(server.url + path, json=mended, headers=AUTH, timeout=60)
        assert r.status_code == 200, (path, mended, r.text)
    # a conversation whose prompt could exceed the context is not sent at all
    long = {"model": "tiny", "messages": [{"role": "user", "content": "x" * CONTEXT}]}
    assert consistent("/v1/chat/completions", long, budget) is None
    # an extra property may be anything: a user message's "tool_calls" as an object (schemathesis drew
    # one, and the mending raised on its keys) is left to the server to judge
    odd = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi",
                                                           "tool_calls": {"id": "k"}}]}
    assert consistent("/v1/chat/completions", odd, budget)["messages"][0]["tool_calls"] == {"id": "k"}
