#!/usr/bin/env bash
# Run a command on a lent GPU machine with vLLM 0.26 + Ray and this checkout installed.
#
# First send the site chunks built by ../shared/gpu/build-site.sh into /tmp/stash (one remote
# command per chunk, see ../shared/gpu/README.md); then, from the project root:
#
#   bash bench/gpu_session.sh python3 -m pytest -q tests/test_parallel.py -k "not tp2xpp2"
#   bash bench/gpu_session.sh python3 bench/runner_bench.py --tp 2
#
# A fresh machine compiles each engine for minutes. COMPILE_CACHE=path/to/pack.tgz (a packed
# ~/.cache/vllm from an earlier machine: `tar czf "$OUT/vllm-cache.tgz" -C ~ .cache/vllm`, carried
# with the call) is unpacked first; the same vLLM and shapes then start in about a minute.
set -euo pipefail
if [ -n "${COMPILE_CACHE:-}" ] && [ -f "$COMPILE_CACHE" ] && [ ! -d ~/.cache/vllm ]; then
  tar xzf "$COMPILE_CACHE" -C ~
fi
if [ ! -d /tmp/site/vllm ]; then
  mkdir -p /tmp/site && cat /tmp/stash/chunk* | xz -d -T8 | tar -x -C /tmp/site
fi
rm -rf /tmp/ilib
pip install -q --no-deps --no-build-isolation --no-index --target /tmp/ilib . >/dev/null 2>&1
export PYTHONPATH=/tmp/site:/tmp/ilib PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=WARNING
exec "$@"
