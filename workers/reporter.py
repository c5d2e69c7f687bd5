"""The reporter: assembles and writes finished invokes' reports off the engine thread.

A sweep's report can be hundreds of MiB of saves to gather and write. Done inline, it would stall
the engine's next step, and every other request with it, for that long; on this thread the engine
keeps stepping while the report is written (gathering and writing release the GIL). Jobs run one
at a time, in the order they were submitted.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import queue
import re
import threading
from typing import Callable

logger = logging.getLogger("interlace")


def one_openmp_thread() -> None:
    """Run torch's CPU work on the calling thread (one of interlace's own, beside the engine's)
    with one OpenMP thread.

    OpenMP keeps a team of threads per thread that starts parallel work. The first large torch op
    on a reporter thread made a second team beside the engine's, and a CPU engine's forward pass
    (thousands of small parallel regions a step) then ran at 0.57 of its speed for the rest of the
    process, plain vLLM's beside it too (2-core CPU, 2026-12-05). The likely cause is libgomp's
    documented throttling: with more OpenMP threads than cores its threads spin 100 times, not
    300,000, before they sleep between regions (GOMP_SPINCOUNT). ``torch.set_num_threads`` is
    not the way: it also sets the count torch keeps for the whole process, which slowed the
    engine alike. So the runtime's own per-thread setting, ``omp_set_num_threads``, in every
    OpenMP library this process loaded (torch's, and others' that libraries bundle, such as
    sentencepiece's: this thread starts no team in any of them)."""
    import torch  # (loaded already by whoever starts this thread: a rank)

    torch.get_num_threads()  # torch sets up this thread's OpenMP count once, at its first use: first
    for set_threads in _openmp_set_num_threads():
        set_threads(1)


@functools.cache
def _openmp_set_num_threads() -> tuple:
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps
                     if re.match(r"lib(gomp|iomp5|omp)([.-]|$)", line.rsplit("/", 1)[-1])}
    except OSError:  # not Linux
        return ()
    setters = []
    for path in sorted(paths):  # libgomp, libiomp5 or libomp: the same call
        try:
            setters.append(ctypes.CDLL(path).omp_set_num_threads)
        except (OSError, AttributeError):
            continue
    return tuple(setters)


class Reporter:
    def __init__(self, device=None):
        """``device``: the rank's torch device. On a GPU the thread makes it its current one, so
        that what it asks of CUDA (pinning report files, copies) never opens a context on GPU 0."""
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._device = device

    def submit(self, job: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True, name="interlace-reporter")
            self._thread.start()
        self._jobs.put(job)

    def _loop(self) -> None:
        one_openmp_thread()
        if self._device is not None and self._device.type == "cuda":
            import torch

            torch.cuda.set_device(self._device)
        while True:
            job = self._jobs.get()
            try:
                job()
            except Exception:  # noqa: BLE001 - a job reports its own failures; this is a last resort
                logger.exception("interlace: a report could not be written")
            job = None  # let go of its saves (pinned chunks, the file mapping) while idle
