"""OpenAI-compatible request and response bodies.

Requests ignore unknown fields, as OpenAI's API does, so clients written for
newer API versions or for other servers keep working; fields that would change
the output in a way this server cannot honour (logprobs, penalties, n > 1) are
declared here so the app can refuse them with a clear 400 instead of silently
ignoring them. A few extensions other servers accept are declared too: `top_k`,
`ignore_eos`, `stop_token_ids`, `cache_salt` (vLLM's names) and the
program-identity fields of docs/architecture.md ("Request identity"), with the agent-hint
spellings of other engines that identity.py maps to them.

Declared fields are strict: a value of the wrong JSON type is a 400, never
coerced (`"8"` is not a number, `"yes"` not a boolean), because a silently
converted value is a request the client did not send. Ranges are OpenAI's
documented ones; every id is at most MAX_ID_LENGTH characters. Messages are
told apart by role, each with the fields OpenAI requires of it, and these same
models generate the OpenAPI document (openapi.py).

Responses are pydantic models dumped to JSON; a streaming delta drops its
unset fields, as OpenAI's chunks do."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from agentserve.server.field_types import Id, Int, NonEmptyId, Strict, ToolName, served, whole_number
from agentserve.server.identity import MAX_ID_LENGTH, MAX_SALT_LENGTH


# --- requests -----------------------------------------------------------------


def _text_part_schema(schema: dict[str, Any]) -> None:
    # what is served: a text part with its text (the document lists no other type)
    schema["properties"]["type"] = {"type": "string", "enum": ["text"]}
    schema["properties"]["text"] = {"type": "string"}
    schema["required"] = ["type", "text"]


class TextPart(Strict):
    """A content part. Only text parts reach the model; another type is refused
    by name when the messages are rendered (chat_template.py)."""
    model_config = ConfigDict(json_schema_extra=_text_part_schema)

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_has_text(self) -> TextPart:
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs `text`")
        return self


Content = Union[str, list[TextPart]]


class FunctionCallIn(Strict):
    name: ToolName
    arguments: str | dict[str, Any] = "{}"  # a JSON object as a string (OpenAI's format), or the object


class ToolCallIn(Strict):
    id: NonEmptyId
    type: Literal["function"] = "function"
    function: FunctionCallIn


class _Message(Strict):
    name: str | None = Field(None, max_length=256)


class SystemMessage(_Message):
    role: Literal["system", "developer"]  # developer: OpenAI's newer name for the system role
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class AssistantMessageIn(_Message):
    model_config = ConfigDict(json_schema_extra={"anyOf": [  # content or calls, as the validator below says
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}}]})

    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCallIn] | None = None

    @model_validator(mode="after")
    def _says_something(self) -> AssistantMessageIn:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs `content` or `tool_calls`")
        return self


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: NonEmptyId


ChatMessage = Annotated[Union[SystemMessage, UserMessage, AssistantMessageIn, ToolMessage],
                        Field(discriminator="role")]


class FunctionDef(Strict):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(Strict):
    name: ToolName


class NamedToolChoice(Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(Strict):
    include_usage: bool = False


class JsonSchemaFormat(Strict):
    """response_format's `json_schema` (OpenAI's shape); `schema` absent: any JSON object."""
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    model_config = ConfigDict(json_schema_extra={  # as the validator below says
        "if": {"required": ["type"], "properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}}})

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a response_format of type json_schema needs `json_schema`")
        return self


# The other engines' hints are typed here; their values (ids within MAX_ID_LENGTH,
# finite TTLs >= 0) are checked where they are mapped, in identity.py, and stated in the document.
class CacheControlHint(Strict):
    ttl: float | None = Field(None, json_schema_extra={"minimum": 0})  # seconds


class AgentHint(Strict):
    """vLLM's agent-hint RFC (`agent_hint`); identity.py maps what is used."""
    session_id: str | None = Field(None, json_schema_extra={"maxLength": MAX_ID_LENGTH})
    cache_control: CacheControlHint | None = None


