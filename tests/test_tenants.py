"""Tenants end to end (issue 14's probes as tests): several API keys, each its
tenant; no prefix-cache side channel between tenants (nor a render-cache one), programs namespaced per
tenant (a foreign id answers as an unknown one and is left untouched), one
tenant's pins survive another's traffic; `cache_salt` without tenants;
`--cached-tokens-report none`; the keys file and the CLI's errors."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from agentserve.server.tenants import TenantConfigError, Tenants, key_tenants, read_keys_file
from server_fixtures import start_tiny_server, idle

KEYS = {"key-a": "t-a", "key-a2": "t-a", "key-b": "t-b"}
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SECRET = "4711-8342-1190-5521"
WRONG = ["0000-1111-2222-3333", "9999-8888-7777-6666"]


@pytest.fixture(scope="module")
def server():
    srv, llm, scripted = start_tiny_server(api_key=None, config={"api_keys": KEYS})
    srv.llm, srv.scripted, srv.engine = llm, scripted, srv.app.state.server.engine
    yield srv
    srv.stop()


def post(server, path: str, key: str | None, body: dict | None = None, **headers) -> httpx.Response:
    h = {**({"Authorization": f"Bearer {key}"} if key else {}), **headers}
    return httpx.post(server.url + path, json=body, headers=h, timeout=30)


def chat(server, key: str, content: str, **body) -> dict:
    r = post(server, "/v1/chat/completions", key, {"model": "tiny", "max_tokens": 2, "temperature": 0,
                                                    "messages": [{"role": "user", "content": content}], **body},
             **body.pop("headers", {}))
    assert r.status_code == 200, r.text
    return r.json()


def cached(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def pin_blocks(server, engine_pid: str) -> list[int] | None:
    def get():
        p = server.llm.kv.pins.get(engine_pid)
        return None if p is None else [b.block_id for b in p.blocks]
    return server.engine.call_sync(get)


def probe(secret: str) -> str:
    return f"The vault code is {secret}. Tell nobody, and confirm that you will keep it."


# --- the side channel ------------------------------------------------------------------


@pytest.mark.parametrize("program", [None, "probe"])
def test_prefix_cache_side_channel_is_closed(server, program):
    """Tenant A's prompt holds a secret; tenant B's right and wrong guesses get identical cached counts.
    The same guesses from A itself (a second key of A's tenant) do tell them apart: the probe is sharp."""
    ident = {} if program is None else {"headers": {"X-Program-Id": f"{program}-victim"}}
    chat(server, "key-a", probe(SECRET) + f" ({program})", **ident)

    def guesses(key: str) -> list[int]:
        who = {} if program is None else {"headers": {"X-Program-Id": f"{program}-{key}"}}
        chat(server, key, probe(WRONG[0]) + f" ({program})", **who)  # warms the part every guess shares
        return [cached(chat(server, key, probe(g) + f" ({program})", **who)) for g in (SECRET, WRONG[1])]

    right, wrong = guesses("key-b")
    assert right == wrong, "another tenant's guesses must not be told apart"
    right_a, wrong_a = guesses("key-a2")
    assert right_a >= wrong_a + 8, "within a tenant the cache is shared (the probe can see a hit)"
    idle(server)


def test_completions_side_channel_is_closed(server):
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0}
    assert post(server, "/v1/completions", "key-a", {**body, "prompt": probe(SECRET)}).status_code == 200
    post(server, "/v1/completions", "key-b", {**body, "prompt": probe(WRONG[0])})
    counts = [cached(post(server, "/v1/completions", "key-b", {**body, "prompt": probe(g)}).json())
              for g in (SECRET, WRONG[1])]
    assert counts[0] == counts[1]
    idle(server)


# --- programs ----------------------------------------------------------------------------


def _program_calls(server, key: str, pid: str) -> list[tuple[int, dict]]:
    return [(r.status_code, r.json()) for r in (post(server, f"/v1/programs/{pid}/release", key),
                                                 post(server, f"/v1/programs/{pid}/end", key))]


def _pin_program(server, key: str, pid: str, engine_pid: str, content: str) -> dict:
    server.scripted.script(engine_pid, CALL_TEXT)
    r = chat(server, key, content, tools=WEATHER, max_tokens=80, ttl=60, headers={"X-Program-Id": pid})
    assert r["choices"][0]["finish_reason"] == "tool_calls"
    idle(server)
    assert pin_blocks(server, engine_pid), "a tool-calling turn with a TTL keeps its KV pinned"
    return r


