"""Anthropic Messages API bodies (`POST /v1/messages`, `/v1/messages/count_tokens`).

The request models are strict as protocol.py's are (unknown fields ignored,
declared ones never coerced), and they generate the OpenAPI document. Content
blocks, tools and tool_choice are unions told apart by their `type`; a type
this server cannot honour is refused while the body is validated, with a
message naming the type and where it is (`messages[2].content[0]: content
block type 'image' is refused: ...`), never silently dropped:

- `image` and `document` blocks: the model reads text only;
- tools with a `type` of their own (`web_search_20250305`, `bash_20250124`,
  ...): Anthropic's server tools run on Anthropic's servers, and nothing here
  would run them;
- any block type the API does not have.

`thinking` and `redacted_thinking` blocks in an assistant's history are
accepted and not shown to the model (they are the reasoning of another model).
The union tags are the models' class names, so an error's parameter path
names only the client's own fields.

Responses are plain pydantic models in Anthropic's shape; the stream's events
are here too, for the OpenAPI document and for messages_endpoint.py."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError

from agentserve.server.field_types import Id, NonEmptyId, Strict, ToolName, served, whole_number

NO_VISION = "is refused: the model served here reads text only"


def _typed(*models: type[BaseModel], what: str, refused: dict[str, str] | None = None) -> Any:
    """A union of `models` told apart by their `type` literal; `refused`: types that get a 400 of their own."""
    tags = {get_args(m.model_fields["type"].annotation)[0]: m.__name__ for m in models}
    known = ", ".join(tags)
    refused = refused or {}

    def check(v: Any) -> Any:
        if not isinstance(v, dict):
            raise PydanticCustomError("object_type", "a {what} must be an object with a `type` (one of {known})",
                                      {"what": what, "known": known})
        t = v.get("type")
        if not isinstance(t, str):
            raise PydanticCustomError("missing_type", "a {what} needs a `type` (one of {known})",
                                      {"what": what, "known": known})
        if t in refused:
            raise PydanticCustomError("refused_type", "{what} type '{type}' {why}",
                                      {"what": what, "type": t, "why": refused[t]})
        if t not in tags:
            raise PydanticCustomError("unknown_type", "{what} type '{type}' is not supported (one of {known})",
                                      {"what": what, "type": t, "known": known})
        return v

    def tag(v: Any) -> str | None:
        return tags.get(v.get("type") if isinstance(v, dict) else getattr(v, "type", None))

    branches = tuple(Annotated[m, Tag(m.__name__)] for m in models)
    return Annotated[Union[branches], Discriminator(tag), BeforeValidator(check)]


# --- requests -----------------------------------------------------------------


class CacheControl(Strict):
    """A prompt-cache breakpoint. agentserve caches every prefix anyway; `ttl` is a retention hint."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class _Block(Strict):
    cache_control: CacheControl | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    """A call the assistant made (in `messages` history)."""

    type: Literal["tool_use"]
    id: NonEmptyId
    name: ToolName
    input: dict[str, Any]


_VISION_REFUSED = {"image": NO_VISION, "document": NO_VISION}
ToolResultPart = _typed(TextBlock, what="tool_result content block", refused=_VISION_REFUSED)


