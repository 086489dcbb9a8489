"""The APIs a replay can drive a workload over (`agentserve bench run --api`):
one conversation, sent in each API's own shape with the program identity that
API's agents send, its stream and usage read back as the same numbers
(first-token time, text, prompt / cached / completion tokens). The table of
what each sends and reads is on the docs' benchmarks page ("Over each agent
API"). The program's end rides in the body for chat and the Responses API,
and in agentserve's `X-Program-End` header for the Messages API, whose body has
no room for extensions an Anthropic client would send."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from agentserve.bench.replay_stream import ReplayError, StreamAccumulator, error_event, sse_data

API_NAMES = ("chat", "responses", "responses-chain", "messages")
ANTHROPIC_VERSION = "2023-06-01"


@dataclass
class Request:
    """One HTTP request of a turn."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]


class Wire:
    """How one API carries a turn. `request` builds it from the conversation (chat messages);
    `accumulator` reads its stream; `usage` reads a whole reply's (prompt, cached, completion)
    tokens; `answered` is told of each answered turn (the chain's state); `program` is the id
    the server knows the program by (for an explicit end)."""

    name = "chat"
    path = "/v1/chat/completions"
    stream_type: type[StreamAccumulator] = StreamAccumulator

    def __init__(self, api_key: str | None = None) -> None:
        self.api_key = api_key

    def request(self, model: str, messages: list[dict], pid: str, max_tokens: int, *, stream: bool,
                ignore_eos: bool, end: bool) -> Request:
        body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                                "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        # vLLM's session header too, which its scheduler sees (agentserve's own header wins in agentserve)
        return Request(self.path, self._extensions(body, ignore_eos, end), {"X-Program-Id": pid, "X-Session-ID": pid})

    @staticmethod
    def _extensions(body: dict[str, Any], ignore_eos: bool, end: bool) -> dict[str, Any]:
        """agentserve's (and vLLM's) fields beyond the API: decode to max_tokens, end the program."""
        if ignore_eos:
            body["ignore_eos"] = True
        if end:
            body["end_program"] = True
            body["vllm_xargs"] = {"end_program": True}  # what reaches vLLM's scheduler (its plugin)
        return body

    def accumulator(self, t_send: float) -> StreamAccumulator:
        return self.stream_type(t_send)

    def usage(self, reply: dict) -> tuple[int, int, int]:
        return self.stream_type.tokens(reply.get("usage") or {})

    def answered(self, pid: str, messages: list[dict], acc: StreamAccumulator) -> None:
        pass

    def program(self, pid: str) -> str:
        return pid

    def probe(self) -> Wire:
        """The wire of a calibration probe (a request the server keeps nothing of)."""
        return self


# --- the Responses API ------------------------------------------------------------------


def responses_input(messages: list[dict]) -> tuple[str | None, list[dict]]:
    """(instructions, input items) of a chat conversation: a leading system message becomes the
    instructions (as Codex sends its system prompt)."""
    if messages and messages[0]["role"] == "system":
        return messages[0]["content"], response_items(messages[1:])
    return None, response_items(messages)


def response_items(messages: list[dict]) -> list[dict]:
    """Chat messages as input items: calls and their results as function_call /
    function_call_output items."""
    items: list[dict] = []
    for m in messages:
        role = m["role"]
        if role == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]})
            continue
        calls = m.get("tool_calls") or []
        if role != "assistant" or m.get("content") or not calls:
            part = "output_text" if role == "assistant" else "input_text"
            items.append({"type": "message", "role": role, "content": [{"type": part, "text": m.get("content") or ""}]})
        items += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                   "arguments": c["function"]["arguments"]} for c in calls]
    return items


