#!/bin/bash
# The CUDA checks of docs/gpu.md as one script, for one short session on a GPU machine:
#   bash benchmarks/gpu_check.sh OUTDIR [tests] [profile] [bench]
# tests: the runner/engine/server tests on the GPU (AGENTSERVE_TEST_DEVICE=cuda);
# profile: `agentserve profile` of the 8B shape, CUDA graphs + Triton against the portable path;
# bench: an agent replay through the server without and with a host tier.
# Everything it prints and writes lands in OUTDIR. Python packages the machine lacks can be
# put as wheels in .whl/ beside this repository's root: they are installed to a scratch folder.
set -u
out=${1:?usage: gpu_check.sh OUTDIR [tests] [profile] [bench]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/agentserve-site .whl/*.whl \
    || echo "installing .whl/ failed"
  export PYTHONPATH=/tmp/agentserve-site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src:$PWD PYTHONUNBUFFERED=1
CLI='import sys, logging; logging.basicConfig(level=logging.INFO); from agentserve.cli import main; sys.exit(main())'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
for stage in "$@"; do
case $stage in
tests)
  AGENTSERVE_TEST_DEVICE=cuda timeout 330 python3 -m pytest -q -p no:cacheprovider \
    tests/test_triton_kernels.py tests/test_cuda_graphs.py tests/test_copy_engine.py tests/test_runner_correctness.py \
    tests/test_runner_engine.py tests/test_disk_store.py tests/test_speculation.py tests/test_grouped_prefill.py \
    tests/test_async_copies.py tests/test_random_model.py tests/test_server.py tests/test_engine_thread.py \
    tests/test_toolcall_validator.py tests/test_response_cache.py tests/test_identity_hints.py \
    tests/test_runner_architectures.py tests/test_hybrid_engine.py tests/test_rope_scaling.py > "$out/tests.txt" 2>&1
  tail -40 "$out/tests.txt";;
profile)
  for mode in after before; do
    if [ $mode = before ]; then export AGENTSERVE_ATTENTION=torch; E=--enforce-eager; else unset AGENTSERVE_ATTENTION; E=; fi
    timeout 240 python3 -c "$CLI" profile --model random:llama3.1-8b --device cuda $E \
      --prefill-lengths 1024,4096,8192 --batch-sizes 1,8,64 --contexts 512,4096 \
      --output "$out/profile-$mode.json" > "$out/profile-$mode.log" 2>&1
    tail -20 "$out/profile-$mode.log"
  done
  unset AGENTSERVE_ATTENTION;;
bench)
  for tier in 0 131072; do
    python3 -c "$CLI" serve --model random:llama3.1-8b --device cuda --port 8123 --host-kv-tokens $tier \
      --kv-cache-tokens 49152 > "$out/serve-$tier.log" 2>&1 &
    pid=$!
    for _ in $(seq 120); do curl -sf localhost:8123/v1/models >/dev/null && break; sleep 1; done
    timeout 60 python3 -c "$CLI" bench run --url http://127.0.0.1:8123 --workload swebench --programs 1 \
      --max-turns 2 --time-scale 0 --seed 99 --no-progress > /dev/null 2>&1   # warm-up
    timeout 220 python3 -c "$CLI" bench run --url http://127.0.0.1:8123 --workload swebench --programs 12 --rate 1 \
      --time-scale 0.1 --seed 0 --json "$out/bench-$tier.json" --no-progress > "$out/bench-$tier.txt" 2>&1
    head -12 "$out/bench-$tier.txt"
    curl -s localhost:8123/metrics > "$out/metrics-$tier.txt"
    kill $pid; wait $pid 2>/dev/null
  done;;
*) echo "unknown stage $stage (tests, profile, bench)"; exit 2;;
esac
done
