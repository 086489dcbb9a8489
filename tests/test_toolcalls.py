import json
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.policy.toolcalls import ToolCall, first_tool_name, parse_tool_calls

# ----------------------------------------------------------------------------- openai


def test_openai_dicts_chat_completions():
    calls = [
        {
            "id": "call_0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'},
        },
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_time", "arguments": {"tz": "CET"}},
        },
    ]
    out = parse_tool_calls(None, calls)
    assert out == [
        ToolCall("get_weather", {"location": "Paris"}, "openai"),
        ToolCall("get_time", {"tz": "CET"}, "openai"),
    ]


def test_openai_responses_api_flat_item():
    item = {"id": "fc_0", "call_id": "call_0", "type": "function_call",
            "name": "get_weather", "arguments": {"location": "Paris"}}
    assert parse_tool_calls("", [item]) == [ToolCall("get_weather", {"location": "Paris"}, "openai")]


def test_openai_objects():
    obj = SimpleNamespace(id="c", function=SimpleNamespace(name="search", arguments='{"q": "x"}'))
    assert parse_tool_calls(None, [obj]) == [ToolCall("search", {"q": "x"}, "openai")]


def test_openai_invalid_argument_string_kept_raw():
    calls = [{"function": {"name": "f", "arguments": '{"a": 1'}}]
    assert parse_tool_calls(None, calls) == [ToolCall("f", '{"a": 1', "openai")]


def test_openai_bad_entries_skipped_and_fallback_to_text():
    class Boom:
        @property
        def function(self):
            raise RuntimeError("boom")

    bad = [{"function": {"name": 3}}, {"function": {}}, None, 7, Boom(), {"function": {"name": "  "}}]
    assert parse_tool_calls(None, bad) == []
    text = '<tool_call>{"name": "ls", "arguments": {}}</tool_call>'
    assert parse_tool_calls(text, bad) == [ToolCall("ls", {}, "hermes")]
    # empty list: text is parsed
    assert first_tool_name(text, []) == "ls"


def test_openai_wins_over_text():
    text = '<tool_call>{"name": "ls", "arguments": {}}</tool_call>'
    assert first_tool_name(text, [{"function": {"name": "cat", "arguments": "{}"}}]) == "cat"


# ----------------------------------------------------------------------------- hermes

QWEN_MULTI = """<think>
I need the weather in two cities.
</think>

<tool_call>
{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}
</tool_call>
<tool_call>
{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", "date": "2024-10-01"}}
</tool_call>"""


def test_hermes_multi_call():
    out = parse_tool_calls(QWEN_MULTI)
    assert [c.name for c in out] == ["get_current_temperature", "get_temperature_date"]
    assert all(c.format == "hermes" for c in out)
    assert out[1].arguments == {"location": "San Francisco, CA, USA", "date": "2024-10-01"}


def test_hermes_parameters_key_and_string_arguments():
    t = '<tool_call>{"name": "a", "parameters": {"x": 1}}</tool_call>'
    assert parse_tool_calls(t) == [ToolCall("a", {"x": 1}, "hermes")]
    t = '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
    assert parse_tool_calls(t) == [ToolCall("b", {"y": 2}, "hermes")]
    t = '<tool_call>{"name": "c"}</tool_call>'
    assert parse_tool_calls(t) == [ToolCall("c", {}, "hermes")]


def test_hermes_close_tag_inside_json_string():
    args = {"code": 'print("</tool_call>") ; x = {"a": [1, {"b": "}"}]}', "n": {"deep": {"er": [1, 2]}}}
    t = "Sure.\n<tool_call>\n" + json.dumps({"name": "python", "arguments": args}) + "\n</tool_call>\n"
    out = parse_tool_calls(t)
    assert out == [ToolCall("python", args, "hermes")]


def test_hermes_open_tag_inside_json_string_not_a_second_call():
    inner = '<tool_call>{"name": "evil", "arguments": {}}</tool_call>'
    t = "<tool_call>" + json.dumps({"name": "echo", "arguments": {"s": inner}}) + "</tool_call>"
    assert [c.name for c in parse_tool_calls(t)] == ["echo"]


def test_hermes_unclosed_final_complete_json_accepted():
    t = 'ok <tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n'
    assert parse_tool_calls(t) == [ToolCall("search", {"q": "x"}, "hermes")]


def test_hermes_truncated_json_rejected():
    t = '<tool_call>\n{"name": "search", "arguments": {"q": "x"'
    assert parse_tool_calls(t) == []
    # the complete first call is kept, the truncated second is not
    t2 = '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "argu'
    assert [c.name for c in parse_tool_calls(t2)] == ["a"]


def test_hermes_malformed_names():
    for obj in ({"arguments": {}}, {"name": 42, "arguments": {}}, {"name": "", "arguments": {}},
                {"name": None}, {"name": ["x"]}):
        assert parse_tool_calls("<tool_call>" + json.dumps(obj) + "</tool_call>") == []
    assert parse_tool_calls("<tool_call>[1, 2]</tool_call>") == []
    assert parse_tool_calls("<tool_call>{not json}</tool_call>") == []


def test_hermes_junk_after_json_rejected():
    t = '<tool_call>{"name": "a", "arguments": {}} trailing junk</tool_call>'
    assert parse_tool_calls(t) == []


def test_prose_mentioning_tool_call():
    prose = (
        "To call a tool, wrap a JSON object in <tool_call> and </tool_call> tags. "
        "The tool_call must have a name. I will not call anything now."
    )
    assert parse_tool_calls(prose) == []
    assert first_tool_name("I considered a tool_call but the answer is 42.") is None


# ----------------------------------------------------------------------------- llama 3


