"""Fixtures shared by test modules: the default model's file and transformers'
model loaded from that same GGUF (slow to build: once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentserve.runner.loader import default_model_path


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
