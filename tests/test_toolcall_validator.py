"""The streaming tool-call validator (policy/toolcall_stream.py): the state machine on the
Hermes, Llama 3 and bash forms, fed at every split of the text; the engine's early stop; and,
end to end on the tiny server, early stop with finish_reason tool_calls, the declared-tool
filter, the constrained re-generation of an undeclared call, /metrics and the stats line."""

from __future__ import annotations

import argparse
import json
import random

import httpx
import openai
import pytest

from agentserve.engine.sampling_params import SamplingParams
from agentserve.policy.toolcall_stream import ToolCallValidator, ValidatorStats
from agentserve.server.app import create_app
from agentserve.server.server_state import ServerConfig
from agentserve.server.stats_log import stats_line
from agentserve.server.tool_output import parse_tool_output, tool_choice_for
from agentserve.server.tool_validation import ValidatorConfig
from server_fixtures import EOS, ScriptedExecutor, ServerThread, tiny_llm

DECLARED = ["get_weather", "calc"]
CHOICE = tool_choice_for(DECLARED, None)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALC = '<tool_call>\n{"name": "calc", "arguments": {"expr": "1+1"}}\n</tool_call>'
L3 = '{"name": "calc", "parameters": {"expr": "2*3"}}'


def server_verify(text: str) -> int:
    return len(parse_tool_output(text, CHOICE)[1])


def run(text: str, step: int = 1, declared=DECLARED, **kw):
    """Feed `text` in pieces of `step` characters: (the text the engine keeps, stopped?, validator)."""
    kw.setdefault("verify", server_verify if declared is DECLARED else None)
    v = ToolCallValidator(declared, **kw)
    seen = ""
    for i in range(0, len(text), step):
        piece = text[i:i + step]
        seen += piece
        if v.feed(piece):
            assert not v.disabled and len(seen) - v.keep >= 0
            return seen[:v.keep], True, v
        assert 0 <= v.hold <= len(seen)
    return seen, False, v


STEPS = (1, 2, 3, 5, 7, 1000)


# --- hermes ------------------------------------------------------------------------------


@pytest.mark.parametrize("step", STEPS)
def test_hermes_call_then_prose_stops_at_the_close(step):
    kept, stopped, v = run("Let me check.\n" + CALL + "\nThe weather in Paris is sunny.", step)
    assert stopped and kept == "Let me check.\n" + CALL and v.stop_reason == "call"
    assert [c.name for c in v.calls] == ["get_weather"]
    content, calls = parse_tool_output(kept, CHOICE)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize("step", STEPS)
def test_hermes_call_then_end_of_turn_does_not_stop(step):
    kept, stopped, v = run(CALL + "\n", step)
    assert not stopped and kept == CALL + "\n" and len(v.calls) == 1


@pytest.mark.parametrize("step", STEPS)
def test_parallel_calls_are_kept(step):
    text = CALL + "\n\n" + CALC + "\n" + CALL + " and now some prose"
    kept, stopped, v = run(text, step)
    assert stopped and kept == CALL + "\n\n" + CALC + "\n" + CALL
    assert [c.name for c in v.calls] == ["get_weather", "calc", "get_weather"]
    assert len(parse_tool_output(kept, CHOICE)[1]) == 3


