"""Host probe: what the save path's building blocks cost on this machine (no vLLM needed).

A diagnostic for choosing how saves travel, not a figure against plain vLLM:

    handoffs   a round trip between two Python threads (semaphores, as programs run now), the same
               with both threads on one core, and a greenlet switch round trip (when importable)
    gather     a sweep's 512 MiB of pinned step-major rows into invoke-major order in a /dev/shm
               mapping: indexed copies and strided copies, on 1 and 4 threads; a plain memcpy
    cuda       (with a GPU) pinning a /dev/shm mapping with cudaHostRegister, and device-to-host
               copies into it, into pageable memory and into pinned memory; a device-side gather
    files      a trace's report files in /dev/shm after its last step: removing the folder while
               the rank truncates a quarter of it (reserved, unused), with shutil.rmtree and with
               sink.discard; dropping results read from it, against a plain private mapping
    maplock    how long another thread of the process waits to map 1 MiB (it needs the memory map
               lock) while the reporter reserves a data file (one madvise call, against
               DataFile.reserve's slices) and while a used data file is unmapped (one munmap,
               against DataFile.close's slices first)
    register   (with a GPU) how long a thread launching kernels waits while another registers a
               populated /dev/shm mapping with CUDA (one call, or slices), and a device-to-host copy
               into it cut at the slices' edges, against the same mapping unregistered
    bookkeeping  a sweep's report bookkeeping after its last steps (256 invokes, 4 names saved
               together at 130 steps: 520 ledger chunks): SaveLedger.take of two batches of 128
               and giving their holds back, then a 256-report batch header written and read

Usage: python bench/host_probe.py [--mib 512] [--only cuda|files|maplock|bookkeeping|...]
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import threading
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor

import torch


def timed(label: str, fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    print(f"  {label:58} {best * 1000:9.2f} ms", flush=True)
    return best


def handoffs(rounds: int = 3000) -> None:
    print("handoffs (per round trip)")

    def ping_pong(pin: int | None) -> float:
        to_b, to_a = threading.Semaphore(0), threading.Semaphore(0)

        def b():
            if pin is not None:
                os.sched_setaffinity(0, {pin})
            for _ in range(rounds):
                to_b.acquire()
                to_a.release()

        before = os.sched_getaffinity(0)
        if pin is not None:
            os.sched_setaffinity(0, {pin})
        thread = threading.Thread(target=b)
        thread.start()
        started = time.perf_counter()
        for _ in range(rounds):
            to_b.release()
            to_a.acquire()
        seconds = time.perf_counter() - started
        thread.join()
        os.sched_setaffinity(0, before)
        return seconds / rounds

    print(f"  {'threads, semaphores':58} {ping_pong(None) * 1e6:9.1f} us")
    cpu = sorted(os.sched_getaffinity(0))[0]
    print(f"  {'threads, semaphores, both on one core':58} {ping_pong(cpu) * 1e6:9.1f} us")
    try:
        import greenlet
    except ImportError:
        print("  greenlet: not importable")
        return
    main = greenlet.getcurrent()

    def body():
        while True:
            main.switch()

    child = greenlet.greenlet(body)
    started = time.perf_counter()
    for _ in range(rounds):
        child.switch()
    print(f"  {'greenlet switch there and back':58} {(time.perf_counter() - started) / rounds * 1e6:9.1f} us")


def shm_tensor(nbytes: int) -> torch.Tensor:
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(dir=folder)
    os.unlink(path)
    os.ftruncate(fd, nbytes)
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    out = torch.frombuffer(mapping, dtype=torch.uint8)
    out[:: mmap.PAGESIZE].zero_()  # fault every page in, as reserving ahead does
    return out


def wide(t: torch.Tensor) -> torch.Tensor:
    return t.view(t.shape[0], -1).view(torch.uint8).view(torch.complex128)


def gather(mib: int) -> None:
    invokes, hidden, names = 256, 2048, 4
    steps = mib * 2**20 // (invokes * hidden * 2 * names)
    pinned = torch.cuda.is_available()
    print(f"gather ({names} names x {steps} steps x {invokes} invokes x {hidden} bf16 = {mib} MiB, "
          f"sources {'pinned' if pinned else 'pageable'}, destination /dev/shm)")
    chunks = [[torch.randn(invokes, hidden).to(torch.bfloat16).pin_memory() if pinned else
               torch.randn(invokes, hidden).to(torch.bfloat16) for _ in range(steps)] for _ in range(names)]
    out = shm_tensor(mib * 2**20).view(torch.bfloat16).view(names, invokes * steps, hidden)
    dest = [torch.arange(invokes) * steps + k for k in range(steps)]
    pool = ThreadPoolExecutor(4)

    def indexed(n: int) -> None:
        for k, c in enumerate(chunks[n]):
            wide(out[n]).index_copy_(0, dest[k], wide(c))

    def strided(n: int) -> None:
        for k, c in enumerate(chunks[n]):
            out[n][k::steps].copy_(c)

    def contiguous(n: int) -> None:
        for k, c in enumerate(chunks[n]):
            out[n][k * invokes : (k + 1) * invokes].copy_(c)

    for label, fn in [("indexed copies (16-byte elements)", indexed), ("strided copies", strided),
                      ("contiguous copies (memcpy)", contiguous)]:
        timed(f"{label}, 1 thread", lambda: [fn(n) for n in range(names)])
        timed(f"{label}, 4 threads", lambda: list(pool.map(fn, range(names))))


def cuda(mib: int) -> None:
    if not torch.cuda.is_available():
        print("cuda: no GPU")
        return
    nbytes = mib * 2**20
    print(f"cuda ({mib} MiB)")
    device = torch.randn(nbytes // 2, device="cuda").to(torch.bfloat16).view(torch.uint8)[:nbytes]
    torch.cuda.synchronize()
    shm = shm_tensor(nbytes)
    cudart = torch.cuda.cudart()
    started = time.perf_counter()
    rc = cudart.cudaHostRegister(shm.data_ptr(), nbytes, 0)
    print(f"  {'cudaHostRegister of a /dev/shm mapping':58} {(time.perf_counter() - started) * 1000:9.2f} ms (rc {rc})")

    def d2h(dst: torch.Tensor):
        def go():
            dst.copy_(device, non_blocking=True)
            torch.cuda.synchronize()
        return go

    timed("device -> registered /dev/shm mapping", d2h(shm))
    timed("device -> pinned (cudaHostAlloc)", d2h(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)))
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.zero_()
    timed("device -> pageable", d2h(pageable))
    started = time.perf_counter()
    cudart.cudaHostUnregister(shm.data_ptr())
    print(f"  {'cudaHostUnregister':58} {(time.perf_counter() - started) * 1000:9.2f} ms")
    # A data file is reserved ahead in steps (report_file.DataFile.reserve): registered step by
    # step, a batch's region may span two registrations. Does a copy across them run pinned?
    step = nbytes // 8
    started = time.perf_counter()
    for offset in range(0, nbytes, step):
        assert int(cudart.cudaHostRegister(shm.data_ptr() + offset, step, 1)) == 0  # portable
    print(f"  {'cudaHostRegister in 8 steps (portable)':58} {(time.perf_counter() - started) * 1000:9.2f} ms")
    try:
        timed("device -> /dev/shm registered in 8 steps (one copy across)", d2h(shm))
    except RuntimeError as exc:  # on an H100 host, 2026-11-26: cudaErrorInvalidValue
        print(f"  {'device -> /dev/shm registered in 8 steps (one copy across)':58} fails: {str(exc).splitlines()[0]}")
    pieces = [(offset, step) for offset in range(0, nbytes, step)]

    def d2h_pieces():
        for offset, length in pieces:
            shm[offset : offset + length].copy_(device[offset : offset + length], non_blocking=True)
        torch.cuda.synchronize()

    timed("... the same as one copy per registration", d2h_pieces)
    for offset in range(0, nbytes, step):
        cudart.cudaHostUnregister(shm.data_ptr() + offset)
    timed("device -> the same mapping unregistered again", d2h(shm))
    rows = device.view(-1, 4096)
    perm = torch.randperm(rows.shape[0], device="cuda")
    torch.cuda.synchronize()

    def device_gather():
        rows.index_select(0, perm)
        torch.cuda.synchronize()

    timed("device-side gather (index_select of 4 KiB rows)", device_gather)
    stream = torch.cuda.Stream()
    host = torch.empty(rows[:256].shape, dtype=torch.uint8, pin_memory=True)
    launches = 2000

    def copy_launches():
        for _ in range(launches):
            host.copy_(rows[:256], non_blocking=True)
        torch.cuda.synchronize()

    def event_records():
        for _ in range(launches):
            torch.cuda.Event().record()
        torch.cuda.synchronize()

    with torch.cuda.stream(stream):
        per = timed(f"{launches} async 1 MiB device-to-host copies", copy_launches) / launches
    print(f"  {'... per copy':58} {per * 1e6:9.1f} us")
    per = timed(f"{launches} event records", event_records) / launches
    print(f"  {'... per event':58} {per * 1e6:9.1f} us")


def files(mib: int) -> None:
    import shutil

    import numpy as np

    from interlace.workers.save_gather import TakenSaves
    from interlace.workers.saves import SaveChunk
    from interlace.workers.sink import DirSink, discard, read_new_reports

    nbytes = mib * 2**20
    root = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    print(f"files ({mib} MiB of rows, {mib // 4} MiB reserved past them, in {root})")
    rows = torch.ones(nbytes // 4096, 2048, dtype=torch.bfloat16)
    one = np.array([0])
    saves = TakenSaves({"rows": [(SaveChunk("rows", rows, None, one, one, one + len(rows), 1), np.ones(1, dtype=bool))]}, one)

    def trace(name: str) -> list[dict]:
        """A trace's one batch written and read, as a rank and the driver do."""
        sink = DirSink(root)
        sink.reserve(name, 0, nbytes + nbytes // 4)
        with sink.batch(name, 0) as batch:
            batch.finish([{"trace": name, "invoke": 0, "stage": 0, "saves": s, "shared": [], "error": None}
                          for s in saves.assemble(batch.allocate)])
        back = read_new_reports(Path(root) / name, set())
        closing = threading.Thread(target=sink.close, args=(name, 0))  # the rank truncates the rest
        closing.start()
        time.sleep(0.002)
        return back, closing

    for label, remove in (("shutil.rmtree", lambda folder: shutil.rmtree(folder)), ("sink.discard", discard)):
        back, closing = trace(label.replace(".", "-"))
        started = time.perf_counter()
        remove(Path(root) / label.replace(".", "-"))
        print(f"  {'removing the folder while the rank truncates, ' + label:58} {(time.perf_counter() - started) * 1000:9.2f} ms")
        closing.join()
        started = time.perf_counter()
        del back
        if label == "sink.discard":
            print(f"  {'dropping the results read from it':58} {(time.perf_counter() - started) * 1000:9.2f} ms")
    path = Path(root) / "plain"
    with open(path, "w+b") as f:
        os.posix_fallocate(f.fileno(), 0, nbytes)
        mapping = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    plain = torch.frombuffer(mapping, dtype=torch.uint8)
    del mapping
    path.unlink()
    started = time.perf_counter()
    del plain
    print(f"  {'dropping a plain private mapping of the same (last user)':58} {(time.perf_counter() - started) * 1000:9.2f} ms")
    time.sleep(0.5)
    shutil.rmtree(root, ignore_errors=True)


def _longest_wait_while(work, action) -> tuple[float, float]:
    """``work``'s time, and the longest ``action`` took in another thread meanwhile (repeated
    every 0.2 ms, as an engine thread maps memory and launches kernels)."""
    waits, done = [], threading.Event()

    def repeat():
        while not done.is_set():
            started = time.perf_counter()
            action()
            waits.append(time.perf_counter() - started)
            time.sleep(0.0002)

    thread = threading.Thread(target=repeat)
    thread.start()
    time.sleep(0.02)
    started = time.perf_counter()
    work()
    took = time.perf_counter() - started
    time.sleep(0.02)
    done.set()
    thread.join()
    return took, max(waits)


def _longest_map_wait_while(work) -> tuple[float, float]:
    """An anonymous 1 MiB mmap + munmap as the action: both take the process's memory map lock
    for writing, as malloc and CUDA do."""
    return _longest_wait_while(work, lambda: mmap.mmap(-1, 1 << 20).close())


def maplock(mib: int) -> None:
    from interlace.workers import report_file
    from interlace.workers.report_file import DataFile

    nbytes = mib * 2**20
    root = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    print(f"maplock ({mib} MiB in {root}; another thread maps 1 MiB every 0.2 ms: longest wait)")
    for attempt in range(2):
        for label, slice_ in (("one call", 1 << 40), ("DataFile's slices", report_file._SLICE)):
            report_file._SLICE = slice_
            data = DataFile(root / f"{attempt}-{slice_}.data")
            took, wait = _longest_map_wait_while(lambda: data.reserve(nbytes))
            print(f"  {'reserving, ' + label:44} {took * 1000:8.1f} ms; longest map wait {wait * 1000:8.2f} ms", flush=True)
            data.region(nbytes)[1].fill_(1)  # a trace's rows written into it
            view = data.bytes[:nbytes]
            started = time.perf_counter()
            if label == "one call":  # close as it was before the slices: truncate, keep the mapping
                os.ftruncate(data._fd, data.used)
                os.close(data._fd)
                data.bytes = None
            else:
                data.close()
            closing = time.perf_counter() - started
            holder = [view, data]
            del view, data
            took, wait = _longest_map_wait_while(holder.clear)  # the last view goes: munmap
            print(f"  {'unmapping the used file, ' + label:44} {took * 1000:8.1f} ms; longest map wait {wait * 1000:8.2f} ms"
                  + f" (close before it: {closing * 1000:.1f} ms)", flush=True)
            for leftover in root.glob("*.data"):
                leftover.unlink()
    report_file._SLICE = 2 << 20
    os.rmdir(root)


def register(mib: int) -> None:
    if not torch.cuda.is_available():
        print("register: no GPU")
        return
    nbytes = mib * 2**20
    cudart = torch.cuda.cudart()
    device = torch.randn(nbytes // 2, device="cuda").to(torch.bfloat16).view(torch.uint8)[:nbytes]
    small = torch.zeros(256, 2048, device="cuda")
    torch.cuda.synchronize()
    print(f"register ({mib} MiB of /dev/shm; another thread launches a small kernel every 0.2 ms, as an engine step does)")
    for slice_mib in (mib, 64, 8, 2):
        shm = shm_tensor(nbytes)  # populated, as a reserved data file is
        step = slice_mib * 2**20

        def register_slices():
            for offset in range(0, nbytes, step):
                assert int(cudart.cudaHostRegister(shm.data_ptr() + offset, step, 1)) == 0  # portable

        took, longest = _longest_wait_while(register_slices, lambda: small.add_(1))
        print(f"  registering in {slice_mib:4d} MiB slices: {took * 1000:8.1f} ms; longest launch {longest * 1000:8.2f} ms", flush=True)

        def d2h_pieces():
            for offset in range(0, nbytes, step):
                shm[offset : offset + step].copy_(device[offset : offset + step], non_blocking=True)
            torch.cuda.synchronize()

        timed(f"device -> the mapping, one copy per {slice_mib} MiB registration", d2h_pieces)
        for offset in range(0, nbytes, step):
            cudart.cudaHostUnregister(shm.data_ptr() + offset)
        timed("device -> the same mapping unregistered", d2h_pieces)


def bookkeeping(rounds: int = 15) -> None:
    import io
    import statistics

    import numpy as np

    from interlace.workers import report_file
    from interlace.workers.saves import DeviceRoom, SaveLedger

    def take_twice() -> tuple[float, float, float]:
        ledger = SaveLedger(DeviceRoom(1 << 40))
        owners, starts = np.arange(256), np.arange(256)
        for _step in range(130):  # as taps.TappedSaves adds them: views of one gather per step
            ledger.add("t", list(zip("abcd", torch.zeros(4, 256, 8).unbind(0))), owners, starts, starts + 1, True)
        t0 = time.perf_counter()
        first = ledger.take("t", list(range(128)))
        t1 = time.perf_counter()
        rest = ledger.take("t", list(range(128, 256)))
        t2 = time.perf_counter()
        first.release(), rest.release()
        return 1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * (time.perf_counter() - t2)

    runs = [take_twice() for _ in range(rounds)]
    first, second, release = (statistics.median(column) for column in zip(*runs))
    print(f"ledger: take of 128 invokes {first:.2f} ms, of the other 128 {second:.2f} ms, "
          f"both holds given back {release:.2f} ms (medians of {rounds})")
    region = torch.zeros(4 * 256 * 128 * 64 * 2, dtype=torch.uint8)
    rows = region.view(torch.bfloat16).view(4, 256 * 128, 64)
    reports = [{"trace": "t", "invoke": i, "stage": 0, "shared": [], "error": None,
                "saves": {f"l{j}": rows[j, 128 * i : 128 * (i + 1)] for j in range(4)}} for i in range(256)]
    dumps, loads = [], []
    for _ in range(rounds):
        out = io.BytesIO()
        t0 = time.perf_counter()
        report_file._HeaderPickler(out, region, 0, region.numel()).dump(reports)
        t1 = time.perf_counter()
        report_file._HeaderUnpickler(io.BytesIO(out.getvalue()), region).load()
        dumps.append(1e3 * (t1 - t0)), loads.append(1e3 * (time.perf_counter() - t1))
    print(f"header of 256 reports x 4 region tensors: written {statistics.median(dumps):.2f} ms, "
          f"read {statistics.median(loads):.2f} ms, {len(out.getvalue())} bytes (medians of {rounds})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--only", choices=("handoffs", "gather", "cuda", "files", "maplock", "register",
                                                 "bookkeeping"), help="one part only")
    args = parser.parse_args()
    print(f"cores this process may use: {len(os.sched_getaffinity(0))}; torch threads {torch.get_num_threads()}")
    parts = (("handoffs", handoffs), ("gather", lambda: gather(args.mib)), ("cuda", lambda: cuda(args.mib)),
             ("files", lambda: files(args.mib)), ("maplock", lambda: maplock(args.mib)),
             ("register", lambda: register(args.mib)), ("bookkeeping", bookkeeping))
    for name, part in parts:
        if args.only in (None, name):
            part()


if __name__ == "__main__":
    main()
