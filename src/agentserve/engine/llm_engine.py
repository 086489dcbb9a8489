"""The step loop over a scheduler and an executor, with output processing:
incremental detokenization, stop strings, stop tokens and finish reasons, and
a request's streaming tool-call validator (SamplingParams.tool_validator), fed
every token's text, which may end the request at the close of a tool call.

Text that might be the start of a stop string is held back from the stream
until it is known not to be one, so a streaming client never sees a stop
string or a piece of one. The decoded text is also handed to the request
(`output_text`) before the scheduler finishes it, which is how the policy's
tool-call parser learns which tool the turn calls.

The engine keeps no map of its own: a request's output state lives on the
request (`Request.output_state`), found through the scheduler's one registry. A
`RequestOutput` carries what is new since the last one; the whole output
(`token_ids`, `text`) only on the finishing one, so a long answer costs each
step its new tokens, not a copy of everything so far."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentserve.clock import Clock
from agentserve.engine.executor import Executor
from agentserve.engine.request import Request, RequestStatus
from agentserve.engine.sampling_params import SamplingParams
from agentserve.engine.scheduler import Scheduler

log = logging.getLogger("agentserve.engine")

COPY_WAIT_S = 0.05  # an idle step waits this long at most for a copy to land

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str: ...


@dataclass
class RequestOutput:
    request_id: str
    program_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]  # the whole output on the finishing output; empty before
    text: str  # likewise
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort"
    stop_reason: str | int | None  # the stop string or stop token that ended it
    num_prompt_tokens: int
    num_cached_tokens: int
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    queue_time: float
    # the engine's record of the request (the server's own bookkeeping reads it)
    request: Request | None = field(default=None, repr=False, compare=False)


@dataclass
class _Tracked:
    params: SamplingParams
    detok: Detokenizer
    text: str = ""
    emitted_chars: int = 0
    emitted_tokens: int = 0
    stop_reason: str | int | None = None
    max_stop: int = field(init=False)
    validator: Any = field(init=False)  # params.tool_validator until it proves inconsistent

    def __post_init__(self) -> None:
        self.max_stop = max((len(s) for s in self.params.stop), default=0)
        self.validator = self.params.tool_validator


class KVShare(Protocol):
    """KV that other servers share (runner/shared_kv.py): looked up as a request
    arrives, written through as turns end."""

    def before_add(self, req: Request) -> None: ...

    def after_turns(self, reqs: list[Request]) -> None: ...


class LLMEngine:
    def __init__(self, scheduler: Scheduler, executor: Executor, clock: Clock,
                 detokenizer: Callable[[], Detokenizer], eos_token_ids: Iterable[int] = ()) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock
        self.new_detokenizer = detokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._ids = itertools.count()
        scheduler.token_hook = self._on_token
        self.kv_share: KVShare | None = None

    # --- requests in ---

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                    program_id: str | None = None, ttl_hint: float | None = None,
                    is_last_turn: bool = False, arrival_time: float | None = None,
                    cache_salt: Hashable = None) -> Request:
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.scheduler.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        eos = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        req = Request(rid, program_id if program_id is not None else rid, prompt_token_ids,
                      params.max_tokens, arrival_time=self.clock.now() if arrival_time is None else arrival_time,
                      eos_token_ids=eos, is_last_turn=is_last_turn, ttl_hint=ttl_hint, sampling=params,
                      anonymous=program_id is None, cache_salt=cache_salt)
        req.output_state = _Tracked(params, self.new_detokenizer())
        if self.kv_share is not None:
            self.kv_share.before_add(req)
        self.scheduler.add_request(req)  # raises ValueError for a request that can never fit
        return req

    def get(self, request_id: str) -> Request | None:
        """An unfinished request."""
        return self.scheduler.requests.get(request_id)

    def abort(self, request_id: str) -> bool:
        if self.scheduler.abort(request_id) is None:
            return False
        self.executor.release(request_id)
        return True

    @property
    def has_unfinished(self) -> bool:
        return bool(self.scheduler.requests)

    @property
    def num_unfinished(self) -> int:
        return len(self.scheduler.requests)

    # --- the step ---

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler
        if sched.copies_in_flight:  # copies an overlapping executor finished since the last step
            sched.copies_done(self.executor.poll_copies())
        out = sched.schedule()
        if out.is_empty:
            if sched.copies_in_flight:  # nothing to compute until a copy lands: wait for one
                sched.copies_done(self.executor.poll_copies(wait=COPY_WAIT_S))
            return []
        try:
            result = self.executor.execute(out)
        except BaseException:
            self.scheduler.copies_lost(out)  # the step's copies cannot be trusted; its requests fail with it
            raise
        self.scheduler.update(out, result)
        outputs = []
        for ch in out.chunks:
            req = ch.request
            t = req.output_state
            if t is None or not ch.sample or req.status is RequestStatus.FINISHED_ABORTED:
                continue
            o = self._output(req, t)
            if o is not None:
                outputs.append(o)
        if self.kv_share is not None:
            ended = [o.request for o in outputs if o.finished and o.finish_reason != "abort"]
            if ended:
                self.kv_share.after_turns(ended)
        return outputs

    def _on_token(self, req: Request, token_id: int) -> RequestStatus | None:
        """Called by the scheduler for each new token, before it decides whether the request ends."""
        t = req.output_state
        if t is None:
            return None
        if token_id in req.eos_token_ids:
            t.stop_reason = token_id if token_id in t.params.stop_token_ids else None
            return None  # the scheduler ends it; the stop token adds no text
        piece = t.detok.push(token_id)
        if piece:
            t.text += piece
            if t.max_stop:
                hit = self._find_stop(t, len(piece))
                if hit is not None:
                    req.output_text = t.text
                    return RequestStatus.FINISHED_STOPPED
        if t.validator is not None and self._validate(req, t, piece):
            req.output_text = t.text
            return RequestStatus.FINISHED_STOPPED
        req.output_text = t.text
        return None

    def _validate(self, req: Request, t: _Tracked, piece: str) -> bool:
        """Feed the tool-call validator; True: it ended the request at a call's close, and the
        text is cut there (the tokens stay, as for a stop string). A validator that fails, or
        asks for a cut in text already streamed, is dropped: the request decodes plainly."""
        v = t.validator
        try:
            if not v.feed(piece):
                return False
            keep = v.keep
            if not t.emitted_chars <= keep <= len(t.text):
                raise ValueError(f"a cut at {keep} outside the unstreamed text {t.emitted_chars}..{len(t.text)}")
        except Exception as e:
            t.validator = None
            log.warning("request %s: tool-call validator dropped (%s); it decodes plainly", req.request_id, e)
            with contextlib.suppress(Exception):
                v.fail(str(e))
            return False
        t.text = t.text[:keep]
        return True

    def _find_stop(self, t: _Tracked, added: int) -> str | None:
        window_start = max(0, len(t.text) - added - t.max_stop + 1)
        best = None
        for s in t.params.stop:
            i = t.text.find(s, window_start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        t.text = t.text[:best[0]]
        t.stop_reason = best[1]
        return best[1]

    def _output(self, req: Request, t: _Tracked) -> RequestOutput | None:
        finished = req.is_finished
        new_tokens = req.output_token_ids[t.emitted_tokens:]
        if not new_tokens and not finished:
            return None
        t.emitted_tokens = req.num_output_tokens
        if finished:
            visible = len(t.text)
        else:
            held = _held_back(t.text, t.params.stop)
            if t.validator is not None:  # text a validator stop may still cut
                held = max(held, _validator_hold(t.validator))
            visible = len(t.text) - held
        visible = max(visible, t.emitted_chars)
        new_text = t.text[t.emitted_chars:visible]
        t.emitted_chars = visible
        if finished:
            self.executor.release(req.request_id)
        return RequestOutput(
            request_id=req.request_id, program_id=req.program_id, new_token_ids=new_tokens, new_text=new_text,
            token_ids=list(req.output_token_ids) if finished else [], text=t.text if finished else "",
            finished=finished,
            finish_reason=FINISH_REASONS.get(req.status) if finished else None,
            stop_reason=t.stop_reason if finished else None,
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=max(req.num_cached_tokens, 0),
            arrival_time=req.arrival_time, first_token_time=req.first_token_time,
            finish_time=req.finish_time, queue_time=req.queue_time, request=req)


def _validator_hold(v: Any) -> int:
    try:
        return max(int(v.hold), 0)
    except Exception:  # a broken validator holds nothing back; its next feed drops it
        return 0


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
