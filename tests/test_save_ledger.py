"""The save ledger hands each invoke exactly its own rows, also when its slot number is reused.

Slots are reused as soon as an invoke finishes (see workers/slots.py), while rows it shared a chunk
with may still wait for the rest of its group; a reused slot must not pick those up again.
"""

import numpy as np
import pytest
import torch

from interlace.workers.save_gather import TakenSaves
from interlace.workers.saves import DeviceRoom, SaveChunk, SaveLedger, TraceOwners
from interlace.workers.slots import ALL_STEPS


def _rows(*values: float) -> torch.Tensor:
    return torch.tensor(values).reshape(-1, 1)


def test_reused_slot_gets_only_rows_saved_after_it_was_reused():
    ledger = SaveLedger()
    one_row_each = dict(starts=np.array([0, 1]), stops=np.array([1, 2]))
    ledger.add("t", [("h", _rows(10, 11))], owners=np.array([0, 1]), **one_row_each)  # step 1: slots 0, 1
    [first] = ledger.take("t", [0]).assemble()  # invoke A (slot 0) finishes; slot 1 goes on
    assert first["h"].flatten().tolist() == [10]

    # slot 0 now belongs to invoke C of the same trace
    ledger.add("t", [("h", _rows(20, 21))], owners=np.array([0, 1]), **one_row_each)
    [c, b] = ledger.take("t", [0, 1]).assemble()
    assert c["h"].flatten().tolist() == [20]
    assert b["h"].flatten().tolist() == [11, 21]
    assert ledger.take("t", [0, 1]).assemble() == [{}, {}]  # nothing left behind


def test_names_saved_together_from_one_copy_stay_apart_and_keep_their_order():
    """Saves at several graph taps of the same rows are one gather per step (taps.TappedSaves):
    one add of views of one tensor, which each name gets back whole and in step order."""
    ledger = SaveLedger()
    one_row_each = dict(starts=np.array([0, 1]), stops=np.array([1, 2]))
    for step in range(3):
        both = torch.tensor([[[10.0 + step], [20.0 + step]], [[30.0 + step], [40.0 + step]]])  # [names, rows, 1]
        ledger.add("t", list(zip(["a", "b"], both.unbind(0))), owners=np.array([4, 2]), fresh=True, **one_row_each)
    four, two = ledger.take("t", [4, 2]).assemble()
    assert four["a"].flatten().tolist() == [10, 11, 12] and four["b"].flatten().tolist() == [30, 31, 32]
    assert two["a"].flatten().tolist() == [20, 21, 22] and two["b"].flatten().tolist() == [40, 41, 42]


def test_chunks_saved_together_taken_in_three_batches_each_get_their_rows():
    """Chunks that share their owners array share each take's selection (worked out once per
    array, not per chunk): three takes, with a chunk of other owners among them, still give every
    invoke exactly its own rows, in save order, and leave nothing behind."""
    ledger = SaveLedger()
    owners, one_row_each = np.array([0, 1, 2]), dict(starts=np.arange(3), stops=np.arange(1, 4))
    for step in range(2):
        for name, base in (("a", 0), ("b", 100)):
            ledger.add("t", [(name, _rows(*(base + 10 * step + o for o in range(3))))], owners=owners, **one_row_each)
    ledger.add("t", [("a", _rows(7, 8, 9))], owners=np.array([2, 1, 0]), **one_row_each)
    got = {slot: ledger.take("t", [slot]).assemble()[0] for slot in (0, 2, 1)}
    assert {slot: {n: v.flatten().tolist() for n, v in saves.items()} for slot, saves in got.items()} == {
        0: {"a": [0, 10, 9], "b": [100, 110]},
        2: {"a": [2, 12, 7], "b": [102, 112]},
        1: {"a": [1, 11, 8], "b": [101, 111]},
    }
    assert ledger.take("t", [0, 1, 2]).assemble() == [{}, {}, {}]


