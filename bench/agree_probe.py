"""What one agreement round costs: the all-reduce the TP ranks run on the host to compare
programs' paths (tp_agreement.agree_on_paths) and time-outs (agree_on_time).

A round is one gloo all-reduce (max) of 3 float64 per program call over the TP group's CPU
group, the group vLLM builds for host-side collectives. A program step under TP runs one round
after its programs start and one at each module where programs ran (the step's time-outs ride
on the last when every program is done): a batched program saving 4 layers runs 5 per step. This starts that many ranks on this host and times
rounds for a few call counts, so its figure can be set beside a step's time:

    python3 bench/agree_probe.py [--ranks 2] [--rounds 2000]
"""

from __future__ import annotations

import argparse
import os
import socket
import time


def _rank(rank: int, ranks: int, port: int, rounds: int) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    for calls in (1, 16, 256):
        codes = np.zeros(3 * calls)
        for _ in range(200):  # warm up
            dist.all_reduce(torch.from_numpy(codes.copy()), op=dist.ReduceOp.MAX)
        dist.barrier()
        started = time.perf_counter()
        for _ in range(rounds):  # as Interleaver.agree_max does it: from numpy, back to numpy
            tensor = torch.from_numpy(codes.copy())
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            tensor.numpy()
        if rank == 0:
            print(f"{ranks} ranks, {calls} calls: {(time.perf_counter() - started) / rounds * 1e6:.1f} us per round",
                  flush=True)
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(args.ranks, port, args.rounds), nprocs=args.ranks)


if __name__ == "__main__":
    main()
