"""The collector: one Ray actor that gathers every report of a trace, from every replica, shard and
pipeline stage, and hands the driver the trace's reports once, with its shared values merged.

    driver  --expect(trace, keys)-->  collector  <--report([...])--  replicas (saves by object ref)
    driver  <--take(trace)----------  collector   (once every expected (invoke, stage) reported)

Reports are keyed by (trace, invoke, stage, attempt). A key counts once: a duplicate is dropped,
and so is a report of an attempt older than the key's current one (a shard re-run after its
replica died bumps its keys' attempt with :meth:`Collector.retry`). Saved tensors travel as Ray
object refs (owned by the replica that made them); the collector never fetches them. A trace is forgotten once delivered, so memory follows the traces in
flight, not the traces served. A restarted collector knows no trace: ``take`` answers ``None``
and the driver re-runs that trace.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from interlace.core.merge import MergeError, merge_shared
from interlace.core.wire import Report, portable

Key = tuple[int, int]  # (invoke, stage)


@dataclass
class TraceReports:
    """What the collector delivers for one trace."""

    reports: dict[int, list[Report]]  # by invoke, one per stage; saves still object refs
    shared: dict[str, Any]  # merged across invokes, stages, shards and replicas
    merge_error: MergeError | None = None  # merging failed (e.g. one name with two merges)


@dataclass
class _Pending:
    expected: dict[Key, int]  # key -> its current attempt
    received: dict[Key, Report] = field(default_factory=dict)
    complete: asyncio.Event = field(default_factory=asyncio.Event)

    def check(self) -> None:
        if len(self.received) == len(self.expected):
            self.complete.set()
        else:
            self.complete.clear()


class Collector:
    """Use through :func:`start_collector` (a Ray actor); plain methods so it can be tested whole."""

    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}
        self.accepted = 0
        self.dropped = 0  # duplicates, stale attempts, unknown traces

    def expect(self, trace: str, keys: list[Key], attempt: int = 0) -> None:
        """Announce ``trace``'s reports (before its shards run); a trace with none completes at once."""
        pending = self._pending.setdefault(trace, _Pending({}))
        for key in keys:
            pending.expected[tuple(key)] = attempt
        pending.check()

    def retry(self, trace: str, keys: list[Key], attempt: int) -> None:
        """``keys`` are being re-run as ``attempt``: reports of older attempts no longer count."""
        pending = self._pending.get(trace)
        if pending is None:
            return
        for key in map(tuple, keys):
            pending.expected[key] = max(pending.expected.get(key, 0), attempt)
            held = pending.received.get(key)
            if held is not None and held.attempt < pending.expected[key]:
                del pending.received[key]
        pending.check()

    def report(self, reports: list[Report]) -> int:
        """Take reports; returns how many counted (the rest were duplicates or stale)."""
        counted = 0
        for report in reports:
            pending = self._pending.get(report.trace)
            current = pending.expected.get(report.key) if pending is not None else None
            held = pending.received.get(report.key) if pending is not None else None
            if current is None or report.attempt < current or (held is not None and held.attempt >= report.attempt):
                self.dropped += 1
                continue
            pending.expected[report.key] = report.attempt
            pending.received[report.key] = report
            pending.check()
            counted += 1
        self.accepted += counted
        return counted

    async def take(self, trace: str, timeout_s: float | None = None) -> TraceReports | None:
        """The trace's reports once all arrived, delivered once (then forgotten). ``None``: the
        collector does not know the trace (restarted, or delivered already); the driver re-runs it."""
        pending = self._pending.get(trace)
        if pending is None:
            return None
        await asyncio.wait_for(pending.complete.wait(), timeout_s)
        if self._pending.pop(trace, None) is None:  # another take() got it first
            return None
        return _deliver(pending.received.values())

    def drop(self, trace: str) -> None:
        """Forget a trace the driver gave up on."""
        self._pending.pop(trace, None)

    def stats(self) -> dict[str, int]:
        return {"pending": len(self._pending), "accepted": self.accepted, "dropped": self.dropped}

    def pid(self) -> int:
        """This actor's process (a restarted collector has a new one)."""
        import os

        return os.getpid()


def _deliver(received) -> TraceReports:
    by_invoke: dict[int, list[Report]] = {}
    contributions, failed = [], False
    for report in sorted(received, key=lambda r: r.key):
        by_invoke.setdefault(report.invoke, []).append(report)
        contributions += [(report.invoke, name, how, value) for name, how, value in report.shared]
        failed = failed or report.error is not None
    for report in received:  # back to the driver through Ray (core.wire.portable)
        report.shared = portable(report.shared)
    if failed:  # the trace fails with its first error; nothing to merge
        return TraceReports(by_invoke, {})
    try:
        return TraceReports(by_invoke, portable(merge_shared(contributions)))
    except MergeError as exc:  # the programs' contributions: the trace fails on the driver, its results kept
        return TraceReports(by_invoke, {}, merge_error=exc)


def start_collector(name: str | None = None, max_restarts: int = -1):
    """The collector actor (no CPU reserved: it only moves small records and refs)."""
    import ray

    actor = ray.remote(num_cpus=0, max_restarts=max_restarts, max_task_retries=0,
                       max_concurrency=10_000)(Collector)
    return actor.options(name=name).remote() if name else actor.remote()
