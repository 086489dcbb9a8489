"""OpenAI's Responses API: POST /v1/responses, GET and DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items.

A request is translated into the chat request chat_run.py runs
(responses_translate.py): the stored chain of `previous_response_id` plus the
new input is the conversation, and the reply is formatted as output
items (responses_reply.py), whole or as the API's named server-sent events (with increasing
`sequence_number`s, ending in `response.completed`, `response.incomplete` or
`response.failed`, never chat's `[DONE]`).

The chain is the program: a response that continues another is scheduled as
the program of the one it continues, and a stored response that continues
none, sent without any other identity (identity.py's table), is the program
named by its own id. So retention, TTL and program order apply to an agent
that sends no header.

`generate: false` (Codex's prewarm; `prompt_cache_options.prewarm` is
OpenAI's spelling) is a prefill without output: the engine has no
prefill-only request, so it runs with max_tokens 1 and the token is dropped
(usage says 0 output tokens); the answer is a completed response with empty
output, stored like any other, and its KV is the program's first turn, kept
as the policy keeps any turn's.

`truncation: "auto"` drops the oldest turns (from a user message on, never
the instructions or the leading system/developer messages, never a call
without its output) until the prompt and `max_output_tokens` fit the
context; with "disabled" (the default) a conversation that does not fit is a
400 naming the model's context."""

from __future__ import annotations

import logging

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentserve.server.api_errors import APIError
from agentserve.server.chat_run import PromptNames, render_chat, start_chat, whole_reply
from agentserve.server.identity import ProgramIdentity
from agentserve.server.input_checks import InputError, check_path_id
from agentserve.server.protocol import ChatCompletionRequest
from agentserve.server.request_checks import (authorize, check_model, input_error, program_identity, read_json,
                                              reject, tenant_scope, validate_body)
from agentserve.server.request_run import EventStream
from agentserve.server.responses_protocol import InputItemList, ResponseDeleted, ResponsesRequest
from agentserve.server.responses_reply import (ResponseJob, output_items, reply_status, response_events,
                                               responses_store)
from agentserve.server.responses_store import ResponseNotFound, ResponsesStore, StoredResponse
from agentserve.server.responses_translate import (chat_messages, chat_request, chat_tool_choice, chat_tools,
                                                   droppable_starts, input_items, new_id, without_turns)
from agentserve.server.server_state import ServerState, server_state

log = logging.getLogger("agentserve.server")

NAMES = PromptNames(prompt="input", max_tokens="max_output_tokens")


# --- POST /v1/responses -----------------------------------------------------------------


async def create_response(request: Request) -> Response:
    st = server_state(request)
    authorize(st, request)
    req: ResponsesRequest = validate_body(ResponsesRequest, await read_json(st, request))
    model = check_model(st, req.model)
    _refuse_unserved(req)
    if req.reasoning is not None and "responses.reasoning" not in st.warned:
        st.warned.add("responses.reasoning")
        log.info("a Responses request set `reasoning`: accepted and ignored (this server's models do not "
                 "reason apart from their output); logged once")
    scope = tenant_scope(st, request)
    store = responses_store(st)
    prev = None
    if req.previous_response_id is not None:
        try:
            prev = store.continue_from(scope, req.previous_response_id)
        except ResponseNotFound:
            raise APIError(404, f"previous response with id '{req.previous_response_id}' not found: it was never "
                                "stored (store: false), or it was deleted, or it was evicted from this server's "
                                "store (kept in memory only, the least recently used beyond --responses-store-max "
                                "are dropped); send the whole conversation as input instead",
                           param="previous_response_id", code="previous_response_not_found") from None
    rid = new_id("resp")
    new_items = input_items(req)
    history = prev.conversation() if prev is not None else []
    if not new_items and not history and req.instructions is None:
        raise APIError(400, "input: the request has nothing to answer: send `input` (a string or items), or "
                            "`previous_response_id`", param="input")
    tools, offered = chat_tools(req.tools, st.warned)
    choice = chat_tool_choice(req.tool_choice, offered)
    if req.prewarm:
        choice = "none"  # the tools are rendered (they are part of the prefix); nothing is decoded
    messages = chat_messages(req.instructions, history, new_items, req.previous_response_id)
    chat = chat_request(req, messages, tools, choice)
    ident = _identity(req, request, prev, rid)
    if req.truncation == "auto":
        chat = await _fit(st, chat, ident, req.max_output_tokens or 1)
    try:
        run = await start_chat(st, request, chat, rid, ident, NAMES,
                               max_tokens=1 if req.prewarm else req.max_output_tokens)
    except APIError as e:
        if e.code == "context_length_exceeded" and prev is not None:
            raise APIError(e.status, f"{e.message} (the prompt is the conversation of previous_response_id "
                                     f"'{prev.id}' and this input; send truncation: 'auto' to drop its oldest "
                                     "turns)", e.type, e.param, e.code) from None
        raise
    job = ResponseJob(st, req, model, rid, prev, new_items, offered, ident, scope)
    if req.stream:
        return EventStream(response_events(job, run), run.stream, done=False)
    reply = await whole_reply(run, request)
    if reply is None:
        return Response(status_code=499)  # nobody is listening
    output = [] if req.prewarm else output_items(reply.content, reply.calls, offered, reply_status(reply.out))
    body = job.finish(output, reply.out)
    return JSONResponse(body)


