"""Engine start times on a CPU: two ``interlace.Model`` engines started one after the other in
one process, their engine cores forked from the fork server (cluster/engine_processes.py) or
spawned as vLLM does by default.

    .venv/bin/python bench/engine_start.py forkserver
    .venv/bin/python bench/engine_start.py spawn
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main(mode: str) -> None:
    import interlace
    from interlace.cluster import engine

    if mode == "spawn":
        engine.fork_engine_cores = lambda: None  # vLLM's own spawn
    for i in range(2):
        started = time.perf_counter()
        model = interlace.Model("tiny-llama")
        model.engine
        up = time.perf_counter() - started
        tokens = model.generate("Hello there", max_tokens=3).token_ids
        print(f"{mode} engine {i}: started in {up:.1f} s, tokens {tokens}", flush=True)
        model.close()


if __name__ == "__main__":  # the engine core re-imports this file as its main module
    main(sys.argv[1] if len(sys.argv) > 1 else "forkserver")
