"""The write log on its own (no engine): which logged rows a recomputed chunk gets back, where,
and what happens past the limit (workers/write_log.py)."""

from __future__ import annotations

import torch

from interlace.workers.points import Point
import numpy as np

from interlace.workers.write_log import Written, WriteLog, record_rows, replay_writes

RESID = Point("model.layers.1", "resid")
OUT = Point("model.layers.2.mlp", "output")


def test_a_recomputed_chunk_gets_each_invokes_own_rows_at_their_positions():
    # a batched call over two invokes: invoke 0 owns rows 0:3 (prompt positions 0-2), invoke 1 rows 3:5
    step0 = Written(torch.arange(5.0)[:, None].repeat(1, 4), 5, None)
    log0, log1 = WriteLog(1 << 20), WriteLog(1 << 20)
    log0.record(RESID, 0, step0, 0, 3, 48, step=0)
    log1.record(RESID, 0, step0, 3, 5, 32, step=0)
    log0.record(RESID, 3, Written(torch.full((1, 4), 9.0), 1, None), 0, 1, 16, step=1)  # step 1, position 3
    # (hidden, residual) of a layer's output: the tuple is kept, per-token element by element
    log0.record(OUT, 3, Written((torch.full((1, 4), 7.0), None), 1, None), 0, 1, 16, step=1)

    # invoke 0 recomputed from position 1 (position 0 still in the prefix cache), its chunk at batch row 10
    got = replay_writes(log0, first=1, stop=4, start_row=10)
    # positions 1-2 of step 0 and 3 of step 1 follow each other: one write of 3 rows
    assert [(p, row, n) for p, row, n, _v in got] == [(RESID, 10, 3), (OUT, 12, 1)]
    assert got[0][3].flatten().tolist() == [1.0] * 4 + [2.0] * 4 + [9.0] * 4
    assert got[1][3][1] is None and got[1][3][0].flatten().tolist() == [7.0] * 4
    [(_p, row, n, value)] = replay_writes(log1, first=0, stop=2, start_row=0)
    assert (row, n) == (0, 2) and value[:, 0].tolist() == [3.0, 4.0]
    assert replay_writes(log0, first=4, stop=4, start_row=0) == []  # nothing recomputed: nothing replayed


def test_decode_steps_logged_a_row_at_a_time_come_back_as_one_write_per_run_of_positions():
    """A recomputed request gets one write per run of consecutive positions, not one per decode
    step; a position the log lacks (never written) ends a run, in order."""
    log = WriteLog(1 << 20)
    log.record(RESID, 0, Written(torch.zeros(4, 2), 4, None), 0, 4, 32, step=0)  # the prompt
    for pos in [*range(4, 40), *range(41, 50)]:  # a decode step each; position 40 not written
        log.record(RESID, pos, Written(torch.full((3, 2), float(pos)), 3, None), 1, 2, 8, step=pos - 3)
    got = replay_writes(log, first=2, stop=45, start_row=7)
    assert [(row, n) for _p, row, n, _v in got] == [(7, 38), (46, 4)]
    assert got[0][3][:, 0].tolist() == [0.0, 0.0, *map(float, range(4, 40))]
    assert got[1][3][:, 1].tolist() == [41.0, 42.0, 43.0, 44.0]


def test_past_its_limit_a_log_is_dropped_and_says_where():
    log = WriteLog(100)
    log.record(RESID, 0, Written(torch.zeros(3, 4), 3, None), 0, 3, 60, step=0)
    assert log.replayable and log.bytes == 60
    log.record(RESID, 3, Written(torch.zeros(3, 4), 3, None), 0, 3, 60, step=1)
    assert not log.replayable and log.entries == {} and log.bytes == 0
    assert "INTERLACE_REPLAY_LOG_MIB" in log.overflow and "layers.1.resid, step 1" in log.overflow
    log.record(RESID, 4, Written(torch.zeros(1, 4), 1, None), 0, 1, 16, step=2)  # nothing kept from then on
    assert log.entries == {}


def test_a_calls_rows_logged_in_one_pass_equal_logging_each_invoke_and_one_past_its_limit_drops_only_its_own():
    written = Written(torch.arange(6.0)[:, None].repeat(1, 4), 6, None)
    firsts, starts, stops = np.array([5, 0, 9]), np.array([0, 1, 3]), np.array([1, 3, 6])  # 1, 2 and 3 rows
    each = [WriteLog(40), WriteLog(40), WriteLog(40)]
    for log, first, a, b, step in zip(each, firsts.tolist(), starts.tolist(), stops.tolist(), [5, 0, 7]):
        log.record(RESID, first, written, a, b, 16 * (b - a), step)
    at_once = [WriteLog(40), None, WriteLog(40), WriteLog(40)]
    record_rows(at_once[:1] + at_once[2:], RESID, firsts.tolist(), written, starts.tolist(), stops.tolist(),
                (16 * (stops - starts)).tolist(), [5, 0, 7])
    for one, other in zip(each, at_once[:1] + at_once[2:]):
        assert (one.bytes, one.overflow) == (other.bytes, other.overflow)
        assert [list(e) for e in one.entries.values()] == [list(e) for e in other.entries.values()]
    assert not at_once[3].replayable and "step 7" in at_once[3].overflow  # 48 bytes past 40: its own log only
    assert at_once[0].replayable and at_once[2].replayable
    record_rows([at_once[1]], RESID, [5], written, [0], [1], [16], [5])  # None: nothing kept
