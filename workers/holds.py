"""What a program holds of the points it read in a step, and whether its writes can still land.

A value read at a point belongs to the forward pass only while the hook that produced it runs.
While it does, the interleaver writes back what the program changed (an assignment, an in-place
edit of a copy) after every run of the program, also a run resumed later at the same hook (a
receiver woken by another invoke's ``send``). Once the hook has returned the forward pass has
used the value, so a write could only be lost; it fails the program instead:

- an assignment, at once, in the program (:meth:`Holdings.refuse_write`);
- an in-place edit of a copy (``resid``, rows gathered or selected, values carried from an earlier
  pipeline stage), the next time the program switches back to the engine (:meth:`Holdings.late_edit`):
  copies are normal tensors whose version counter shows the edit, read without a GPU sync. A copy
  is watched while the program can still reach it (a Python reference, a view of it, or the view's
  ``m.<point>`` of the current point), so the check costs a few attribute reads per value it still
  holds, and keeps nothing alive that the program dropped.

In-place edits of views of vLLM's own tensors (a module's output for contiguous rows) cannot be
seen (inference tensors have no version counter); docs/guide.md says not to make them after a wait.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from interlace.workers.points import MAILBOX, Point, short_name


@dataclass(slots=True)
class Held:
    """A value handed to a program while its point's hook runs."""

    point: Point
    value: Any
    versions: tuple[int, ...]  # each tensor's version counter when handed out or last written back
    access: Any  # the hook's PointAccess
    rows: Any  # the call's Rows at this point
    split: Any  # the tensor-parallel split of the value (None: whole on every rank)
    copy: bool  # not a view of the hook's tensors: in-place edits must be written back
    written: Any = None  # what was last written back here (this rank's piece): its rows go to the write log


@dataclass(slots=True)
class Late:
    """A copy a program may still hold after its point's hook returned."""

    point: Point
    after: Point | None  # what the program waited for when the hook returned (or first read live)
    tensors: list[tuple[torch.Tensor, int]]  # its normal tensors, and their version counters then


class Holdings:
    """One call's values: those whose hook runs now (written back) and earlier ones (watched)."""

    __slots__ = ("live", "late", "replayed", "after")

    def __init__(self):
        self.live: list[Held] = []
        self.late: list[Late] = []
        self.replayed: list[tuple[Point, Any]] = []  # replayed from an earlier pipeline stage
        self.after: dict[Point, Point | None] = {}  # point whose hook returned -> what the program waited for

    def reset(self) -> None:
        """Nothing held: the call's next step (CallContext.again). Most of these are empty by then."""
        if self.live:
            self.live.clear()
        if self.late:
            self.late.clear()
        if self.replayed:
            self.replayed.clear()
        if self.after:
            self.after.clear()

    def live_at(self, point: Point) -> Held | None:
        for held in reversed(self.live):
            if held.point is point or held.point == point:
                return held
        return None

    def close(self, after: Point | None, done: bool) -> None:
        """The hook of the live values returned; ``after``: what the program waits for now."""
        if not done:  # a finished program edits nothing more
            for held in self.live:
                self.after[held.point] = after
                if held.copy:
                    self._watch(held.point, after, held.value)
        self.live.clear()

    def replay_ended(self, after: Point) -> None:
        """The program made its first live access on this pipeline stage (``after``): the values
        replayed before it come from earlier stages, and edits made to them from now on are late
        (edits made while replaying were made, and written, on their own stage)."""
        for point, value in self.replayed:
            self.after[point] = after
            self._watch(point, after, value)
        self.replayed.clear()

    def _watch(self, point: Point, after: Point | None, value: Any) -> None:
        tensors = tracked(value)
        if tensors:
            self.late.append(Late(point, after, tensors))

    def refuse_write(self, point: Point) -> None:
        """Raise unless ``point``'s hook still runs (the program may assign it)."""
        if self.live_at(point) is not None:
            return
        raise RuntimeError(late_message(point, self.after.get(point), "assigned"))

    def late_edit(self, done: bool) -> str | None:
        """After the program ran: why it fails, if it edited in place a copy whose hook had
        returned. Copies it can no longer reach are let go (``done``: all of them)."""
        for late in self.late:
            if _edited(late.tensors):
                _charged(late.tensors)
                self.late.clear()
                return late_message(late.point, late.after, "edited in place its copy of")
        self.late = [] if done else [late for late in self.late if _reachable(late.tensors)]
        return None


