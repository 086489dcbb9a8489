"""The server's side of the streaming tool-call validator (policy/toolcall_stream.py): which
requests get one, and the constrained re-generation of a call that names an undeclared tool.

A chat request that declares tools (tool_choice not "none") gets a validator that follows
Hermes and Llama 3 calls (Hermes only under a JSON response_format, whose answer is bare JSON),
checks names against the request's tools and verifies every stop with the server's own output parser (tool_output.py), so a stopped response always parses to
exactly the calls the validator closed. With `bash_blocks`, a chat request without tools gets
one that ends the turn after its first complete ```bash block (mini-swe-agent's format).

`undeclared="regenerate"`: a call naming an undeclared tool (before any valid call) ends the
request with the text cut where the call began; `RegeneratingStream` then submits a second
request to the same program: the first request's prompt and output tokens up to the call,
decoded under the tools' xgrammar grammar (as for tool_choice "required"), so the reply goes on
with one valid call. The client sees one response: the first request's text, then the second's;
usage counts both requests' output tokens. If the re-generation cannot be made (no xgrammar, a
full queue, a schema the grammar cannot use), the reply is the text before the call, finish
reason "stop": the undeclared call still never reaches the client."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from agentserve.engine.llm_engine import RequestOutput
from agentserve.engine.sampling_params import SamplingParams
from agentserve.policy.toolcall_stream import GRACE_TOKENS, ToolCallValidator, ValidatorStats
from agentserve.server.tool_output import ToolChoice, parse_tool_output

log = logging.getLogger("agentserve.server")

UNDECLARED_MODES = ("text", "regenerate")


@dataclass(frozen=True)
class ValidatorConfig:
    early_stop: bool = True  # end a request at the structural close of its tool call(s)
    grace_tokens: int = GRACE_TOKENS  # blank tokens after a call that may precede a parallel call
    undeclared: str = "text"  # a call of an undeclared tool: "text" (content) or "regenerate"
    bash_blocks: bool = False  # requests without tools: end the turn after its first ```bash block

    def __post_init__(self) -> None:
        if self.undeclared not in UNDECLARED_MODES:
            raise ValueError(f"undeclared must be one of {', '.join(UNDECLARED_MODES)}, got {self.undeclared!r}")
        if self.grace_tokens < 0:
            raise ValueError(f"grace_tokens must be >= 0, got {self.grace_tokens}")


def with_validator(config: ValidatorConfig, stats: ValidatorStats | None, choice: ToolChoice | None,
                   params: SamplingParams) -> SamplingParams:
    """`params` with a fresh validator for this request, or unchanged when none applies."""
    regenerate = config.undeclared == "regenerate"
    if choice is None:
        if not (config.bash_blocks and config.early_stop):
            return params
        v = ToolCallValidator(None, formats=("bash",), max_tokens=params.max_tokens, stats=stats)
    else:
        if not (config.early_stop or regenerate):
            return params
        v = ToolCallValidator(choice.allowed, formats=("hermes", "llama3") if choice.bare_json else ("hermes",),
                              parallel=choice.parallel,
                              grace_tokens=config.grace_tokens, early_stop=config.early_stop,
                              stop_on_undeclared=regenerate, max_tokens=params.max_tokens,
                              verify=lambda text: len(parse_tool_output(text, choice)[1]), stats=stats)
    return dataclasses.replace(params, tool_validator=v)


Submit = Callable[[list[int], SamplingParams], Awaitable[Any]]  # -> a RequestStream
Constrain = Callable[[SamplingParams], Awaitable[SamplingParams]]  # -> params with the grammar, or unchanged


class RegeneratingStream:
    """A chat request's outputs (like a RequestStream: iterate, then `close()`), which re-generate
    a call its validator stopped as undeclared. Every other output passes through unchanged."""

    def __init__(self, first: Any, prompt_ids: list[int], params: SamplingParams, submit: Submit,
                 constrain: Constrain, stats: ValidatorStats | None) -> None:
        self._first = first
        self._second: Any = None
        self._prompt_ids = prompt_ids
        self._params = params
        self._submit = submit
        self._constrain = constrain
        self._stats = stats

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    def close(self) -> None:
        self._first.close()
        if self._second is not None:
            self._second.close()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        v = self._params.tool_validator
        async for out in self._first:
            if not (out.finished and v is not None and v.stop_reason == "undeclared" and v.rejected_at):
                yield out
                continue
            second = await self._start_second(out, v.rejected_at[1])
            if second is None:
                yield out  # the text before the undeclared call, finish reason "stop"
                return
            self._second = second
            yield dataclasses.replace(out, finished=False, finish_reason=None, stop_reason=None, finish_time=None)
            async for o in second:
                yield dataclasses.replace(
                    o, request_id=out.request_id, token_ids=out.token_ids + o.token_ids if o.finished else [],
                    text=out.text + o.text if o.finished else "",
                    num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
                    arrival_time=out.arrival_time, first_token_time=out.first_token_time or o.first_token_time,
                    queue_time=out.queue_time + o.queue_time)
            return

    async def _start_second(self, out: RequestOutput, tokens_before: int) -> Any:
        """Submit the constrained continuation; None when it cannot be made (logged)."""
        p = self._params
        try:
            constrained = await self._constrain(dataclasses.replace(
                p, tool_validator=None, max_tokens=max(p.max_tokens - tokens_before, 1)))
            if constrained.constraint is None:
                raise RuntimeError("no grammar for the tools (is xgrammar installed?)")
            stream = await self._submit(self._prompt_ids + out.token_ids[:tokens_before], constrained)
        except Exception as e:
            log.warning("request %s: cannot re-generate an undeclared tool call (%s); replying with the text "
                        "before it", out.request_id, e)
            return None
        if self._stats is not None:
            self._stats.add(regenerations=1)
        return stream
