"""The OpenAPI 3.1 document of the API, served at GET /openapi.json.

Its schemas are generated from the pydantic models the server validates with
(protocol.py), so the document cannot drift from what the server accepts and
answers; only the paths, parameters and which statuses each path may answer
are written here. Clients can be generated from it, and tests fuzz the live
server with it (schemathesis; `python -m benchmarks fuzz-api`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from agentserve.server.identity import HEADER_FLAG_PATTERN, HEADER_SECONDS_PATTERN, MAX_ID_LENGTH
from agentserve.server.input_checks import PATH_ID_PATTERN
from agentserve.server.messages_protocol import (STREAM_EVENTS, AnthropicErrorResponse, CountTokensRequest,
                                                 MessageResponse, MessagesRequest, TokensCount)
from agentserve.server.protocol import (ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, Completion,
                                        CompletionRequest, ErrorResponse, Health, ModelList, ProgramEnded,
                                        ProgramReleased)
from agentserve.server.responses_protocol import InputItemList, ResponseDeleted, ResponseObject, ResponsesRequest

_REF = "#/components/schemas/{model}"
_REQUESTS: list[type[BaseModel]] = [ChatCompletionRequest, CompletionRequest]
_RESPONSES: list[type[BaseModel]] = [ChatCompletion, ChatCompletionChunk, Completion, ModelList, ProgramReleased,
                                     ProgramEnded, Health, ErrorResponse]
_REQUESTS += [ResponsesRequest]  # OpenAI's Responses API
_RESPONSES += [ResponseObject, ResponseDeleted, InputItemList]
_REQUESTS += [MessagesRequest, CountTokensRequest]  # Anthropic's Messages API
_RESPONSES += [MessageResponse, TokensCount, AnthropicErrorResponse, *STREAM_EVENTS]

_ERRORS = {
    "400": "a malformed body, a value out of range, an unsupported parameter or a prompt over the context",
    "401": "a missing or wrong API key",
    "404": "an unknown model",
    "408": "the body stopped arriving: nothing of it for --request-body-timeout seconds (the connection is closed)",
    "413": "a body over --max-body-bytes (the request body's description says how many bytes)",
    "500": "the engine failed while computing the reply (the message says how)",
    "503": "the queue is full, the engine is not running, or too many connections are in progress "
           "(--max-connections, --max-connections-per-client); retry after Retry-After seconds",
}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying",
                                "schema": {"type": "integer", "minimum": 0}}}

_NEEDS_ID = ("; a retention hint of the program the request names (the body's program_id, X-Program-Id, or any "
             "other way): a request that names none is its own program, ended with it, and the hint is ignored")
_FLAG = ("true, false, 1, 0, yes, no, on or off, in any case (empty: false)", {"pattern": HEADER_FLAG_PATTERN})
_ID_HEADERS = [
    ("X-Program-Id", "the program this request belongs to (when the body names none); spaces around it are "
                     "ignored and an empty value names nothing", {"maxLength": MAX_ID_LENGTH}),
    ("X-Session-Id", "the program, by vLLM's name (after X-Program-Id and body session_id)",
     {"maxLength": MAX_ID_LENGTH}),
    ("X-Program-TTL", "seconds to keep the program's KV after this turn: digits, with a fraction after a '.' "
                      "(60, 2.5)" + _NEEDS_ID, {"pattern": HEADER_SECONDS_PATTERN}),
    ("X-Program-Release", "a flag: true drops the program's pin after this turn; " + _FLAG[0] + _NEEDS_ID,
     _FLAG[1]),
    ("X-Program-End", "a flag: true ends the program after this turn (no program named: nothing to end); "
                      + _FLAG[0], _FLAG[1]),
]


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def _errors(*codes: str) -> dict[str, Any]:
    """The error replies of `codes`; every operation can answer 503 (the connection bounds, http_limits.py)."""
    out: dict[str, Any] = {}
    for code in (*codes, "503"):
        out[code] = {"description": _ERRORS[code], "content": _json(ErrorResponse)}
        if code == "503":
            out[code]["headers"] = _RETRY_AFTER
    return out


def _event_stream(events: str, data: dict[str, Any], *, done: bool = False) -> dict[str, Any]:
    """A streamed reply: server-sent events. As OpenAPI 3.1 reads an event stream, the schema is one
    event's (its `event` name and `data` text): the data is a JSON text that `data` describes
    (contentMediaType and contentSchema), or (`done`) the `[DONE]` that ends OpenAI's streams."""
    payload: dict[str, Any] = {"type": "string", "contentMediaType": "application/json", "contentSchema": data}
    if done:
        payload = {"type": "string", "if": {"const": "[DONE]"}, "else": payload}
    return {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"], "properties": {"event": {"type": "string"}, "data": payload},
        "description": f"one server-sent event of the stream (text/event-stream): {events}"}}}