def test_rows_saved_for_several_traces_at_once_go_to_each_trace_and_are_let_go_of_once():
    """A server's one-invoke traces saving at the same graph tap are one gather per step for all
    of them (taps.TappedSaves): each step's chunk is listed under every trace in it. Each trace
    takes exactly its own invokes' rows whatever the order the traces finish in, a trace's take
    leaves the chunks its other invoke still needs, and the ledger lets go of each chunk once,
    in the last take."""
    ledger = SaveLedger()
    owners = np.array([5, 3, 8])  # slots of invokes of traces a, b, a (in batch order)
    traces = TraceOwners.of(["a", "b", "a"])
    assert TraceOwners.of(["a", "a"]) is None  # one trace: the usual chunks
    released = []
    original = ledger.release
    ledger.release = lambda chunks: (released.extend(chunks), original(chunks))[1]
    for step in range(3):
        rows = torch.tensor([[1.0 + step], [2.0 + step], [3.0 + step]])
        ledger.add(traces, [("h", rows)], owners=owners, starts=np.arange(3), stops=np.arange(1, 4), fresh=True)
    [five] = ledger.take("a", [5]).assemble()  # trace a's first invoke; its second goes on
    assert five["h"].flatten().tolist() == [1, 2, 3]
    [three] = ledger.take("b", [3]).assemble()  # trace b ends
    assert three["h"].flatten().tolist() == [2, 3, 4]
    assert "b" not in ledger._chunks and not released  # trace a's invoke 8 still needs every chunk
    [eight] = ledger.take("a", [8]).assemble()
    assert eight["h"].flatten().tolist() == [3, 4, 5]
    assert "a" not in ledger._chunks
    assert len(released) == len({id(chunk) for chunk in released}) == 3  # each chunk once, all in the last take


def test_a_gather_on_the_device_copies_only_the_span_of_each_chunk_it_takes_rows_from():
    """On a GPU one name's rows are concatenated and put in order there (save_gather._gather_on_device,
    run here on host tensors, which takes the same steps): only each chunk's span that holds the
    report's rows is concatenated, so a trace's report from chunks saved for many traces copies
    its own rows, in order, and nothing else."""
    from interlace.workers import save_gather

    ledger = SaveLedger()
    owners, traces = np.array([0, 1, 2, 3]), TraceOwners.of(["a", "b", "b", "c"])
    for step in range(3):  # trace b's two invokes own rows 1-2 and 3-4 of each step's 6 rows
        rows = torch.arange(6 * 2, dtype=torch.float32).reshape(6, 2) + 100 * step
        ledger.add(traces, [("x", rows)], owners=owners, starts=np.array([0, 1, 3, 5]), stops=np.array([1, 3, 5, 6]))
    taken = ledger.take("b", [2, 1])
    plan = save_gather._plan(taken.parts["x"], taken.wanted)
    assert save_gather._spans(plan.row_chunk, plan.row_source, len(plan.chunks))[0].tolist() == [1, 1, 1]
    out = torch.empty(plan.shape)
    concatenated = []
    cat = torch.cat
    try:
        torch.cat = lambda tensors: (concatenated.extend(len(t) for t in tensors), cat(tensors))[1]
        save_gather._gather_on_device(plan, out)
    finally:
        torch.cat = cat
    assert concatenated == [4, 4, 4]  # rows 1-4 of each 6-row chunk
    two, one = plan.views(out)[0], plan.views(out)[1]
    step_rows = lambda a, b: torch.cat([torch.arange(2 * a, 2 * b, dtype=torch.float32).reshape(-1, 2) + 100 * s
                                        for s in range(3)])
    assert torch.equal(two, step_rows(3, 5)) and torch.equal(one, step_rows(1, 3))


def test_rows_kept_on_the_device_give_their_room_back_once_every_holder_let_go():
    """The ledger and each report hold a device chunk; holds are taken and given back a list at a
    time, and a chunk's bytes return to the device room with its last holder (checked here on
    host tensors marked as device-held: the GPU test below runs the whole path)."""
    room = DeviceRoom(limit=1 << 20)
    room.used = 48
    ledger = SaveLedger(room)
    bounds = dict(owners=np.array([0]), starts=np.array([0]), stops=np.array([1]), pending=1)
    big = SaveChunk("x", torch.zeros(4, 2), None, device_holds=1, **bounds)  # 32 bytes
    small = SaveChunk("y", torch.zeros(2, 2), None, device_holds=1, **bounds)  # 16 bytes
    ledger.retain([big, small])  # a report's holds
    ledger.release([big])
    assert room.used == 48 and big.device_holds == 1
    ledger.release([big, small])
    assert room.used == 16 and (big.device_holds, small.device_holds) == (0, 1)
    ledger.release([small])
    assert room.used == 0


