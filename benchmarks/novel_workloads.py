"""The stateful-inference paper's agent workloads (section 5), as generators of
real chat conversations with six declared tools (OpenAI `tools` JSON schemas):

* `bugfix6`: a coding agent fixes a bug in 6 turns, one tool call a turn:
  read_file, search_code, write_file, run_command, get_diagnostics, summary.
  Every agent run has its own repository, module, test and function names (a
  per-run tag), so no prompt of the workload repeats: response caches never hit,
  only prefix reuse and fast decoding can help.
* `deepcoding35`: a 35-turn conversation that builds a small web application
  step by step (a user instruction every turn, mostly tool calls, a few prose
  answers, `summary` last); the prefix deepens by ~200 tokens a turn.
* `repeat_agents`: 3 agents x 5 turns of fully scripted bug-fix conversations
  (the assistant turns are scripted calls too), for the repeated-prompt
  patterns of the response-cache evaluation (section 5.4).

A run is a list of `ScriptedTurn`s. What a replay does with turn k (see
benchmarks/fastpath.py): append its `user` message if any, send the conversation
(the model's own earlier replies included), append the model's reply, then
append `result` answering the reply's tool call (a `tool` message; a `user`
message naming the tool when the reply made no call). `call` is the call the
script expects; the repeated-prompt workload sends it as the assistant turn.

Everything is deterministic in (seed, salt, run index); the system prompt and
tools are the same for every run (a shared prefix, as in real agents)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from benchmarks.agent_runs import (SYSTEM_BUGFIX, SYSTEM_CODING, TOOL_NAMES, TOOLS, AgentRun, ScriptedTurn,  # noqa: F401
                         call_message, run_rng, run_tag)

# ---------------------------------------------------------------------------
# bugfix6

_DOMAINS = {
    "billing": ["invoice", "ledger", "refund", "payment", "charge"],
    "shipping": ["parcel", "route", "carrier", "manifest", "label"],
    "inventory": ["stock", "warehouse", "pallet", "batch", "reorder"],
    "accounts": ["session", "member", "quota", "profile", "grant"],
    "analytics": ["metric", "report", "event", "funnel", "cohort"],
    "scheduling": ["booking", "shift", "slot", "roster", "visit"],
}
_VERBS = ["total", "window", "score", "balance", "count", "weight"]
# (buggy loop line, fixed loop line, how the failing test reports it)
_BUGS = [
    ("    for i in range(1, min(limit, len(records))):",
     "    for i in range(min(limit, len(records))):", "the first record is skipped"),
    ("    for i in range(min(limit, len(records)) - 1):",
     "    for i in range(min(limit, len(records))):", "the last record within the limit is skipped"),
    ("    for i in range(min(limit + 1, len(records))):",
     "    for i in range(min(limit, len(records))):", "one record past the limit is counted"),
]


@dataclass(frozen=True)
class _Names:
    tag: str
    repo: str
    pkg: str
    noun: str
    cls: str
    func: str
    module: str
    test: str
    api: str


def _names(rng: random.Random) -> _Names:
    tag = run_tag(rng)
    pkg = rng.choice(sorted(_DOMAINS))
    noun = rng.choice(_DOMAINS[pkg])
    func = f"{noun}_{rng.choice(_VERBS)}_{tag}"
    return _Names(tag, f"{pkg}-service-{tag}", pkg, noun, f"{noun.capitalize()}Record{tag.upper()}", func,
                  f"src/{pkg}/{noun}_{tag}.py", f"tests/test_{noun}_{tag}.py", f"src/{pkg}/api_{tag}.py")


def _module_text(n: _Names, loop_line: str, rng: random.Random) -> str:
    field_ = rng.choice(["amount", "weight", "quantity", "duration_s"])
    helpers = rng.sample([
        f"def open_{n.noun}s(records: list[{n.cls}]) -> list[{n.cls}]:\n"
        f"    return [r for r in records if not r.closed]\n",
        f"def by_id(records: list[{n.cls}]) -> dict[str, {n.cls}]:\n"
        f"    return {{r.{n.noun}_id: r for r in records}}\n",
        f"def close_all(records: list[{n.cls}]) -> int:\n    n = 0\n    for r in records:\n"
        f"        if not r.closed:\n            r.closed = True\n            n += 1\n    return n\n",
        f"def largest(records: list[{n.cls}]) -> {n.cls} | None:\n"
        f"    return max(records, key=lambda r: r.{field_}, default=None)\n",
    ], 2)
    return (
        f'"""{n.pkg.capitalize()}: {n.noun} records and their running {field_}."""\n\n'
        "from __future__ import annotations\n\nfrom dataclasses import dataclass, field\n"
        "from decimal import Decimal\n\n\n"
        f"@dataclass\nclass {n.cls}:\n    {n.noun}_id: str\n    {field_}: Decimal\n"
        "    tags: list[str] = field(default_factory=list)\n    closed: bool = False\n\n\n"
        f"def load_{n.noun}s(rows: list[dict]) -> list[{n.cls}]:\n    out = []\n    for row in rows:\n"
        f"        out.append({n.cls}(str(row[\"id\"]), Decimal(str(row[\"{field_}\"])), list(row.get(\"tags\", ()))))\n"
        "    return out\n\n\n"
        f"def {n.func}(records: list[{n.cls}], limit: int) -> Decimal:\n"
        f'    """The {field_} of the first `limit` open records."""\n    total = Decimal("0")\n'
        f"{loop_line}\n        if not records[i].closed:\n            total += records[i].{field_}\n"
        "    return total\n\n\n" + "\n\n".join(helpers))


def _fixed_function(n: _Names, fixed_line: str, module: str) -> str:
    start = module.index(f"def {n.func}(")
    end = module.index("\n\n\n", start)
    body = module[start:end]
    return module[:start] + body[:body.index("    for i in")] + fixed_line + body[body.index(":\n        if"):] \
        + module[end:]


def _grep(n: _Names, module: str, rng: random.Random) -> str:
    line = module[:module.index(f"def {n.func}(")].count("\n") + 1
    lines = [f"{n.module}:{line}:def {n.func}(records: list[{n.cls}], limit: int) -> Decimal:",
             f"{n.api}:{rng.randint(30, 90)}:    total = {n.func}(records, limit=page_size)",
             f"{n.api}:{rng.randint(91, 140)}:        \"{n.noun}_total\": str({n.func}(open_items, limit)),",
             f"{n.test}:{rng.randint(8, 20)}:from {n.pkg}.{n.noun}_{n.tag} import {n.func}, load_{n.noun}s",
             f"{n.test}:{rng.randint(21, 40)}:    assert {n.func}(records, 3) == Decimal(\"30\")",
             f"{n.test}:{rng.randint(41, 60)}:    assert {n.func}(records, 0) == Decimal(\"0\")"]
    extra = rng.randint(0, 3)
    lines += [f"src/{n.pkg}/jobs_{n.tag}.py:{rng.randint(10, 200)}:    nightly = {n.func}(batch, limit=cap)"
              for _ in range(extra)]
    return "\n".join(lines)


def _pytest(test: str, passed: int, failed: list[str], seconds: float, root: str) -> str:
    dots = "." * passed + "F" * len(failed)
    head = ("=" * 29 + " test session starts " + "=" * 30 + "\nplatform linux -- Python 3.11.7, pytest-8.3.2, "
            f"pluggy-1.5.0\nrootdir: /workspace/{root}\ncollected {passed + len(failed)} items\n\n"
            f"{test} {dots}\n\n")
    tail = ", ".join(([f"{len(failed)} failed"] if failed else []) + [f"{passed} passed"])
    fails = "".join(f"FAILED {test}::{name}\n" for name in failed)
    return head + fails + f"{'=' * 10} {tail} in {seconds:.2f}s {'=' * 10}"


def bugfix_run(seed: int, index: int, salt: str = "", workload: str = "bugfix6") -> AgentRun:
    """One bug-fix agent run: 6 tool-call turns on a repository of its own."""
    rng = run_rng(workload, seed, salt, index)
    n = _names(rng)
    bad, good, symptom = rng.choice(_BUGS)
    module = _module_text(n, bad, rng)
    fixed = _fixed_function(n, good, module)
    test_name = f"test_{n.func}_respects_limit"
    task = (f"Repository {n.repo}. The test {n.test}::{test_name} fails: {symptom} by {n.func} in {n.module} "
            f"(assert Decimal('{rng.randint(11, 99)}') == Decimal('{rng.randint(100, 300)}')). "
            "Find the cause, fix it, run the tests, check the diagnostics and finish with a summary.")
    n_tests = rng.randint(6, 14)
    diag = (f"{n.module}:5:1 - information: Import \"field\" is used only in annotations\n"
            f"{n.module}:18:16 - warning: Type of parameter \"rows\" is partially unknown "
            f"(reportUnknownParameterType)\n0 errors, 1 warning, 1 information")
    turns = (
        ScriptedTurn(task, "read_file", {"path": n.module}, module),
        ScriptedTurn(None, "search_code", {"query": n.func, "path": "src"}, _grep(n, module, rng)),
        ScriptedTurn(None, "write_file", {"path": n.module, "content": fixed},
                     f"Wrote {fixed.count(chr(10)) + 1} lines ({len(fixed.encode())} bytes) to {n.module}"),
        ScriptedTurn(None, "run_command", {"command": f"python -m pytest -q {n.test}"},
                     _pytest(n.test, n_tests, [], rng.uniform(0.2, 1.5), n.repo)),
        ScriptedTurn(None, "get_diagnostics", {"path": n.module}, diag),
        ScriptedTurn(None, "summary", {"text": f"Fixed the loop bounds in {n.func} ({n.module}): {symptom}. "
                                               f"{n_tests} tests pass."}, None),
    )
    return AgentRun(f"{workload}-{salt or seed}-{index}-{n.tag}", workload, SYSTEM_BUGFIX, turns)


# ---------------------------------------------------------------------------
# deepcoding35

_ENTITIES = ["booking", "venue", "review", "ticket", "recipe", "author", "course", "lesson", "garden", "plant",
             "trip", "guide", "invoice", "client", "album", "track", "league", "player", "clinic", "doctor"]
_ADJ = ["amber", "brisk", "cobalt", "dapper", "ember", "fjord", "gusty", "hazel", "indigo", "jolly"]


def _wrote(path: str, rng: random.Random) -> str:
    lines = rng.randint(9, 60)
    return f"Wrote {lines} lines ({lines * rng.randint(24, 38)} bytes) to {path}"


def _coding_steps(app: str, e1: str, e2: str, e3: str, rng: random.Random) -> list[tuple]:
    """(user message, tool or None, call arguments, result) for the 35 turns."""
    t1, t2, t3 = f"tests/test_{e1}s.py", f"tests/test_{e2}s.py", f"tests/test_{e3}s.py"

    def pyt(test: str, passed: int, failed: tuple[str, ...] = ()) -> str:
        return _pytest(test, passed, list(failed), rng.uniform(0.3, 2.5), app)

    def w(path: str) -> str:
        return _wrote(path, rng)

    init = (f'from flask import Flask\n\n\ndef create_app(test_config=None):\n    app = Flask("{app}")\n'
            f'    app.config.from_mapping(DATABASE="instance/{app}.sqlite")\n    if test_config:\n'
            "        app.config.update(test_config)\n    from . import db\n    db.init_app(app)\n    return app\n")
    conftest = ("import pytest\n\nfrom app import create_app\n\n\n@pytest.fixture\ndef client(tmp_path):\n"
                f'    app = create_app({{"DATABASE": str(tmp_path / "{app}.sqlite")}})\n'
                "    return app.test_client()\n")

    def diag(path: str, k: str) -> str:
        return (f"{path}:{rng.randint(5, 40)}:12 - error: Argument of type \"str | None\" cannot be assigned to "
                f"parameter \"{k}\" of type \"str\"\n{path}:{rng.randint(41, 70)}:5 - warning: Import \"jsonify\" "
                "is not accessed\n1 error, 1 warning, 0 informations")

    return [
        (f"Let's build {app}, a Flask app for {e1}s, {e2}s and {e3}s. Start with app/__init__.py holding an "
         "application factory.", "write_file", {"path": "app/__init__.py", "content": init}, w("app/__init__.py")),
        ("Add app/db.py with get_db, close_db and an init-db command.", "write_file",
         {"path": "app/db.py", "content": "import sqlite3\n..."}, w("app/db.py")),
        (f"Write app/schema.sql with a {e1} table: id, name, created_at.", "write_file",
         {"path": "app/schema.sql", "content": f"CREATE TABLE {e1} (...);"}, w("app/schema.sql")),
        ("Initialise the database.", "run_command", {"command": "flask --app app init-db"},
         "Initialized the database.\nexit code 0"),
        (f"Add a blueprint app/{e1}s.py with GET /{e1}s returning every {e1} as JSON.", "write_file",
         {"path": f"app/{e1}s.py", "content": "from flask import Blueprint, jsonify\n..."}, w(f"app/{e1}s.py")),
        ("Run the tests.", "run_command", {"command": "python -m pytest -q"},
         pyt(t1, 2, (f"test_list_{e1}s",)) + "\nE   assert 404 == 200\nexit code 1"),
        ("Show me app/__init__.py again.", "read_file", {"path": "app/__init__.py"}, init),
        (f"Register the {e1}s blueprint in the factory.", "write_file",
         {"path": "app/__init__.py", "content": init + "..."}, w("app/__init__.py")),
        ("Rerun the tests.", "run_command", {"command": "python -m pytest -q"}, pyt(t1, 3)),
        ("Why an application factory instead of a module-level app?", None, None, None),
        (f"Add POST /{e1}s that validates the JSON body and returns 201.", "write_file",
         {"path": f"app/{e1}s.py", "content": "..."}, w(f"app/{e1}s.py")),
        (f"Check app/{e1}s.py for type errors.", "get_diagnostics", {"path": f"app/{e1}s.py"},
         diag(f"app/{e1}s.py", "name")),
        ("Fix those diagnostics.", "write_file", {"path": f"app/{e1}s.py", "content": "..."}, w(f"app/{e1}s.py")),
        (f"Add a {e2} table with a foreign key to {e1}.", "write_file",
         {"path": "app/schema.sql", "content": f"CREATE TABLE {e2} (...);"}, w("app/schema.sql")),
        (f"Add app/{e2}s.py with list and create routes, nested under /{e1}s/<id>/{e2}s.", "write_file",
         {"path": f"app/{e2}s.py", "content": "..."}, w(f"app/{e2}s.py")),
        ("Find every place that opens a database connection.", "search_code", {"query": "get_db\\(", "path": "app"},
         "\n".join(f"app/{m}.py:{rng.randint(5, 80)}:    db = get_db()" for m in ("db", f"{e1}s", f"{e1}s", f"{e2}s"))),
        (f"Write tests for the {e2} routes in {t2}.", "write_file", {"path": t2, "content": "..."}, w(t2)),
        ("Run them.", "run_command", {"command": f"python -m pytest -q {t2}"},
         pyt(t2, 3, (f"test_create_{e2}", f"test_list_{e2}s")) + "\nE   sqlite3.OperationalError: database is locked"),
        ("Read tests/conftest.py.", "read_file", {"path": "tests/conftest.py"}, conftest),
        ("Give every test a fresh database file.", "write_file",
         {"path": "tests/conftest.py", "content": conftest + "..."}, w("tests/conftest.py")),
        ("Run the whole suite.", "run_command", {"command": "python -m pytest -q"}, pyt("tests", 11)),
        (f"When should the {e2} routes return 404 and when 422?", None, None, None),
        (f"Add page and per_page query parameters to GET /{e1}s.", "write_file",
         {"path": f"app/{e1}s.py", "content": "..."}, w(f"app/{e1}s.py")),
        ("Check that file again.", "get_diagnostics", {"path": f"app/{e1}s.py"}, diag(f"app/{e1}s.py", "page")),
        (f"Add a {e3} table linked many-to-many to {e2}.", "write_file",
         {"path": "app/schema.sql", "content": f"CREATE TABLE {e3} (...);"}, w("app/schema.sql")),
        (f"Add app/{e3}s.py with its routes and register it.", "write_file",
         {"path": f"app/{e3}s.py", "content": "..."}, w(f"app/{e3}s.py")),
        ("Which routes read a JSON body without validating it?", "search_code",
         {"query": "get_json\\(", "path": "app"},
         "\n".join(f"app/{m}.py:{rng.randint(10, 90)}:    data = request.get_json()" for m in (f"{e2}s", f"{e3}s"))),
        (f"Validate the body of POST /{e3}s like the others.", "write_file",
         {"path": f"app/{e3}s.py", "content": "..."}, w(f"app/{e3}s.py")),
        ("Run the tests once more.", "run_command", {"command": "python -m pytest -q"}, pyt(t3, 14)),
        ("Add GET /health that checks the database connection.", "write_file",
         {"path": "app/health.py", "content": "..."}, w("app/health.py")),
        ("How would you run this behind gunicorn in production?", None, None, None),
        ("Write a Dockerfile for it.", "write_file", {"path": "Dockerfile", "content": "FROM python:3.11-slim\n..."},
         w("Dockerfile")),
        ("Build the image.", "run_command", {"command": f"docker build -t {app} ."},
         f"Step 1/7 : FROM python:3.11-slim\nStep 7/7 : CMD [\"gunicorn\", \"app:create_app()\"]\n"
         f"Successfully built {rng.getrandbits(48):012x}\nSuccessfully tagged {app}:latest\nexit code 0"),
        ("Anything you would refactor before we ship?", None, None, None),
        ("Summarise what we built.", "summary", {"text": f"{app}: a Flask app with {e1}, {e2} and {e3} routes."},
         None),
    ]


def deepcoding_run(seed: int, index: int, salt: str = "", workload: str = "deepcoding35") -> AgentRun:
    """One 35-turn coding conversation on an application of its own."""
    rng = run_rng(workload, seed, salt, index)
    tag = run_tag(rng)
    app = f"{rng.choice(_ADJ)}-{rng.choice(_ENTITIES)}s-{tag}"
    e1, e2, e3 = rng.sample(_ENTITIES, 3)
    turns = tuple(ScriptedTurn(u, t, c, r) for u, t, c, r in _coding_steps(app, e1, e2, e3, rng))
    return AgentRun(f"{workload}-{salt or seed}-{index}-{tag}", workload, SYSTEM_CODING, turns)


# ---------------------------------------------------------------------------
# entry points

NOVEL = {"bugfix6": bugfix_run, "deepcoding35": deepcoding_run}
REPEAT_PATTERNS = ("sequential", "interleaved", "round-robin")


def novel_runs(workload: str, runs: int, seed: int = 0, salt: str = "") -> list[AgentRun]:
    """`runs` agent runs of a novel workload (bugfix6 or deepcoding35)."""
    if workload not in NOVEL:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(NOVEL)}")
    if runs < 1:
        raise ValueError("runs must be at least 1")
    return [NOVEL[workload](seed, i, salt) for i in range(runs)]


def repeat_agents(seed: int = 0, salt: str = "", agents: int = 3, turns: int = 5) -> list[AgentRun]:
    """`agents` scripted bug-fix conversations of `turns` turns (the first turns of bugfix6)."""
    if not 1 <= turns <= 6:
        raise ValueError("turns must be 1..6")
    return [AgentRun(r.run_id.replace("bugfix6", "repeat"), "repeat", r.system, r.turns[:turns])
            for r in (bugfix_run(seed, a, salt, workload="repeat") for a in range(agents))]


def dispatch_order(pattern: str, agents: int, turns: int, seed: int = 0) -> list[tuple[int, int]]:
    """(agent, turn) in the order a pattern sends them. sequential: each agent's
    turns in a row; round-robin: turn t of every agent, then turn t+1;
    interleaved: a seeded random merge that keeps each agent's turn order."""
    if pattern == "sequential":
        return [(a, t) for a in range(agents) for t in range(turns)]
    if pattern == "round-robin":
        return [(a, t) for t in range(turns) for a in range(agents)]
    if pattern == "interleaved":
        rng = random.Random(f"interleave:{seed}")
        left = [0] * agents
        out = []
        while len(out) < agents * turns:
            a = rng.choice([i for i in range(agents) if left[i] < turns])
            out.append((a, left[a]))
            left[a] += 1
        return out
    raise ValueError(f"unknown pattern {pattern!r}; choose from {', '.join(REPEAT_PATTERNS)}")


def scripted_prompt(run: AgentRun, turn: int) -> list[dict]:
    """The fully scripted conversation of `run` up to turn `turn`'s request
    (every earlier assistant turn is its scripted call)."""
    msgs = run.first_messages()
    for k, t in enumerate(run.turns[:turn + 1]):
        if t.user is not None:
            msgs.append({"role": "user", "content": t.user})
        if k == turn:
            break
        cid = f"call_{k}"
        if t.tool is not None:
            msgs.append(call_message(t.tool, t.call or {}, cid))
            if t.result is not None:
                msgs.append({"role": "tool", "tool_call_id": cid, "content": t.result})
        else:
            msgs.append({"role": "assistant", "content": "Done."})
    return msgs
