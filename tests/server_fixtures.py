"""A real server on loopback for the server tests: the tiny random Llama of
tiny_models.py behind `create_app`, run by uvicorn on a background thread.

A random model never writes a tool call, so `ScriptedExecutor` wraps the real
executor and, for the programs a test names, replaces the sampled tokens by a
scripted text (byte tokenizer: one token per byte) followed by EOS. The
forward pass still runs, so KV, prefix hits and pins behave as for any other
request."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from agentserve.engine.executor import Executor, ExecutorResult
from agentserve.engine.scheduler_output import SchedulerOutput
from agentserve.llm import LLM
from agentserve.server.app import create_app
from agentserve.server.server_state import ServerConfig
from tiny_models import DEVICE, byte_tokenizer, hf_llama, loaded

EOS = 257  # <|im_end|> of the byte tokenizer


class ScriptedExecutor(Executor):
    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.scripts: dict[str, list[int]] = {}  # program id -> the tokens its requests sample
        self.fail_programs: set[str] = set()  # a step that runs one of these programs raises
        self.turns: dict[str, list[list[int]]] = {}  # program id -> the scripts of its next requests, in order
        self.queued: list[list[int]] = []  # the scripts of the next unscripted requests, whatever their program
        self.taken: dict[str, list[int]] = {}  # request id -> the script it took from `turns` or `queued`

    def script(self, program_id: str, text: str) -> None:
        self.scripts[program_id] = list(text.encode()) + [EOS]

    def script_turns(self, program_id: str, *texts: str) -> None:
        """The program's next requests sample these texts, one each, in order (then `script`'s, or the model's)."""
        self.turns[program_id] = [list(t.encode()) + [EOS] for t in texts]

    def script_next(self, *texts: str) -> None:
        """The next requests that no script names (any program, e.g. one named by a response id the
        test cannot know in advance) sample these texts, one each, in the order they first sample."""
        self.queued.extend(list(t.encode()) + [EOS] for t in texts)

    def _script_of(self, req) -> list[int] | None:
        taken = self.taken.get(req.request_id)
        if taken is not None:
            return taken
        if req.num_output_tokens == 0:
            turns = self.turns.get(req.program_id)
            if turns:
                taken = self.taken[req.request_id] = turns.pop(0)
                return taken
        script = self.scripts.get(req.program_id)
        if script is None and self.queued and req.num_output_tokens == 0:
            script = self.taken[req.request_id] = self.queued.pop(0)
        return script

    def execute(self, output: SchedulerOutput) -> ExecutorResult:
        if any(ch.request.program_id in self.fail_programs for ch in output.chunks):
            raise RuntimeError("injected executor failure")
        result = self.inner.execute(output)
        for ch in output.chunks:
            script = self._script_of(ch.request) if ch.sample else None
            if script is not None:
                i = ch.request.num_output_tokens
                result.sampled[ch.request.request_id] = [script[i] if i < len(script) else EOS]
        return result

    def release(self, request_id: str) -> None:
        self.taken.pop(request_id, None)
        self.inner.release(request_id)


def tiny_llm(positions: int = 1024, **kw) -> LLM:
    """`positions`: the model's context (the tiny model's default 1024; agents' prompts need more)."""
    opts = dict(dtype="float32", device=DEVICE, kv_cache_tokens=4096, block_size=4, max_num_seqs=8,
                max_num_batched_tokens=256)
    opts.update(kw)
    return LLM(loaded(hf_llama(positions=positions), byte_tokenizer()), **opts)


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 on a free port, on a daemon thread."""

    def __init__(self, app) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                   timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def start_tiny_server(api_key: str | None = "test-key", max_body_bytes: int = 64 * 1024,
                      config: dict | None = None, **llm_kw):
    """(server thread, llm, scripted executor) for the tiny model named 'tiny';
    `config`: more ServerConfig fields."""
    llm = tiny_llm(**llm_kw)
    scripted = ScriptedExecutor(llm.engine.executor)
    llm.engine.executor = scripted
    app = create_app(llm, ServerConfig(["tiny", "tiny-alias"], api_key=api_key, max_queue=64,
                                       max_body_bytes=max_body_bytes, **(config or {})))
    return ServerThread(app).start(), llm, scripted


def idle(server, timeout: float = 20.0) -> None:
    """Wait until the engine of a test server (`server.engine`, `server.llm`) holds no request,
    then check its block accounting."""
    deadline = time.monotonic() + timeout
    while server.engine.call_sync(lambda: server.llm.engine.has_unfinished):
        assert time.monotonic() < deadline, "requests still in the engine"
        time.sleep(0.02)
    server.engine.call_sync(server.llm.check_integrity)
