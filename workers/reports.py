"""Report writing: what this rank reports for its finished invokes, and when.

An invoke's report carries its saves (rows kept by the SaveLedger, values that are not rows),
its shared contributions and its error. :class:`ReportBatcher` holds a trace's finished invokes
until the rest of it finishes, then hands them to the reporter thread (reporter.py) as one batch,
and keeps the trace's report data file reserved ahead of its saves (report_file.py); the
module-level ``_write_*`` functions run on that thread and write through the trace's sink.
"""

from __future__ import annotations

import functools
import pickle
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import torch

from interlace.workers import report_file
from interlace.workers.calls import error_record
from interlace.workers.reporter import Reporter
from interlace.workers.save_gather import TakenSaves
from interlace.workers.saves import HostRows, SaveLedger
from interlace.workers.sink import open_sink
from interlace.workers.slots import SlotTable
from interlace.workers.states import InvokeState

RESERVE_MIN = 16 << 20  # a trace saving less is reserved when it is reported (see ReportBatcher.reserve_ahead)
REPORT_HOLD_S = 0.05  # how long finished invokes' reports wait for the rest of their trace (see ReportBatcher.report)


class ReportBatcher:
    """Hands finished invokes' reports to the reporter thread, one batch per trace (on TP rank 0,
    which alone reports for its group; every pipeline stage reports its own)."""

    def __init__(self, ledger: SaveLedger, slots: SlotTable, reporter: Reporter, stage: int):
        """``ledger``, ``slots``, ``reporter``: the interleaver's own, shared; ``stage``: this
        rank's pipeline stage, which its reports carry."""
        self.ledger = ledger
        self.slots = slots
        self.reporter = reporter
        self.stage = stage
        self.held: dict[tuple[str, str], _HeldReports] = {}  # (sink, trace) -> reports waiting for the rest (report)
        self._reserving: dict[tuple[str, str], tuple[int, int]] = {}  # (sink, trace) -> bytes saved, reserved

    def report(self, finished: list[InvokeState], live_invokes: Iterable[InvokeState]) -> None:
        """Hand the finished invokes' reports to the reporter thread, one batch per (sink, trace).

        A trace's invokes often finish a step or two apart (those admitted a step later). Their
        reports are held until the trace's last invoke on this rank finishes, or for at most
        REPORT_HOLD_S, and written as one batch: one take from the ledger, one plan, one region
        and one header, not one of each per step. (Each invoke keeps its slot meanwhile, so no
        invoke admitted since can be given its number and its rows.) Written at once, the first
        batch's gathering ran on the reporter thread during the trace's last steps, slowing them
        (Python contends for the GIL), and the next waited behind it: 55-70 ms from the last step
        to the results on an H100 host, for 512 MiB saved in three batches (bench/step_probe.py,
        2026-11-26). ``live_invokes``: the invokes still running on this rank."""
        live = {(state.sink, state.trace) for state in live_invokes}
        for state in finished:
            key = (state.sink, state.trace)
            self.held.setdefault(key, _HeldReports(time.monotonic())).states.append(state)
        batches = []
        for key in dict.fromkeys((state.sink, state.trace) for state in finished):
            if key not in live:  # this rank's last batch of the trace
                self._reserving.pop(key, None)
                batches.append(self._take(key, last=True))
        # Traces whose rows go in their headers, finishing together (a server's one-invoke traces
        # decode in step, and clients that wait for their results keep them so) are one job:
        # their rows gathered at once. As a job each (4 ms on an H200 host, mostly the gather),
        # they queued behind one another: with 32 clients on the 2-core CPU a report waited
        # 43 ms at the median, up to 100 ms, for the jobs ahead of it (bench/path_probe.py).
        joined = [batch for batch in batches if batch.taken.nbytes <= report_file.ROWS_IN_HEADER]
        if len(joined) < 2:
            joined = []
        else:
            self.reporter.submit(functools.partial(_write_together, joined))
        for batch in batches:
            if batch not in joined:
                self.reporter.submit(functools.partial(_write_reports, batch))

    def submit_held(self) -> None:
        """Hand over the held reports that have waited REPORT_HOLD_S."""
        before = time.monotonic() - REPORT_HOLD_S
        for key in [key for key, held in self.held.items() if held.since <= before]:
            self.reporter.submit(functools.partial(_write_reports, self._take(key, last=False)))

    def _take(self, key: tuple[str, str], last: bool) -> "_Batch":
        """The held reports of ``key`` with their saves taken from the ledger, to write."""
        states = self.held.pop(key).states
        slots = [state.slot for state in states]
        taken = self.ledger.take(key[1], slots, self.slots.last_step[slots])
        for slot in slots:  # the ledger has let go of their rows: the numbers may go to new invokes
            self.slots.remove(slot)
        return _Batch(*key, self.stage, [_report_of(state, self.stage) for state in states], taken,
                      [state.saves for state in states], last)

    def reserve_ahead(self, state: InvokeState, nbytes: int) -> None:
        """Keep the trace's report data file reserved ahead of its saves (see report_file.py): a
        job for the reporter thread each time the saves grow by a quarter, from RESERVE_MIN on."""
        key = (state.sink, state.trace)
        saved, reserved = self._reserving.get(key, (0, 0))
        saved += nbytes
        if saved >= max(reserved, RESERVE_MIN):
            reserved = saved + saved // 4
            self.reporter.submit(functools.partial(_reserve, state.sink, state.trace, self.stage, reserved))
        self._reserving[key] = (saved, reserved)


