#!/usr/bin/env bash
# What a lent host of two GPUs checks (issue 44's two-GPU items), one step per device call, each
# within a call's 600 s. Send the site chunks first (bench/gpu_session.sh), then, with carry
# [".gpu/p4"] on the call that unpacks the last chunk:
#
#   bash bench/gpu_session.sh bash bench/two_gpu_checks.sh tests      # then: parallel, tp2, pp2, one
#
#   tests     the GPU tests of two ranks (marked ranks(2): TP=2 and PP=2 layouts, taps, a program's
#             CUDA device) in test_graphs, test_gpu_numerics, test_taps and test_isolation
#   parallel  tests/test_parallel.py at TP=2 (or `parallel pp2`: PP=2), compiled with default taps, Llama
#   tp2, pp2  runner_bench at the 8B shape on both GPUs: 256 prompts, all batched cases; then 8 and
#             1 concurrent requests, the programs that save 4 layers and steer 1
#   one       the same cases on one GPU of the same host: the one-GPU ratios the two-GPU ones are
#             held against (each >= 0.9 of it)
#
# Logs: $OUT/<step>.log. vLLM's custom all-reduce is off in the engine harness; NVLink multicast
# is turned off here (../shared/gpu/README.md says why).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=WARNING
out=${OUT:-/tmp/out}
mkdir -p "$out"
git log -1 --format='%h %s' > "$out/tree.txt" 2>/dev/null || true

# step NAME SECONDS CMD...: run it within SECONDS (SIGINT first: engines shut down cleanly), log it
step() {
  local name=$1 limit=$2
  shift 2
  echo "== $name $(date +%T)"
  timeout -s INT -k 30 "$limit" "$@" >> "$out/$name.log" 2>&1
  echo "rc=$? $(date +%T)"
  grep -e passed -e failed -e '^host' -e '^case' -e '^none' -e '^ops' -e '^prog' -e Error "$out/$name.log" | tail -n 24
}

bench() {  # NAME [runner_bench arguments]: 256 prompts, then 8 and 1 (on the engines compiled by then)
  local name=$1
  shift
  step "$name" 370 python3 bench/runner_bench.py --graphs --shape 8b "$@" --n 256 --repeats 3 \
      --cases none,ops-save4,ops-steer1,prog-save4,prog-steer1
  step "$name" 170 python3 bench/runner_bench.py --graphs --shape 8b "$@" --n 8,1 --repeats 3 \
      --cases prog-save4,prog-steer1
}

case "${1:-}" in
  tests) step tests 560 python3 -m pytest -q -p no:cacheprovider -m ranks \
           tests/test_graphs.py tests/test_gpu_numerics.py tests/test_taps.py tests/test_isolation.py ;;
  parallel) step "parallel-${2:-tp2}" 560 python3 -m pytest -q -p no:cacheprovider tests/test_parallel.py \
              -k "${2:-tp2} and not tp2xpp2 and not qwen" ;;
  tp2) bench tp2 --tp 2 ;;
  pp2) bench pp2 --pp 2 ;;
  one) CUDA_VISIBLE_DEVICES=0 bench one ;;
  *) echo "usage: bench/two_gpu_checks.sh tests|parallel [tp2|pp2]|tp2|pp2|one" >&2; exit 2 ;;
esac