def test_rows_of_several_lengths_concatenate_in_save_order():
    ledger = SaveLedger()
    ledger.add("t", [("x", _rows(1, 2, 3))], owners=np.array([5, 7]), starts=np.array([0, 2]), stops=np.array([2, 3]))
    ledger.add("t", [("x", _rows(4, 5))], owners=np.array([7, 5]), starts=np.array([0, 1]), stops=np.array([1, 2]))
    seven, five = ledger.take("t", [7, 5]).assemble()
    assert five["x"].flatten().tolist() == [1, 2, 5]
    assert seven["x"].flatten().tolist() == [3, 4]


def test_a_chunk_in_batch_order_is_scattered_to_invoke_order():
    # vLLM's batch order differs from invoke order: every row of the chunk moves, none is lost
    ledger = SaveLedger()
    for step in range(2):
        ledger.add("t", [("h", _rows(*(10 * step + o for o in (3, 1, 4, 2))))], owners=np.array([3, 1, 4, 2]),
                   starts=np.arange(4), stops=np.arange(1, 5))
    results = ledger.take("t", [1, 2, 3, 4]).assemble()
    assert [r["h"].flatten().tolist() for r in results] == [[1, 11], [2, 12], [3, 13], [4, 14]]


def test_slab_memory_is_reused_only_after_reports_let_go():
    ledger = SaveLedger()
    hidden = 1024  # 256 x 1024 float32 = 1 MiB a chunk: 64 to a slab
    owners = np.arange(256)
    bounds = dict(starts=owners, stops=owners + 1)

    def sweep(trace: str, offset: float):
        for step in range(100):  # 100 MiB: with the other sweep, three slabs filled and a fourth begun
            ledger.add(trace, [("h", torch.full((256, hidden), float(offset + step)))], owners=owners, **bounds)
        return ledger.take(trace, owners.tolist())

    first = sweep("a", 0)
    second = sweep("b", 1000)  # the reporter has not written the first trace yet: nothing reused
    assert ledger._pinned._spare == []
    results = {"a": first.assemble(), "b": second.assemble()}
    first.release(), second.release()
    assert len(ledger._pinned._spare) == 3  # every full slab is free again
    third = sweep("c", 2000)  # reuses them
    results["c"] = third.assemble()
    for trace, offset in (("a", 0), ("b", 1000), ("c", 2000)):  # reuse overwrote nothing reported
        assert results[trace][7]["h"].shape == (100, hidden)
        assert results[trace][7]["h"][:, 0].tolist() == [offset + s for s in range(100)]
        assert results[trace][255]["h"][:, -1].tolist() == [offset + s for s in range(100)]


def test_rows_of_any_width_and_layout_gather_exactly_also_split_across_batches():
    """Rows are copied as wide elements when a row allows it (16 bytes: bfloat16 x 8), else as
    they are (int8 x 3; a transposed, non-contiguous value); split across two reports either way."""
    torch.manual_seed(0)
    values = {"wide": torch.randn(4, 8).to(torch.bfloat16), "odd": torch.randint(-9, 9, (4, 3), dtype=torch.int8),
              "strided": torch.randn(5, 4).t()}
    ledger = SaveLedger()
    owners, one_row_each = np.array([3, 1, 2, 0]), dict(starts=np.arange(4), stops=np.arange(1, 5))
    for step in range(2):
        for name, value in values.items():
            ledger.add("t", [(name, value + step)], owners=owners, **one_row_each)
    first = ledger.take("t", [0, 2]).assemble()  # two of the four finish first
    rest = ledger.take("t", [1, 3]).assemble()
    for slot, saves in zip([0, 2, 1, 3], first + rest):
        row = int(np.flatnonzero(owners == slot)[0])
        for name, value in values.items():
            assert torch.equal(saves[name], torch.stack([value[row], value[row] + 1])), (slot, name)


