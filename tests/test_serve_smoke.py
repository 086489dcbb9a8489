"""`agentserve serve` as a user starts it, with the real default model:
it comes up, answers a chat request and a tool-call request, and stops
cleanly on SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(smollm_path):
    openai = pytest.importorskip("openai")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "agentserve.cli", "serve", "--port", str(port),
                             "--kv-cache-tokens", "8192", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited: {proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("server did not become healthy in 120 s")
    yield proc, openai.OpenAI(base_url=url + "/v1", api_key="unused")
    if proc.poll() is None:
        proc.kill()


def test_default_model_chat_and_tool_call(served):
    proc, client = served
    model = client.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct"
    r = client.chat.completions.create(model=model, temperature=0, max_tokens=20,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}},
                                                              "required": ["city"]}}}]
    r = client.chat.completions.create(model=model, temperature=0, max_tokens=60, tools=tools,
                                       tool_choice="required", extra_headers={"X-Program-Id": "smoke"},
                                       messages=[{"role": "user", "content": "What's the weather in Paris?"}])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in call.function.arguments


def test_sigterm_stops_cleanly(served):
    proc, _ = served
    proc.send_signal(signal.SIGTERM)
    # uvicorn drains, then re-raises the signal it caught, so the exit status says "terminated"
    assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    out = proc.stdout.read()
    assert "Traceback" not in out, out
