#!/usr/bin/env bash
# A/B of interlace revisions on one lent GPU machine: bench/step_probe.py in one process per
# revision, alternating, so that a difference between revisions is not a difference between lent
# machines (plain vLLM's time for the same work moved 1.4-2.5 s between H200s and runs).
#
# Here, once per revision to compare (the working tree is the other side, named "tree"):
#   bench/ab_revisions.sh prepare 86b617c           -> .ab/86b617c: that revision's package (git-ignored)
# Then, after sending the vLLM site chunks (see bench/gpu_session.sh), one remote command with
# carry [".ab"]:
#   bash bench/ab_revisions.sh run "86b617c tree 86b617c tree" [ops-save4,prog-save4]
# Each process starts an engine (about 100 s on a fresh machine, 50 s after) and runs `none` and the
# cases twice (warm, timed); PER_RUN_S (default 240) bounds each process, and the first process of a
# call gets FIRST_EXTRA_S more (default 200): on a fresh host it compiles the engines for every later
# process (vLLM's compile cache is on disk); on an H200 on 2026-11-26 runner's first process had
# started both engines but given no pair by 285 s, and the second gave 24 pairs in 285 s. At TP=2 or
# PP=2 (two H200s, 2026-11-27) a fresh host's first process gave no pair in 330 s; a process on
# the warm cache ran 40 TP=2 pairs in 462 s, and a PP=2 one that compiled gave 21 pairs in 440 s. A process past its time gets SIGINT first, so its engines shut down and it
# leaves no files behind (after a SIGTERM during a start, a load-errors file was found in /tmp).
# Logs: $OUT/ab-<name>.log.
# BENCH_ARGS are passed on to the bench script, e.g. BENCH_ARGS=--graphs for compiled engines.
set -euo pipefail
cd "$(dirname "$0")/.."
# lib NAME: that revision's package installed once into /tmp/ab-lib-NAME (the vLLM site unpacked first).
lib() {
  if [ ! -d /tmp/site/vllm ]; then mkdir -p /tmp/site && cat /tmp/stash/chunk* | xz -d -T8 | tar -x -C /tmp/site; fi
  local dir=/tmp/ab-lib-$1 src=.
  [ "$1" = tree ] || src=./.ab/$1
  [ -d "$dir" ] || pip install -q --no-deps --no-build-isolation --no-index --target "$dir" "$src" >/dev/null 2>&1
  echo "$dir"
}
export PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=WARNING
quiet() { grep -v -e WARNING -e INFO -e '^\[W' -e '^$'; }

case "${1:-}" in
  prepare)
    shift
    for rev in "$@"; do
      rm -rf ".ab/$rev" && mkdir -p ".ab/$rev"
      git archive "$rev" pyproject.toml README.md driver workers cluster configs | tar -x -C ".ab/$rev"
    done ;;
  run)
    extra=${FIRST_EXTRA_S:-200}
    for name in $2; do
      echo "=== $name"
      PYTHONPATH=/tmp/site:$(lib "$name") timeout -s INT -k 30 $(( ${PER_RUN_S:-240} + extra )) python3 bench/step_probe.py \
          --cases "${3:-ops-save4,prog-save4}" ${BENCH_ARGS:-} 2>&1 | quiet | tee -a "${OUT:-/tmp}/ab-$name.log" \
        | grep -e '^none' -e '^ops' -e '^prog' -e 'runner.execute_model' -e 'Error' || true
      extra=0
    done ;;
  runner)
    # The same alternation with bench/runner_bench.py (interlace/plain ratios, paired in each
    # process): bash bench/ab_revisions.sh runner "9284079 tree 9284079 tree" [cases] [repeats]
    extra=${FIRST_EXTRA_S:-200}
    for name in $2; do
      echo "=== $name $(date +%T)"
      PYTHONPATH=/tmp/site:$(lib "$name") timeout -s INT -k 30 $(( ${PER_RUN_S:-280} + extra )) python3 bench/runner_bench.py \
          --cases "${3:-none,ops-save4,prog-save4,ops-steer1,prog-steer1}" --repeats "${4:-3}" ${BENCH_ARGS:-} 2>&1 | quiet \
        | tee -a "${OUT:-/tmp}/ab-runner-$name.log" | grep -e '^host' -e '^{' -e '^case' -e '^none' -e '^ops' -e '^prog' -e 'Error' || true
      extra=0
    done ;;
  script)
    # Any bench script the same way, its arguments after its name; each process's last lines are
    # printed (logs: $OUT/ab-<script>-<name>.log). E.g. the reports job's path through a Cluster:
    #   bash bench/ab_revisions.sh script "tree 3d31ca4 tree 3d31ca4" path_probe.py --shape 1b --traces 2 --cases serve
    names=$2 script=$3
    shift 3
    extra=${FIRST_EXTRA_S:-200}
    for name in $names; do
      echo "=== $name $(date +%T)"
      PYTHONPATH=/tmp/site:$(lib "$name") timeout -s INT -k 30 $(( ${PER_RUN_S:-240} + extra )) python3 "bench/$script" "$@" \
          2>&1 | quiet | tee -a "${OUT:-/tmp}/ab-${script%.py}-$name.log" | tail -n "${TAIL_LINES:-20}" || true
      extra=0
    done ;;
  *) echo "usage: bench/ab_revisions.sh prepare REV... | run 'NAME ...' [cases] | runner 'NAME ...' [cases] [repeats]" \
          "| script 'NAME ...' SCRIPT.py [its arguments]" >&2; exit 2 ;;
esac