class ResponsesAccumulator(StreamAccumulator):
    """The Responses API's event stream: text and call-argument deltas, the usage and status of the
    final response event; `response_id` from the first event that carries the response."""

    def __init__(self, t_send: float) -> None:
        super().__init__(t_send)
        self.response_id: str | None = None

    def feed(self, line: str, now: float) -> None:
        ev = sse_data(line)
        if ev is None:
            return
        kind = ev.get("type")
        if kind == "error":
            raise ReplayError(f"error event: {ev.get('message') or ev.get('error') or ev}")
        resp = ev.get("response")
        if isinstance(resp, dict) and resp.get("id"):
            self.response_id = resp["id"]
        if kind in ("response.output_text.delta", "response.function_call_arguments.delta",
                    "response.custom_tool_call_input.delta"):
            piece = ev.get("delta") or ""
            if piece:
                self.carried(now)
                if kind == "response.output_text.delta":
                    self.parts.append(piece)
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            self.usage = resp.get("usage") or {}
            self.done = True
            details = resp.get("incomplete_details") or {}
            self.finish_reason = details.get("reason") or resp.get("status")
            if kind == "response.failed":
                raise error_event(resp.get("error") or {})

    @staticmethod
    def tokens(u: dict) -> tuple[int, int, int]:
        return (int(u.get("input_tokens") or 0), int((u.get("input_tokens_details") or {}).get("cached_tokens") or 0),
                int(u.get("output_tokens") or 0))


class ResponsesWire(Wire):
    name = "responses"
    path = "/v1/responses"
    stream_type = ResponsesAccumulator

    def request(self, model: str, messages: list[dict], pid: str, max_tokens: int, *, stream: bool,
                ignore_eos: bool, end: bool) -> Request:
        instructions, items = responses_input(messages)
        body: dict[str, Any] = {"model": model, "input": items, "max_output_tokens": max_tokens, "temperature": 0,
                                "stream": stream, "store": False, "prompt_cache_key": pid}
        return Request(self.path, self._common(body, instructions, ignore_eos, end), {})

    @classmethod
    def _common(cls, body: dict[str, Any], instructions: str | None, ignore_eos: bool, end: bool) -> dict[str, Any]:
        if instructions is not None:
            body["instructions"] = instructions
        return cls._extensions(body, ignore_eos, end)


@dataclass
class _Chain:
    response_id: str  # the last answered response
    first_id: str  # the chain's first response: the program's name on the server
    messages: list[dict]  # the conversation the chain holds (the replay's own list, compared by identity)
    held: int  # how many of its messages the server has stored (the answered turn's reply included)


class ResponsesChainWire(ResponsesWire):
    """The Responses API with the server's store: turn 2+ sends only the messages after the last
    answered turn, with `previous_response_id`. A conversation that restarts (a compaction) starts
    a new chain. Tool results must be user messages (the synthetic calls of `--tool-role tool`
    are not in the model's stored output)."""

    name = "responses-chain"

    def __init__(self, api_key: str | None = None) -> None:
        super().__init__(api_key)
        self.chains: dict[str, _Chain] = {}
        self._sent: dict[str, tuple[list[dict], int]] = {}  # pid -> the conversation and its length, as sent

    def request(self, model: str, messages: list[dict], pid: str, max_tokens: int, *, stream: bool,
                ignore_eos: bool, end: bool) -> Request:
        chain = self.chains.get(pid)
        instructions, _ = responses_input(messages)
        body: dict[str, Any] = {"model": model, "max_output_tokens": max_tokens, "temperature": 0,
                                "stream": stream, "store": True}
        if chain is not None and chain.messages is messages:
            body["previous_response_id"] = chain.response_id
            body["input"] = response_items(messages[chain.held:])
        else:
            body["input"] = responses_input(messages)[1]
        self._sent[pid] = (messages, len(messages))
        return Request(self.path, self._common(body, instructions, ignore_eos, end), {})

    def answered(self, pid: str, messages: list[dict], acc: StreamAccumulator) -> None:
        sent, n = self._sent.pop(pid, (None, 0))
        rid = getattr(acc, "response_id", None)
        if sent is not messages or rid is None:
            self.chains.pop(pid, None)
            return
        chain = self.chains.get(pid)
        first = chain.first_id if chain is not None and chain.messages is messages else rid
        self.chains[pid] = _Chain(rid, first, messages, n + 1)  # + the reply, which the server stored

    def program(self, pid: str) -> str:
        chain = self.chains.get(pid)
        return chain.first_id if chain is not None else pid

    def probe(self) -> Wire:
        return ResponsesWire(self.api_key)


