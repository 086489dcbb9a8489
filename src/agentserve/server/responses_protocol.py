"""Bodies of OpenAI's Responses API (`POST /v1/responses` and the stored
responses' endpoints), as the `openai` package's types under
`openai/types/responses/` spell them.

Requests are strict as chat's are (protocol.py: unknown fields ignored, no
coercion). An input item, a tool and a `tool_choice` of a type this server
does not serve is still parsed (as `OtherItem`, `OtherTool`, `OtherToolChoice`)
so that the translation can refuse it by its type name in a clear 400, rather
than pydantic listing every type it tried; the OpenAPI document leaves those
branches out (SkipJsonSchema), as it states every other value the server
refuses, so that a request valid by the document is one the server answers. The union tags are capitalised
because input_checks.param_of leaves such labels out of the parameter names
it reports (`input[2].call_id`, not `input[2].FunctionCall.call_id`).

Replies are plain pydantic models; the same models describe the endpoints in
the OpenAPI document (openapi.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_serializer, model_validator
from pydantic.json_schema import SkipJsonSchema

from agentserve.server.identity import MAX_SALT_LENGTH
from agentserve.server.field_types import Id, NonEmptyId, Strict, ToolName, served, whole_number

TEXT_PART_TYPES = ("input_text", "output_text", "text")  # the content parts whose text reaches the model


def _tag(kinds: dict[str, str], default: str | None = None):
    """A discriminator: the branch named by the value's `type` (`default` when it has none), else 'Other'."""

    def pick(v: Any) -> str:
        t = v.get("type", default) if isinstance(v, dict) else getattr(v, "type", default)
        return kinds.get(t, "Other") if isinstance(t, str) or t is None else "Other"

    return pick


# --- requests: input items ------------------------------------------------------------


def _text_part_schema(schema: dict[str, Any]) -> None:
    # what is served: a text part with its text (the document lists no other type)
    schema["properties"]["type"] = {"type": "string", "enum": list(TEXT_PART_TYPES)}
    schema["properties"]["text"] = {"type": "string"}
    schema["required"] = ["type", "text"]


class ContentPart(Strict):
    """A content part; only text parts reach the model, another type is refused by name."""
    model_config = ConfigDict(json_schema_extra=_text_part_schema)

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_has_text(self) -> ContentPart:
        if self.type in TEXT_PART_TYPES and self.text is None:
            raise ValueError(f"a part of type {self.type!r} needs `text`")
        return self


Content = Union[str, list[ContentPart]]


class MessageItem(Strict):
    type: Literal["message"] = "message"  # optional on input, as the API allows
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: Id | None = None


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: NonEmptyId
    name: ToolName
    arguments: str
    namespace: ToolName | None = None
    id: Id | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: NonEmptyId
    output: Content
    id: Id | None = None


class CustomToolCallItem(Strict):
    type: Literal["custom_tool_call"]
    call_id: NonEmptyId
    name: ToolName
    input: str
    namespace: ToolName | None = None
    id: Id | None = None


class CustomToolCallOutputItem(Strict):
    type: Literal["custom_tool_call_output"]
    call_id: NonEmptyId
    output: Content
    id: Id | None = None


class ReasoningItem(BaseModel):
    """A reasoning item from an earlier output: accepted (and listed) but never shown to the model."""

    model_config = {"extra": "allow"}
    type: Literal["reasoning"]
    id: Id | None = None


ITEM_TYPES = ("message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output",
              "reasoning")


class OtherItem(Strict):
    # refused by name (responses_translate.py); the document says it is none of the served types
    type: str = Field(json_schema_extra={"not": {"enum": list(ITEM_TYPES)}})


InputItem = Annotated[Union[
    Annotated[MessageItem, Tag("Message")],
    Annotated[FunctionCallItem, Tag("FunctionCall")],
    Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")],
    Annotated[CustomToolCallItem, Tag("CustomToolCall")],
    Annotated[CustomToolCallOutputItem, Tag("CustomToolCallOutput")],
    Annotated[ReasoningItem, Tag("Reasoning")],
    Annotated[SkipJsonSchema[OtherItem], Tag("Other")],
], Discriminator(_tag({"message": "Message", "function_call": "FunctionCall",
                       "function_call_output": "FunctionCallOutput", "custom_tool_call": "CustomToolCall",
                       "custom_tool_call_output": "CustomToolCallOutput", "reasoning": "Reasoning"},
                      default="message"))]


# --- requests: tools ------------------------------------------------------------------


class FunctionTool(Strict):
    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextInputFormat(Strict):
    type: Literal["text"]


class GrammarInputFormat(Strict):
    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: str = Field(max_length=64 * 1024)


class CustomTool(Strict):
    """A freeform tool (Codex's apply_patch): its input is one string, optionally in a grammar."""

    type: Literal["custom"]
    name: ToolName
    description: str | None = None
    format: Annotated[Union[TextInputFormat, GrammarInputFormat], Field(discriminator="type")] | None = None


