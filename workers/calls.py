"""Running a program interleaved with the forward pass.

A :class:`ProgramCall` is one run of a user program for one generation step over one group of
invokes. It runs on a pool thread; each module access hands control back to the engine thread,
which resumes it when the forward pass reaches that module. Only one side runs at a time, so the
program sees a consistent model and the engine never races it.

The engine side never lets a user exception or a hang through: errors are captured as records
with the user's traceback, and a program that overruns its time budget is interrupted
(an exception is raised inside its thread) and its invokes fail.
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
import threading
import time
import traceback
from typing import Any, Callable

import torch

from interlace.workers.points import Point


class ProgramError(Exception):
    """Raised inside a program thread to stop it (timeout, engine-side refusal)."""


class Suspended(ProgramError):
    """Raised inside a program thread whose next access belongs to a later pipeline stage."""


class _Finished:
    """Sentinel: the program returned (or failed) for this step."""


FINISHED = _Finished()


def error_record(exc: BaseException, where: str) -> dict:
    """A picklable description of a failure, with the user's own traceback."""
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "where": where,
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    }


class _ThreadPool:
    """Daemon threads that run program calls; grows on demand, reuses idle threads."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._idle == 0:
                threading.Thread(target=self._loop, daemon=True, name="interlace-program").start()
            else:
                self._idle -= 1
        self._jobs.put(fn)

    def _loop(self) -> None:
        while True:
            fn = self._jobs.get()
            try:
                fn()
            except ProgramError:  # a late interrupt for a program that had just finished
                pass
            with self._lock:
                self._idle += 1


_POOL = _ThreadPool()


class ProgramCall:
    """One program run over one step; the engine drives it with :meth:`start` and :meth:`resume`."""

    def __init__(self, program: Callable, view, budget_s: float, limit_s: float, replay: list | None = None,
                 keep_log: bool = False):
        self.program = program
        self.view = view
        self.budget_s = budget_s  # program running time left to the trace
        self.limit_s = limit_s  # the trace's whole time limit (for the message)
        # Pipeline parallelism (see pipeline.py): the values earlier stages' accesses returned, and
        # whether to log this stage's for the next one.
        self.replay = replay or []
        self.replaying = replay is not None  # even with no values: the code before the first access ran there
        self.log: list | None = [] if keep_log else None
        self._accesses = 0
        self._stream = None
        self.used_s = 0.0  # time the program ran in this call (engine time not counted)
        self.waiting_for: Point | _Finished | None = None  # what the program needs next
        self.error: dict | None = None
        self._value: Any = None  # handed to the program at its access
        self._to_program = threading.Semaphore(0)
        self._to_engine = threading.Semaphore(0)
        self._thread_id: int | None = None

    # --- engine side ---------------------------------------------------------------------------

    def start(self) -> None:
        # The program's kernels (and any collective it triggers, e.g. reading a TP-split parameter)
        # must queue behind the forward pass on the engine's device and stream; a fresh thread
        # would otherwise use device 0's default stream.
        self._stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None
        _POOL.submit(self._run)
        self._wait_for_program()

    def resume(self, value: Any) -> None:
        """Hand ``value`` to the program waiting at its point; return when it waits again."""
        self._value = value
        self._to_program.release()
        self._wait_for_program()

    def cancel(self, reason: str) -> None:
        """Stop a program that is waiting at a point that will not come."""
        self._stop(ProgramError(reason))

    def suspend(self) -> None:
        """Stop a program whose next access runs on a later pipeline stage (not an error)."""
        self._stop(Suspended())

    def _stop(self, exc: ProgramError) -> None:
        if self.waiting_for is FINISHED:
            return
        self._value = exc
        self._to_program.release()
        self._wait_for_program()

    @property
    def done(self) -> bool:
        return self.waiting_for is FINISHED

    def _wait_for_program(self) -> None:
        remaining = self.budget_s - self.used_s
        started = time.monotonic()
        ok = remaining > 0 and self._to_engine.acquire(timeout=remaining)
        self.used_s += time.monotonic() - started
        if ok:
            return
        self._interrupt()
        self.error = self.error or error_record(
            TimeoutError(f"the program ran past the trace's time limit of {self.limit_s:g}s and was stopped"),
            where=str(self.waiting_for) if isinstance(self.waiting_for, Point) else "program",
        )
        self.waiting_for = FINISHED

    def _interrupt(self) -> None:
        # Raise inside the program's thread so a runaway loop stops using the CPU.
        if self._thread_id is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self._thread_id), ctypes.py_object(ProgramError)
            )

    # --- program side --------------------------------------------------------------------------

    def access(self, live: Callable[[], Any]) -> Any:
        """One access of the program (a point or a recv): replayed from the carry while earlier
        pipeline stages already made it, else ``live()``; logged when a later stage needs it."""
        index, self._accesses = self._accesses, self._accesses + 1
        if index < len(self.replay):
            return self.replay[index]
        self.replaying = False
        value = live()
        if self.log is not None:
            self.log.append(_snapshot(value))
        return value

    def wait_at(self, point: Point) -> Any:
        """Called from the program thread: block until the engine reaches ``point``."""
        self.waiting_for = point
        self._to_engine.release()
        self._to_program.acquire()
        value = self._value
        if isinstance(value, ProgramError):
            raise value
        return value

    def _run(self) -> None:
        self._thread_id = threading.get_ident()
        try:
            if self._stream is not None:
                torch.cuda.set_device(self._stream.device)
            with torch.inference_mode(), _on_stream(self._stream):  # per-thread state: match the engine's
                self.program(self.view)
        except Suspended:
            pass
        except BaseException as exc:  # noqa: BLE001 - every user failure becomes a record
            if self.waiting_for is not FINISHED:
                self.error = error_record(exc, where=self.view.where())
        finally:
            self._thread_id = None
            if self.waiting_for is not FINISHED:
                self.waiting_for = FINISHED
                self._to_engine.release()


def _on_stream(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _snapshot(value: Any) -> Any:
    """A copy that later in-place kernels (and the program's own edits) cannot change."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(_snapshot(v) for v in value)
    return value
