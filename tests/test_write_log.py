"""The write log on its own (no engine): which logged rows a recomputed chunk gets back, where,
and what happens past the limit (workers/write_log.py)."""

from __future__ import annotations

import numpy as np
import torch

from interlace.workers.points import Point
from interlace.workers.slots import SlotTable
from interlace.workers.write_log import WriteBook, Written

RESID = Point("model.layers.1", "resid")
OUT = Point("model.layers.2.mlp", "output")


def book_with(n: int, limit: int = 1 << 20) -> tuple[WriteBook, list[int], list]:
    table = SlotTable()
    slots = [table.add(prompt_len=3, max_save_bytes=0, timeout_s=1.0, invoke=i, some_steps=False) for i in range(n)]
    book = WriteBook(table, limit)
    return book, slots, [book.open(slot) for slot in slots]


def a(*values) -> np.ndarray:
    return np.array(values, np.int64)


def test_a_recomputed_chunk_gets_each_invokes_own_rows_at_their_positions():
    book, (s0, s1), (log0, log1) = book_with(2)
    # a batched call over two invokes: invoke 0 owns rows 0:3 (prompt positions 0-2), invoke 1 rows 3:5
    book.record(RESID, Written(torch.arange(5.0)[:, None].repeat(1, 4), 5, None), a(s0, s1), a(0, 0), a(0, 3), a(3, 5),
                a(48, 32), a(0, 0))
    book.record(RESID, Written(torch.full((1, 4), 9.0), 1, None), a(s0), a(3), a(0), a(1), a(16), a(1))  # step 1, position 3
    # (hidden, residual) of a layer's output: the tuple is kept, per-token element by element
    book.record(OUT, Written((torch.full((1, 4), 7.0), None), 1, None), a(s0), a(3), a(0), a(1), a(16), a(1))

    # invoke 0 recomputed from position 1 (position 0 still in the prefix cache), its chunk at batch
    # row 10; invoke 1 whole (positions 0-1) at rows 0-1, in the same step
    got = book.replay(a(log0.id, log1.id), firsts=a(1, 0), stops=a(4, 2), start_rows=a(10, 0))
    assert [(p, rows.tolist(), which.tolist()) for p, rows, _v, which in got] == [
        (RESID, [10, 11, 0, 1, 12], [0, 1]), (OUT, [12], [0])]
    assert got[0][2][:, 0].tolist() == [1.0, 2.0, 3.0, 4.0, 9.0]
    assert got[1][2][1] is None and got[1][2][0].flatten().tolist() == [7.0] * 4
    [(_p, rows, value, _w)] = book.replay(a(log1.id), firsts=a(0), stops=a(2), start_rows=a(0))
    assert rows.tolist() == [0, 1] and value[:, 0].tolist() == [3.0, 4.0]
    assert book.replay(a(log0.id), firsts=a(4), stops=a(4), start_rows=a(0)) == []  # nothing recomputed: nothing


def test_decode_steps_logged_a_row_at_a_time_come_back_as_one_write_in_position_order():
    """A recomputed request gets one write per point, not one per decode step; a position the
    log lacks (never written) is left as recomputed."""
    book, [slot], [log] = book_with(1)
    book.record(RESID, Written(torch.zeros(4, 2), 4, None), a(slot), a(0), a(0), a(4), a(32), a(0))  # the prompt
    for pos in [*range(4, 40), *range(41, 50)]:  # a decode step each (row 1 of a 3-row copy); 40 not written
        book.record(RESID, Written(torch.full((3, 2), float(pos)), 3, None), a(slot), a(pos), a(1), a(2), a(8), a(pos - 3))
    [(point, rows, value, _w)] = book.replay(a(log.id), firsts=a(2), stops=a(45), start_rows=a(7))
    assert point == RESID and rows.tolist() == [*range(7, 45), *range(46, 50)]
    assert value[:, 0].tolist() == [0.0, 0.0, *map(float, range(4, 40)), 41.0, 42.0, 43.0, 44.0]


def test_past_its_limit_a_log_is_dropped_says_where_and_others_of_its_call_are_kept():
    book, (s0, s1), (log0, log1) = book_with(2, limit=100)
    written = Written(torch.zeros(6, 4), 6, None)
    book.record(RESID, written, a(s0, s1), a(0, 0), a(0, 3), a(3, 6), a(60, 24), a(0, 0))
    assert log0.replayable and book.slots.log_bytes[s0] == 60
    book.record(RESID, written, a(s0, s1), a(3, 3), a(0, 3), a(3, 6), a(60, 24), a(1, 1))
    assert not log0.replayable and log1.replayable
    assert "INTERLACE_REPLAY_LOG_MIB" in log0.overflow and "layers.1.resid, step 1" in log0.overflow
    book.record(RESID, written, a(s0, s1), a(6, 6), a(0, 3), a(3, 6), a(1, 1), a(2, 2))  # nothing of it kept from then on
    assert [e.ids.tolist() for e in book.entries] == [[log0.id, log1.id], [log1.id], [log1.id]]
    [(_p, rows, _v, _w)] = book.replay(a(log1.id), firsts=a(0), stops=a(9), start_rows=a(0))
    assert rows.tolist() == list(range(9))


