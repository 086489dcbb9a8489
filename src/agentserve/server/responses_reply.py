"""A Responses-API reply once the engine runs it: the response body with its
usage, stored when asked (`ResponseJob`), the output items of a whole reply,
and the reply as the API's named server-sent events (`response_events`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from itertools import count
from typing import Any

from agentserve.engine.llm_engine import RequestOutput
from agentserve.server.api_errors import engine_failure
from agentserve.server.chat_run import ChatRun, reply_deltas
from agentserve.server.identity import ProgramIdentity
from agentserve.server.request_run import sse
from agentserve.server.request_stream import EngineError, EngineStopped
from agentserve.server.responses_protocol import ResponsesRequest
from agentserve.server.responses_store import ResponsesStore, StoredResponse
from agentserve.server.responses_translate import OfferedTool, call_item, new_id
from agentserve.server.server_state import ServerState


def responses_store(st: ServerState) -> ResponsesStore:
    store = getattr(st, "responses_store", None)
    if store is None:  # (an app built without one, e.g. by a test: the defaults)
        store = st.responses_store = ResponsesStore()
    return store



class ResponseJob:
    """What a response needs once its reply is in: the body's fields and the store."""

    def __init__(self, st: ServerState, req: ResponsesRequest, model: str, rid: str, prev: StoredResponse | None,
                 new_items: list[dict[str, Any]], offered: dict[str, OfferedTool], ident: ProgramIdentity,
                 scope: str | None) -> None:
        self.st, self.req, self.model, self.rid, self.prev = st, req, model, rid, prev
        self.new_items, self.offered, self.ident, self.scope = new_items, offered, ident, scope
        self.created = int(time.time())

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        text = req.text.model_dump(exclude_none=True, by_alias=True) if req.text is not None else {}
        text.setdefault("format", {"type": "text"})
        tools = [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools or ()]
        tool_choice = req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else req.tool_choice
        return {
            "id": self.rid, "object": "response", "created_at": self.created,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "prompt_cache_key": req.prompt_cache_key,
            "reasoning": req.reasoning, "store": req.stores, "background": False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p, "text": text,
            "tool_choice": tool_choice or "auto", "tools": tools, "truncation": req.truncation or "disabled",
            "usage": usage, "user": req.user, "metadata": req.metadata or {},
        }

    def usage(self, out: RequestOutput) -> dict[str, Any]:
        exact = self.st.config.cached_tokens_report == "exact"  # "none": nothing told about the cache
        cached = out.num_cached_tokens if exact else 0
        written = out.num_prompt_tokens - out.num_cached_tokens if exact else 0  # computed now, cached from now on
        produced = 0 if self.req.prewarm else len(out.token_ids)
        return {"input_tokens": out.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
                "output_tokens": produced, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": out.num_prompt_tokens + produced}

    def finish(self, output: list[dict[str, Any]], out: RequestOutput) -> dict[str, Any]:
        """The finished response's body; stored when the request asked for it."""
        body = self.body("completed" if self.req.prewarm else reply_status(out), output, self.usage(out))
        if self.req.stores:
            responses_store(self.st).put(self.scope, StoredResponse(
                self.rid, body, self.new_items, output, self.prev, _client_program(self.ident, self.scope)))
        return body


def _client_program(ident: ProgramIdentity, scope: str | None) -> str | None:
    """The program id as the client named it (the engine's is prefixed by the tenant)."""
    pid = ident.program_id
    if pid is None or scope is None:
        return pid
    return pid[len(scope) + 1:]


def reply_status(out: RequestOutput) -> str:
    return "incomplete" if out.finish_reason == "length" else "completed"


def output_items(content: str | None, calls: list, offered: dict[str, OfferedTool], status: str) -> list[dict[str, Any]]:
    """The output items of a whole reply: its text as one message (first), then one item per call."""
    items = []
    if content is not None and (content or not calls):
        items.append(_message(new_id("msg"), content, status))
    items.extend(call_item(c, offered, "completed") for c in calls)
    return items


def _message(mid: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"id": mid, "type": "message", "role": "assistant", "status": status, "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


# --- streaming --------------------------------------------------------------------------


async def response_events(job: ResponseJob, run: ChatRun) -> AsyncIterator[str]:
    """The reply as the Responses API's events. The message item (when the reply has text)
    opens with its first text and stays open to the end; each call is an item of its own."""
    seq = count()

    def ev(kind: str, **fields: Any) -> str:
        return sse({"type": kind, "sequence_number": next(seq), **fields}, event=kind)

    started = job.body("in_progress", [])
    yield ev("response.created", response=started)
    yield ev("response.in_progress", response=started)
    items: list[dict[str, Any]] = []
    msg: dict[str, Any] | None = None
    text = ""
    final: RequestOutput | None = None

    def open_message() -> list[str]:
        nonlocal msg
        msg = _message(new_id("msg"), None, "in_progress")
        items.append(msg)
        i = len(items) - 1
        return [ev("response.output_item.added", output_index=i, item=dict(msg, content=[])),
                ev("response.content_part.added", output_index=i, item_id=msg["id"], content_index=0,
                   part=_text_part(""))]

    try:
        async for d in reply_deltas(run):
            if d.out.finished:
                final = d.out
            if job.req.prewarm:
                continue
            if d.content:
                if msg is None:
                    for e in open_message():
                        yield e
                text += d.content
                yield ev("response.output_text.delta", output_index=items.index(msg), item_id=msg["id"],
                         content_index=0, delta=d.content, logprobs=[])
            for call in d.calls:
                item = call_item(call, job.offered, "in_progress")
                i = len(items)
                items.append(item)
                custom = item["type"] == "custom_tool_call"
                field, kind = ("input", "response.custom_tool_call_input") if custom else (
                    "arguments", "response.function_call_arguments")
                whole = item[field]
                yield ev("response.output_item.added", output_index=i, item=dict(item, **{field: ""}))
                yield ev(f"{kind}.delta", output_index=i, item_id=item["id"], delta=whole)
                yield ev(f"{kind}.done", output_index=i, item_id=item["id"], **{field: whole},
                         **({} if custom else {"name": item["name"]}))
                item["status"] = "completed"
                yield ev("response.output_item.done", output_index=i, item=item)
    except (EngineError, EngineStopped) as e:
        err = engine_failure(e)
        yield ev("error", code=err.code, message=err.message, param=None)
        yield ev("response.failed", response=job.body("failed", items, error={"code": "server_error",
                                                                                "message": err.message}))
        return
    assert final is not None
    status = reply_status(final)
    if not job.req.prewarm and msg is None and not any(it["type"] != "message" for it in items):
        for e in open_message():  # an empty reply is an empty message, as the whole reply has it
            yield e
    if msg is not None:
        i = items.index(msg)
        part = _text_part(text)
        yield ev("response.output_text.done", output_index=i, item_id=msg["id"], content_index=0, text=text,
                 logprobs=[])
        yield ev("response.content_part.done", output_index=i, item_id=msg["id"], content_index=0, part=part)
        msg.update(status=status, content=[part])
        yield ev("response.output_item.done", output_index=i, item=msg)
    body = job.finish(items, final)
    yield ev("response.completed" if body["status"] == "completed" else "response.incomplete", response=body)


# --- the stored responses ---------------------------------------------------------------
