"""Load a Hugging Face model folder (config.json, *.safetensors, tokenizer.json).

Tensors keep the dtype they are stored in (a bf16 checkpoint stays bf16): the
runner casts to its compute dtype once, and upcasting a large checkpoint to
float32 here would double its host memory for nothing.

End-of-sequence ids are gathered from every file that names some -
config.json, generation_config.json (chat models often list their end-of-turn
token only there) and the tokenizer config - so generation stops on any.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from agentserve.runner.config import ModelConfig, UnsupportedModel
from agentserve.runner.checkpoint import LoadedModel, check_weights
from agentserve.runner.tokenizer import Tokenizer

# Buffers some older checkpoints saved alongside the weights; recomputed by the runner.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_safetensors_dir(path: str | Path) -> LoadedModel:
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder not found: {folder}")
    try:
        config = ModelConfig.from_hf(_read_json(folder / "config.json"), name=folder.name)
    except UnsupportedModel as e:
        raise UnsupportedModel(f"{folder}: {e}") from None
    except (KeyError, TypeError) as e:
        raise ValueError(f"{folder}/config.json lacks a field the runner needs or has one of the wrong type: "
                         f"{e}") from None
    generation = _read_json(folder / "generation_config.json", required=False)
    config.eos_token_ids = _merge_ids(config.eos_token_ids, _as_ids(generation.get("eos_token_id")))
    tok_config = _read_json(folder / "tokenizer_config.json", required=False)
    tokenizer = Tokenizer.from_file(folder / "tokenizer.json", tok_config,
                                    eos_token_ids=config.eos_token_ids, bos_token_id=config.bos_token_id)
    # The tokenizer config may name yet another EOS; the model config lists them all.
    config.eos_token_ids = _merge_ids(config.eos_token_ids, tokenizer.eos_token_ids)
    tokenizer.eos_token_ids = list(config.eos_token_ids)
    if config.bos_token_id is None:
        config.bos_token_id = tokenizer.bos_token_id
    weights = load_weights(folder, config)
    check_weights(config, weights, str(folder))
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer,
                       chat_template=_chat_template(folder, tok_config), source=str(folder))


def load_weights(folder: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every *.safetensors file in the folder (one or many shards), in stored dtype."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        for name, tensor in load_file(str(f)).items():
            if name in weights:
                raise ValueError(f"{folder}: tensor {name} appears in more than one shard")
            weights[name] = tensor
    for name in [n for n in weights if n.endswith(_IGNORED_SUFFIXES)]:
        del weights[name]
    if config.tie_word_embeddings:
        # Tied means lm_head *is* the embedding; a stored copy would only be a duplicate.
        weights.pop("lm_head.weight", None)
    return weights


def _chat_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    """`chat_template.jinja` (where current transformers writes it), else the
    `chat_template` entry of tokenizer_config.json (a string, or a list of
    named templates of which "default" is the one to use)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template


def _read_json(path: Path, required: bool = True) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path.name} not found in {path.parent}")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _merge_ids(first: list[int], more: list[int]) -> list[int]:
    return list(dict.fromkeys([*first, *more]))
