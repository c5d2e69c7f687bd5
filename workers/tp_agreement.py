"""TP agreement rounds: where every tensor-parallel rank decides a program's fate alike.

Under TP every rank runs each program in lockstep on the same values. Two decisions must come out
the same everywhere, or a rank would enter a gather the others never join (the group hangs) or
compute from values the others do not have (silently wrong): where each call goes next, and
whether it ran out of time. Each is one all-reduce over the TP group's CPU group (``agree_max``,
from the runner adapter), at places every rank reaches alike (see dispatch.py's ``settle`` and
interleaver.py's ``end_step``).
"""

from __future__ import annotations

import zlib
from typing import Callable

import numpy as np

from interlace.workers.calls import ProgramCall, RanksDiverged, error_record
from interlace.workers.states import Step


def agree_on_paths(step: Step, agree_max: Callable[[np.ndarray], np.ndarray]) -> None:
    """Stop, on every rank, each call whose ranks went different ways.

    The TP ranks run each program on the same values, so they make the same accesses, unless
    the program consults something rank-local (the clock, the process id, a file, a device
    error on one GPU). A rank whose program then reads a split value would enter a gather the
    others never join, and the group would hang; one that writes where the others do not
    would leave the ranks computing from different values, silently. So each time programs
    ran, before anything is gathered for them, the ranks compare every call's state (what
    it waits for next, whether it failed, how many writes it made, whether a rank's watchdog
    interrupted it): one all-reduce of a few numbers per call over the group's CPU group. A
    call interrupted on any rank times out on every rank; one whose paths differ otherwise is
    stopped with :class:`RanksDiverged`. The calls are the same, in the same order,
    on every rank, and a rank runs a round exactly where the others do: after starting the
    step's programs, and at each hook where calls that all ranks agreed wait there ran.
    Values a program computes without acting on them differently (e.g. noise added to a
    write) are not compared."""
    calls, n = step.calls, len(step.calls)
    codes = np.fromiter((_path_code(call) for call, _ in calls), np.float64, n)
    used = np.fromiter((call.used_s for call, _ in calls), np.float64, n)
    # A call a rank's watchdog interrupted (a busy loop never reaches a point where the ranks
    # could agree first) times out on every rank, whatever path the others are on.
    timed = np.fromiter((call.timed_out and not call.stopped for call, _ in calls), np.float64, n)
    agreed = agree_max(np.concatenate([codes, -codes, used, timed]))  # the times too (see agree_on_time)
    high, low = agreed[:n], -agreed[n : 2 * n]
    for (call, _ctx), used_s in zip(calls, agreed[2 * n : 3 * n].tolist()):
        call.agreed_s = used_s
    for (call, _ctx), hi, lo, timed_out in zip(calls, high.tolist(), low.tolist(), agreed[3 * n :].tolist()):
        if timed_out:
            call.time_out()
        elif hi != lo:
            message = (
                f"the program took different paths on the tensor-parallel ranks (on this rank it "
                f"{_path_words(call)}, on another not). "
                "Every rank runs the program on the same values and must read, write and fail alike; "
                "something rank-local (the clock, the process id or rank, a file, randomness seeded "
                "apart, an error on one GPU only) decided otherwise. It was stopped on every rank"
            )
            call.stop(error_record(RanksDiverged(message), where=call.view.where()))
    step.times_agreed = all(call.done for call, _ in calls)  # no program runs again this step


def agree_on_time(step: Step, agree_max: Callable[[np.ndarray], np.ndarray]) -> None:
    """Under TP, decide the step's time-outs the same way on every rank: each call's running
    time is the most any rank counted (an all-reduce over the TP group's CPU group, unless the
    step's last path round carried the final times already), and every call past its budget
    by that measure is stopped here, on every rank alike. The calls are the same, in the same
    order, on every rank of the group (built from the same schedule)."""
    calls = step.calls
    if not step.times_agreed:  # programs ran since the last round, or some wait for a point not reached
        agreed = agree_max(np.fromiter((call.used_s for call, _ in calls), np.float64, len(calls)))
        for (call, _ctx), used in zip(calls, agreed.tolist()):
            call.agreed_s = used
    for call, _ctx in calls:
        if call.agreed_s >= call.budget_s and call.error is None:
            call.time_out()


def _path_code(call: ProgramCall) -> float:
    """A call's state as one number that ranks taking the same path compute alike: what it waits
    for next (or that it is done), whether it failed, how many writes it made (float64 holds it
    exactly: under 2**46)."""
    if call.stopped:  # stopped alike on every rank (its ranks went different ways): no longer compared
        return -1.0
    point = call.waiting_for
    where = 0 if call.done else 1 + zlib.crc32(f"{point.module}\0{point.kind}".encode())  # stable across processes
    return float((((where << 1) | (call.error is not None)) << 12) | (call.writes & 0xFFF))


def _path_words(call: ProgramCall) -> str:
    state = "finished" if call.done else f"waits for {call.waiting_for}"
    failed = " after failing" if call.error is not None else ""
    return f"{state}{failed} with {call.writes} writes"
