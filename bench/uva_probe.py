"""Probe: can a GPU kernel write saved rows straight into a report data file's pinned pages?

A data file's pages are registered with CUDA in 2 MiB slices (report_file.DataFile._pin). With
unified addressing a kernel can write registered host memory through its host address; this
checks that torch accepts such a range as a CUDA tensor (``__cuda_array_interface__``), that an
``index_copy_`` into it lands in the file, and what it costs against the present path (rows kept
on the GPU, gathered and copied to the host in one copy after the last step).

Usage: python bench/uva_probe.py [--rows 256] [--steps 128] [--names 4] [--hidden 2048]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from interlace.workers.report_file import DataFile, copy_to_host


class _HostRange:
    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--names", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    args = parser.parse_args()
    torch.cuda.init()
    device = torch.device("cuda", 0)
    row_bytes = args.hidden * 2
    total_rows = args.rows * args.steps * args.names
    nbytes = total_rows * row_bytes
    folder = Path(tempfile.mkdtemp(dir="/dev/shm"))
    data = DataFile(folder / "probe.data")
    t = time.perf_counter()
    start, _region = data.region(nbytes + (4 << 20))
    print(f"reserve+pin {nbytes >> 20} MiB: {time.perf_counter() - t:.3f} s, pinned {data.pinned >> 20} MiB, start {start}")
    base = data.bytes.data_ptr()
    on_gpu = torch.as_tensor(_HostRange(base, data.pinned), device=device)
    print("as_tensor:", on_gpu.device, on_gpu.shape, hex(on_gpu.data_ptr()), "same address", on_gpu.data_ptr() == base)
    wide_gpu = on_gpu[: nbytes].view(torch.int64).view(total_rows, row_bytes // 8)
    wide_host = data.bytes[: nbytes].view(torch.int64).view(total_rows, row_bytes // 8)

    # each step: [names, rows, hidden] rows; invoke-major destination: name, invoke, step
    blocks = [torch.randn(args.names, args.rows, args.hidden, device=device, dtype=torch.bfloat16) for _ in range(4)]
    owner = np.arange(args.rows)
    name = np.arange(args.names)
    dests = []
    for step in range(args.steps):
        d = (name[:, None] * args.rows * args.steps + owner[None, :] * args.steps + step).reshape(-1)
        dests.append(torch.from_numpy(d).pin_memory().to(device, non_blocking=True))
    torch.cuda.synchronize()

    # correctness
    block = blocks[0]
    wide_gpu.index_copy_(0, dests[3], block.view(-1, args.hidden).view(torch.int64).view(-1, row_bytes // 8))
    torch.cuda.synchronize()
    got = wide_host.index_select(0, dests[3].cpu()).view(torch.bfloat16).view(args.names, args.rows, args.hidden)
    print("lands in the file:", torch.equal(got, block.cpu()))

    for rep in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        launch = 0.0
        for step in range(args.steps):
            a = time.perf_counter()
            src = blocks[step % 4].view(-1, args.hidden).view(torch.int64).view(-1, row_bytes // 8)
            wide_gpu.index_copy_(0, dests[step], src)
            launch += time.perf_counter() - a
        torch.cuda.synchronize()
        direct = time.perf_counter() - t
        # the present path: keep each step's block on the device, gather invoke-major, one copy
        kept = [blocks[step % 4] for step in range(args.steps)]
        torch.cuda.synchronize()
        t = time.perf_counter()
        rows = torch.stack(kept, 2)  # names, rows, steps, hidden: invoke-major per name
        copy_to_host(data.bytes[: nbytes].view(torch.bfloat16).view(rows.shape), rows)
        tail = time.perf_counter() - t
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        wide_gpu.index_copy_(0, dests[0], blocks[0].view(-1, args.hidden).view(torch.int64).view(-1, row_bytes // 8))
        ev1.record()
        torch.cuda.synchronize()
        print(f"round {rep}: direct writes {args.steps} steps {direct * 1e3:.1f} ms (host launch {launch * 1e3:.2f} ms, "
              f"one step's kernel {ev0.elapsed_time(ev1):.3f} ms, {args.names * args.rows * row_bytes / 2**20:.0f} MiB); "
              f"gather + one copy after the last step {tail * 1e3:.1f} ms")
    data.close()


if __name__ == "__main__":
    main()
