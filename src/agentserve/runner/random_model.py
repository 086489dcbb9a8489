"""Random-weight models of a known shape (`random:llama3.1-8b`): what
`agentserve profile` times on a machine where that model's checkpoint is not
present. Step times depend on the shape, not on the weights' values, so a
profile measured this way is the one the simulator and the TTL cost model need;
its text output is noise. The tokenizer is byte-level (no merges)."""

from __future__ import annotations

import torch

from agentserve.runner.checkpoint import LoadedModel, expected_shapes
from agentserve.runner.config import ModelConfig
from agentserve.runner.tokenizer import byte_level_tokenizer

PREFIX = "random:"
_BLOCK = 1 << 22  # values drawn per model; every matrix repeats them

# Hugging Face config.json fields of each shape (the published configs' sizes;
# Llama 3.1's long-context RoPE scaling is left out: it does not change a step's time).
SHAPES: dict[str, dict] = {
    "llama3.1-8b": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                        max_position_embeddings=32768),
    "llama3.2-1b": dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                        max_position_embeddings=32768, tie_word_embeddings=True),
    "smollm2-135m": dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True),
}


def is_random_spec(spec: object) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def random_model(spec: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> LoadedModel:
    """`random:<shape>`: each matrix is one seeded block of N(0, 0.02) values
    repeated (drawing 8B values one by one takes minutes on a CPU; the values
    do not change a step's time); norms are 1."""
    shape = spec.removeprefix(PREFIX)
    if shape not in SHAPES:
        raise ValueError(f"unknown random model shape {shape!r}: one of {', '.join(sorted(SHAPES))} "
                         f"(as {PREFIX}<shape>)")
    specials = ["<|im_start|>", "<|im_end|>"]
    cfg = ModelConfig.from_hf(dict(SHAPES[shape], eos_token_id=256 + 1, rms_norm_eps=1e-5), name=f"random-{shape}")
    block = torch.empty(_BLOCK, dtype=dtype).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(seed))
    weights = {}
    for name, size in expected_shapes(cfg).items():
        t = torch.empty(size, dtype=dtype)
        if len(size) == 1:
            t.fill_(1.0)
        else:
            flat = t.view(-1)
            for i in range(0, flat.numel(), _BLOCK):
                k = min(_BLOCK, flat.numel() - i)
                flat[i:i + k].copy_(block[:k])
        weights[name] = t
    return LoadedModel(cfg, weights, byte_level_tokenizer(specials, eos="<|im_end|>"), None, spec)
