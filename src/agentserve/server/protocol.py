"""OpenAI-compatible request and response bodies.

Requests ignore unknown fields, as OpenAI's API does, so clients written for
newer API versions or for other servers keep working; fields that would change
the output in a way this server cannot honour (logprobs, penalties, n > 1) are
declared here so the app can refuse them with a clear 400 instead of silently
ignoring them. A few extensions other servers accept are declared too: `top_k`,
`ignore_eos`, `stop_token_ids`, `cache_salt` (vLLM's names) and the
program-identity fields of DESIGN.md ("Request identity"), with the agent-hint
spellings of other engines that identity.py maps to them.

Responses are pydantic models dumped to JSON; a streaming delta drops its
unset fields, as OpenAI's chunks do."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


# --- requests -----------------------------------------------------------------


class FunctionCallIn(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Lenient):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Lenient):
    include_usage: bool = False


class ResponseFormat(_Lenient):
    type: str = "text"


class CacheControlHint(_Lenient):
    ttl: float | None = None  # seconds


class AgentHint(_Lenient):
    """vLLM's agent-hint RFC (`agent_hint`); identity.py maps what is used."""
    session_id: str | None = None
    cache_control: CacheControlHint | None = None


class AgentHints(_Lenient):
    """SGLang's `agent_hints`; identity.py maps what is used."""
    workflow_id: str | None = None
    agent_id: str | None = None
    cache_ttl_ms: float | None = None


class _Common(_Lenient):
    """Fields both endpoints share: sampling, streaming, identity hints."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (vLLM's names)
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # program identity and retention hints (DESIGN.md, "Request identity")
    program_id: str | None = None
    session_id: str | None = None
    ttl: float | None = None
    release_program: bool = False
    end_program: bool = False
    # the same, as other engines spell it (identity.py maps them)
    job_id: str | None = None  # Continuum
    is_last_step: bool = False  # Continuum
    agent_hint: AgentHint | None = None  # vLLM's agent-hint RFC
    agent_hints: AgentHints | None = None  # SGLang
    # prefix-cache hits only among requests with an equal salt (vLLM's name)
    cache_salt: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None


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
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


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
    root: str  # the file or folder the weights came from


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