def test_entries_are_let_go_once_none_of_their_invokes_is_live():
    book, (s0, s1), (log0, log1) = book_with(2)
    for step in range(100):  # invoke 0 alone for 100 steps, then both
        book.record(RESID, Written(torch.zeros(1, 2), 1, None), a(s0), a(step), a(0), a(1), a(8), a(step))
    book.record(RESID, Written(torch.zeros(2, 2), 2, None), a(s0, s1), a(100, 0), a(0, 1), a(1, 2), a(8, 8), a(100, 0))
    book.close([log0])
    assert [e.ids.tolist() for e in book.entries] == [[log0.id, log1.id]]  # invoke 1's rows are in it
    book.close([log1])
    assert book.entries == []


def test_a_step_recomputing_several_requests_gets_exactly_the_rows_each_logged():
    """Random calls over 6 invokes (prompts, then a row a step; some invokes skip some steps),
    writing two points (one with its tokens on dim 1); three invokes recomputed over random
    ranges: every replayed row is the one logged at that invoke and position, each at its own
    batch row, and nothing else is written."""
    rng = np.random.default_rng(0)
    book, slots, logs = book_with(6)
    logged = {}  # (invoke, position) -> value
    positions = [0] * 6
    for step in range(40):
        who = [j for j in range(6) if step == 0 or rng.random() < 0.8]
        lengths = [5 if step == 0 else 1 for _ in who]
        firsts = [positions[j] if step else 0 for j in who]
        value = torch.tensor(rng.normal(size=(sum(lengths), 3)), dtype=torch.float32)
        starts = np.cumsum([0] + lengths[:-1])
        for j, first, start, n in zip(who, firsts, starts, lengths):
            for r in range(n):
                logged[(j, first + r)] = value[start + r].clone()
        for point, v in ((RESID, value), (OUT, 2 * value[None])):
            book.record(point, Written(v, len(value), None), a(*[slots[j] for j in who]), a(*firsts), a(*starts),
                        a(*(starts + lengths)), a(*[12 * n for n in lengths]), a(*[step] * len(who)))
        for j in range(6):
            positions[j] += 5 if step == 0 else 1  # a skipped step: its position is simply not logged
    recomputed = [4, 1, 3]
    firsts, stops = a(2, 0, 10), a(30, 7, 44)
    rows = a(100, 0, 50)
    got = book.replay(a(*[logs[j].id for j in recomputed]), firsts, stops, rows)
    want = {int(row + p - first): logged[(j, p)] for j, first, stop, row in zip(recomputed, firsts, stops, rows)
            for p in range(first, stop) if (j, p) in logged}
    assert [point for point, *_ in got] == [RESID, OUT]
    for (point, got_rows, value, which), scale in zip(got, (1, 2)):
        assert sorted(got_rows.tolist()) == sorted(want) and which.tolist() == [0, 1, 2]
        for row, v in zip(got_rows.tolist(), value if point == RESID else value[0]):
            assert torch.equal(v, scale * want[row])


def test_only_the_program_that_edited_its_rows_of_a_taps_copy_is_taken_to_have_written():
    """Every program's rows of a tap's value are views of one copy (points.TapAccess), sharing its
    version counter. A program suspended at the tap (at a ``recv``) while another edits its own
    rows is not taken to have edited (its unchanged rows would be logged as a write), and its own
    later edit is still seen; so are edits of programs checked after they all ran
    (calls.start_at_points)."""
    from interlace.workers.holds import Held, live_edit, versions

    copy = torch.zeros(6, 4)
    held = [Held(RESID, rows, versions(rows), None, None, None, True) for rows in (copy[0:2], copy[2:4], copy[4:6])]
    assert [live_edit(h) for h in held] == [None] * 3
    held[1].value += 1.0  # the second program's run; the first waits at the tap meanwhile
    assert live_edit(held[1]) is not None
    assert live_edit(held[0]) is None and live_edit(held[2]) is None
    held[0].value[-1] = 2.0  # the first resumes and edits
    assert live_edit(held[0]) is not None
    assert live_edit(held[1]) is None and live_edit(held[2]) is None
    held[0].value.mul_(3.0)  # started together: two programs edit, both checked afterwards
    held[2].value.mul_(3.0)
    assert sum(live_edit(h) is not None for h in held) == 1  # charged once: the copy has both rows already
    own = torch.zeros(2, 4)  # a copy of one program's own (not a view): every edit its own
    mine = Held(RESID, own, versions(own), None, None, None, True)
    own += 1.0
    assert live_edit(mine) is not None and live_edit(mine) is None
