"""The OpenAPI 3.1 document of the API, served at GET /openapi.json.

Its schemas are generated from the pydantic models the server validates with
(protocol.py), so the document cannot drift from what the server accepts and
answers; only the paths, parameters and which statuses each path may answer
are written here. Clients can be generated from it, and tests fuzz the live
server with it (schemathesis; bench/fuzz_api.py)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from agentserve.server.identity import MAX_ID_LENGTH
from agentserve.server.protocol import (ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, Completion,
                                        CompletionRequest, ErrorResponse, Health, ModelList, ProgramEnded,
                                        ProgramReleased)

_REF = "#/components/schemas/{model}"
_REQUESTS: list[type[BaseModel]] = [ChatCompletionRequest, CompletionRequest]
_RESPONSES: list[type[BaseModel]] = [ChatCompletion, ChatCompletionChunk, Completion, ModelList, ProgramReleased,
                                     ProgramEnded, Health, ErrorResponse]

_ERRORS = {
    "400": "a malformed body, a value out of range, an unsupported parameter or a prompt over the context",
    "401": "a missing or wrong API key",
    "404": "an unknown model",
    "413": "a body over --max-body-bytes",
    "503": "the queue is full or the engine is not running; retry after Retry-After seconds",
}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying",
                                "schema": {"type": "integer", "minimum": 0}}}

_ID_HEADERS = [
    ("X-Program-Id", "the program this request belongs to (when the body names none)", {"maxLength": MAX_ID_LENGTH}),
    ("X-Session-Id", "the program, by vLLM's name (after X-Program-Id and body session_id)",
     {"maxLength": MAX_ID_LENGTH}),
    ("X-Program-TTL", "seconds to keep the program's KV after this turn", {"pattern": r"^[0-9]+(\.[0-9]+)?$"}),
    ("X-Program-Release", "true: drop the program's pin after this turn", {"enum": ["true", "false"]}),
    ("X-Program-End", "true: the program is over after this turn", {"enum": ["true", "false"]}),
]


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def _errors(*codes: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for code in codes:
        out[code] = {"description": _ERRORS[code], "content": _json(ErrorResponse)}
        if code == "503":
            out[code]["headers"] = _RETRY_AFTER
    return out


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
                    "content": {**_json(reply), "text/event-stream": {"schema": {"type": "string"}}}},
            **_errors("400", "401", "404", "413", "503")}}}


def _program_op(summary: str, reply: type[BaseModel], auth: list) -> dict[str, Any]:
    return {"post": {
        "summary": summary, "security": auth,
        "parameters": [{"name": "program_id", "in": "path", "required": True,
                        "schema": {"type": "string", "minLength": 1, "maxLength": MAX_ID_LENGTH}}],
        "responses": {"200": {"description": "done", "content": _json(reply)}, **_errors("400", "401")}}}


def openapi_document(model_names: list[str], auth: bool) -> dict[str, Any]:
    """The document for a server serving `model_names`; `auth`: whether it wants a Bearer key."""
    _, defs = models_json_schema([(m, "validation") for m in _REQUESTS] + [(m, "serialization") for m in _RESPONSES],
                                 ref_template=_REF)
    need = [{"bearer": []}] if auth else []
    paths: dict[str, Any] = {
        "/v1/chat/completions": _generation("a chat completion", ChatCompletionRequest, ChatCompletion,
                                            ChatCompletionChunk, need),
        "/v1/completions": _generation("a text completion", CompletionRequest, Completion, Completion, need),
        "/v1/models": {"get": {"summary": "the served model names", "security": need, "responses": {
            "200": {"description": "the models", "content": _json(ModelList)}, **_errors("401")}}},
        "/v1/programs/{program_id}/release": _program_op("drop the program's pin (its KV stays cached)",
                                                         ProgramReleased, need),
        "/v1/programs/{program_id}/end": _program_op("end the program: drop its pin, record its completion time",
                                                     ProgramEnded, need),
        "/health": {"get": {"summary": "whether the engine runs", "security": [], "responses": {
            "200": {"description": "serving", "content": _json(Health)},
            "503": {"description": "the engine is not running", "headers": _RETRY_AFTER, "content": _json(Health)}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics (names prefixed agentserve:)", "security": need,
                             "responses": {"200": {"description": "the text exposition format",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}},
                                           **_errors("401")}}},
        "/openapi.json": {"get": {"summary": "this document", "security": [], "responses": {
            "200": {"description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "agentserve", "version": "v1",  # the API's version, as in its paths
                 "description": "An OpenAI-compatible LLM server for agent workloads. Models served: "
                                + ", ".join(model_names) + "."},
        "paths": paths,
        "components": {"schemas": defs["$defs"]},
    }
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc
