#!/usr/bin/env bash
# Where a sweep replica's time goes on a GPU machine: bench/sweep_bench.py, with py-spy sampling
# the replica's Ray Data actor and its engine core for 8 s mid-sweep (raw collapsed stacks in $OUT:
# actor.txt, core.txt per thread, actor_gil.txt for the thread holding the GIL).
#
# py-spy's wheel goes along (GPU machines reach no registry): here, `pip download py-spy --no-deps
# -d .pyspy` (.pyspy is git-ignored: add it to .git/info/exclude), then carry .pyspy with
#   IF=2,4 N=4096 bash bench/profile_sweep.sh      (IF: --in-flight values; the first one is profiled)
set -u
pip install -q --no-deps --no-index --target /tmp/pyspy .pyspy/py_spy-*.whl >/dev/null 2>&1
SPY=/tmp/pyspy/bin/py-spy
N=${N:-4096}
bash bench/gpu_session.sh python3 bench/sweep_bench.py --n "$N" --in-flight "${IF:-4}" > "$OUT/bench.log" 2>&1 &
for _ in $(seq 1 500); do  # until the first shard is written: the engine is up and the sweep under way
  grep -q "^[0-9]*/$N prompts" "$OUT/bench.log" 2>/dev/null && break
  sleep 1
done
ps -eo pid,ppid,pcpu,comm --sort=-pcpu | head -12 > "$OUT/ps.txt"
ACTOR=$(pgrep -f "ShardRunner" | head -1)
CORE=$(pgrep -f "EngineCore" | head -1)
$SPY record --pid "$ACTOR" --duration 8 --rate 250 --threads --format raw -o "$OUT/actor.txt" --nonblocking > /dev/null 2>&1 &
$SPY record --pid "$CORE" --duration 8 --rate 250 --threads --format raw -o "$OUT/core.txt" --nonblocking > /dev/null 2>&1 &
$SPY record --pid "$ACTOR" --duration 8 --rate 250 --gil --format raw -o "$OUT/actor_gil.txt" --nonblocking > /dev/null 2>&1 &
wait
grep "^{" "$OUT/bench.log"
