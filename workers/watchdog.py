"""The watchdog: interrupts programs that run past their time limit, and ends the worker process
for one that will not stop (see calls.py, whose calls it watches, for why it must be so).

Programs run on the engine's own thread (greenlets), so the only way to stop one from outside is an
exception raised in that thread, at a moment when the program's code, not the engine's, runs.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from interlace.workers.calls import ProgramCall

GRACE_S = 3.0  # past its deadline, a program that is still running ends its worker process
EXIT_CODE = 75  # the worker's exit status then (EX_TEMPFAIL), for whoever reads the process table


class Watchdog:
    """Interrupts programs that run past their deadline: one daemon thread per process, which
    looks every ``period`` seconds whether a running program is late and, if so, raises
    ``interrupt`` (calls.ProgramError) inside the thread it runs on (again each period, should the program
    swallow it).

    An interruption must land in the program, never in the engine's own code. It is raised only
    while the program's greenlet is the one running (see :attr:`ProgramCall.running`) and its
    call is entered, under the lock; programs :meth:`leave` before they switch back to the
    engine, which also clears an interruption raised too late to have landed. One that lands on
    a program's way out ends its greenlet, and the engine side catches it as it comes out of the
    switch.
    """

    def __init__(self, interrupt: type[BaseException], period: float = 0.05):
        self.interrupt = interrupt  # what is raised in a program past its deadline (calls.ProgramError)
        self.period = period
        self._lock = threading.Lock()
        # thread id -> the program it runs or ran last (None once it left). A thread's key stays
        # once made, so :meth:`enter` replaces a value without the lock: the loop, which holds it,
        # never sees the dict change size. That lock is what the interruption's landing needs
        # (the program cannot leave while the loop decides), and a switch pays one, in leave.
        self._running: dict[int, "ProgramCall | None"] = {}
        self._thread: threading.Thread | None = None

    def enter(self, call: "ProgramCall", deadline: float) -> None:
        call.deadline = deadline
        call.watched = True
        thread = threading.get_ident()
        if thread in self._running:
            self._running[thread] = call
            return
        with self._lock:  # this thread's first program: a new key
            self._running[thread] = call
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name="interlace-watchdog")
                self._thread.start()

    def running(self) -> "ProgramCall | None":
        """The call whose program's code this thread runs now (None: interlace's or vLLM's code)."""
        return self._running.get(threading.get_ident())

    def leave(self, call: "ProgramCall") -> None:
        thread = threading.get_ident()
        with self._lock:
            call.watched = False
            if self._running.get(thread) is call:
                self._running[thread] = None
                if call.timed_out:
                    raise_in(thread, None)  # nothing pending once the program is out

    def _loop(self) -> None:
        while True:
            time.sleep(self.period)
            now = time.monotonic()
            with self._lock:
                for thread, call in self._running.items():
                    if call is None:
                        continue
                    if now > call.deadline + GRACE_S and call.running:
                        _end_process(call, now - call.deadline)
                    if now > call.deadline and call.running:
                        call.timed_out = True
                        raise_in(thread, self.interrupt)


def _end_process(call: "ProgramCall", late_s: float) -> None:
    """The last resort for a program that does not stop: record why, then end this process.

    Its thread is the engine's; while it runs, nothing else in the engine can. The record goes
    where the invokes' reports go (``last_words`` of the interleaver serving the call), and the
    rank's flight record says the program overran (flight.py: a replica reads it), so the driver
    can say which program it was and what happened."""
    record = {
        "type": "ProgramIgnoredTimeLimit",
        "message": (
            f"the program was still running {late_s:.1f}s past the trace's time limit of {call.limit_s:g}s "
            "(it caught the interruption, e.g. with `except BaseException`, or sat in one long call "
            "into C), so interlace ended the engine's worker process to stop it; the trace is lost "
            "and the next one starts a new engine. Let ProgramError propagate (catch Exception, "
            "not BaseException) and keep blocking calls short"
        ),
        "where": call.view.where() if hasattr(call.view, "where") else "",
        "traceback": "",
    }
    try:
        if call.flight is not None:
            call.flight.recorder.overran(call.flight)
        last_words = getattr(getattr(call.view, "_ctx", None), "services", None)
        if last_words is not None and hasattr(last_words, "last_words"):
            last_words.last_words(call.view._ctx, record)
    except BaseException:  # noqa: BLE001 - the process ends either way
        pass
    finally:
        os._exit(EXIT_CODE)


def raise_in(thread_id: int, exc_type: type[BaseException] | None) -> None:
    """Raise ``exc_type`` in thread ``thread_id`` at its next bytecode (None: clear a pending one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc_type) if exc_type else ctypes.c_void_p(None))