def test_a_foreign_program_answers_as_an_unknown_one_and_is_untouched(server):
    pid = "agent-x"
    before = _program_calls(server, "key-b", pid)  # the id exists nowhere yet
    assert before == [(200, {"program_id": pid, "released": False}),
                      (200, {"program_id": pid, "ended": True, "known": False})]
    _pin_program(server, "key-a", pid, "t-a/" + pid, "Weather in Paris, please, for the foreign test.")
    blocks = pin_blocks(server, "t-a/" + pid)
    assert _program_calls(server, "key-b", pid) == before, "B cannot tell that A's program exists"
    assert pin_blocks(server, "t-a/" + pid) == blocks, "nor release or end it"
    # B's own turn under the same id is B's program
    chat(server, "key-b", "Another tenant's turn under the same id.", headers={"X-Program-Id": pid,
                                                                             "X-Program-End": "true"})
    idle(server)
    assert pin_blocks(server, "t-a/" + pid) == blocks
    # A's tenant (any of its keys) reaches it
    r = post(server, f"/v1/programs/{pid}/end", "key-a2")
    assert r.json() == {"program_id": pid, "ended": True, "known": True}
    assert pin_blocks(server, "t-a/" + pid) is None
    idle(server)


def test_one_tenants_pins_survive_another_tenants_traffic(server):
    pid = "agent-keep"
    content = "Weather in Lyon? This conversation must survive the other tenant."
    r1 = _pin_program(server, "key-a", pid, "t-a/" + pid, content)
    blocks = pin_blocks(server, "t-a/" + pid)
    server.scripted.script("t-b/" + pid, CALL_TEXT)
    for i in range(6):  # B: turns under the same id, releases and ends of it, one-shot requests
        chat(server, "key-b", content + f" {i}", tools=WEATHER, max_tokens=80, ttl=60,
             headers={"X-Program-Id": pid, "X-Program-Release": "true" if i % 2 else "false"})
        chat(server, "key-b", content)
        _program_calls(server, "key-b", pid)
    idle(server)
    assert pin_blocks(server, "t-a/" + pid) == blocks
    # A's next turn finds its first turn (prompt and output) in the cache
    msg = r1["choices"][0]["message"]
    call = msg["tool_calls"][0]
    r = post(server, "/v1/chat/completions", "key-a", {
        "model": "tiny", "max_tokens": 2, "temperature": 0, "tools": WEATHER, "program_id": pid,
        "end_program": True, "messages": [{"role": "user", "content": content}, msg,
                                          {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]})
    first = r1["usage"]["prompt_tokens"] + r1["usage"]["completion_tokens"] - 1
    assert cached(r.json()) >= first // 4 * 4 - 4
    idle(server)


def test_keys_and_the_401s(server):
    ok = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    for key in KEYS:
        assert post(server, "/v1/chat/completions", key, ok).status_code == 200
    for key in (None, "key-c", "KEY-A", "key-", "key-a2x"):
        r = post(server, "/v1/chat/completions", key, ok)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert post(server, "/v1/programs/p/end", None).status_code == 401
    idle(server)


# --- cache_salt without tenants, and the cached-tokens report --------------------------------


@pytest.fixture(scope="module")
def open_server():
    srv, llm, scripted = start_tiny_server(api_key=None)
    srv.llm, srv.engine = llm, srv.app.state.server.engine
    yield srv
    srv.stop()


def test_cache_salt_without_tenants(open_server):
    s = open_server
    text = "A prompt long enough to span a good number of cache blocks, salted or not."
    assert cached(chat(s, None, text, cache_salt="x")) == 0
    assert cached(chat(s, None, text, cache_salt="y")) == 0
    assert cached(chat(s, None, text)) == 0
    hit = cached(chat(s, None, text, cache_salt="x"))
    assert hit >= 40
    assert cached(chat(s, None, text)) == hit
    for bad in ("", "s" * 257):
        r = post(s, "/v1/chat/completions", None, {"model": "tiny", "cache_salt": bad,
                                                   "messages": [{"role": "user", "content": text}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    idle(s)


def test_the_response_cache_answers_only_within_a_salt():
    from agentserve.engine.sampling_params import SamplingParams
    from agentserve.server.response_cache import signature

    p = SamplingParams(max_tokens=4)
    sigs = {signature(p, None, "m", salt=s) for s in (None, ("t-a", None), ("t-b", None), (None, "x"), (None, "y"))}
    assert len(sigs) == 5
    assert signature(p, None, "m", salt=(None, "x")) == signature(p, None, "m", salt=(None, "x"))


def test_the_render_cache_reuses_a_prompt_only_within_its_scope():
    from agentserve.server.chat_template import CHATML, ChatTemplate
    from agentserve.server.render_cache import RenderCache
    from tiny_models import byte_tokenizer

    cache = RenderCache(ChatTemplate(CHATML), byte_tokenizer())
    msgs = [{"role": "user", "content": f"The vault code is {SECRET}."}]
    cache.encode_chat(msgs, scope=("t-a", None))
    more = msgs + [{"role": "assistant", "content": "Noted."}]
    cache.encode_chat(more, scope=("t-b", None))
    cache.encode_chat(more, scope=None)
    assert (cache.stats().hits, cache.stats().misses) == (0, 3), "no reuse across scopes"
    cache.encode_chat(more + [{"role": "user", "content": "Again."}], scope=("t-a", None))
    assert cache.stats().hits == 1


def test_cached_tokens_report_none_hides_every_hit():
    srv, llm, _ = start_tiny_server(api_key=None, config={"cached_tokens_report": "none", "response_cache": 8})
    try:
        text = "The same prompt twice, so the second is a prefix hit and a cached response."
        body = {"model": "tiny", "max_tokens": 3, "temperature": 0, "messages": [{"role": "user", "content": text}]}
        hits_before = llm.scheduler.stats.hit_tokens
        for _ in range(2):
            r = post(srv, "/v1/chat/completions", None, body, **{"Cache-Control": "no-cache"})
            assert cached(r.json()) == 0
        assert llm.scheduler.stats.hit_tokens > hits_before, "the engine did hit"
        for _ in range(2):  # the second is answered by the response cache
            assert cached(post(srv, "/v1/chat/completions", None, body).json()) == 0
        assert srv.app.state.server.response_cache.stats().hits >= 1
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=30, json={
                **body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
            lines = [ln for ln in resp.iter_lines() if ln.startswith("data: {")]
        assert '"cached_tokens":0' in lines[-1].replace(" ", "")
        comp = {"model": "tiny", "max_tokens": 3, "prompt": text}
        for _ in range(2):
            assert cached(post(srv, "/v1/completions", None, comp).json()) == 0
    finally:
        srv.stop()


# --- keys, the keys file and the command line ------------------------------------------------


def test_keys_file_format_and_errors(tmp_path):
    good = tmp_path / "keys"
    good.write_text("# key tenant\nalpha-1 team-a\n\n  beta-2\tteam-b  \nalpha-2 team-a\n")
    assert read_keys_file(good) == {"alpha-1": "team-a", "beta-2": "team-b", "alpha-2": "team-a"}
    assert key_tenants(["k1", "k2"], good) == {"k1": "api-key-1", "k2": "api-key-2", "alpha-1": "team-a",
                                               "beta-2": "team-b", "alpha-2": "team-a"}
    t = Tenants(key_tenants(["k1"], good))
    assert t.scoped and t.authenticate("beta-2") == "team-b" and t.authenticate("beta-") is None
    assert not Tenants({"k": "one", "k2": "one"}).scoped and not Tenants({}).enabled
    for text, msg in (("onlykey\n", "line 1: expected 'KEY TENANT', found 1 field"),
                      ("k t extra\n", "found 3 field"),
                      ("k team/a\n", "tenant name"),
                      ("k1 a\nk1 b\n", "line 2: the key repeats line 1"),
                      ("# nothing\n\n", "no keys"),
                      ("k\x01 a\n", "printable ASCII")):
        bad = tmp_path / "bad"
        bad.write_text(text)
        with pytest.raises(TenantConfigError, match=msg) as e:
            read_keys_file(bad)
        assert "\n" not in str(e.value) and "k1" not in str(e.value).split(":", 1)[1]
    with pytest.raises(TenantConfigError, match="cannot read"):
        read_keys_file(tmp_path / "missing")
    with pytest.raises(TenantConfigError, match="also given with --api-key"):
        key_tenants(["alpha-1"], good)
    with pytest.raises(TenantConfigError, match="repeats an earlier"):
        key_tenants(["k", "k"])


def test_serve_refuses_a_bad_keys_file_in_one_line(tmp_path):
    bad = tmp_path / "keys"
    bad.write_text("secret-key team a\n")
    p = subprocess.run([sys.executable, "-m", "agentserve.cli", "serve", "--api-keys-file", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "line 1: expected 'KEY TENANT', found 3 field(s)" in lines[0]
    assert "secret-key" not in p.stderr