def test_parallel_off_stops_right_at_the_first_close():
    one = tool_choice_for(DECLARED, None, parallel=False)
    kept, stopped, v = run(CALL + "\n" + CALC, 3, parallel=False,
                           verify=lambda t: len(parse_tool_output(t, one)[1]))
    assert stopped and kept == CALL and v.tokens == -(-len(CALL) // 3)


def test_grace_window_counts_blank_tokens_only():
    # four blank tokens after the close end the wait; a begun <tool_call> is always followed
    v = ToolCallValidator(DECLARED, verify=server_verify, grace_tokens=4)
    assert not v.feed(CALL)
    assert [v.feed(p) for p in ("\n", " ", "\n")] == [False] * 3
    assert v.hold == 3  # the blank text after the call may still be cut
    assert v.feed("\n") and v.keep == len(CALL)
    v = ToolCallValidator(DECLARED, verify=server_verify, grace_tokens=3)
    pieces = [CALL, "\n", "\n", "<", "tool", "_", "call", ">", CALC[len("<tool_call>"):], "x"]
    assert [v.feed(p) for p in pieces] == [False] * 9 + [True]
    assert len(v.calls) == 2
    v = ToolCallValidator(DECLARED, verify=server_verify)
    assert not v.feed(CALL) and not v.feed("<tool") and v.feed("box>")  # not a tag after all
    assert v.keep == len(CALL)


def test_grace_zero_stops_at_the_close():
    kept, stopped, _ = run(CALL + "\n" + CALC, 4, grace_tokens=0)
    assert stopped and kept == CALL


@pytest.mark.parametrize("step", STEPS)
def test_braces_and_escaped_quotes_inside_strings(step):
    tricky = '<tool_call>\n{"name": "calc", "arguments": {"expr": "}{ \\"}\\" ]] {{", "n": [1, {"a": "}"}]}}\n' \
             '</tool_call>'
    kept, stopped, v = run(tricky + " trailing", step)
    assert stopped and kept == tricky and v.calls[0].arguments["expr"] == '}{ "}" ]] {{'


@pytest.mark.parametrize("step", STEPS)
def test_unclosed_call_followed_by_prose_ends_where_the_object_closed(step):
    obj = '<tool_call>\n{"name": "calc", "arguments": {"expr": "1"}}'
    kept, stopped, v = run(obj + "\nI have called the calculator.", step)
    assert stopped and kept == obj
    assert [c.name for c in parse_tool_output(kept, CHOICE)[1]] == ["calc"]


MALFORMED = [
    "<tool_call>{not json}</tool_call> ok",
    '<tool_call>{"name": "calc", "arguments": {"x": 1',
    '<tool_call>{"name": "calc", "arguments": {"x": 1}</tool_call> more text',
    '<tool_call>{"name": "calc", "arguments": "x"}</tool_call> more text',  # arguments not an object
    '<tool_call>{"name": 5, "arguments": {}}</tool_call> more',
    '<tool_call>{"name": "calc", "arguments": {"c": "</tool_call>"}}</tool_call> more',  # cut inside the string
    '<tool_call>["calc"]</tool_call> more',
    '<tool_call>{"name": "calc", "arguments": {}]]</tool_call> x',
    '{"name": "calc", "parameters": {"x": 1} trailing',
    '{"answer": 42} and prose',
    '[{"name": "calc", "parameters": {}}, 3] more',
    "<|python_tag|>not json at all",
    "```bash\n```\nthen ```bash\nls\n```",
    "<tool_call><tool_call><tool_call>",
    "}}}]]]{{{[[[\"\\",
]


@pytest.mark.parametrize("text", MALFORMED)
@pytest.mark.parametrize("step", (1, 3, 1000))
def test_malformed_calls_never_stop_and_never_raise(text, step):
    stats = ValidatorStats()
    kept, stopped, v = run(text, step, formats=("hermes", "llama3", "bash"), stats=stats)
    assert not stopped and kept == text and not v.disabled and not v.calls
    assert stats.counts().fallbacks == 0


@pytest.mark.parametrize("step", (1, 4))
def test_undeclared_call_is_left_as_text_then_a_later_call_counts(step):
    bad = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    stats = ValidatorStats()
    kept, stopped, v = run(bad, step, stats=stats)
    assert not stopped and v.stop_reason is None and stats.counts().undeclared == 1
    kept, stopped, v = run(bad + "\n" + CALL + " then prose", step)
    assert stopped and kept == bad + "\n" + CALL
    content, calls = parse_tool_output(kept, CHOICE)
    assert content == bad and [c.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize("step", (1, 4))
def test_undeclared_call_after_a_valid_one_ends_the_reply_at_the_valid_one(step):
    bad = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    kept, stopped, v = run(CALL + "\n" + bad + " more", step)
    assert stopped and kept == CALL and [c.name for c in v.calls] == ["get_weather"]


@pytest.mark.parametrize("step", (1, 3, 1000))
def test_undeclared_call_to_regenerate_stops_where_it_began(step):
    text = 'Sure.\n<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> and more'
    kept, stopped, v = run(text, step, stop_on_undeclared=True)
    assert stopped and v.stop_reason == "undeclared" and kept == "Sure.\n"
    char, tok = v.rejected_at
    assert char == len("Sure.\n") and tok == char // step  # the token whose piece holds the '<'


def test_cache_key_names_what_decides_the_stop():
    a, b = ToolCallValidator(DECLARED), ToolCallValidator(reversed(DECLARED))
    assert a.cache_key == b.cache_key
    assert a.cache_key != ToolCallValidator(DECLARED, grace_tokens=0).cache_key
    assert a.cache_key != ToolCallValidator(["calc"]).cache_key


def test_hold_covers_what_a_stop_may_cut():
    v = ToolCallValidator(DECLARED, verify=server_verify)
    v.feed("Hello <tool")
    assert v.hold == len("<tool")  # may begin a call
    v.feed("_call>{")
    assert v.hold == len("<tool_call>{")  # inside a call
    v = ToolCallValidator(DECLARED, verify=server_verify)
    v.feed("Hello there")
    assert v.hold == 0


# --- llama 3 and bash ----------------------------------------------------------------------


@pytest.mark.parametrize("step", STEPS)
def test_llama3_json_call(step):
    kept, stopped, v = run("  " + L3 + "\n\nThis computes 2*3.", step)
    assert stopped and kept == "  " + L3 and v.calls[0].name == "calc"
    kept, stopped, _ = run("<|python_tag|>" + L3 + "; " + L3 + " prose", step)
    assert stopped and kept == "<|python_tag|>" + L3 + "; " + L3
    lst = '[' + L3 + ', {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    kept, stopped, v = run(lst + " prose", step)
    assert stopped and kept == lst and len(v.calls) == 2
    kept, stopped, _ = run(L3, step)
    assert not stopped and kept == L3


@pytest.mark.parametrize("step", STEPS)
def test_bash_block(step):
    text = "THOUGHT: look around.\n```python\nx = 1\n```\n```bash\nls -la\n```\nand then ```bash\nrm\n```"
    kept, stopped, v = run(text, step, declared=None, formats=("bash",))
    assert stopped and kept.endswith("```bash\nls -la\n```") and v.calls[0].name == "ls"
    # the parser's reading of inline fences, followed exactly: this one finds no block, so no stop
    text = "use ```bash``` inline\n```bash\nls -la\n```\nmore"
    assert not run(text, step, declared=None, formats=("bash",))[1]
    kept, stopped, _ = run("no block here ``", step, declared=None, formats=("bash",))
    assert not stopped


# --- fuzz: whatever the text and the split, a stop is one the server's parser agrees with -----


FRAGMENTS = ["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"', "\\", ":", ",", ";", " ", "\n", "x",
             '"name"', '"calc"', '"rm"', '"arguments"', '"parameters"', "<|python_tag|>", "```", "bash\n", "<",
             CALL, L3, '<tool_call>{"name": "rm", "arguments": {}}</tool_call>', '{"name": "rm", "parameters": {}}']


def test_fuzz_never_raises_and_every_stop_parses():
    rng = random.Random(7)
    stats = ValidatorStats()
    stops = 0
    for _ in range(1500):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 14)))
        v = ToolCallValidator(DECLARED, verify=server_verify, stats=stats,
                              grace_tokens=rng.choice((0, 1, 4)), stop_on_undeclared=rng.random() < 0.3)
        seen, i = "", 0
        while i < len(text):
            n = rng.randint(1, 6)
            piece, i = text[i:i + n], i + n
            seen += piece
            if v.feed(piece):
                stops += 1
                kept = seen[:v.keep]
                if v.stop_reason == "call":
                    assert len(parse_tool_output(kept, CHOICE)[1]) == len(v.calls)
                else:
                    assert not parse_tool_output(kept, CHOICE)[1]
                break
            assert 0 <= v.hold <= len(seen)
    counts = stats.counts()
    assert stops > 300 and counts.undeclared > 50 and counts.malformed > 50
    assert counts.fallbacks == 0  # the validator reads these texts exactly as the server's parser does


