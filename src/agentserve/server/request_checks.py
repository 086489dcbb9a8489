"""The checks a request passes before it reaches the engine: API key, body
size and JSON, valid Unicode text throughout, the body's schema (strict
types, OpenAI's ranges), the model name, unsupported fields, the program
identity, and sampling values and lengths as OpenAI checks them (prompt +
completion within the context). Each failure is an `APIError`.

The body is parsed by hand rather than by FastAPI's dependency injection: the
error replies must be OpenAI's 400s, not FastAPI's 422s, and the body limit
must hold before anything is parsed."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from agentserve.engine.sampling_params import SamplingParams
from agentserve.server.api_errors import APIError
from agentserve.server.identity import IdentityError, ProgramIdentity, resolve_identity
from agentserve.server.input_checks import InputError, check_id_headers, check_text, error_text, param_of
from agentserve.server.server_state import ServerState, server_state


def authorize(st: ServerState, request: Request) -> str | None:
    """The request's tenant (None when the server takes no key); a 401 without a valid key.
    The key is read from `Authorization: Bearer` (OpenAI's clients, Claude Code's ANTHROPIC_AUTH_TOKEN)
    or `x-api-key` (Anthropic's clients, Claude Code's ANTHROPIC_API_KEY), on every path."""
    tenants = st.config.tenants
    if not tenants.enabled:
        return None
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    sent = [k for k in (token.strip() if scheme.lower() == "bearer" else "",
                        request.headers.get("x-api-key", "").strip()) if k]
    if not sent:
        raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                       code="invalid_api_key")
    tenant = next((t for t in map(tenants.authenticate, sent) if t is not None), None)
    if tenant is None:
        raise APIError(401, "incorrect API key provided", code="invalid_api_key")
    request.state.tenant = tenant
    return tenant


def tenant_scope(st: ServerState, request: Request) -> str | None:
    """What the request's program ids and cache salt are scoped by (tenants.py); after `authorize`."""
    return st.config.tenants.scope(getattr(request.state, "tenant", None))


async def read_json(st: ServerState, request: Request) -> dict:
    limit = st.config.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {declared} bytes; the limit is {limit} (--max-body-bytes)",
                       code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the request body exceeds {limit} bytes (--max-body-bytes)",
                           code="request_too_large")
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(obj, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        check_text(obj)
    except InputError as e:
        raise input_error(e) from None
    return obj


def input_error(e: InputError) -> APIError:
    return APIError(400, str(e), param=e.param)


def validate_body(model: type[BaseModel], obj: dict) -> Any:
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        # the deepest error is the most specific one: for a value that matches no
        # branch of a union, the branch the client meant is the one it got furthest in
        first = max(errs, key=lambda err: len(err["loc"]))
        param = param_of(first["loc"])
        more = f" (and {len(errs) - 1} more problems)" if len(errs) > 1 else ""
        raise APIError(400, f"{param or 'body'}: {error_text(first['msg'])}{more}", param=param or None) from None


def check_model(st: ServerState, name: str | None, hint: str = "") -> str:
    """The reported model name; a 404 naming the served ones for another (`hint`: appended to its message)."""
    if name is not None and name not in st.config.served_model_names:
        raise APIError(404, f"the model `{name}` does not exist; this server serves "
                            f"{', '.join(st.config.served_model_names)}{hint}", param="model", code="model_not_found")
    return st.model_name


def reject(cond: bool, message: str, param: str) -> None:
    if cond:
        raise APIError(400, message, param=param, code="unsupported_parameter")


def check_common(req: Any) -> None:
    reject(req.n is not None and req.n != 1, f"n={req.n}: only n=1 is supported", "n")
    reject(bool(req.presence_penalty), "presence_penalty is not supported (send 0 or leave it out)",
           "presence_penalty")
    reject(bool(req.frequency_penalty), "frequency_penalty is not supported (send 0 or leave it out)",
           "frequency_penalty")
    reject(bool(req.logit_bias), "logit_bias is not supported", "logit_bias")


async def accept(request: Request, body_model: type[BaseModel]) -> tuple[ServerState, Any, str]:
    """The checks every generation endpoint makes first: key, body, model, shared fields."""
    st = server_state(request)
    authorize(st, request)
    req = validate_body(body_model, await read_json(st, request))
    model = check_model(st, req.model)
    check_common(req)
    return st, req, model


def program_identity(req: Any, request: Request, **hints: Any) -> ProgramIdentity:
    """The request's program (identity.py); `hints`: resolve_identity's keywords (`chain`, `cache_ttl`)."""
    try:
        check_id_headers(request.headers)
        return resolve_identity(req, request.headers, tenant_scope(server_state(request), request), **hints)
    except InputError as e:
        raise input_error(e) from None
    except IdentityError as e:
        raise APIError(400, str(e), param=e.param) from None


def sampling_params(st: ServerState, req: Any, num_prompt: int, max_tokens: int | None, prompt_param: str,
                    max_param: str, *, clamp: bool = False) -> SamplingParams:
    """Sampling parameters, with the length checks OpenAI makes (prompt + completion within context).
    `clamp`: a `max_tokens` beyond the room the context leaves is cut to that room instead of refused
    (Anthropic's newer models answer so, with stop_reason model_context_window_exceeded)."""
    limit = st.llm.max_model_len
    if num_prompt >= limit:
        raise APIError(400, f"this model's maximum context length is {limit} tokens ({st.model_name}), but the "
                            f"prompt is {num_prompt} tokens; shorten the {prompt_param}, or serve a model whose "
                            f"context holds at least {_room_for(num_prompt)} tokens (agentserve serve --model ...)",
                       param=prompt_param, code="context_length_exceeded")
    kv = st.llm.scheduler.kv
    room = limit - num_prompt
    if max_tokens is None:
        max_tokens = min(room, kv.num_blocks * kv.block_size - num_prompt)
        if max_tokens < 1:
            raise APIError(400, f"the prompt of {num_prompt} tokens does not fit the KV cache "
                                f"({kv.num_blocks * kv.block_size} tokens)", param=prompt_param,
                           code="context_length_exceeded")
    elif max_tokens > room and clamp:
        max_tokens = room
    elif max_tokens > room:
        raise APIError(400, f"this model's maximum context length is {limit} tokens, but {num_prompt + max_tokens} "
                            f"were requested ({num_prompt} in the {prompt_param}, {max_tokens} in the completion); "
                            f"reduce the {prompt_param} or {max_param}", param=max_param,
                       code="context_length_exceeded")
    vocab = st.llm.config.vocab_size
    bad = [t for t in req.stop_token_ids or () if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"stop_token_ids: {bad[0]} is not a token id (vocabulary of {vocab})",
                       param="stop_token_ids")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, seed=req.seed,
                              stop=req.stop or [], stop_token_ids=list(req.stop_token_ids or ()),
                              ignore_eos=req.ignore_eos)
    except ValueError as e:
        msg = str(e)
        param = next((f for f in _SAMPLING_FIELDS if f in msg), None)
        raise APIError(400, msg, param=max_param if param == "max_tokens" else param) from None


def _room_for(num_prompt: int) -> int:
    """The next power of two that holds the prompt and a reply of 1024 tokens: the context to ask for."""
    need = num_prompt + 1024
    return 1 << (need - 1).bit_length()


_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "stop")  # named in SamplingParams' errors
