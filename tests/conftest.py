"""Fixtures shared by test modules: the default model's file and transformers'
model loaded from that same GGUF (slow to build: once per session)."""

from __future__ import annotations

import os
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
