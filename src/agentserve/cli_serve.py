"""`agentserve serve`: the OpenAI-compatible server, with vllm-serve-like flags.

This module builds the model (it may import torch, through cli_model); the
HTTP layer it starts (`agentserve.server.app`) never does."""

from __future__ import annotations

import argparse
import logging
import os
import re
from pathlib import Path

from agentserve.cli_errors import CliError
from agentserve.cli_model import add_model_options, build_llm
from agentserve.server.learned_state import FILE_NAME as STATE_FILE_NAME
from agentserve.server.learned_state import SAVE_INTERVAL_S
from agentserve.server.render_cache import DEFAULT_ENTRIES as RENDER_CACHE_ENTRIES
from agentserve.server.responses_store import DEFAULT_MAX_BYTES as RESPONSES_STORE_BYTES
from agentserve.server.responses_store import DEFAULT_MAX_RESPONSES as RESPONSES_STORE_MAX
from agentserve.server.responses_store import parse_store_max
from agentserve.server.stats_log import STATS_INTERVAL_S

log = logging.getLogger("agentserve")

# GGUF file names end in their quantization ("SmolLM2-135M-Instruct.Q4_1",
# "Llama-3.2-1B-Instruct-Q4_K_M", "model.f16"): not part of the model's name.
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d+(?:_[A-Z0-9]+)*|F16|F32|BF16|FP16)$", re.IGNORECASE)


def default_served_name(model_source: str | Path) -> str:
    """A model's name from its file or folder: the stem without a quantization suffix."""
    p = Path(model_source)
    stem = p.stem if p.suffix.lower() == ".gguf" else p.name
    return _QUANT_SUFFIX.sub("", stem) or stem


def _store_max(s: str) -> tuple[int, int]:
    try:
        return parse_store_max(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _non_negative(kind: str):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{kind} must be an integer, got {s!r}") from None
        if v < 0:
            raise argparse.ArgumentTypeError(f"{kind} must be >= 0, got {v}")
        return v
    return parse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None ones (their help says what happens)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


# The command line's defaults (the app itself defaults to no queue limit).
DEFAULT_MAX_QUEUE = 1024
DEFAULT_MAX_BODY_BYTES = 16 * 2**20
DEFAULT_BODY_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 2048


def add_serve(sub) -> None:
    p = sub.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible API: POST /v1/chat/completions (tools, streaming), "
                    "POST /v1/completions, POST /v1/responses (OpenAI's Responses API, with GET/DELETE "
                    "/v1/responses/{id} for stored responses), GET /v1/models, GET /health, GET /metrics (Prometheus), "
                    "POST /v1/programs/{id}/release|end, and GET /openapi.json. Requests of one agent program are tied together by "
                    "the X-Program-Id header (or program_id / session_id / user); the scheduler keeps a "
                    "program's KV across its tool calls for a learned TTL.",
        formatter_class=HelpFormatter)
    add_server_options(p)
    p.set_defaults(func=cmd_serve)