def test_rows_that_cannot_be_copied_as_wide_elements_keep_their_values():
    """A non-contiguous chunk (the ledger's own copies are contiguous, but a chunk need not be) is
    copied as it is, while the tensor it goes into could be widened: float32 x 5 rows must not be
    copied as int32 x 5 (a cast of the values)."""
    rows = torch.randn(5, 4).t()  # [4, 5] float32, non-contiguous
    one = SaveChunk("x", rows, None, np.array([7]), np.array([0]), np.array([4]), 1)  # one owner: a slice copy
    many = SaveChunk("y", rows, None, np.array([2, 1]), np.array([0, 2]), np.array([2, 4]), 2)  # scattered
    taken = TakenSaves({"x": [(one, np.ones(1, bool))], "y": [(many, np.ones(2, bool))]}, np.array([1, 2, 7]))
    by_one, by_two, by_seven = taken.assemble()
    assert torch.equal(by_seven["x"], rows)
    assert torch.equal(by_two["y"], rows[:2]) and torch.equal(by_one["y"], rows[2:])


@pytest.mark.gpu
def test_rows_kept_on_the_gpu_gather_exactly_past_its_room_too_and_give_the_room_back():
    """Rows stay on the GPU while the rank's room lasts, then go to pinned host memory; a name
    with rows in both places, split across two reports, still gathers exactly, and the room is
    given back once both reports have let go."""
    torch.manual_seed(0)
    chunk_bytes = 4 * 8 * 4  # [4, 8] float32
    room = DeviceRoom(limit=3 * chunk_bytes)
    ledger = SaveLedger(room)
    owners, one_row_each = np.array([3, 1, 2, 0]), dict(starts=np.arange(4), stops=np.arange(1, 5))
    values = [torch.randn(4, 8, device="cuda") for _ in range(5)]
    expected = [v.cpu() for v in values]
    for value in values:
        ledger.add("t", [("h", value)], owners=owners, **one_row_each)
    ledger.add("t", [("fresh", values[0] * 2)], owners=owners, fresh=True, **one_row_each)  # no room left: host
    assert [c.rows.is_cuda for c in ledger._chunks["t"]] == [True, True, True, False, False, False]
    values[0].add_(100)  # saves are snapshots: editing the tensor afterwards changes nothing
    first = ledger.take("t", [0, 2])
    results = first.assemble()
    rest = ledger.take("t", [1, 3])
    results += rest.assemble()
    for slot, saves in zip([0, 2, 1, 3], results):
        row = int(np.flatnonzero(owners == slot)[0])
        assert saves["h"].device.type == "cpu"
        assert torch.equal(saves["h"], torch.stack([e[row] for e in expected])), slot
        assert torch.equal(saves["fresh"], expected[0][row : row + 1] * 2)
    assert room.used == 3 * chunk_bytes  # the reports still hold the rows
    first.release(), rest.release()
    assert room.used == 0


@pytest.mark.gpu
def test_rows_all_on_the_gpu_are_gathered_there_in_invoke_order():
    ledger = SaveLedger(DeviceRoom(limit=1 << 30))
    owners = np.array([2, 0, 1])
    for step in range(3):  # invoke 0 saves two rows a step, the others one
        rows = torch.arange(4 * 16, dtype=torch.bfloat16, device="cuda").reshape(4, 16) + 100 * step
        ledger.add("t", [("x", rows)], owners=owners, starts=np.array([0, 1, 3]), stops=np.array([1, 3, 4]))
    one, rest = ledger.take("t", [0]), ledger.take("t", [1, 2])
    [zero], [first, second] = one.assemble(), rest.assemble()
    expect = lambda a, b: torch.cat([torch.arange(16 * a, 16 * b, dtype=torch.bfloat16).reshape(-1, 16) + 100 * s
                                     for s in range(3)])
    assert torch.equal(zero["x"], expect(1, 3)) and zero["x"].dtype == torch.bfloat16
    assert torch.equal(first["x"], expect(3, 4)) and torch.equal(second["x"], expect(0, 1))


