#!/usr/bin/env bash
# Where the engine core processes' time goes during runner_bench, in the bench's own setting
# (each engine core in its own process, beside the driver): py-spy samples every EngineCore
# process for DUR seconds once the first pair is done, with --idle (waits show) and per thread.
# The interlace engine's file is the one whose stacks pass through interlace/workers
# (bench/spy_frames.py FILE --through execute_model --only workers/).
#
# py-spy's wheel goes along as for bench/profile_sweep.sh (carry .pyspy, or set PYSPY_WHEEL);
# the bench's arguments follow the script:
#   DUR=20 bash bench/profile_runner.sh --graphs --shape 1b --n 1024 --in 128 --out 512 --kv-gib 4 --cases prog-steer1 --repeats 3
set -u
pip install -q --no-deps --no-index --target /tmp/pyspy ${PYSPY_WHEEL:-.pyspy/py_spy-*.whl} >/dev/null 2>&1
SPY=/tmp/pyspy/bin/py-spy
bash bench/gpu_session.sh python3 bench/runner_bench.py "$@" > "$OUT/bench.log" 2>&1 &
for _ in $(seq 1 900); do  # until the first pair is done: both engines are up and warm
  grep -q '^{"n"' "$OUT/bench.log" 2>/dev/null && break
  sleep 1
done
for pid in $(pgrep -f EngineCore); do
  $SPY record --pid "$pid" --duration "${DUR:-20}" --rate 200 --threads --idle --format raw \
    -o "$OUT/core-$pid.txt" --nonblocking > /dev/null 2>&1 &
done
wait
grep '^{"n"\|x plain' "$OUT/bench.log"
