"""What the server learned, kept over a restart (`agentserve serve --state-dir`).

The policy's tool-duration windows, the TTL model's eta and queueing delays
(policy/tool_stats.py, policy/ttl.py) and the step-time fit
(engine/step_time.py) live in memory; a deploy or a crash would send the TTL
model back to its cold-start defaults and the step-time model back to its
cautious first steps. Those objects export and import their state as plain
data; this module keeps it in an SQLite file (the standard library's
sqlite3), one per server (`agentserve cluster`: one per replica).

The file is written whole and atomically: a new database beside it, synced,
then renamed over it, so a process killed while writing leaves the last file
as it was. It is written every `interval` seconds (the engine thread exports,
a writer thread writes) and once more at shutdown.

On start the file is read back. One that is not an agentserve state file,
that SQLite cannot read, from another schema version, learned with another
model, or holding values the objects refuse, is moved aside
(`NAME.<why>-<time>`) with one log line saying why, and the server starts
cold. A file learned on another device, dtype or weight format keeps its tool
statistics and eta, but its step-time fit is left out (the fit describes that
machine).

Nothing per tenant is kept: the tool statistics are learned per tool name
from every tenant's calls (as the policy learns them), the programs waiting
for a tool (named by tenant) are not stored, and no program id or prompt
reaches the file."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("agentserve.server")

SCHEMA_VERSION = 1
APPLICATION_ID = 0x41675376  # "AgSv": PRAGMA application_id of an agentserve state file
SAVE_INTERVAL_S = 60.0
FILE_NAME = "learned-state.sqlite"

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE tools (position INTEGER PRIMARY KEY, tool TEXT NOT NULL UNIQUE);
CREATE TABLE tool_samples (position INTEGER NOT NULL, seq INTEGER NOT NULL, seconds REAL NOT NULL,
                           PRIMARY KEY (position, seq));
CREATE TABLE global_samples (seq INTEGER PRIMARY KEY, tool TEXT NOT NULL, seconds REAL NOT NULL);
CREATE TABLE eta_programs (seq INTEGER PRIMARY KEY, turns INTEGER NOT NULL);
CREATE TABLE queue_delays (seq INTEGER PRIMARY KEY, seconds REAL NOT NULL);
CREATE TABLE step_samples (kind TEXT NOT NULL, seq INTEGER NOT NULL, f0 REAL, f1 REAL, f2 REAL, f3 REAL,
                           f4 REAL, f5 REAL, f6 REAL, seconds REAL NOT NULL, PRIMARY KEY (kind, seq));
CREATE TABLE step_ratios (seq INTEGER PRIMARY KEY, ratio REAL NOT NULL);
"""
_STEP_FEATURES = 7


class Rejected(Exception):
    """The file cannot be taken up; `tag` names why in the moved-aside file's name."""

    def __init__(self, tag: str, why: str) -> None:
        super().__init__(why)
        self.tag = tag


def model_identity(llm: Any) -> dict[str, str]:
    """What a state file must have been learned with: `model`, the model's name and shape
    (a file of another model is refused), and `runner`, the device, dtype and weight format
    (a file from another runner keeps all but its step-time fit)."""
    cfg = llm.config
    name = Path(str(llm.model_source)).name  # the file's name, not where it lies
    shape = (f"{getattr(cfg, 'arch', 'llama')} layers={cfg.num_layers} hidden={cfg.hidden_size} "
             f"heads={cfg.num_heads}/{cfg.num_kv_heads} vocab={cfg.vocab_size}")
    model = getattr(llm, "model", None)
    dtype = str(getattr(llm, "dtype", "?")).removeprefix("torch.")
    runner = f"{getattr(llm, 'device', '?')} {dtype} {getattr(model, 'weight_format', '?')}"
    return {"model": f"{name} ({shape})", "runner": runner}


def export_learned(scheduler: Any) -> dict[str, Any]:
    """The scheduler's learned state (on the engine thread, or with the engine stopped)."""
    return {"policy": scheduler.policy.export_state(), "step_time": scheduler.step_model.export_state()}


def import_learned(scheduler: Any, state: dict[str, Any]) -> None:
    """Take up `export_learned`'s state (a part missing from it is left as it is). All or
    nothing: ValueError, TypeError or KeyError on malformed data, and nothing changed."""
    step = state.get("step_time")
    if step is not None:  # checked on a fresh model first: the policy's import checks before it changes
        type(scheduler.step_model)(scheduler.step_model.window).import_state(step)
    if "policy" in state:
        scheduler.policy.import_state(state["policy"])
    if step is not None:
        scheduler.step_model.import_state(step)


def summary(state: dict[str, Any]) -> str:
    """A few words on what a state holds, for the log."""
    pol = state.get("policy", {})
    tools = pol.get("tool_stats", {}).get("tools", [])
    step = state.get("step_time")
    parts = [f"{len(tools)} tool(s), {sum(len(xs) for _, xs in tools)} duration(s)"]
    if "eta" in pol:
        parts.append(f"eta from {len(pol['eta'])} program(s)")
    parts.append(f"step-time fit from {len(step['prefill']) + len(step['decode'])} step(s)" if step
                 else "no step-time fit")
    return ", ".join(parts)