# --- the engine --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    llm = tiny_llm()
    llm.engine.executor = ScriptedExecutor(llm.engine.executor)
    return llm


def generate(llm, pid: str, script: str, validator, max_tokens: int = 200):
    llm.engine.executor.script(pid, script)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, tool_validator=validator)
    return llm.generate([[1, 2, 3, 4, 5]], params, program_ids=[pid])[0]


def test_engine_early_stop_cuts_text_not_tokens(llm):
    v = ToolCallValidator(DECLARED, verify=server_verify)
    out = generate(llm, "eng-1", CALL + "\nNow the weather is known.", v)
    assert out.text == CALL and out.finish_reason == "stop"
    assert len(out.token_ids) == len(CALL) + 2  # byte tokens: the close, "\n", then "N" decided it
    llm.check_integrity()
    plain = generate(llm, "eng-2", CALL + "\nNow the weather is known.", None)
    assert plain.text == CALL + "\nNow the weather is known." and plain.token_ids[-1] == EOS


def test_bench_measures_tokens_saved(llm):
    from benchmarks.toolcall_early_stop import measure_turn, summarize, table

    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in DECLARED]
    msgs = [{"role": "user", "content": "Weather?"}]
    stats = ValidatorStats()
    rows = []
    for pid, script in (("bench-1", CALL + "\nThe weather is fine."), ("bench-2", "No call needed.")):
        llm.engine.executor.script(pid, script)
        rows.append(measure_turn(llm, msgs, tools, 200, ValidatorConfig(), stats, ("w", pid, 0), program_id=pid))
    a, b = rows
    assert (a.plain_tokens, a.validated_tokens, a.saved, a.stop, a.prefix) == (
        len(CALL) + len("\nThe weather is fine.") + 1, len(CALL) + 2, len("\nThe weather is fine.") - 1, "call", True)
    assert (a.plain_calls, a.validated_calls) == (1, 1)
    assert b.saved == 0 and b.stop is None and b.prefix
    s = summarize(rows)
    assert (s["tool_turns"], s["saved_tokens"], s["early_stops"], s["all_prefix"]) == (1, a.saved, 1, True)
    assert s["saved_per_tool_turn"] == a.saved and "bench-1"[-4:] in table(rows)


