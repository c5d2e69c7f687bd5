"""Where program greenlets start on the engine's thread, and what switches into them.

Programs run in greenlets on the engine's own thread (calls.py). Two things about where a
greenlet's stack starts decide what a switch into it costs: greenlet copies out the part of the C
stack the greenlet switched to runs over (so workers and the hub start below every tap:
:func:`deep_switch`), and on Python 3.12 and later walks the Python frame chain of the greenlet it
leaves (so the engine switches into programs from a hub whose stack starts empty:
:func:`run_shallow`). Each greenlet counts its recursion depth on from where it started, so the
worker process leaves programs the room those starts take (:func:`make_room`).
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any, Callable

import greenlet

_local = threading.local()


def idle_workers() -> list:
    """This thread's idle workers (a greenlet switches only within its own thread)."""
    idle = getattr(_local, "idle", None)
    if idle is None:
        idle = _local.idle = []
    return idle


# How far below the engine's frames a worker's stack starts, in C frames (Python functions called
# from C, about 1 KB each). A greenlet switch copies out whatever part of the C stack the
# greenlet switched to runs over, and back on the way out: a worker started where the step
# begins runs over the forward pass's frames at every tap below it, which cost a switch in and
# out 2.8 us instead of 0.3 us from 100 such frames down (2-core CPU; the CPU forward's tap sits
# 8.8 KB below where the step begins). A worker that starts below every tap copies none of them.
_DEEP_FRAMES = 256


def make_room() -> None:
    """Raise this process's recursion limit by what the hub's and workers' deep starts take, so
    a program recurses as deep as plain Python lets a script (each greenlet counts on from where
    it started: a program had 424 levels left on the CPU engine, against 998 in a script). Once
    per process; a higher limit set before is kept."""
    global _ROOM_MADE
    if not _ROOM_MADE:
        _ROOM_MADE = True
        sys.setrecursionlimit(sys.getrecursionlimit() + _ROOM)


_ROOM = 2 * _DEEP_FRAMES + 200  # the hub's start, a worker's below it, and the engine's frames above both
_ROOM_MADE = False


def deep_frames() -> int:
    """_DEEP_FRAMES, or fewer where the interpreter's recursion limit leaves less room (a worker
    starts once per thread and concurrent program: the walk up the frames is paid that often)."""
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    return max(0, min(_DEEP_FRAMES, sys.getrecursionlimit() - depth - 200))


def deep_switch(worker: greenlet.greenlet, value: Any, frames: int) -> Any:
    """``worker.switch(value)``, made ``frames`` C frames further down the stack than the caller.

    Where the interpreter has no room for them, the switch is made here instead (the worker's
    switches then copy more of the stack, and run the same): a tracer or profiler in this thread
    (coverage.py, pdb, an IDE's debugger, cProfile) counts each of these frames two or more times
    against the recursion limit, which deep_frames cannot see, and the first program of a traced
    engine failed with a RecursionError in interlace's code."""
    switched: list = []  # whether the switch was made: a RecursionError after it is not ours
    try:
        return _descend(worker, value, switched, frames)
    except RecursionError:
        if switched:
            raise
        return worker.switch(value)


def _descend(worker: greenlet.greenlet, value: Any, switched: list, frames: int) -> Any:
    """``next(map(...))`` calls back into Python from C, each call a frame of the interpreter's
    (a partial with keywords would count each twice against the recursion limit)."""
    if frames <= 0:
        switched.append(True)
        return worker.switch(value)
    return next(map(functools.partial(_descend, worker, value, switched), (frames - 1,)))


def run_shallow(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, run in this thread's hub: a greenlet whose Python stack starts empty, for
    code that switches into programs (a step's start, a hook's delivery loop).

    On Python 3.12 and later greenlet walks the whole Python frame chain of the greenlet it
    switches away from, and again on the way back, so that ``gr_frame`` tracebacks stay valid
    (``expose_frames``/``unexpose_frames`` in greenlet's source; 3.11 has no such walk): about 1 us
    more per switch into a program and back for every 100 frames the engine is deep (Python 3.12,
    greenlet 3.5.6; 4-9 us instead of 2 at 200-400 frames), and a program per invoke makes 512 of
    them a step. At a tap the engine is dozens of frames deep (46 in the CPU engine's forward).
    Here the engine's frames are walked once per call of this function, and each program's switch
    walks the hub's few.

    Runs ``fn`` directly where a switch would not help or could not be made: in the hub itself,
    or while the hub is away in a program (a program reaching here would resume the hub midway).
    """
    hub = getattr(_local, "hub", None)
    here = greenlet.getcurrent()
    if hub is here or getattr(_local, "hub_busy", False):
        return fn(*args)
    _local.hub_busy = True
    try:
        if hub is None or hub.dead:  # its first switch sets where its stack starts: below every tap, as a worker's
            hub = _local.hub = greenlet.greenlet(_hub)
            ok, value = deep_switch(hub, (here, fn, args), deep_frames())
        else:
            ok, value = hub.switch((here, fn, args))
    finally:
        _local.hub_busy = False
    if ok:
        return value
    raise value


def _hub(job: tuple) -> None:
    """The hub's life (see run_shallow): run a job, hand back its result or exception, wait for
    the next. Its parent is the engine greenlet that made it."""
    while True:
        caller, fn, args = job
        try:
            result = (True, fn(*args))
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's side
            result = (False, exc)
        job = caller.switch(result)
