#!/usr/bin/env bash
# Install llama.cpp's OpenAI-compatible server (llama-cpp-python[server]) into its
# own virtual environment, .peers/llamacpp-venv at the repository root, as a peer
# to measure agentserve against (see README.md beside this script).
#
#   bash benchmarks/peers/install_llamacpp.sh [--force]
#
# llama-cpp-python ships only an sdist on PyPI: pip builds llama.cpp from source
# with cmake + ninja (about 10 minutes on 2 cores; needs gcc/g++). The default
# build uses -march=native, so the venv is tied to this machine's CPU.
# Environment: PYTHON (default python3), AGENTSERVE_PEERS_DIR (default ROOT/.peers).
# It writes PEERS/llamacpp-install.json (versions, seconds, venv size).
set -euo pipefail

LLAMACPP_VERSION=0.3.36
# The server's dependencies at the versions that worked (2 cores, Python 3.11).
PINS=(
    "llama-cpp-python[server]==$LLAMACPP_VERSION"
    "numpy==2.4.6"
    "fastapi==0.165.0"
    "starlette==1.10.0"
    "uvicorn==0.54.0"
    "sse-starlette==3.7.0"
    "starlette-context==0.3.6"
    "pydantic==2.14.3"
    "pydantic-settings==2.16.3"
)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS="${AGENTSERVE_PEERS_DIR:-$ROOT/.peers}"
VENV="$PEERS/llamacpp-venv"
PY="${PYTHON:-python3}"
FORCE=0
[[ "${1:-}" == "--force" ]] && FORCE=1

mkdir -p "$PEERS"
if [[ $FORCE == 0 && -x "$VENV/bin/python" ]] && "$VENV/bin/python" - "$LLAMACPP_VERSION" <<'PYEOF' 2>/dev/null
import sys, llama_cpp, llama_cpp.server, uvicorn
sys.exit(0 if llama_cpp.__version__ == sys.argv[1] else 1)
PYEOF
then
    echo "llama-cpp-python $LLAMACPP_VERSION is already installed in $VENV (--force to reinstall)"
    exit 0
fi

for tool in gcc g++; do
    command -v "$tool" >/dev/null || { echo "error: $tool is needed to build llama.cpp (apt-get install build-essential)" >&2; exit 1; }
done

start=$(date +%s)
rm -rf "$VENV"
"$PY" -m venv "$VENV"
# Two cores: build with both. pip's build isolation brings cmake and ninja
# from PyPI when the system has none.
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
"$VENV/bin/python" -m pip install --no-cache-dir "${PINS[@]}"
end=$(date +%s)

"$VENV/bin/python" -c "import llama_cpp, llama_cpp.server; print('llama-cpp-python', llama_cpp.__version__)"
size=$(du -sb "$VENV" | cut -f1)
"$VENV/bin/python" - "$PEERS/llamacpp-install.json" "$((end - start))" "$size" <<'PYEOF'
import json, platform, sys
from importlib.metadata import version
out, seconds, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pkgs = {p: version(p) for p in ("llama_cpp_python", "uvicorn", "fastapi", "sse-starlette", "numpy")}
json.dump({"peer": "llama.cpp", "python": platform.python_version(), "packages": pkgs,
           "install_s": seconds, "venv_bytes": size}, open(out, "w"), indent=1)
print(json.dumps({"install_s": seconds, "venv_MB": round(size / 1e6)}))
PYEOF
echo "installed llama-cpp-python $LLAMACPP_VERSION in $VENV"