class _Broken:
    hold = 0

    def __init__(self):
        self.failed = None

    def feed(self, piece):
        raise RuntimeError("boom")

    def fail(self, reason):
        self.failed = reason


class _CutsStreamedText(_Broken):
    """Asks, at the 10th token, for a cut at 0: text the engine has already streamed."""
    keep = 0
    fed = 0

    def feed(self, piece):
        self.fed += 1
        return self.fed == 10


@pytest.mark.parametrize("make", [_Broken, _CutsStreamedText])
def test_engine_drops_an_inconsistent_validator(llm, make):
    v = make()
    out = generate(llm, "eng-broken", "abc " + CALL + " tail", v)
    assert out.text == "abc " + CALL + " tail"  # decoded plainly
    assert v.failed is not None


# --- the server, end to end --------------------------------------------------------------


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}]


class _Scripted(ScriptedExecutor):
    """Scripts by program id, and for re-generated requests (id ending "-regen") by `regen`."""

    def __init__(self, inner):
        super().__init__(inner)
        self.regen: list[int] = []

    def execute(self, output):
        result = super().execute(output)
        for ch in output.chunks:
            if ch.sample and ch.request.request_id.endswith("-regen") and self.regen:
                i = ch.request.num_output_tokens
                result.sampled[ch.request.request_id] = [self.regen[i] if i < len(self.regen) else EOS]
        return result


def _server(tool_calls: ValidatorConfig):
    llm = tiny_llm()
    scripted = _Scripted(llm.engine.executor)
    llm.engine.executor = scripted
    app = create_app(llm, ServerConfig(["tiny"], max_queue=64, tool_calls=tool_calls))
    srv = ServerThread(app).start()
    srv.llm, srv.scripted = llm, scripted
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30)
    return srv, client


@pytest.fixture(scope="module")
def served():
    srv, client = _server(ValidatorConfig())
    yield srv, client
    srv.stop()


def ask(client, pid: str, **kw):
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=WEATHER,
        temperature=0, max_tokens=300, extra_headers={"X-Program-Id": pid}, **kw)


