"""Structured outputs: a chat request's `response_format` json_object or
json_schema, held by constrained decoding (the Responses API's `text.format`
arrives here as the same field).

Agent frameworks ask for typed replies this way (LangChain's
`with_structured_output`, the OpenAI Agents SDK's `output_type`) and parse
the reply without a second chance, so the reply is decoded under an xgrammar
grammar from the schema, as forced tool calls are: exactly one JSON value (an
object for json_object, one following the schema for json_schema), then the
end of the turn. Even a 135M model then answers with JSON that parses and
follows the schema; only `max_tokens` can cut it (finish_reason "length").

`strict` (OpenAI's strict mode) leaves out every property and item the schema
does not declare; without it the schema's own rules apply (JSON Schema allows
undeclared properties unless `additionalProperties` is false). Nothing is
added to the prompt: the schema constrains the decoding, and the model sees
only the conversation (OpenAI asks json_object callers to say "JSON" in the
messages; this server neither requires nor adds it).

With tools and tool_choice "auto" the reply is one tool call or the JSON, the
model's choice (OpenAI allows both together: an agent calls tools until it
gives its typed answer); a forced tool_choice makes the reply a call, so the
format does not apply to it. Under a format, a reply that is bare JSON is the
answer, never read as a Llama 3 style call."""

from __future__ import annotations

import dataclasses

from agentserve.engine.sampling_params import SamplingParams
from agentserve.server.api_errors import APIError
from agentserve.server.input_checks import InputError
from agentserve.server.message_checks import MAX_SCHEMA_DEPTH, json_depth
from agentserve.server.protocol import ChatCompletionRequest, ResponseFormat
from agentserve.server.server_state import ServerState
from agentserve.server.tool_output import ToolChoice


def json_format(req: ChatCompletionRequest) -> ResponseFormat | None:
    """The request's response_format when it asks for JSON (None for text or none),
    its schema checked for depth as tools' parameters are (message_checks.py)."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.json_schema is not None and json_depth(fmt.json_schema.schema_) > MAX_SCHEMA_DEPTH:
        raise InputError(f"response_format.json_schema.schema nests objects and arrays more than "
                         f"{MAX_SCHEMA_DEPTH} levels deep", "response_format.json_schema.schema")
    return fmt


def constrain_output(st: ServerState, req: ChatCompletionRequest, fmt: ResponseFormat, choice: ToolChoice | None,
                     params: SamplingParams) -> SamplingParams:
    """`params` holding the reply to the format (or, with tool_choice "auto", to one call of
    the tools). Blocking (compiles the grammar on a miss): run it in a thread."""
    spec = fmt.json_schema if fmt.type == "json_schema" else None
    schema = spec.schema_ if spec is not None else None
    tools = None
    if choice is not None:
        tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
        tools = [t for t in tools if t["function"]["name"] in choice.allowed]
    try:
        constraint = st.llm.json_constraint(schema, bool(spec is not None and spec.strict), tools)
    except ValueError as e:  # runner/structured.py's GrammarError names the culprit
        param = getattr(e, "param", None) or "response_format"
        raise APIError(400, str(e), param=param) from None
    except RuntimeError as e:
        if _grammar_library_missing(e):
            raise APIError(400, f"response_format {fmt.type} needs constrained decoding, and this server lacks "
                                "xgrammar: install it where the server runs with pip install "
                                "'agentserve[structured]' (or leave response_format out)", param="response_format",
                           code="structured_output_unavailable") from None
        raise
    return dataclasses.replace(params, constraint=constraint)


def _grammar_library_missing(e: RuntimeError) -> bool:
    # runner/structured.py's StructuredOutputUnavailable, known by name: this layer never imports the runner
    return any(c.__name__ == "StructuredOutputUnavailable" for c in type(e).__mro__)


def without_bare_json_calls(choice: ToolChoice | None) -> ToolChoice | None:
    """A reply under a JSON format is read as Hermes calls or the answer, never as bare-JSON calls."""
    return None if choice is None else dataclasses.replace(choice, bare_json=False)