# --- the file ---

def write_state(path: Path, state: dict[str, Any], identity: dict[str, str],
                wall: Callable[[], float] = time.time) -> None:
    """Write `state` to `path` atomically: a new database beside it, synced, renamed over it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink(missing_ok=True)
        con = sqlite3.connect(tmp, isolation_level=None)
        try:
            con.execute("PRAGMA journal_mode = OFF")  # the rename is the commit
            con.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            con.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            con.execute("BEGIN")
            for stmt in filter(str.strip, _SCHEMA.split(";")):
                con.execute(stmt)
            _write_rows(con, state, identity, wall())
            con.execute("COMMIT")
        finally:
            con.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:  # the rename itself, on the directory
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _write_rows(con: sqlite3.Connection, state: dict[str, Any], identity: dict[str, str], saved_at: float) -> None:
    meta = {"schema_version": str(SCHEMA_VERSION), "saved_at": f"{saved_at:.3f}", **identity}
    con.executemany("INSERT INTO meta VALUES (?, ?)", meta.items())
    pol = state.get("policy", {})
    stats = pol.get("tool_stats")
    if stats is not None:
        con.execute("INSERT INTO meta VALUES ('tool_shifts', ?)", (str(int(stats.get("shifts", 0))),))
        con.executemany("INSERT INTO tools VALUES (?, ?)", ((i, t) for i, (t, _) in enumerate(stats["tools"])))
        con.executemany("INSERT INTO tool_samples VALUES (?, ?, ?)",
                        ((i, k, x) for i, (_, xs) in enumerate(stats["tools"]) for k, x in enumerate(xs)))
        con.executemany("INSERT INTO global_samples VALUES (?, ?, ?)",
                        ((k, t, x) for k, (x, t) in enumerate(stats["global"])))
    if "eta" in pol:
        con.executemany("INSERT INTO eta_programs VALUES (?, ?)", enumerate(pol["eta"]))
    if "queue_delays" in pol:
        con.executemany("INSERT INTO queue_delays VALUES (?, ?)", enumerate(pol["queue_delays"]))
    step = state.get("step_time")
    if step is not None:
        con.execute("INSERT INTO meta VALUES ('step_time', 'yes')")
        for kind in ("prefill", "decode"):
            con.executemany("INSERT INTO step_samples VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            ((kind, k, *row) for k, row in enumerate(step[kind])))
        con.executemany("INSERT INTO step_ratios VALUES (?, ?)", enumerate(step["ratios"]))
    parts = [p for p in ("eta", "queue_delays") if p in pol]
    con.execute("INSERT INTO meta VALUES ('policy_parts', ?)", (",".join(parts),))


def read_state(path: Path, identity: dict[str, str]) -> dict[str, Any]:
    """The state in `path`, checked against this server's `identity`. Raises Rejected (the
    file is not to be used, and why), FileNotFoundError or another OSError (it cannot be read)."""
    path = Path(path)
    with open(path, "rb") as f:  # raises when missing or unreadable, before SQLite makes an empty one
        head = f.read(16)
    if head != b"SQLite format 3\x00":
        raise Rejected("corrupt", "not an SQLite database" if head else "empty")
    try:
        con = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True)
    except sqlite3.Error as e:
        raise Rejected("corrupt", f"SQLite cannot open it ({e})") from None
    try:
        try:
            app, version = con.execute("PRAGMA application_id").fetchone()[0], \
                con.execute("PRAGMA user_version").fetchone()[0]
            if app != APPLICATION_ID:
                raise Rejected("foreign", "an SQLite database that is not an agentserve state file")
            if version != SCHEMA_VERSION:
                raise Rejected(f"schema-v{version}", f"schema version {version}; this server reads version "
                                                     f"{SCHEMA_VERSION}")
            meta = dict(con.execute("SELECT key, value FROM meta"))
            if meta.get("model") != identity.get("model"):
                raise Rejected("other-model", f"learned with {meta.get('model')!r}; this server runs "
                                              f"{identity.get('model')!r}")
            return _read_rows(con, meta, identity)
        except sqlite3.Error as e:
            raise Rejected("corrupt", f"SQLite cannot read it ({e})") from None
    finally:
        con.close()


def _read_rows(con: sqlite3.Connection, meta: dict[str, str], identity: dict[str, str]) -> dict[str, Any]:
    tools = {i: [t, []] for i, t in con.execute("SELECT position, tool FROM tools ORDER BY position")}
    for i, x in con.execute("SELECT position, seconds FROM tool_samples ORDER BY position, seq"):
        if i not in tools:
            raise Rejected("corrupt", f"samples of tool #{i}, which the file does not name")
        tools[i][1].append(x)
    policy: dict[str, Any] = {"tool_stats": {
        "tools": list(tools.values()),
        "global": [[x, t] for t, x in con.execute("SELECT tool, seconds FROM global_samples ORDER BY seq")],
        "shifts": int(meta.get("tool_shifts", "0"))}}
    parts = set(filter(None, meta.get("policy_parts", "").split(",")))
    if "eta" in parts:
        policy["eta"] = [n for (n,) in con.execute("SELECT turns FROM eta_programs ORDER BY seq")]
    if "queue_delays" in parts:
        policy["queue_delays"] = [x for (x,) in con.execute("SELECT seconds FROM queue_delays ORDER BY seq")]
    state: dict[str, Any] = {"policy": policy, "saved_at": meta.get("saved_at")}
    if meta.get("step_time") == "yes":
        if meta.get("runner") != identity.get("runner"):
            log.info("learned state: the step-time fit was learned on %s, this server runs %s: left out",
                     meta.get("runner"), identity.get("runner"))
        else:
            cols = ", ".join(f"f{i}" for i in range(_STEP_FEATURES))
            step: dict[str, Any] = {kind: [list(row) for row in con.execute(
                f"SELECT {cols}, seconds FROM step_samples WHERE kind = ? ORDER BY seq", (kind,))]
                for kind in ("prefill", "decode")}
            step["ratios"] = [r for (r,) in con.execute("SELECT ratio FROM step_ratios ORDER BY seq")]
            state["step_time"] = step
    return state


def move_aside(path: Path, tag: str, wall: Callable[[], float] = time.time) -> Path | None:
    """Rename `path` to `NAME.<tag>-<local time>` beside it; None if it cannot be moved."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(wall()))
    target = path.with_name(f"{path.name}.{tag}-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.{tag}-{stamp}-{n}")
    try:
        os.replace(path, target)
    except OSError:
        return None
    return target