def metric(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics").text
    line = next(ln for ln in text.splitlines() if ln.startswith(f"agentserve:{name}_total{{"))
    return float(line.rsplit(" ", 1)[1])


def test_server_early_stop_ends_with_tool_calls(served):
    srv, client = served
    before = metric(srv, "tool_call_early_stops")
    srv.scripted.script("es-1", CALL + "\nThe weather in Paris is sunny, I am sure of it.")
    r = ask(client, "es-1")
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
    assert r.usage.completion_tokens == len(CALL) + 2  # not the 45 tokens of prose
    assert metric(srv, "tool_call_early_stops") == before + 1
    assert metric(srv, "tool_call_early_stop_budget_left") >= 300 - len(CALL) - 2
    # streamed: the same call, nothing of the prose
    srv.scripted.script("es-2", "Checking.\n" + CALL + "\nIt is sunny.")
    chunks = list(ask(client, "es-2", stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or ()]
    assert content == "Checking." and [d.function.name for d in deltas] == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    srv.llm.check_integrity()


def test_server_early_stop_keeps_the_kv_the_next_turn_reuses(served):
    """The early-stopped turn's tokens (call and grace tokens) are what the program keeps: the
    next turn, re-sent with the call, finds its prompt and the whole call in the cache."""
    srv, client = served
    pid, bs = "es-kv", srv.llm.kv.block_size
    srv.scripted.script(pid, CALL + "\nI will wait for the result now.")
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r1 = client.chat.completions.create(model="tiny", messages=msgs, tools=WEATHER, temperature=0, max_tokens=300,
                                        extra_headers={"X-Program-Id": pid, "X-Program-TTL": "60"})
    c1 = r1.choices[0]
    assert c1.finish_reason == "tool_calls" and r1.usage.completion_tokens == len(CALL) + 2
    srv.scripted.script(pid, "Sunny.")
    msgs += [c1.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": c1.message.tool_calls[0].id, "content": "sunny"}]
    r2 = client.chat.completions.create(model="tiny", messages=msgs, tools=WEATHER, temperature=0,
                                        extra_headers={"X-Program-Id": pid, "X-Program-End": "1"})
    assert r2.choices[0].message.content == "Sunny."
    assert r2.usage.prompt_tokens_details.cached_tokens >= (r1.usage.prompt_tokens + len(CALL)) // bs * bs
    srv.llm.check_integrity()


def test_server_filters_undeclared_and_malformed_calls(served):
    srv, client = served
    bad = '<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>'
    srv.scripted.script("es-bad", bad + "\nDone.")
    c = ask(client, "es-bad").choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls and c.message.content == bad + "\nDone."
    assert metric(srv, "tool_call_undeclared") >= 1
    for name in ("validated_requests", "valid_calls", "early_stops", "early_stop_budget_left", "grace_tokens",
                 "undeclared", "malformed", "regenerations", "validator_fallbacks"):
        metric(srv, "tool_call_" + name)  # every counter is exported
    assert metric(srv, "tool_call_validator_fallbacks") == 0
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    srv.scripted.script("es-broken", broken)
    c = ask(client, "es-broken").choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls and c.message.content == broken


def test_server_regenerates_an_undeclared_call_under_the_grammar():
    pytest.importorskip("xgrammar")
    srv, client = _server(ValidatorConfig(undeclared="regenerate"))
    try:
        srv.scripted.script("rg", 'Let me see.\n<tool_call>\n{"name": "weather_lookup", "arguments": {}}\n'
                                  '</tool_call>\nmore')
        srv.scripted.regen = list(CALL.encode())
        r = ask(client, "rg")
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content == "Let me see."
        assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
        assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Paris"}
        assert metric(srv, "tool_call_regenerations") == 1
        chunks = list(ask(client, "rg", stream=True))
        deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or ()]
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert content == "Let me see." and [d.function.name for d in deltas] == ["get_weather"]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        srv.llm.check_integrity()
    finally:
        srv.stop()


def test_stats_line_and_cli_flags():
    from test_stats_log import snap

    from agentserve.cli_serve import add_serve
    from agentserve.policy.toolcall_stream import ValidatorCounts

    a = snap(executed_steps=1)
    b = a.but(executed_steps=5, tool_calls=ValidatorCounts(early_stops=3, grace_tokens=4, budget_left=900,
                                                                 undeclared=1))
    line = stats_line(a, b, 10.0)
    assert "tool calls: 3 early stops (4 grace tokens, 900 max_tokens left), 1 undeclared" in line
    assert "tool calls" not in stats_line(a, a.but(executed_steps=5), 10.0)
    ap = argparse.ArgumentParser(prog="agentserve")
    add_serve(ap.add_subparsers(dest="command"))
    args = ap.parse_args(["serve"])
    assert (args.tool_call_early_stop, args.tool_call_grace_tokens, args.undeclared_tool_calls,
            args.bash_block_early_stop) == (True, 4, "text", False)
    args = ap.parse_args(["serve", "--no-tool-call-early-stop", "--tool-call-grace-tokens", "0",
                          "--undeclared-tool-calls", "regenerate", "--bash-block-early-stop"])
    assert (args.tool_call_early_stop, args.tool_call_grace_tokens, args.undeclared_tool_calls,
            args.bash_block_early_stop) == (False, 0, "regenerate", True)
    with pytest.raises(SystemExit):
        ap.parse_args(["serve", "--undeclared-tool-calls", "drop"])
    with pytest.raises(ValueError):
        ValidatorConfig(undeclared="drop")
