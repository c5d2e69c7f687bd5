"""Saved rows, laid out per invoke as they arrive, hand each invoke exactly its own rows: in save
order, whatever the batch order, across moves to larger runs, and when a slot number is reused.

Slots are reused as soon as an invoke finishes (see workers/slots.py), while other invokes of its
trace go on saving; a reused slot must not pick up the rows of its earlier owner.
"""

import numpy as np
import torch

from interlace.workers.pinned import PinnedSlabs
from interlace.workers.saves import SaveChunk, SavedRows


def _rows(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).reshape(-1, 1)


def _chunk(name, rows, owners, starts=None, stops=None, steps_left=0) -> SaveChunk:
    owners = np.asarray(owners, dtype=np.int64)
    if starts is None:  # one row each
        starts, stops = np.arange(len(owners)), np.arange(1, len(owners) + 1)
    return SaveChunk.of("t", name, rows, owners, np.asarray(starts), np.asarray(stops),
                        np.full(len(owners), steps_left, np.int64))


def test_reused_slot_gets_only_rows_saved_after_it_was_reused():
    saved = SavedRows()
    saved.take_in(_chunk("h", _rows(10, 11), [0, 1], steps_left=3))  # step 1: slots 0, 1
    [first] = saved.take([0])  # invoke A (slot 0) finishes; slot 1 goes on
    assert first["h"].flatten().tolist() == [10]

    # slot 0 now belongs to invoke C of the same trace
    saved.take_in(_chunk("h", _rows(20, 21), [0, 1], steps_left=2))
    [c, b] = saved.take([0, 1])
    assert c["h"].flatten().tolist() == [20]
    assert b["h"].flatten().tolist() == [11, 21]
    assert saved.take([0, 1]) == [{}, {}]  # nothing left behind


def test_rows_of_several_lengths_concatenate_in_save_order():
    saved = SavedRows()
    saved.take_in(_chunk("x", _rows(1, 2, 3), [5, 7], starts=[0, 2], stops=[2, 3]))
    saved.take_in(_chunk("x", _rows(4, 5), [7, 5], starts=[0, 1], stops=[1, 2]))
    seven, five = saved.take([7, 5])
    assert five["x"].flatten().tolist() == [1, 2, 5]
    assert seven["x"].flatten().tolist() == [3, 4]


def test_rows_in_batch_order_land_in_each_invokes_run():
    # vLLM's batch order differs from invoke order, and changes: every row lands, none is lost
    saved = SavedRows()
    for step, order in enumerate([(3, 1, 4, 2), (2, 4, 1, 3), (1, 2, 3, 4)]):
        saved.take_in(_chunk("h", _rows(*(10 * step + o for o in order)), order, steps_left=2 - step))
    results = saved.take([1, 2, 3, 4])
    assert [r["h"].flatten().tolist() for r in results] == [[1, 11, 21], [2, 12, 22], [3, 13, 23], [4, 14, 24]]


def test_a_run_saved_every_step_moves_once_and_one_that_outgrows_its_room_again_keeps_every_row():
    allocated = []

    def allocate(nbytes):
        allocated.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    saved = SavedRows(allocate)
    steps = 6
    for step in range(steps):  # slot 0 saves once a step, slot 1 twice (one more row than its room)
        left = steps - 1 - step
        saved.take_in(_chunk("h", _rows(step, 100 + step), [0, 1], steps_left=left))
        saved.take_in(_chunk("h", _rows(200 + step), [1], steps_left=left))
    # step 0: exact room for each first row; slot 1's second row: room for one more row per step
    # left (1 + 1 + 5); slot 0's second row, at step 1: 1 + 1 + 4 = all six, so it never moves again
    assert allocated[:3] == [2 * 4, 7 * 4, 6 * 4]
    assert len(allocated) == 4  # slot 1, saving two rows a step, outgrew its room once more
    zero, one = saved.take([0, 1])
    assert zero["h"].flatten().tolist() == list(range(steps))
    assert one["h"].flatten().tolist() == [v for s in range(steps) for v in (100 + s, 200 + s)]


def test_rows_saved_once_take_no_more_room_than_they_need():
    allocated = []
    saved = SavedRows(lambda n: allocated.append(n) or torch.empty(n, dtype=torch.uint8))
    saved.take_in(_chunk("prompt", torch.randn(12, 8), [0, 1], starts=[0, 5], stops=[5, 12], steps_left=50))
    assert allocated == [12 * 8 * 4]
    a, b = saved.take([0, 1])
    assert a["prompt"].shape == (5, 8) and b["prompt"].shape == (7, 8)


def test_rows_of_any_width_and_layout_land_exactly():
    """Rows are copied as wide elements when a row allows it (16 bytes: bfloat16 x 8), else as
    they are (int8 x 3; a transposed, non-contiguous value); taken in two groups either way."""
    torch.manual_seed(0)
    values = {"wide": torch.randn(4, 8).to(torch.bfloat16), "odd": torch.randint(-9, 9, (4, 3), dtype=torch.int8),
              "strided": torch.randn(5, 4).t()}
    saved = SavedRows()
    owners = [3, 1, 2, 0]
    for step in range(3):
        for name, value in values.items():
            saved.take_in(_chunk(name, value + step, owners, steps_left=2 - step))
    first = saved.take([0, 2])  # two of the four finish first
    rest = saved.take([1, 3])
    for slot, saves in zip([0, 2, 1, 3], first + rest):
        row = owners.index(slot)
        for name, value in values.items():
            assert torch.equal(saves[name], torch.stack([value[row] + s for s in range(3)])), (slot, name)


def test_a_name_saved_with_rows_of_two_shapes_gives_one_tensor_per_shape():
    saved = SavedRows()
    saved.take_in(_chunk("x", torch.ones(2, 4), [0, 1], steps_left=2))
    saved.take_in(_chunk("x", torch.zeros(2, 3), [0, 1], steps_left=1))
    saved.take_in(_chunk("x", 2 * torch.ones(2, 4), [0, 1], steps_left=0))
    [zero, _] = saved.take([0, 1])
    assert [tuple(v.shape) for v in zero["x"]] == [(2, 4), (1, 3)]
    assert zero["x"][0][:, 0].tolist() == [1, 2]


def test_pinned_slabs_are_reused_once_every_piece_is_released():
    slabs = PinnedSlabs(slab_bytes=1 << 20)
    pieces = [slabs.empty((256, 256), torch.float32) for _ in range(5)]  # 256 KiB each: a slab and a bit
    assert slabs._spare == []
    for rows, slab in pieces[:4]:
        rows.fill_(1)
        slabs.release(slab)
    assert len(slabs._spare) == 1  # the full slab, once its four pieces are let go
    again, slab = slabs.empty((256, 256), torch.float32)
    slabs.release(pieces[4][1])
    slabs.empty((256, 256), torch.float32)
    slabs.empty((256, 256), torch.float32)
    slabs.empty((256, 256), torch.float32)  # the second slab is full: the spare one is cut next
    assert slabs._spare == []