def write_now(states: list[InvokeState], stage: int) -> None:
    """Write the invokes' reports (no saves, no shared values: their errors) at once, on this
    thread: the process is about to end (Interleaver.last_words), so the reporter thread will not."""
    batches: dict[tuple[str, str], list[InvokeState]] = defaultdict(list)
    for state in states:
        batches[(state.sink, state.trace)].append(state)
    for (sink, trace), batch in batches.items():
        open_sink(sink).write(trace, stage, [{**_report_of(state, stage), "shared": []} for state in batch])


def _report_of(state: InvokeState, stage: int) -> dict:
    return {"trace": state.trace, "invoke": state.invoke, "stage": stage, "saves": {},
            "shared": state.shared, "error": state.error,
            "printed": state.printed.report() if state.printed is not None else []}


def _reserve(sink: str, trace: str, stage: int, nbytes: int) -> None:
    """On the reporter thread, while the trace runs: its report data file ``nbytes`` long."""
    try:
        open_sink(sink).reserve(trace, stage, nbytes)
    except OSError:  # e.g. no room now: the report tries again, and fails with the reason if it must
        pass


@dataclass(eq=False)
class _Batch:
    """One trace's reports on this rank, their saves taken from the ledger: a reporter job's work."""

    sink: str
    trace: str
    stage: int
    reports: list[dict]
    taken: TakenSaves
    objects: list[dict[str, list]]  # each invoke's saved values that are not rows
    last: bool  # the trace's last batch on this rank: its data file is closed after it


@dataclass
class _HeldReports:
    """Finished invokes of one trace whose reports wait for the rest of it (ReportBatcher.report)."""

    since: float  # when the first of them finished
    states: list[InvokeState] = field(default_factory=list)


def _write_reports(batch: _Batch) -> None:
    """On the reporter thread: write one batch of reports, then let the saves' host memory be
    reused (the reports hold copies of it); after the trace's last batch, close its data file."""
    try:
        _write_batch(batch)
    finally:
        batch.taken.release()
        if batch.last:
            open_sink(batch.sink).close(batch.trace, batch.stage)