def test_llama3_python_tag():
    t = '<|python_tag|>{"name": "get_weather", "parameters": {"location": "Menlo Park"}}<|eom_id|>'
    assert parse_tool_calls(t) == [ToolCall("get_weather", {"location": "Menlo Park"}, "llama3")]


def test_llama3_plain_json_and_arguments_key():
    t = '  {"name": "search", "arguments": {"q": "a; b"}}\n'
    assert parse_tool_calls(t) == [ToolCall("search", {"q": "a; b"}, "llama3")]


def test_llama3_semicolon_separated():
    t = '{"name": "a", "parameters": {"s": "x;y"}}; {"name": "b", "parameters": {}}'
    assert [c.name for c in parse_tool_calls(t)] == ["a", "b"]
    assert parse_tool_calls(t + ";") != []


def test_llama3_list():
    t = '[{"name": "a", "parameters": {}}, {"name": "b", "arguments": {"k": 1}}]'
    assert [c.name for c in parse_tool_calls(t)] == ["a", "b"]


def test_llama3_rejections():
    assert parse_tool_calls('{"location": "Paris", "temp": 20}') == []  # no name
    assert parse_tool_calls('{"name": 5, "parameters": {}}') == []  # name not a string
    assert parse_tool_calls('[{"name": "a"}, {"value": 1}]') == []  # not all calls
    assert parse_tool_calls('[]') == []
    assert parse_tool_calls('{"name": "a", "parameters": {}} and then prose') == []
    assert parse_tool_calls('{"name": "a", "parameters": {"x": ') == []  # truncated
    assert parse_tool_calls('The answer: {"name": "a"}') == []  # not the whole text


# ----------------------------------------------------------------------------- bash

SWE_ONE = """THOUGHT: I need to look at the source of the failing function before editing it.
Let me find where `bulk_create` is defined.

```bash
grep -rn "def bulk_create" /testbed/django/db/models/ | head -20
```"""


def test_bash_mini_swe_agent():
    out = parse_tool_calls(SWE_ONE)
    assert len(out) == 1
    assert out[0].name == "grep" and out[0].format == "bash"
    assert out[0].arguments.startswith("grep -rn")


def test_bash_sh_and_other_language_blocks():
    t = "Here is the file:\n```python\nprint(1)\n```\nNow run:\n```sh\npython -m pytest -x\n```\n"
    assert first_tool_name(t) == "python"


def test_bash_two_blocks_is_no_call():
    t = SWE_ONE + "\n\nand also\n```bash\nls -la\n```"
    assert parse_tool_calls(t) == []


def test_bash_no_block_unclosed_or_inline():
    assert parse_tool_calls("THOUGHT: done.\n\nNo command.") == []
    assert parse_tool_calls("```bash\nls -la\n") == []  # truncated
    assert parse_tool_calls("Use ```bash``` fences for commands.") == []
    assert parse_tool_calls("```bash\n\n   \n```") == []  # empty command


def test_bash_env_assignments_and_comments_skipped():
    t = "```bash\n# reproduce\nPYTHONPATH=/testbed DEBUG=1 python reproduce.py\n```"
    assert first_tool_name(t) == "python"
    assert first_tool_name("```bash\nFOO=bar\n```") == "FOO=bar"
    assert first_tool_name("```bash\ncd /testbed && git diff\n```") == "cd"


def test_bash_multiline_heredoc_name_is_first_word():
    t = "THOUGHT: write a file\n\n```bash\ncat <<'EOF' > /tmp/x.py\nprint('```')\nEOF\n```"
    # the fence inside the heredoc closes the block early; still exactly one shell block opens
    # before it, so the name is the first word
    assert first_tool_name(t) == "cat"


# ----------------------------------------------------------------------------- robustness


def test_garbage_inputs_do_not_raise():
    for x in (None, "", 5, b"bytes", ["list"], {"d": 1}, "{" * 100000, "[" * 100000,
              "<tool_call>" + "[" * 50000, "```bash\n" * 20000, "\x00\uffff"):
        assert parse_tool_calls(x) == []  # type: ignore[arg-type]
    assert parse_tool_calls(None, "not a list") == []  # type: ignore[arg-type]
    assert parse_tool_calls(None, 12) == []  # type: ignore[arg-type]


def test_huge_string_is_fast():
    big = ("lorem ipsum dolor " * 200000) + "<tool_call>" + '{"name": "x", "arguments": {}}'
    assert first_tool_name(big) == "x"


_alphabet = st.sampled_from(
    list('{}[]":;,\\ \n\tabcxyz019-_=#`') + ["<tool_call>", "</tool_call>", "<|python_tag|>",
                                            "```bash\n", "```", '"name"', '"arguments"',
                                            '"parameters"', "null", "true", "1e5"]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_alphabet, max_size=60).map("".join))
def test_random_structured_text_never_raises(text):
    out = parse_tool_calls(text)
    assert isinstance(out, list)
    for c in out:
        assert isinstance(c.name, str) and c.name.strip()
        assert c.format in ("hermes", "llama3", "bash")


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300), st.one_of(st.none(), st.lists(st.one_of(
    st.none(), st.integers(), st.text(max_size=5),
    st.dictionaries(st.sampled_from(["function", "name", "arguments"]),
                    st.one_of(st.none(), st.integers(), st.text(max_size=5),
                              st.dictionaries(st.sampled_from(["name", "arguments"]),
                                              st.one_of(st.integers(), st.text(max_size=5))))),
), max_size=4)))
def test_random_text_and_tool_calls_never_raise(text, tool_calls):
    out = parse_tool_calls(text, tool_calls)
    for c in out:
        assert isinstance(c.name, str) and c.name.strip()