class AgentHints(Strict):
    """SGLang's `agent_hints`; identity.py maps what is used."""
    workflow_id: str | None = Field(None, json_schema_extra={"maxLength": MAX_ID_LENGTH})
    agent_id: str | None = Field(None, json_schema_extra={"maxLength": MAX_ID_LENGTH})
    cache_ttl_ms: float | None = Field(None, json_schema_extra={"minimum": 0})


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TokenCount = whole_number(ge=1)
_ZERO = {"type": "number", "const": 0}


class _Common(Strict):
    """Fields both endpoints share: sampling, streaming, identity hints."""

    model: Id | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: TokenCount | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: whole_number(ge=-2**63, lt=2**64) | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None  # (SamplingParams')
    n: whole_number(ge=1, le=128) | None = Field(1, json_schema_extra=served({"type": "integer", "const": 1}))
    presence_penalty: Penalty | None = Field(None, json_schema_extra=served(_ZERO))
    frequency_penalty: Penalty | None = Field(None, json_schema_extra=served(_ZERO))
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, json_schema_extra=served({"type": "object", "maxProperties": 0}))
    user: Id | None = None
    # extensions (vLLM's names)
    top_k: whole_number(ge=-1, lt=2**63) | None = None  # the sampler holds it as a 64-bit integer
    ignore_eos: bool = False
    stop_token_ids: list[whole_number(ge=0)] | None = None
    # program identity and retention hints (docs/architecture.md, "Request identity")
    program_id: Id | None = None
    session_id: Id | None = None
    ttl: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    release_program: bool = False
    end_program: bool = False
    # the same, as other engines spell it (identity.py maps them)
    job_id: str | None = Field(None, json_schema_extra={"maxLength": MAX_ID_LENGTH})  # Continuum
    is_last_step: bool = False  # Continuum
    agent_hint: AgentHint | None = None  # vLLM's agent-hint RFC
    agent_hints: AgentHints | None = None  # SGLang
    # prefix-cache hits only among requests with an equal salt (vLLM's name)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT_LENGTH)


class ChatCompletionRequest(_Common):
    model_config = ConfigDict(json_schema_extra={  # a tool_choice but "none" needs tools (tool_output.py)
        "if": {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"enum": [None, "none"]}}}},
        "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}})

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: TokenCount | None = None
    prompt_cache_key: Id | None = None  # OpenAI's cache scope: names the program (identity.py)
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = None  # metadata.user_id names it too
    logprobs: bool | None = Field(None, json_schema_extra=served({"type": "boolean", "const": False}))
    top_logprobs: whole_number(ge=0, le=20) | None = Field(None, json_schema_extra=served({"type": "integer", "const": 0}))
    response_format: ResponseFormat | None = None


class CompletionRequest(_Common):
    prompt: str | list[Int] | list[str] | list[list[Int]]
    echo: bool = Field(False, json_schema_extra=served({"type": "boolean", "const": False}, nullable=False))
    suffix: str | None = Field(None, json_schema_extra=served({"type": "string", "maxLength": 0}))
    best_of: whole_number(ge=0, le=20) | None = Field(None, json_schema_extra=served({"type": "integer", "const": 1}))
    logprobs: whole_number(ge=0, le=5) | None = Field(None, json_schema_extra=served())


# --- responses ----------------------------------------------------------------


def now_s() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> Usage:
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's format)


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDelta(BaseModel):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None  # left out when the reply made no call, as OpenAI does

    @model_serializer(mode="wrap")
    def _calls_when_made(self, handler):
        d = handler(self)
        if not d.get("tool_calls"):
            d.pop("tool_calls", None)
        return d


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    stop_reason: str | int | None = None  # vLLM's field: the stop string or token that ended it
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _only_set(self, handler):  # OpenAI's deltas carry only what changed
        return {k: v for k, v in handler(self).items() if v is not None}


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "agentserve"
    max_model_len: int
    root: str  # the name of the file or folder the weights came from (never its path)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ProgramReleased(BaseModel):
    program_id: str
    released: bool  # whether a pin was dropped


class ProgramEnded(BaseModel):
    program_id: str
    ended: Literal[True] = True
    known: bool  # whether the server held anything of the program


class Health(BaseModel):
    status: str  # "ok", or why not


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