def test_rows_of_steps_past_an_invokes_last_returned_token_are_left_out():
    """Under asynchronous scheduling (vLLM's default on GPUs) a request that sampled EOS has run
    one step more; its rows from that step are not reported (Interleaver.finish cuts each owner
    at its last returned step), and the chunk is still let go of once every owner is taken."""
    ledger = SaveLedger()
    owners = np.array([0, 1])
    ledger.add("t", [("h", _rows(0, 1, 2, 100))], owners=owners, starts=np.array([0, 3]), stops=np.array([3, 4]),
               steps=np.array([0, 0]))  # the prompts: 3 rows and 1 row
    for step in range(1, 4):
        ledger.add("t", [("h", _rows(step * 10, 100 + step))], owners=owners, starts=np.array([0, 1]),
                   stops=np.array([1, 2]), steps=np.array([step, step]))
    cut, whole = ledger.take("t", [0, 1], np.array([1, ALL_STEPS])).assemble()
    assert cut["h"].flatten().tolist() == [0, 1, 2, 10]  # steps 0 and 1
    assert whole["h"].flatten().tolist() == [100, 101, 102, 103]
    assert ledger.take("t", [0, 1]).assemble() == [{}, {}]  # nothing left behind
    ledger.add("t", [("h", _rows(5))], owners=np.array([0]), starts=np.array([0]), stops=np.array([1]),
               steps=np.array([2]))
    assert ledger.take("t", [0], np.array([1])).assemble() == [{}]  # every row cut: no name at all


def _save_step(ledger, key, trace, names, owners, starts, stops, steps, values, run: bool):
    """One step of a group's saves (``values``: [names, rows, width]), as dispatch.take_tapped
    keeps them: into the group's run, or added as they are."""
    into = None
    if run:
        into = ledger.run_rows(key, trace, names, owners, starts, stops, steps, tuple(values.shape[1:]),
                               values.dtype, values.device)
        assert into is not None and tuple(into.shape) == tuple(values.shape)
    if into is not None:
        into.copy_(values)
    else:
        ledger.add(trace, list(zip(names, values.clone().unbind(0))), owners, starts, stops, fresh=True, steps=steps)


def _plain(results):
    return [{name: value.flatten().tolist() for name, value in saves.items()} for saves in results]


def test_a_group_saved_at_every_step_into_runs_reports_what_adding_each_step_reports():
    """A decode's saves in the graph taps go into runs of RUN_STEPS steps (SaveLedger.run_rows):
    over more steps than two runs, with a program's save of the same name in between (which
    enters the open run first, so each owner's rows stay in save order), an owner reported
    before the others, and the last step of one owner cut, every owner gets exactly what the
    ledger gives when each step is added on its own, from a few chunks per name."""
    from interlace.workers.saves import RUN_STEPS

    owners, starts, stops = np.array([7, 3, 5]), np.array([0, 1, 2]), np.array([1, 2, 3])
    key = object()
    results = {}
    for run in (False, True):
        ledger = SaveLedger()
        got = {}
        for step in range(2 * RUN_STEPS + 5):
            values = torch.arange(6, dtype=torch.float32).reshape(2, 3, 1) + 100 * step
            _save_step(ledger, key, "t", ["a", "b"], owners, starts, stops, np.full(3, step), values, run)
            if step == 40:  # a save of "a" for owner 3 only, from elsewhere
                ledger.add("t", [("a", _rows(-1.0))], np.array([3]), np.array([0]), np.array([1]), steps=np.array([step]))
            if step == 50:
                got[7] = ledger.take("t", [7]).assemble()[0]
        got[3], got[5] = ledger.take("t", [3, 5], np.array([ALL_STEPS, 2 * RUN_STEPS + 3])).assemble()
        if run:
            assert len(ledger._runs) == 0 and not ledger._open
        results[run] = {slot: _plain([saves])[0] for slot, saves in got.items()}
    assert results[True] == results[False]
    assert results[True][3]["a"][40:43] == [4001, -1, 4101] and len(results[True][5]["b"]) == 2 * RUN_STEPS + 4
    assert len(results[True][7]["a"]) == 51