def versions(value: Any) -> tuple[int, ...]:
    """The version counter of each tensor in a value (-1 for an inference tensor: none to read)."""
    if isinstance(value, torch.Tensor):
        return (-1 if value.is_inference() else value._version,)
    if isinstance(value, tuple):
        return tuple(v for item in value for v in versions(item))
    return ()


# Views of one tensor share its version counter: every program's rows of a tap's one copy
# (points.TapAccess) count the edits of all of them. Edits are checked right after each run of a
# program (written back while the hook runs, refused once it returned), so a counter that moved
# during that run moved by that program's edit: the counter's value then is kept on the viewed
# tensor (``_SEEN``), and is no edit of the others' views.
_SEEN = "_interlace_edit_seen"


def live_edit(held: Held) -> tuple[int, ...] | None:
    """After a run of the program holding ``held`` (a copy whose hook still runs): its version
    counters if that run edited it in place, else None. A counter moved by another program's
    edit of the same copy (a program suspended at the tap, e.g. at a ``recv``, while others edit
    their rows; programs started together, calls.start_at_points, whose edits are checked after
    all of them ran) was charged to the first program checked since; the copy has its rows already."""
    now = versions(held.value)
    if now == held.versions:
        return None
    value = held.value
    if -1 in now or not isinstance(value, torch.Tensor):  # no counter to tell (or a tuple of copies): taken as edited
        return now
    pair = [(value, held.versions[0])]
    if not _edited(pair):  # moved by another program's edit, charged to it
        held.versions = now
        return None
    _charged(pair)
    return now


def _edited(tensors: list[tuple[torch.Tensor, int]]) -> bool:
    """Whether one of the tensors was edited in place since its version was recorded, by the
    program that ran last (see _SEEN)."""
    for tensor, version in tensors:
        now = tensor._version
        if now != version:
            base = tensor._base
            if now != getattr(tensor if base is None else base, _SEEN, None):
                return True
    return False


def _charged(tensors: list[tuple[torch.Tensor, int]]) -> None:
    """The edits of these tensors are the program's own: not another holder's of the same views."""
    for tensor, _version in tensors:
        base = tensor._base
        setattr(tensor if base is None else base, _SEEN, tensor._version)


def _reachable(tensors: list[tuple[torch.Tensor, int]]) -> bool:
    """Whether the program may still reach one of these tensors: a reference besides the pair
    holding it here and getrefcount's argument (a view of it holds one too)."""
    return any(sys.getrefcount(pair[0]) > 2 for pair in tensors)


def tracked(value: Any) -> list[tuple[torch.Tensor, int]]:
    """A value's normal tensors with their version counters (inference tensors have none)."""
    if isinstance(value, torch.Tensor):
        return [] if value.is_inference() else [(value, value._version)]
    if isinstance(value, tuple):
        return [pair for item in value for pair in tracked(item)]
    return []


def late_message(point: Point, after: Point | None, how: str) -> str:
    """Why a write to ``point`` after its hook returned is refused, and what to write instead."""
    module = short_name(point.module) or str(point)
    if after is None:
        waited, fix = "its module had run", f"Write {point} before the program waits for anything that comes later."
    elif after.module == MAILBOX:
        waited = f"waiting at recv({after.kind!r})"
        fix = (f"Receive first, then read and write {point} (e.g. `m.layers[2].resid[-1] = "
               f"m.recv('clean')[-1]`), and have the sender send {after.kind!r} at or before {point}.")
    elif after.kind.startswith("param:"):
        waited = f"reading {short_name(after.module)}.{after.kind[6:]}, which a later pipeline stage holds"
        fix = ("Under pipeline parallelism a later stage's parameter cannot be used to write an earlier "
               "stage's point: pass the tensor to the program instead (a closure or a global it uses).")
    else:
        waited = f"reading {after}"
        fix = (f"Make every write to {point} before reading {after}: accesses follow the forward order, "
               "and a point can be written until the program reads a later one or waits.")
    return (f"the program {how} {point} after {waited}, when the forward pass had already moved past "
            f"{module}: the write could not reach the model. {fix}")
