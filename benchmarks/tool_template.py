"""The chat template vLLM is given for tool workloads, so that it shows the
model exactly the prompt agentserve does.

SmolLM2's own template is plain ChatML and never mentions tools: vLLM would
drop the `tools` of a request and render an assistant tool call as its empty
content. agentserve renders them Hermes-style instead (server/chat_template.py:
a `<tools>` block appended to the system message, past calls as
`<tool_call>{json}</tool_call>` in the assistant's text, results wrapped in
`<tool_response>`). The template below writes that same text, and vLLM's
`hermes` tool parser reads the model's `<tool_call>` blocks back into
`tool_calls`, so both servers see the same prompt tokens and parse the same
calls. tests/test_bench_fastpath.py renders it against agentserve's renderer.

    spec = server_spec("vllm-cpu", 16384, extra_args=vllm_tool_args(write_template(folder)))
"""

from __future__ import annotations

from pathlib import Path

TEMPLATE_NAME = "hermes-chatml-tools.jinja"

_INTRO_HEAD = ("You may call one or more functions to assist with the user query.\\n\\n"
               "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\\n")
_INTRO_TAIL = ("\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
               "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
               "\"arguments\": <args-json-object>}\\n</tool_call>")

# Whitespace control: every piece of output is an explicit expression, and every
# tag trims around itself, so trim_blocks/lstrip_blocks do not matter.
HERMES_CHATML_TOOLS = (
    "{%- macro tool_json(t) -%}"
    "{%- set f = t['function'] -%}"
    "{{- '{\"type\": \"function\", \"function\": {\"name\": ' + (f['name'] | tojson) -}}"
    "{%- if f['description'] is defined and f['description'] is not none -%}"
    "{{- ', \"description\": ' + (f['description'] | tojson) -}}{%- endif -%}"
    "{%- if f['parameters'] is defined and f['parameters'] is not none -%}"
    "{{- ', \"parameters\": ' + (f['parameters'] | tojson) -}}{%- endif -%}"
    "{{- '}}' -}}"
    "{%- endmacro -%}"
    "{%- macro call_json(c) -%}"
    "{%- set f = c['function'] if c['function'] is defined else c -%}"
    "{%- set a = f['arguments'] if f['arguments'] is defined else {} -%}"
    "{{- '{\"name\": ' + (f['name'] | tojson) + ', \"arguments\": ' -}}"
    "{%- if a is string -%}{{- a -}}{%- else -%}{{- a | tojson -}}{%- endif -%}"
    "{{- '}' -}}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(intro='', content='') -%}"
    "{%- if tools -%}"
    "{%- set ns.intro = '" + _INTRO_HEAD + "' -%}"
    "{%- for t in tools -%}{%- if not loop.first -%}{%- set ns.intro = ns.intro + '\\n' -%}{%- endif -%}"
    "{%- set ns.intro = ns.intro + tool_json(t) -%}{%- endfor -%}"
    "{%- set ns.intro = ns.intro + '" + _INTRO_TAIL + "' -%}"
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\n' + ns.intro + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- elif messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- set ns.content = m['content'] if m['content'] is string else '' -%}"
    "{%- if m['role'] == 'system' and loop.first and tools -%}"
    "{%- set ns.content = ns.content + '\\n\\n' + ns.intro -%}"
    "{%- elif m['role'] == 'assistant' and m['tool_calls'] is defined and m['tool_calls'] -%}"
    "{%- for c in m['tool_calls'] -%}"
    "{%- set ns.content = (ns.content + '\\n' if ns.content else '') + '<tool_call>\\n' + call_json(c)"
    " + '\\n</tool_call>' -%}"
    "{%- endfor -%}"
    "{%- elif m['role'] == 'tool' -%}"
    "{%- set ns.content = '<tool_response>\\n' + ns.content + '\\n</tool_response>' -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + ns.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def write_template(folder: str | Path) -> Path:
    """Write the template into `folder` (created); its path."""
    path = Path(folder) / TEMPLATE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(HERMES_CHATML_TOOLS, encoding="utf-8")
    return path


def vllm_tool_args(template: str | Path) -> list[str]:
    """vLLM's flags for `tools` with tool_choice auto: this template and the hermes parser."""
    return ["--chat-template", str(template), "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