def test_a_run_entered_before_it_is_full_keeps_only_its_filled_steps():
    """A group that lasts a few steps (new arrivals end an epoch) fills a few of its run's 32
    steps: its chunks hold a copy of those, not views of the whole buffer."""
    ledger = SaveLedger()
    owners, starts, stops = np.array([0, 1]), np.array([0, 1]), np.array([1, 2])
    for step in range(3):
        into = ledger.run_rows("group", "t", ["a", "b"], owners, starts, stops, np.full(2, step), (2, 4),
                               torch.float32, torch.device("cpu"))
        into.copy_(torch.full((2, 2, 4), float(step)))
    taken = ledger.take("t", [0, 1])
    step_bytes = 2 * 2 * 4 * 4
    assert [chunk.rows.untyped_storage().nbytes() for parts in taken.parts.values() for chunk, _ in parts] == [
        3 * step_bytes] * 2
    zero, one = taken.assemble()
    assert zero["a"][:, 0].tolist() == [0.0, 1.0, 2.0] and one["b"][:, 3].tolist() == [0.0, 1.0, 2.0]


def test_runs_of_rows_saved_for_several_traces_go_to_each_trace_and_are_let_go_of_once():
    """A server's one-invoke traces saving at the same tap share one run (TraceOwners): each
    trace takes its own rows whichever finishes first, and every chunk is let go of once."""
    owners = np.array([5, 3, 8])
    traces = TraceOwners.of(["a", "b", "a"])
    ledger = SaveLedger()
    released = []
    original = ledger.release
    ledger.release = lambda chunks: (released.extend(chunks), original(chunks))[1]
    key = object()
    for step in range(5):
        values = torch.tensor([[[1.0 + step], [2.0 + step], [3.0 + step]]])
        _save_step(ledger, key, traces, ["h"], owners, np.arange(3), np.arange(1, 4), np.full(3, step), values,
                   run=step > 0)
    [three] = ledger.take("b", [3]).assemble()
    assert three["h"].flatten().tolist() == [2, 3, 4, 5, 6]
    assert not released and "a" in ledger._chunks
    five, eight = ledger.take("a", [5, 8]).assemble()
    assert five["h"].flatten().tolist() == [1, 2, 3, 4, 5] and eight["h"].flatten().tolist() == [3, 4, 5, 6, 7]
    assert len(released) == len({id(c) for c in released}) == 2  # the first step's chunk and the run's
    assert not ledger._chunks and not ledger._runs and not ledger._open


def test_takes_of_several_traces_assembled_together_get_each_its_own_rows_in_save_order():
    """Traces that finish in the same step are reported as one gather (reports._write_together):
    their takes joined (TakenSaves.together) list each chunk once with every trace's owners, keep
    each trace's save order even where their chunks interleave (a only in the first chunk, b only
    in the second, both after), and give each owner exactly the rows its own take assembles."""
    ledger = SaveLedger()
    both = TraceOwners.of(["a", "b", "c"])
    ledger.add("a", [("h", _rows(10.0))], owners=np.array([5]), starts=np.array([0]), stops=np.array([1]), fresh=True)
    ledger.add("b", [("h", _rows(20.0, 20.5))], owners=np.array([3]), starts=np.array([0]), stops=np.array([2]), fresh=True)
    key = object()
    owners = np.array([5, 3, 8])  # slots of traces a, b, c, saved together at a tap, in runs from the second step
    for step in range(4):
        values = torch.tensor([[[11.0 + step], [21.0 + step], [31.0 + step]]])
        _save_step(ledger, key, both, ["h"], owners, np.arange(3), np.arange(1, 4), np.full(3, step), values, run=step > 0)
    ledger.add("c", [("h", _rows(39.0)), ("g", _rows(1.0))], owners=np.array([8]), starts=np.array([0]),
               stops=np.array([1]), fresh=True)
    takes = [ledger.take(trace, [slot]) for trace, slot in (("b", 3), ("a", 5), ("c", 8))]
    joined = TakenSaves.together(takes)
    assert len(joined.parts["h"]) == 5  # a's, b's, the first step's, the run, c's: each chunk once
    assert _plain(joined.assemble()) == [{"h": [20, 20.5, 21, 22, 23, 24]}, {"h": [10, 11, 12, 13, 14]},
                                         {"h": [31, 32, 33, 34, 39], "g": [1]}]
    assert joined.nbytes == 17 * 4 and sum(take.nbytes for take in takes) == joined.nbytes
    assert _plain(joined.assemble()) == [_plain(take.assemble())[0] for take in takes]
    for take in takes:
        take.release()
    assert not ledger._chunks and not ledger._runs