def _generation(summary: str, request: type[BaseModel], reply: type[BaseModel], chunk: type[BaseModel],
                auth: list) -> dict[str, Any]:
    headers = [{"name": name, "in": "header", "required": False, "description": doc,
                "schema": {"type": "string", **extra}} for name, doc, extra in _ID_HEADERS]
    return {"post": {
        "summary": summary, "security": auth, "parameters": headers,
        "requestBody": {"required": True, "content": _json(request)},
        "responses": {
            "200": {"description": f"the reply; with `stream: true`, server-sent events of {chunk.__name__} "
                                   "objects ending with `data: [DONE]`",
                    "content": {**_json(reply), **_event_stream(
                        f"`data:` lines of {chunk.__name__} objects (an engine failure mid-stream: an ErrorResponse "
                        "object), then `data: [DONE]`", {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}, done=True)}},
            **_errors("400", "401", "404", "408", "413", "500")}}}


_ANTHROPIC_ERRORS = {**_ERRORS, "529": "the queue is full, the engine is not running, or too many connections are "
                                      "in progress (Anthropic's overloaded_error); retry after Retry-After seconds"}
_ANTHROPIC_HEADERS = [
    ("anthropic-version", "accepted (any version)", {}),
    ("anthropic-beta", "accepted (betas change nothing here)", {}),
    ("x-claude-code-session-id", "Claude Code's session: the program this request belongs to",
     {"maxLength": MAX_ID_LENGTH}),
    ("x-claude-code-agent-id", "a Claude Code subagent: a program of its own beside its session's",
     {"maxLength": MAX_ID_LENGTH}),
]


def _anthropic_op(summary: str, request: type[BaseModel], reply: type[BaseModel], auth: list,
                  stream: bool) -> dict[str, Any]:
    """An operation of Anthropic's Messages API: its errors are Anthropic's shape and status codes."""
    headers = [{"name": name, "in": "header", "required": False, "description": doc,
                "schema": {"type": "string", **extra}} for name, doc, extra in _ANTHROPIC_HEADERS + _ID_HEADERS]
    query = [{"name": "beta", "in": "query", "required": False,
              "description": "accepted, whatever its value, and ignored (Anthropic's SDK sends beta=true)",
              "schema": {"type": "string"}}]
    ok: dict[str, Any] = {"description": "the reply", "content": _json(reply)}
    if stream:
        ok["description"] += ("; with `stream: true`, server-sent events (`event:` lines) message_start, "
                              "content_block_start / _delta / _stop, message_delta, message_stop, ping and error")
        ok["content"].update(_event_stream(
            "named events (`event:` and `data:` lines, each data a JSON object): message_start, content_block_start "
            "/ _delta / _stop, message_delta, message_stop, ping, and error (an engine failure mid-stream)",
            {"anyOf": [*map(_ref, STREAM_EVENTS), _ref(AnthropicErrorResponse)]}))
    errors: dict[str, Any] = {}
    for code in ("400", "401", "404", "408", "413", *(("500",) if stream else ()), "529"):
        errors[code] = {"description": _ANTHROPIC_ERRORS[code], "content": _json(AnthropicErrorResponse)}
        if code == "529":
            errors[code]["headers"] = _RETRY_AFTER
    return {"post": {"summary": summary, "security": auth, "parameters": headers + query,
                     "requestBody": {"required": True, "content": _json(request)},
                     "responses": {"200": ok, **errors}}}