def add_server_options(p) -> None:
    """The flags of `serve` (server, caches, model and engine, tool calls); `cluster` takes them too."""
    g = p.add_argument_group("server")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) clients send as `model`; the first is reported in responses "
                        "(default: the model file or folder name without its quantization suffix, e.g. "
                        "SmolLM2-135M-Instruct)")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all interfaces)")
    g.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* and /metrics (health and /openapi.json stay "
                        "open); give it several times for several tenants (api-key-1, api-key-2, ... in order). With "
                        "two or more tenants each one's prefix-cache hits, cached responses and program ids are its "
                        "own: no tenant can hit, detect, release or end another's")
    g.add_argument("--api-keys-file", default=None, metavar="PATH",
                   help="keys and their tenants, one 'KEY TENANT' per line (a tenant name: letters, digits, '.', "
                        "'_', '-'; several keys may name one tenant; blank lines and lines starting with # are "
                        "skipped); with or instead of --api-key")
    g.add_argument("--cached-tokens-report", choices=["exact", "none"], default="exact",
                   help="what usage.prompt_tokens_details.cached_tokens tells clients: 'exact' the prompt tokens "
                        "that were prefix-cache hits, 'none' always 0 (hides what the cache holds, e.g. when "
                        "clients share a tenant)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="log level of the server and of uvicorn (debug logs every request's token counts)")
    g.add_argument("--max-queue", type=_non_negative("--max-queue"), default=DEFAULT_MAX_QUEUE,
                   help="requests that may wait for admission at once; more get 503 (0: no limit)")
    g.add_argument("--max-body-bytes", type=_non_negative("--max-body-bytes"), default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body accepted; larger bodies get 413")
    g.add_argument("--request-body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S, metavar="SECONDS",
                   help="a request body that sends nothing for this long gets 408 and its connection is closed; "
                        "only silence is timed, never the whole upload, so a slow client that keeps sending is "
                        "never cut (0: wait forever)")
    g.add_argument("--max-connections", type=_non_negative("--max-connections"), default=DEFAULT_MAX_CONNECTIONS,
                   metavar="N",
                   help="connections carrying a request at once (streams included; idle keep-alive ones are closed "
                        "by uvicorn after 5 s and not counted); more get 503 with Retry-After and are closed "
                        "(Anthropic's 529 on /v1/messages). Keep it above --max-queue plus the running requests, "
                        "and below the open-file limit (ulimit -n). 0: no limit")
    g.add_argument("--max-connections-per-client", type=_non_negative("--max-connections-per-client"), default=0,
                   metavar="N",
                   help="the same bound for each client address (the peer's, or X-Forwarded-For's when the peer is "
                        "a proxy uvicorn trusts: FORWARDED_ALLOW_IPS, default 127.0.0.1), so that one client that "
                        "stalls many connections cannot take them all; behind a proxy that does not forward the "
                        "address every client shares one, as in `agentserve cluster`, whose replicas see every "
                        "request come from its router. 0: no limit")
    g.add_argument("--graceful-shutdown-s", type=float, default=5.0,
                   help="on SIGINT/SIGTERM, seconds to let requests in flight finish before they are aborted")
    g.add_argument("--gc", choices=["engine", "python"], default="engine",
                   help="Python's cyclic garbage collector in the server process: 'engine' freezes the start-up "
                        "heap once the model is loaded and runs full collections only when the engine runs out "
                        "of work (at most every minute) or, if it never does, every 10 minutes, so that no step "
                        "waits on a 100+ ms walk over the KV state (young collections stay as CPython runs them); "
                        "'python': CPython's defaults")
    g.add_argument("--log-stats-interval", type=float, default=STATS_INTERVAL_S, metavar="SECONDS",
                   help="seconds between the engine's stats log lines (throughput, prefix hits, queue, KV and "
                        "pin use, model busy time); 0: none")
    c = p.add_argument_group("caches")
    c.add_argument("--render-cache", type=_non_negative("--render-cache"), default=RENDER_CACHE_ENTRIES,
                   metavar="N",
                   help="chat prompts whose token ids are kept (LRU, at most 8M tokens in all) so that a "
                        "conversation's next turn tokenizes only what it appended; the reuse is checked "
                        "character by character and at the tokenizer's cut points, and any difference means "
                        "a full tokenization; 0: off")
    c.add_argument("--response-cache", type=_non_negative("--response-cache"), default=0, metavar="N",
                   help="keep the N latest finished responses and answer an exact repeat (same prompt tokens, "
                        "sampling parameters, API key and model) from the cache, a streamed one with the "
                        "original's chunks. Changes sampling: a request without a seed is seeded from its "
                        "prompt, so identical prompts give identical outputs at any temperature (send a seed, "
                        "or 'Cache-Control: no-cache', for a fresh sample). 0: off")
    c.add_argument("--responses-store-max", type=_store_max, default=f"{RESPONSES_STORE_MAX},{RESPONSES_STORE_BYTES // 2**20}MiB",
                   metavar="COUNT[,BYTES]",
                   help="the Responses API's stored responses (store: true, the default), which previous_response_id "
                        "continues and GET /v1/responses/{id} returns: at most COUNT responses and BYTES of them "
                        "(KiB, MiB, GiB suffixes; the default if left out), least recently used dropped first; in "
                        "memory only, so a restart forgets them (a later previous_response_id of a dropped one is "
                        "a 404 previous_response_not_found)")
    s = p.add_argument_group("learned state")
    s.add_argument("--state-dir", default=None, metavar="PATH",
                   help=f"keep what the server learned (each tool's durations, the TTL model's eta and queueing "
                        f"delays, the step-time fit) in PATH/{STATE_FILE_NAME} (SQLite; `cluster`: one file per "
                        "replica, replica-N.sqlite), written atomically every --state-save-interval seconds and at "
                        "shutdown, and taken up at start, so a restart does not start cold. A file from another "
                        "model or schema version, or one that cannot be read, is moved aside with a log line "
                        "saying why (default: kept in memory only)")
    s.add_argument("--state-save-interval", type=float, default=SAVE_INTERVAL_S, metavar="SECONDS",
                   help="seconds between saves of the learned state (with --state-dir)")
    add_model_options(p)
    _add_tool_call_options(p)


def _graceful_server(config, engine, grace: float):
    """uvicorn's Server, whose shutdown (SIGINT/SIGTERM) first lets the requests
    in flight finish for `grace` seconds and then ends the rest through the
    engine, so every stream closes with an error event and [DONE] instead of
    being cancelled mid-write."""
    import asyncio

    import uvicorn

    class GracefulServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            drain = asyncio.ensure_future(engine.drain(grace))
            await super().shutdown(sockets)  # closes the listeners, waits for the connections
            await drain

    return GracefulServer(config)


def _add_tool_call_options(p) -> None:
    from agentserve.policy.toolcall_stream import GRACE_TOKENS
    from agentserve.server.tool_validation import UNDECLARED_MODES

    t = p.add_argument_group(
        "tool calls", "A streaming validator follows the tool calls of chat requests that declare tools "
        "(Hermes <tool_call> blocks, Llama 3 JSON) as they are decoded.")
    t.add_argument("--tool-call-early-stop", action=argparse.BooleanOptionalAction, default=True,
                   help="end a request at the structural close of its tool call(s) instead of decoding the "
                        "prose a model may write after a call; only a call of a declared tool whose text the "
                        "output parser accepts ends it, and the reply is what it would have been up to that "
                        "point (finish_reason tool_calls)")
    t.add_argument("--tool-call-grace-tokens", type=_non_negative("--tool-call-grace-tokens"), default=GRACE_TOKENS,
                   metavar="N",
                   help="after a call's close, wait up to N tokens of blank text for a parallel call to begin "
                        "(a next call that has begun is always followed); 0: stop right at the close")
    t.add_argument("--undeclared-tool-calls", choices=UNDECLARED_MODES, default="text",
                   help="a call naming a tool the request did not declare never reaches the client as a call: "
                        "'text' returns it as content (finish_reason stop); 'regenerate' ends the request where "
                        "the call began and decodes a call in its place under the tools' grammar, in the same "
                        "program (needs xgrammar)")
    t.add_argument("--bash-block-early-stop", action="store_true",
                   help="also end chat requests without tools after their first complete ```bash block "
                        "(mini-swe-agent's one-command-a-turn format); off by default, since an ordinary "
                        "answer may hold several blocks")


def _tool_call_config(args):
    import importlib.util

    from agentserve.server.tool_validation import ValidatorConfig

    if args.undeclared_tool_calls == "regenerate" and importlib.util.find_spec("xgrammar") is None:
        raise CliError("--undeclared-tool-calls regenerate needs xgrammar: pip install 'agentserve[structured]'")
    return ValidatorConfig(early_stop=args.tool_call_early_stop, grace_tokens=args.tool_call_grace_tokens,
                           undeclared=args.undeclared_tool_calls, bash_blocks=args.bash_block_early_stop)


def api_keys(args) -> dict[str, str]:
    """The API keys and their tenants that the flags name (a CliError if malformed)."""
    from agentserve.server.tenants import TenantConfigError, key_tenants

    try:
        return key_tenants(args.api_key or (), args.api_keys_file)
    except TenantConfigError as e:
        raise CliError(str(e)) from None


def _keys_line(tenants, n_keys: int) -> str:
    if not n_keys:
        return "not required"
    scoped = "; caches and program ids scoped by tenant" if len(tenants) > 1 else ""
    return f"required ({n_keys} key(s), {len(tenants)} tenant(s){scoped})"


def check_serve_args(args) -> None:
    """The server flags' values make sense (before anything is loaded)."""
    if not 0 < args.port < 65536:
        raise CliError(f"--port must be in 1..65535, got {args.port}")
    if args.log_stats_interval < 0:
        raise CliError(f"--log-stats-interval must be 0 or more, got {args.log_stats_interval}")
    if args.max_body_bytes < 1:
        raise CliError("--max-body-bytes must be at least 1")
    if not args.request_body_timeout >= 0:
        raise CliError(f"--request-body-timeout must be 0 or more seconds, got {args.request_body_timeout}")
    if not args.state_save_interval > 0 or args.state_save_interval == float("inf"):
        raise CliError(f"--state-save-interval must be a number of seconds > 0, got {args.state_save_interval}")
    if args.state_dir is not None:
        state_dir(args.state_dir)


def state_dir(path: str) -> Path:
    """--state-dir, made if missing and checked writable (a CliError if not)."""
    d = Path(path)
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".agentserve-write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CliError(f"--state-dir {path!r} is not a writable directory: {e.strerror or e}") from None
    return d


def state_file(args) -> str | None:
    """The state file of this server (`state_name`: a cluster replica's own, set by the replica)."""
    if args.state_dir is None:
        return None
    name = getattr(args, "state_name", None)
    return str(state_dir(args.state_dir) / (f"{name}.sqlite" if name else STATE_FILE_NAME))


def setup_logging(args) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("agentserve").setLevel(args.log_level.upper())


def build_server(args, llm_factory=None):
    """What `agentserve serve` serves, from its flags: `(app, llm, config)`. The LLM is built
    on the engine thread it will step on, by `llm_factory(args)` (default: `build_llm`, the
    model flags); `agentserve cluster` builds each replica with this same function."""
    from agentserve.engine.gc_policy import POLICIES
    from agentserve.server.app import create_app
    from agentserve.server.engine_thread import EngineThread
    from agentserve.server.server_state import ServerConfig

    tool_calls = _tool_call_config(args)
    keys = api_keys(args)
    factory = llm_factory or build_llm
    thread = EngineThread()
    llm = thread.run(lambda: factory(args))  # loaded where it will step: see engine_thread.py
    names = args.served_model_name or [default_served_name(llm.model_source)]
    config = ServerConfig(names, tool_calls=tool_calls, api_keys=keys, max_queue=args.max_queue or None,
                          max_body_bytes=args.max_body_bytes, request_body_timeout=args.request_body_timeout or None,
                          max_connections=args.max_connections or None,
                          max_connections_per_client=args.max_connections_per_client or None,
                          stats_interval=args.log_stats_interval or None,
                          render_cache=args.render_cache, response_cache=args.response_cache,
                          cached_tokens_report=args.cached_tokens_report, gc_policy=POLICIES[args.gc],
                          responses_store_max=args.responses_store_max[0],
                          responses_store_bytes=args.responses_store_max[1],
                          state_file=state_file(args), state_save_interval=args.state_save_interval)
    return create_app(llm, config, thread=thread), llm, config


def cmd_serve(args) -> int:
    import uvicorn

    check_serve_args(args)
    _tool_call_config(args)
    keys = api_keys(args)
    setup_logging(args)
    app, llm, config = build_server(args)
    names = config.served_model_names
    kv = llm.scheduler.kv
    log.info("serving %s (%s) on http://%s:%d/v1 - max_model_len %d; KV cache %d tokens (%.1f MiB, %d blocks "
             "of %d); policy %s; max queue %s; API keys %s; render cache %s; response cache %s", names[0],
             llm.model_source, args.host, args.port,
             llm.max_model_len, kv.num_blocks * kv.block_size, llm.kv_cache.bytes / 2**20, kv.num_blocks,
             kv.block_size, llm.scheduler.policy.name, config.max_queue or "unlimited",
             _keys_line(config.tenants.names, len(keys)), args.render_cache or "off",
             args.response_cache or "off")
    # uvicorn's own limit is only a backstop: the engine ends late requests first.
    uconfig = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="on",
                             timeout_graceful_shutdown=args.graceful_shutdown_s + 5)
    server = _graceful_server(uconfig, app.state.server.engine, args.graceful_shutdown_s)
    try:
        server.run()  # uvicorn handles SIGINT/SIGTERM: stop accepting, drain, then the lifespan stops the engine
    except OSError as e:
        raise CliError(f"cannot listen on {args.host}:{args.port}: {e}") from None
    return 0 if server.started else 1