class ToolResultBlock(_Block):
    """The result of a call, in a user message."""

    type: Literal["tool_result"]
    tool_use_id: NonEmptyId
    content: str | list[ToolResultPart] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Block):
    """An assistant's reasoning in history: accepted, not shown to the model."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = _typed(TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock,
                      what="content block", refused=_VISION_REFUSED)
SystemBlock = _typed(TextBlock, what="system block")


# which blocks each role's message may hold (messages_endpoint.py refuses the others by name)
_BLOCKS_OF = {"user": ("TextBlock", "ToolResultBlock"),
              "assistant": ("TextBlock", "ToolUseBlock", "ThinkingBlock", "RedactedThinkingBlock")}


def _blocks_by_role(schema: dict[str, Any]) -> None:
    content = schema["properties"]["content"]
    blocks = next(b for b in content["anyOf"] if b.get("type") == "array")["items"]["oneOf"]
    schema["oneOf"] = [{"properties": {"role": {"const": role}, "content": {"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"oneOf": [
            b for b in blocks if _model_of(b["$ref"]) in names]}}]}}} for role, names in _BLOCKS_OF.items()]


def _model_of(ref: str) -> str:
    """The model a $ref names, in its final form (`.../TextBlock`) or pydantic's while it builds the
    schema (`.../agentserve__server__messages_protocol__TextBlock-Input__1`)."""
    return ref.rsplit("/", 1)[1].split("-")[0].split("__")[-1]


class MessageParam(Strict):
    model_config = ConfigDict(json_schema_extra=_blocks_by_role)

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


_SERVER_TOOL = ("is refused: only client tools (name, description, input_schema) are served here; Anthropic's "
                "server tools run on Anthropic's servers")


class AnthropicTool(Strict):
    """A client tool. A tool with another `type` (Anthropic's server tools) is refused by name."""

    type: Literal["custom"] | None = None
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


def _check_tool(v: Any) -> Any:
    if isinstance(v, dict) and isinstance(v.get("type"), str) and v["type"] != "custom":
        raise PydanticCustomError("refused_type", "tool type '{type}' {why}", {"type": v["type"], "why": _SERVER_TOOL})
    return v


ToolParam = Annotated[AnthropicTool, BeforeValidator(_check_tool)]


class _ToolChoice(Strict):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAuto(_ToolChoice):
    type: Literal["auto"]


class ToolChoiceAny(_ToolChoice):
    type: Literal["any"]


class ToolChoiceTool(_ToolChoice):
    type: Literal["tool"]
    name: ToolName


class ToolChoiceNone(Strict):
    type: Literal["none"]


ToolChoiceParam = _typed(ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone, what="tool_choice")


class MessagesMetadata(Strict):
    user_id: str | None = None  # identity.py: a program id when no session header names one


class OutputConfig(Strict):
    effort: str | None = None  # accepted; nothing here trades effort for speed
    format: dict[str, Any] | None = Field(None, json_schema_extra=served(  # messages_endpoint.to_chat's rule
        {"type": "object", "required": ["type", "schema"],
         "properties": {"type": {"const": "json_schema"}, "schema": {"type": "object"}}}))


class CountTokensRequest(Strict):
    """POST /v1/messages/count_tokens: what the prompt is made of."""
    model_config = ConfigDict(json_schema_extra={  # tool_choice any or tool needs tools (messages_endpoint.to_chat)
        "if": {"required": ["tool_choice"], "properties": {"tool_choice": {
            "type": "object", "required": ["type"], "properties": {"type": {"enum": ["any", "tool"]}}}}},
        "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}})

    model: Id
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[SystemBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: dict[str, Any] | None = None  # accepted; the model served here does not think on request
    cache_control: CacheControl | None = None  # Anthropic's automatic caching: a breakpoint at the last block
    output_config: OutputConfig | None = None


MAX_STOP_SEQUENCES = 16  # SamplingParams' limit


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: whole_number(ge=1)
    # the document states the limit; the endpoint refuses more with its own message
    stop_sequences: Annotated[list[str], Field(json_schema_extra={"maxItems": MAX_STOP_SEQUENCES})] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)  # Anthropic's range
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: whole_number(ge=0, lt=2**63) | None = None
    metadata: MessagesMetadata | None = None
    ignore_eos: bool = False  # vLLM's extension, as chat has it: decode max_tokens tokens (benchmarks)


# --- responses ----------------------------------------------------------------


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str  # toolu_...
    name: str
    input: dict[str, Any]


OutputBlock = Annotated[Union[TextContent, ToolUseContent], Field(discriminator="type")]


class MessageUsage(BaseModel):
    """Anthropic's usage: the prompt is input_tokens + cache_read_input_tokens + cache_creation_input_tokens."""

    input_tokens: int  # prompt tokens computed for this request (not read from the prefix cache)
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"]


class MessageResponse(BaseModel):
    id: str  # msg_...
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutputBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: MessageUsage


class TokensCount(BaseModel):
    input_tokens: int


class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: MessageResponse


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: OutputBlock


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: Annotated[Union[TextDelta, InputJsonDelta], Field(discriminator="type")]


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(BaseModel):
    stop_reason: StopReason | None
    stop_sequence: str | None = None


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessageUsage  # the final counts (message_start's could not know the prefix-cache hit yet)


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


class PingEvent(BaseModel):
    type: Literal["ping"] = "ping"


class AnthropicError(BaseModel):
    type: str  # invalid_request_error, authentication_error, not_found_error, overloaded_error, ...
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicError


STREAM_EVENTS: list[type[BaseModel]] = [MessageStartEvent, ContentBlockStartEvent, ContentBlockDeltaEvent,
                                        ContentBlockStopEvent, MessageDeltaEvent, MessageStopEvent, PingEvent]