def _responses_paths(auth: list) -> dict[str, Any]:
    """OpenAI's Responses API: create (whole, or its named events), and the stored responses."""
    create = _generation("a response (OpenAI's Responses API)", ResponsesRequest, ResponseObject, ResponseObject, auth)
    create["post"]["responses"]["200"]["description"] = (
        "the response; with `stream: true`, server-sent events (`event:` and `data:` lines, increasing "
        "`sequence_number`): response.created, response.in_progress, response.output_item.added / .done, "
        "response.content_part.added / .done, response.output_text.delta / .done, "
        "response.function_call_arguments.delta / .done, response.custom_tool_call_input.delta / .done, then "
        "response.completed, response.incomplete or (after an `error` event) response.failed; no [DONE] line")
    create["post"]["responses"]["200"]["content"].update(_event_stream(
        "named events (`event:` and `data:` lines, each data a JSON object named by its `type`), as above",
        {"type": "object", "required": ["type", "sequence_number"],
         "properties": {"type": {"type": "string"}, "sequence_number": {"type": "integer", "minimum": 0}}}))
    create["post"]["responses"]["404"]["description"] = ("an unknown model, or a previous_response_id that is not "
                                                         "stored (previous_response_not_found)")
    rid = {"name": "response_id", "in": "path", "required": True, "description": _PATH_ID_RULES,
           "schema": {"type": "string", "minLength": 1, "maxLength": MAX_ID_LENGTH, "pattern": PATH_ID_PATTERN}}
    missing = {"404": {"description": "no such stored response (never stored, deleted, evicted, another key's)",
                       "content": _json(ErrorResponse)}}
    listing = [rid, {"name": "order", "in": "query", "required": False, "schema": {"enum": ["asc", "desc"]}},
               {"name": "limit", "in": "query", "required": False,
                "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
               *({"name": c, "in": "query", "required": False, "schema": {"type": "string"}}
                 for c in ("after", "before"))]

    def op(summary: str, reply: type[BaseModel], params: list) -> dict[str, Any]:
        return {"summary": summary, "security": auth, "parameters": params, "responses": {
            "200": {"description": "done", "content": _json(reply)}, **_errors("400", "401"), **missing}}

    return {
        "/v1/responses": create,
        "/v1/responses/{response_id}": {"get": op("a stored response", ResponseObject, [rid]),
                                        "delete": op("delete a stored response", ResponseDeleted, [rid])},
        "/v1/responses/{response_id}/input_items": {
            "get": op("the items a stored response was generated from (its chain's, then its own input)",
                      InputItemList, listing)},
    }


_PATH_ID_RULES = ("percent-decoded before it is read (so `a%2Fb` is `a/b`: a program id holding '/' may be "
                  "sent either way); at most 256 characters, none of them a control character (U+0000-U+001F, "
                  "U+007F-U+009F), one at least other than a space; otherwise 400")


def _program_op(summary: str, reply: type[BaseModel], auth: list) -> dict[str, Any]:
    return {"post": {
        "summary": summary, "security": auth,
        "parameters": [{"name": "program_id", "in": "path", "required": True,
                        "description": "the program's id, as its requests named it; " + _PATH_ID_RULES,
                        "schema": {"type": "string", "minLength": 1, "maxLength": MAX_ID_LENGTH,
                                   "pattern": PATH_ID_PATTERN}}],
        "responses": {"200": {"description": "done", "content": _json(reply)}, **_errors("400", "401")}}}


def _context_rules(context: int | None) -> tuple[str, str]:
    """The prompt's rule and the output cap's rule, in words, for a model of `context` tokens."""
    ctx = f"the model's context ({context} tokens)" if context else "the model's context (max_model_len)"
    return (f"The prompt the model's chat template renders from the request must be shorter than {ctx}; a longer "
            "one is a 400 (context_length_exceeded): no JSON Schema can state a length in tokens.",
            f"The prompt's tokens plus this cap must fit {ctx}; beyond, a 400 (context_length_exceeded).")


_CHAT_MESSAGES = ("An assistant message with tool_calls (their ids unique within it) is followed by one tool message "
                  "per call, in any order and with nothing in between, and every tool message answers one of the "
                  "calls of the assistant message before it (its tool_call_id is that call's id); otherwise a 400. ")
_UNIQUE_TOOLS = "Tool names are unique within the request (a 400 names the second). "
_NAMED_TOOL = "A tool_choice that names a tool names one of `tools` (a 400 otherwise). "
_ANTHROPIC_MESSAGES = (
    "A user message answers each tool_use block of the assistant message right before it with a tool_result block "
    "(tool_use_id: that block's id) and holds no other tool_result; tool_use ids are unique within a message; "
    "otherwise a 400. A conversation that ends with an assistant message is a prefill: the reply continues that "
    "message's text and holds only the new text; such a message may hold no tool_use, and a prefill cannot be "
    "combined with output_config.format (a 400 each). ")
_RESPONSES_INPUT = (
    "Each function_call or custom_tool_call item (call_id unique in the conversation, previous_response_id's "
    "included) is answered by a function_call_output or custom_tool_call_output item with its call_id before the "
    "next message or group of calls, and every output item answers such a call; otherwise a 400. ")


def _describe(prop: dict[str, Any], text: str) -> None:
    prop["description"] = (prop.get("description", "") + " " + text).strip()


def _state_rules(defs: dict[str, Any], context: int | None) -> None:
    """The rules of a body that span its items or count tokens, in the descriptions of the fields they bind."""
    prompt_rule, cap_rule = _context_rules(context)
    chat, completion = defs["ChatCompletionRequest"]["properties"], defs["CompletionRequest"]["properties"]
    _describe(chat["messages"], _CHAT_MESSAGES + prompt_rule)
    _describe(chat["tools"], _UNIQUE_TOOLS)
    _describe(chat["tool_choice"], _NAMED_TOOL)
    _describe(chat["max_tokens"], cap_rule + " Ignored when max_completion_tokens is given.")
    _describe(chat["max_completion_tokens"], cap_rule)
    _describe(completion["prompt"], prompt_rule.replace("the model's chat template renders from the request",
                                                        "tokenized"))
    _describe(completion["max_tokens"], cap_rule)
    for name in ("MessagesRequest", "CountTokensRequest"):
        props = defs[name]["properties"]
        _describe(props["messages"], _ANTHROPIC_MESSAGES + prompt_rule)
        _describe(props["tools"], _UNIQUE_TOOLS)
        _describe(props["tool_choice"], "A tool_choice of type tool names one of `tools` (a 400 otherwise).")
    max_tokens = defs["MessagesRequest"]["properties"]["max_tokens"]
    _describe(max_tokens, "A cap beyond the room the prompt leaves in the context is cut to that room (a reply "
                          "that reaches it ends with stop_reason model_context_window_exceeded).")
    responses = defs["ResponsesRequest"]["properties"]
    _describe(responses["input"], _RESPONSES_INPUT + prompt_rule + " With truncation 'auto' the oldest turns are "
                                                                   "dropped until it fits.")
    _describe(responses["tools"], "Tool names are unique within the request, a namespace's tools included (a 400 "
                                  "names the second).")
    _describe(responses["tool_choice"], "A tool_choice of type function or custom names a tool of `tools` declared "
                                        "with that type (a 400 otherwise).")
    _describe(responses["max_output_tokens"], cap_rule + " (Ignored with generate: false, which decodes nothing.)")
    if context:  # the prompt is one token at least: a larger cap is never served (Responses' prewarm ignores it)
        for prop in (chat["max_completion_tokens"], completion["max_tokens"]):
            next(b for b in prop["anyOf"] if b.get("type") == "integer")["maximum"] = context - 1


def openapi_document(model_names: list[str], auth: bool, vocab_size: int | None = None,
                     max_model_len: int | None = None, max_body_bytes: int | None = None) -> dict[str, Any]:
    """The document for a server serving `model_names`; `auth`: whether it wants a Bearer key;
    `vocab_size`: the model's, the bound of a token id (prompt, stop_token_ids); `max_model_len`:
    its context in tokens, and `max_body_bytes` the body limit, both stated where they bind."""
    _, defs = models_json_schema([(m, "validation") for m in _REQUESTS] + [(m, "serialization") for m in _RESPONSES],
                                 ref_template=_REF)
    _state_rules(defs["$defs"], max_model_len)
    for name in ("MessagesRequest", "CountTokensRequest"):  # Anthropic's `model` is required: one served here
        defs["$defs"][name]["properties"]["model"] = {"type": "string", "enum": list(model_names)}
    # /v1/completions takes one prompt, not empty (completions_endpoint.py refuses others with a 400)
    token = {"type": "integer", "minimum": 0, **({"maximum": vocab_size - 1} if vocab_size else {})}
    ids = {"type": "array", "items": token, "minItems": 1, "description": "token ids of the model's vocabulary"}
    defs["$defs"]["CompletionRequest"]["properties"]["prompt"] = {"title": "Prompt", "anyOf": [
        {"type": "string", "minLength": 1}, ids,
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
        {"type": "array", "items": ids, "minItems": 1, "maxItems": 1}]}
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        defs["$defs"][name]["properties"]["stop_token_ids"] = {"title": "Stop Token Ids", "anyOf": [
            {"type": "array", "items": token}, {"type": "null"}]}
    need = [{"bearer": []}] if auth else []
    need_anthropic = [{"bearer": []}, {"x-api-key": []}] if auth else []  # either header
    paths: dict[str, Any] = {
        "/v1/chat/completions": _generation("a chat completion", ChatCompletionRequest, ChatCompletion,
                                            ChatCompletionChunk, need),
        "/v1/completions": _generation("a text completion", CompletionRequest, Completion, Completion, need),
        **_responses_paths(need),
        "/v1/messages": _anthropic_op("a message (Anthropic's Messages API)", MessagesRequest, MessageResponse,
                                      need_anthropic, stream=True),
        "/v1/messages/count_tokens": _anthropic_op("the prompt's length in tokens, as /v1/messages renders it",
                                                   CountTokensRequest, TokensCount, need_anthropic, stream=False),
        "/v1/models": {"get": {"summary": "the served model names", "security": need, "responses": {
            "200": {"description": "the models", "content": _json(ModelList)}, **_errors("401")}}},
        "/v1/programs/{program_id}/release": _program_op("drop the program's pin (its KV stays cached)",
                                                         ProgramReleased, need),
        "/v1/programs/{program_id}/end": _program_op("end the program: drop its pin, record its completion time",
                                                     ProgramEnded, need),
        "/health": {"get": {"summary": "whether the engine runs", "security": [], "responses": {
            "200": {"description": "serving", "content": _json(Health)},
            "503": {"description": "the engine is not running (a Health object), or too many connections are in "
                                   "progress (an ErrorResponse)", "headers": _RETRY_AFTER,
                    "content": {"application/json": {"schema": {"oneOf": [_ref(Health), _ref(ErrorResponse)]}}}}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics (names prefixed agentserve:)", "security": need,
                             "responses": {"200": {"description": "the text exposition format",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}},
                                           **_errors("401")}}},
        "/openapi.json": {"get": {"summary": "this document", "security": [], "responses": {
            "200": {"description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object"}}}},
            **_errors()}}},
    }
    if max_body_bytes is not None:  # no JSON Schema keyword bounds a body's bytes: said where the body is
        for item in paths.values():
            for op in item.values():
                if "requestBody" in op:
                    op["requestBody"]["description"] = (f"a JSON object of at most {max_body_bytes} bytes (a larger "
                                                        "body is a 413)")
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "agentserve", "version": "v1",  # the API's version, as in its paths
                 "description": "An OpenAI-compatible LLM server for agent workloads. Models served: "
                                + ", ".join(model_names) + "."},
        "paths": paths,
        "components": {"schemas": defs["$defs"]},
    }
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    return doc