class NamespaceTool(Strict):
    """A group of tools (Codex's MCP servers); its tools are offered as if declared one by one."""

    type: Literal["namespace"]
    name: ToolName
    description: str | None = None
    tools: list[Annotated[Union[FunctionTool, CustomTool], Field(discriminator="type")]]


class OtherTool(Strict):
    # a hosted tool (web_search, file_search, ...): refused by name
    type: str = Field(json_schema_extra={"not": {"enum": ["function", "custom", "namespace"]}})


Tool = Annotated[Union[
    Annotated[FunctionTool, Tag("Function")],
    Annotated[CustomTool, Tag("Custom")],
    Annotated[NamespaceTool, Tag("Namespace")],
    Annotated[SkipJsonSchema[OtherTool], Tag("Other")],
], Discriminator(_tag({"function": "Function", "custom": "Custom", "namespace": "Namespace"}))]


class NamedToolChoice(Strict):
    type: Literal["function", "custom"]
    name: ToolName


class OtherToolChoice(Strict):
    # allowed_tools, a hosted tool, mcp...: refused by name
    type: str = Field(json_schema_extra={"not": {"enum": ["function", "custom"]}})


# --- requests: the rest ---------------------------------------------------------------


class TextFormat(Strict):
    model_config = ConfigDict(json_schema_extra={  # as the validator below says
        "if": {"properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["name", "schema"], "properties": {"name": {"type": "string"},
                                                               "schema": {"type": "object"}}}})

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")  # as chat's
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_named(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or not self.name):
            raise ValueError("a json_schema format needs `name` and `schema`")
        return self


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: str | None = None


class PromptCacheOptions(Strict):
    prewarm: bool = False  # OpenAI's spelling of Codex's `generate: false`


class ResponsesRequest(Strict):
    # something to answer: input, or a stored conversation to continue, or at least instructions
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={"anyOf": [
        {"required": ["input"], "properties": {"input": {"anyOf": [{"type": "string"},
                                                                  {"type": "array", "minItems": 1}]}}},
        {"required": ["previous_response_id"], "properties": {"previous_response_id": {"type": "string"}}},
        {"required": ["instructions"], "properties": {"instructions": {"type": "string"}}}],
        # a tool_choice but "none" needs tools (tool_output.py, as chat's)
        "if": {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"enum": [None, "none"]}}}},
        "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}})

    model: Id | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    previous_response_id: NonEmptyId | None = None
    store: bool | None = None  # None: true, as OpenAI's default
    stream: bool = False
    background: bool | None = Field(None, json_schema_extra=served({"type": "boolean", "const": False}))
    conversation: str | dict[str, Any] | None = Field(None, json_schema_extra=served())
    prompt: dict[str, Any] | None = Field(None, json_schema_extra=served())
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | SkipJsonSchema[OtherToolChoice] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: whole_number(ge=1) | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: whole_number(ge=0, le=20) | None = Field(None, json_schema_extra=served({"type": "integer", "const": 0}))
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)
    user: Id | None = None
    prompt_cache_key: Id | None = None
    safety_identifier: Id | None = None
    truncation: Literal["auto", "disabled"] | None = None
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    generate: bool | None = None  # false: Codex's prewarm (prefill, no output)
    prompt_cache_options: PromptCacheOptions | None = None
    # program identity and retention hints (docs/architecture.md, "Request identity"), as chat has them
    program_id: Id | None = None
    session_id: Id | None = None
    ttl: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    release_program: bool = False
    end_program: bool = False
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT_LENGTH)
    ignore_eos: bool = False  # vLLM's extension, as chat has it: decode max_output_tokens (benchmarks)

    @property
    def stores(self) -> bool:
        return self.store is not False

    @property
    def prewarm(self) -> bool:
        return self.generate is False or bool(self.prompt_cache_options and self.prompt_cache_options.prewarm)


# --- replies ----------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class _CallOut(BaseModel):
    """What a function call and a custom tool call item share; `namespace` only when the tool had one."""

    id: str
    call_id: str
    name: str
    status: Literal["in_progress", "completed", "incomplete"]
    namespace: str | None = None

    @model_serializer(mode="wrap")
    def _namespace_when_set(self, handler):
        d = handler(self)
        if d.get("namespace") is None:
            d.pop("namespace", None)
        return d


class FunctionCallOut(_CallOut):
    type: Literal["function_call"] = "function_call"
    arguments: str


class CustomToolCallOut(_CallOut):
    type: Literal["custom_tool_call"] = "custom_tool_call"
    input: str


OutputItem = Union[OutputMessage, FunctionCallOut, CustomToolCallOut]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    cache_write_tokens: int = 0  # prompt tokens computed now (their KV joins the cache)


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseErrorBody(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: ResponseErrorBody | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    background: bool = False
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