def _refuse_unserved(req: ResponsesRequest) -> None:
    reject(bool(req.background), "background responses are not supported: send the request and wait for it (or "
                                 "stream it)", "background")
    reject(req.conversation is not None, "conversation (the Conversations API) is not supported: chain responses "
                                         "with previous_response_id, or send the whole conversation as input",
           "conversation")
    reject(req.prompt is not None, "prompt templates are not supported: send instructions and input", "prompt")
    reject(bool(req.top_logprobs), "logprobs are not supported", "top_logprobs")


def _identity(req: ResponsesRequest, request: Request, prev: StoredResponse | None, rid: str) -> ProgramIdentity:
    """The program: the chain's (`prev`'s), or what the request names (identity.py's order), or, for a
    response that is stored and continues none, its own id."""
    ident = program_identity(req, request, chain=prev.program if prev is not None else None)
    if not ident.explicit and prev is None and req.stores:
        ident = program_identity(req, request, chain=rid)
    return ident


async def _fit(st: ServerState, chat: ChatCompletionRequest, ident: ProgramIdentity,
               reserve: int) -> ChatCompletionRequest:
    """`chat` without its oldest turns, as few as leave the context room for `reserve` tokens."""
    limit = st.llm.max_model_len
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]

    def starting_at(start: int) -> ChatCompletionRequest:
        kept = ChatCompletionRequest.model_validate({"messages": without_turns(messages, start)}).messages
        return chat.model_copy(update={"messages": kept})

    def fits(start: int | None) -> bool:
        trial = chat if start is None else starting_at(start)
        return len(render_chat(st, trial, ident.cache_salt, NAMES.prompt)) + reserve <= limit

    if await run_in_threadpool(fits, None):
        return chat
    starts = droppable_starts(messages)
    if not starts:
        return chat  # nothing can go: the context error says what does not fit
    lo, hi = 0, len(starts) - 1  # find the earliest start that fits (the latest is the last resort)
    while lo < hi:
        mid = (lo + hi) // 2
        if await run_in_threadpool(fits, starts[mid]):
            hi = mid
        else:
            lo = mid + 1
    log.debug("truncation auto: the conversation starts at message %d of %d", starts[lo], len(messages))
    return starting_at(starts[lo])


def _stored(request: Request) -> tuple[ResponsesStore, str | None, str]:
    st = server_state(request)
    authorize(st, request)
    rid = request.path_params["response_id"]
    try:
        check_path_id(rid, "response_id")
    except InputError as e:
        raise input_error(e) from None
    return responses_store(st), tenant_scope(st, request), rid


def _not_found(rid: str) -> APIError:
    return APIError(404, f"response with id '{rid}' not found (never stored, deleted, or evicted from this "
                         "server's in-memory store)", param="response_id", code="response_not_found")


async def get_response(request: Request) -> Response:
    store, scope, rid = _stored(request)
    try:
        return JSONResponse(store.get(scope, rid).body)
    except ResponseNotFound:
        raise _not_found(rid) from None


async def delete_response(request: Request) -> Response:
    store, scope, rid = _stored(request)
    if not store.delete(scope, rid):
        raise _not_found(rid)
    return JSONResponse(ResponseDeleted(id=rid).model_dump())


async def list_input_items(request: Request) -> Response:
    store, scope, rid = _stored(request)
    q = request.query_params
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
    raw = q.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= 100:
        raise APIError(400, f"limit must be an integer from 1 to 100, got {raw!r}", param="limit")
    limit = int(raw)
    try:
        e = store.get(scope, rid)
    except ResponseNotFound:
        raise _not_found(rid) from None
    items = (e.previous.conversation() if e.previous is not None else []) + e.input_items
    if order == "desc":
        items = items[::-1]
    for cursor in ("after", "before"):
        at = q.get(cursor)
        if at is None:
            continue
        k = next((i for i, it in enumerate(items) if it.get("id") == at), None)
        if k is None:
            raise APIError(400, f"{cursor}: no input item of response '{rid}' has the id {at!r}", param=cursor)
        items = items[k + 1:] if cursor == "after" else items[:k]
    page = items[:limit]
    body = InputItemList(data=page, first_id=page[0]["id"] if page else None,
                         last_id=page[-1]["id"] if page else None, has_more=len(items) > limit)
    return JSONResponse(body.model_dump())