def load_state(path: Path, identity: dict[str, str], wall: Callable[[], float] = time.time) -> dict[str, Any] | None:
    """The state in `path` for this server, or None (start cold): nothing there, or a file that
    was moved aside (or could not be read) with one log line saying why."""
    path = Path(path)
    try:
        return read_state(path, identity)
    except FileNotFoundError:
        return None
    except Rejected as e:
        return _reject(path, e.tag, str(e), wall)
    except OSError as e:
        log.warning("learned state: cannot read %s (%s); starting cold", path, e.strerror or e)
        return None


def _reject(path: Path, tag: str, why: str, wall: Callable[[], float]) -> None:
    moved = move_aside(path, tag, wall)
    where = f"moved aside to {moved.name}" if moved is not None else "it could not be moved aside"
    log.warning("learned state: %s is %s; %s, starting cold", path, why, where)
    return None


# --- the server's keeper ---

class LearnedState:
    """A server's state file: `load` into the scheduler at start, `tick` on the engine thread
    (an export every `interval` seconds, written by a writer thread), `close` at shutdown (the
    last export, written before it returns)."""

    def __init__(self, path: Path | str, identity: dict[str, str], interval: float = SAVE_INTERVAL_S,
                 wall: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.identity = identity
        self.interval = interval
        self.wall = wall
        self.saves = 0  # files written
        self.failures = 0  # writes that failed (logged)
        self._last: float | None = None  # the engine clock's time of the last export
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None
        self._closed = False

    def load(self, scheduler: Any) -> bool:
        """Take up the file's state, if there is a usable one; whether it was taken up."""
        for stale in self.path.parent.glob(f".{self.path.name}.*.tmp"):  # a write cut short
            stale.unlink(missing_ok=True)
        state = load_state(self.path, self.identity, self.wall)
        if state is None:
            log.info("learned state: nothing to load from %s; starting cold, saving every %.0f s", self.path,
                     self.interval)
            return False
        try:
            import_learned(scheduler, state)
        except (ValueError, TypeError, KeyError) as e:
            _reject(self.path, "corrupt", f"holding values the server refuses ({e})", self.wall)
            return False
        age = ""
        try:
            age = f", saved {max(0.0, self.wall() - float(state['saved_at'])):.0f} s ago"
        except (TypeError, ValueError):
            pass
        log.info("learned state loaded from %s: %s%s", self.path, summary(state), age)
        return True

    def tick(self, now: float, scheduler: Any) -> None:
        """On the engine thread: every `interval` seconds, hand an export to the writer."""
        if self._last is None:
            self._last = now
            return
        if now - self._last < self.interval or self._closed:
            return
        if self._pending is not None and not self._pending.done():
            return  # the last one is still being written
        self._last = now
        state = export_learned(scheduler)
        if self._writer is None:
            self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="agentserve-state")
        self._pending = self._writer.submit(self._write, state)

    def close(self, scheduler: Any) -> None:
        """At shutdown, with the engine stopped: the last export, written now (once)."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        state = export_learned(scheduler)
        if self._write(state):
            log.info("learned state saved to %s: %s", self.path, summary(state))

    def _write(self, state: dict[str, Any]) -> bool:
        try:
            write_state(self.path, state, self.identity, self.wall)
        except (OSError, sqlite3.Error, ValueError, TypeError) as e:
            self.failures += 1
            log.warning("learned state: writing %s failed (%s); the last file stays", self.path, e)
            return False
        self.saves += 1
        return True

