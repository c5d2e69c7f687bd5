"""Reports of traces that finish in the same step are one reporter job (workers/reports.py): what
fails in that job fails one trace's invokes alone, and every other trace's rows arrive whole."""

from __future__ import annotations

import threading

import numpy as np
import torch

from interlace.workers import reports
from interlace.workers.reporter import Reporter
from interlace.workers.reports import ReportBatcher
from interlace.workers.save_gather import TakenSaves
from interlace.workers.saves import SaveLedger
from interlace.workers.sink import read_new_reports
from interlace.workers.slots import SlotTable
from interlace.workers.states import InvokeState


def _finish_together(tmp_path, objects: dict[str, dict], rows: dict[str, torch.Tensor] | None = None) -> dict[str, list[dict]]:
    """Three one-invoke traces, each having saved two rows of "h" (the trace's number), finished
    in one step and reported; ``objects``: a trace's saved values that are not rows; ``rows``: a
    trace's rows of "h" instead. Each trace's reports as the driver reads them."""
    sink = f"dir:{tmp_path}"
    ledger, slots, reporter = SaveLedger(), SlotTable(), Reporter()
    batcher = ReportBatcher(ledger, slots, reporter, stage=0)
    states = []
    for number, trace in enumerate(["a", "b", "c"], start=1):
        slot = slots.add(prompt_len=2, max_save_bytes=1 << 20, timeout_s=10.0, invoke=0, some_steps=False)
        h = (rows or {}).get(trace, torch.full((2, 4), float(number)))
        ledger.add(trace, [("h", h)], owners=np.array([slot]),
                   starts=np.array([0]), stops=np.array([2]), fresh=True)
        states.append(InvokeState(req_id=f"{trace}-0", slot=slot, trace=trace, invoke=0, prompt_len=2, program=None,
                                  group_key=None, ops=[], steps=None, sink=sink, timeout_s=10.0,
                                  max_save_bytes=1 << 20, saves=dict(objects.get(trace, {}))))
    batcher.report(states, live_invokes=[])
    written = threading.Event()
    reporter.submit(written.set)  # after the job above: one thread runs them in order
    assert written.wait(30)
    assert not ledger._chunks  # every take let go of its rows
    return {trace: read_new_reports(tmp_path / trace, set()) for trace in "abc"}


def test_traces_finished_together_get_each_its_own_rows_from_one_job(tmp_path, monkeypatch):
    jobs = []
    submit = Reporter.submit
    monkeypatch.setattr(Reporter, "submit", lambda self, job: (jobs.append(job), submit(self, job))[1])
    got = _finish_together(tmp_path, {})
    assert [getattr(job, "func", None) for job in jobs[:1]] == [reports._write_together]  # one job for the three
    for number, trace in enumerate("abc", start=1):
        [report] = got[trace]
        assert report["error"] is None and torch.equal(report["saves"]["h"], torch.full((2, 4), float(number)))


def test_a_save_that_cannot_be_written_fails_its_own_trace_only_in_a_joined_job(tmp_path):
    """b's lock cannot be pickled into its header: b fails with the reason, a and c arrive."""
    got = _finish_together(tmp_path, {"b": {"lock": [threading.Lock()]}})
    [b] = got["b"]
    assert b["error"]["where"] == "reporting results of save 'lock' (lock)" and "pickle" in b["error"]["message"]
    for number, trace in ((1, "a"), (3, "c")):
        [report] = got[trace]
        assert report["error"] is None and torch.equal(report["saves"]["h"], torch.full((2, 4), float(number)))


def test_a_joined_gather_that_fails_leaves_each_trace_to_gather_its_own(tmp_path, monkeypatch):
    """If the traces' rows cannot be gathered at once, each batch gathers its own rows, as a
    trace reported alone does: every trace still gets exactly its rows."""
    calls = []

    def cannot_join(takens):
        calls.append(len(takens))
        raise RuntimeError("the joined gather failed")

    monkeypatch.setattr(TakenSaves, "together", staticmethod(cannot_join))
    got = _finish_together(tmp_path, {})
    assert calls == [3]
    for number, trace in enumerate("abc", start=1):
        [report] = got[trace]
        assert report["error"] is None and torch.equal(report["saves"]["h"], torch.full((2, 4), float(number)))


def test_rows_that_cannot_be_gathered_fail_their_invoke_rather_than_come_back_empty(tmp_path):
    """b's rows cannot be gathered (a meta tensor: no bytes to copy; programs are refused such
    saves at their line, see test_errors). b's report said nothing and held no saves, so its
    invoke came back without them, as if never saved; now it fails with the reason. a and c,
    whose rows were in the same job, arrive."""
    got = _finish_together(tmp_path, {}, rows={"b": torch.empty((2, 4), device="meta")})
    [b] = got["b"]
    assert b["error"] is not None and b["error"]["where"] == "reporting results" and "meta" in b["error"]["message"]
    for number, trace in ((1, "a"), (3, "c")):
        [report] = got[trace]
        assert report["error"] is None and torch.equal(report["saves"]["h"], torch.full((2, 4), float(number)))