def _write_together(batches: list[_Batch]) -> None:
    """On the reporter thread: several traces' batches whose rows go in their headers, their rows
    gathered at once (TakenSaves.together), then each trace's batch file. If they cannot be
    gathered together, each batch gathers its own (and says what failed)."""
    try:
        try:
            rows = TakenSaves.together([batch.taken for batch in batches]).assemble()
        except Exception:  # noqa: BLE001 - each batch on its own path tells its invokes why
            rows = None
        at = 0
        for batch in batches:
            _write_batch(batch, None if rows is None else rows[at : at + len(batch.reports)])
            at += len(batch.reports)
    finally:
        for batch in batches:
            batch.taken.release()
            if batch.last:
                open_sink(batch.sink).close(batch.trace, batch.stage)


def _write_batch(batch: _Batch, rows: list[dict[str, Any]] | None = None) -> None:
    """Assemble the saves into one batch file (``rows``: each report's, assembled already). If
    the batch cannot be written (e.g. an unpicklable save), each report is written alone, and
    those that still fail carry the error instead of their saves."""
    sink, trace, stage, reports, objects = batch.sink, batch.trace, batch.stage, batch.reports, batch.objects
    gathered = False  # whether the reports hold their saves (the rows were gathered)
    try:
        for report in reports:
            report["shared"] = [(name, how, v.get() if isinstance(v, HostRows) else v)
                                for name, how, v in report["shared"]]
        with open_sink(sink).batch(trace, stage) as writer:  # rows are gathered straight into the file
            def write_header(results: list[dict]) -> None:  # while the rows are still on their way
                nonlocal gathered
                for report, saved, values in zip(reports, results, objects):
                    report["saves"] = _with_objects(saved, values)
                gathered = True
                writer.finish(reports)

            if rows is None:
                batch.taken.assemble(writer.allocate, meanwhile=write_header)
            else:
                write_header(rows)
        return
    except Exception as exc:  # noqa: BLE001
        batch_error = error_record(exc, where="reporting results")
    if not gathered:  # an invoke whose saves were never gathered fails: written without them, it came back empty
        with_rows = _owners_with_rows(batch.taken)
        for report, values, slot in zip(reports, objects, batch.taken.wanted.tolist()):
            if values or slot in with_rows:
                report.update(shared=[], error=report["error"] or batch_error)
    for report in reports:
        try:
            open_sink(sink).write(trace, stage, [report])
        except Exception as exc:  # noqa: BLE001
            record = error_record(exc, where="reporting results" + _unsendable(report)) if report["saves"] else batch_error
            report.update(saves={}, shared=[], error=report["error"] or record)
            open_sink(sink).write(trace, stage, [report])


def _unsendable(report: dict) -> str:
    """Which of a report's saves cannot be pickled (the first), for its error: " of save 'x' (lock)".
    A program may save any value; one that cannot travel (a lock, a generator, a local function)
    fails its invoke when its report is written, and among many saves its name is what says which."""
    for name, value in report["saves"].items():
        if not isinstance(value, torch.Tensor) and not _pickles(value):
            while isinstance(value, (list, tuple)):  # (a value saved at several steps is a list of them)
                value = next((item for item in value if not _pickles(item)), None)
            return f" of save {name!r} ({type(value).__name__})"
    return ""


def _pickles(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 - whatever pickling raises
        return False
    return True


def _owners_with_rows(taken: TakenSaves) -> set[int]:
    """The owners (slots) some of whose rows the take holds."""
    return {slot for parts in taken.parts.values() for chunk, mask in parts
            for slot in np.unique(chunk.owners[mask]).tolist()}


def _with_objects(rows: dict[str, Any], objects: dict[str, list]) -> dict[str, Any]:
    """An invoke's saves: its rows by name, plus values that are not rows (one value, or a list
    when saved at several steps)."""
    for name, values in objects.items():
        if name in rows:
            raise TypeError(f"save({name!r}) got both tensors with rows and other values; use two names")
        rows[name] = values[0] if len(values) == 1 else values
    return rows
