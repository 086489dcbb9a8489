"""Chat messages to prompt text with the model's own Jinja template.

Templates run in Jinja's immutable sandbox with the helpers Hugging Face
templates expect (`raise_exception`, `tojson`, `strftime_now`). A template
that never mentions tools (SmolLM2's ChatML is one) cannot show them to the
model, so for such a template the tools are rendered here in the Hermes style
other servers use: a `<tools>` block in the system message, past calls as
`<tool_call>{json}</tool_call>` in the assistant's text and tool results as
`<tool_response>` blocks. The model's calls come back in that same form,
which `policy/toolcalls.py` parses."""

from __future__ import annotations

import datetime
import json
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

HERMES_TOOLS_INTRO = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}"
    "\n</tool_call>"
)


class TemplateError(ValueError):
    """The messages cannot be rendered (a bad message, or the template raised)."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source or CHATML
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the model's chat template does not parse: {e}") from None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.supports_tools = "tools" in self.source

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True) -> str:
        msgs = [_normalize(m, i) for i, m in enumerate(messages)]
        if not msgs:
            raise TemplateError("messages must not be empty")
        kwargs: dict[str, Any] = {}
        if tools and self.supports_tools:
            kwargs["tools"] = tools
        else:
            msgs = _hermes(msgs, tools)
        try:
            return self._template.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template failed: {e}") from None


def _text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise TemplateError(f"messages[{index}]: content part of type {kind!r} is not supported (text only)")
        return "".join(parts)
    raise TemplateError(f"messages[{index}].content must be a string or a list of text parts")


def _normalize(m: Any, index: int) -> dict[str, Any]:
    if not isinstance(m, dict) or "role" not in m:
        raise TemplateError(f"messages[{index}] must be an object with a role")
    out = dict(m)
    out["content"] = _text(m.get("content"), index)
    return out


def _call_json(call: dict[str, Any]) -> str:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass  # keep the client's text as it is
    return json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)


def _hermes(msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Fold tools, tool calls and tool results into plain text messages."""
    out = []
    for m in msgs:
        m = dict(m)
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(f"<tool_call>\n{_call_json(c)}\n</tool_call>" for c in m["tool_calls"])
            m["content"] = (m["content"] + "\n" if m["content"] else "") + calls
            m.pop("tool_calls")
        elif m["role"] == "tool":
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
        out.append(m)
    if tools:
        intro = HERMES_TOOLS_INTRO.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out[0]["role"] == "system":
            out[0] = dict(out[0], content=out[0]["content"] + "\n\n" + intro)
        else:
            out.insert(0, {"role": "system", "content": intro})
    return out