# --- the Messages API -------------------------------------------------------------------


def anthropic_messages(messages: list[dict]) -> tuple[str | None, list[dict]]:
    """(system, messages) of a chat conversation in Anthropic's shape: the leading system message
    apart, calls as tool_use blocks, results as tool_result blocks of one user message per group
    (another system message, which Anthropic's messages cannot hold, as user text)."""
    system = None
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    out: list[dict] = []
    for m in messages:
        role = m["role"]
        if role == "tool":
            result = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
            last = out[-1] if out else None
            if last is not None and last["role"] == "user" and isinstance(last["content"], list) and \
                    all(b["type"] == "tool_result" for b in last["content"]):
                last["content"].append(result)
            else:
                out.append({"role": "user", "content": [result]})
        elif role == "assistant" and m.get("tool_calls"):
            blocks: list[dict] = [{"type": "text", "text": m["content"]}] if m.get("content") else []
            blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                        "input": json.loads(c["function"]["arguments"] or "{}")} for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": blocks})
        else:
            out.append({"role": "assistant" if role == "assistant" else "user", "content": m.get("content") or ""})
    return system, out


class MessagesAccumulator(StreamAccumulator):
    """The Messages API's event stream: text and tool-input deltas; the usage of message_start,
    updated by message_delta's (which has the final split between cache reads and the rest)."""

    def feed(self, line: str, now: float) -> None:
        ev = sse_data(line)
        if ev is None:
            return
        kind = ev.get("type")
        if kind == "error":
            raise error_event(ev.get("error") or {})
        if kind == "message_start":
            self.usage = dict((ev.get("message") or {}).get("usage") or {})
        elif kind == "content_block_delta":
            delta = ev.get("delta") or {}
            piece = delta.get("text") if delta.get("type") == "text_delta" else delta.get("partial_json")
            if piece:
                self.carried(now)
                if delta.get("type") == "text_delta":
                    self.parts.append(piece)
        elif kind == "message_delta":
            self.usage.update({k: v for k, v in (ev.get("usage") or {}).items() if v is not None})
            self.finish_reason = (ev.get("delta") or {}).get("stop_reason")
        elif kind == "message_stop":
            self.done = True

    @staticmethod
    def tokens(u: dict) -> tuple[int, int, int]:
        read = int(u.get("cache_read_input_tokens") or 0)
        prompt = int(u.get("input_tokens") or 0) + read + int(u.get("cache_creation_input_tokens") or 0)
        return prompt, read, int(u.get("output_tokens") or 0)


class MessagesWire(Wire):
    name = "messages"
    path = "/v1/messages"
    stream_type = MessagesAccumulator

    def request(self, model: str, messages: list[dict], pid: str, max_tokens: int, *, stream: bool,
                ignore_eos: bool, end: bool) -> Request:
        system, msgs = anthropic_messages(messages)
        body: dict[str, Any] = {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0,
                                "stream": stream}
        if system is not None:
            body["system"] = system
        self._extensions(body, ignore_eos, False)  # the program's end goes in a header
        headers = {"x-claude-code-session-id": pid, "anthropic-version": ANTHROPIC_VERSION}
        if self.api_key:
            headers["x-api-key"] = self.api_key
        if end:
            headers["X-Program-End"] = "1"
        return Request(self.path, body, headers)


def wire(api: str, api_key: str | None = None) -> Wire:
    """The Wire of `api` (one of API_NAMES)."""
    kinds = {"chat": Wire, "responses": ResponsesWire, "responses-chain": ResponsesChainWire,
             "messages": MessagesWire}
    if api not in kinds:
        raise ValueError(f"unknown API {api!r}: one of {', '.join(API_NAMES)}")
    return kinds[api](api_key)
