"""How long a lone cluster replica takes to start on a CPU: a local Ray, then a one-replica
``interlace.Cluster`` of the tiny Llama until its first token. Compare revisions by running it in
turn at each (one process per run; alternate them, as the machine's speed moves between runs):

    git checkout <rev>; .venv/bin/python bench/replica_start.py <rev>
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

if __name__ == "__main__":  # the replica's processes import this file again as their main module
    import ray

    import interlace
    from interlace.cluster.config import ClusterConfig

    started = time.perf_counter()
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=400 << 20, log_to_driver=False)
    up = time.perf_counter()
    cluster = interlace.Cluster(ClusterConfig(model="tiny-llama", replicas=1, cpu_cores=[[0]]))
    cluster.generate("Hello", max_tokens=1)
    first = time.perf_counter()
    label = sys.argv[1] if len(sys.argv) > 1 else "tree"
    print(f"{label}: ray.init {up - started:.1f} s, replica to first token {first - up:.1f} s", flush=True)
    cluster.close()
    ray.shutdown()