@pytest.mark.gpu
def test_a_run_on_the_gpu_takes_its_steps_from_the_device_room_and_gives_them_all_back():
    """A run on a GPU holds RUN_STEPS steps of the device room from its start; entered after
    fewer steps it gives the rest back, and its chunks the rest once reported; its rows come
    back exactly. Without room for a run, none is started (the caller adds the rows as before)."""
    from interlace.workers.saves import RUN_STEPS

    torch.manual_seed(0)
    owners, starts, stops = np.array([1, 0]), np.array([0, 1]), np.array([1, 2])
    step_bytes = 2 * 2 * 8 * 2  # [names, rows, 8] bfloat16
    room = DeviceRoom(limit=RUN_STEPS * step_bytes)
    ledger = SaveLedger(room)
    key = object()
    values = [torch.randn(2, 2, 8, device="cuda").to(torch.bfloat16) for _ in range(5)]
    for step, value in enumerate(values):
        into = ledger.run_rows(key, "t", ["a", "b"], owners, starts, stops, np.full(2, step), (2, 8), value.dtype,
                               value.device)
        into.copy_(value)
    assert room.used == RUN_STEPS * step_bytes
    assert ledger.run_rows(object(), "u", ["a"], owners, starts, stops, np.zeros(2), (2, 8), torch.bfloat16,
                           values[0].device) is None  # no room for a second run
    taken = ledger.take("t", [0, 1])
    assert room.used == 5 * step_bytes  # the steps it filled, held by the report
    assert all(chunk.rows.untyped_storage().nbytes() == 5 * step_bytes for parts in taken.parts.values()
               for chunk, _ in parts)  # a copy of them: the 32-step buffer is not kept
    zero, one = taken.assemble()
    for name, j in (("a", 0), ("b", 1)):
        assert torch.equal(zero[name], torch.stack([v[j, 1] for v in values]).cpu())
        assert torch.equal(one[name], torch.stack([v[j, 0] for v in values]).cpu())
    taken.release()
    assert room.used == 0


def test_runs_of_two_batches_of_one_trace_stay_open_while_their_steps_take_turns():
    """Under pipeline parallelism a trace decodes as two batches whose steps alternate, each a
    group saving the same names: their runs share no invoke, so both stay open (a run each, not
    one closed at every step); a group that shares an invoke with an open run closes it first.
    Each invoke's rows come back in save order either way."""
    ledger = SaveLedger()
    first, second = np.array([0, 1]), np.array([2, 3])
    bounds = dict(starts=np.array([0, 1]), stops=np.array([1, 2]))
    for step in range(6):
        for key, owners in (("a", first), ("b", second)):
            into = ledger.run_rows(key, "t", ["h"], owners, bounds["starts"], bounds["stops"], np.full(2, step), (2, 1),
                                   torch.float32, torch.device("cpu"))
            into.copy_((torch.tensor([[[0.0], [1.0]]]) + 10 * owners[0] + 100 * step))
        assert len(ledger._runs) == 2
    overlapping = np.array([1, 2])  # one invoke of each batch: both runs are entered before it
    into = ledger.run_rows("c", "t", ["h"], overlapping, bounds["starts"], bounds["stops"], np.full(2, 6), (2, 1),
                           torch.float32, torch.device("cpu"))
    into.copy_(torch.tensor([[[-1.0], [-2.0]]]))
    assert list(ledger._runs) == ["c"]
    results = ledger.take("t", [0, 1, 2, 3]).assemble()
    assert [r["h"].flatten().tolist() for r in results] == [
        [100 * s for s in range(6)],
        [1 + 100 * s for s in range(6)] + [-1.0],
        [20 + 100 * s for s in range(6)] + [-2.0],
        [21 + 100 * s for s in range(6)],
    ]
