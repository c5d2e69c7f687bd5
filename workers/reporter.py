"""The reporter: assembles and writes finished invokes' reports off the engine thread.

A sweep's report can be hundreds of MiB of saves to gather and write. Done inline, it would stall
the engine's next step, and every other request with it, for that long; on this thread the engine
keeps stepping while the report is written (gathering and writing release the GIL). Jobs run one
at a time, in the order they were submitted.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

logger = logging.getLogger("interlace")


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
