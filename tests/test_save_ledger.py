"""The save ledger hands each invoke exactly its own rows, also when its slot number is reused.

Slots are reused as soon as an invoke finishes (see workers/slots.py), while rows it shared a chunk
with may still wait for the rest of its group; a reused slot must not pick those up again.
"""

import numpy as np
import torch

from interlace.workers.saves import SaveLedger


def _rows(*values: float) -> torch.Tensor:
    return torch.tensor(values).reshape(-1, 1)


def test_reused_slot_gets_only_rows_saved_after_it_was_reused():
    ledger = SaveLedger()
    one_row_each = dict(starts=np.array([0, 1]), stops=np.array([1, 2]))
    ledger.add("t", "h", _rows(10, 11), owners=np.array([0, 1]), **one_row_each)  # step 1: slots 0, 1
    [first] = ledger.take("t", [0]).assemble()  # invoke A (slot 0) finishes; slot 1 goes on
    assert first["h"].flatten().tolist() == [10]

    # slot 0 now belongs to invoke C of the same trace
    ledger.add("t", "h", _rows(20, 21), owners=np.array([0, 1]), **one_row_each)
    [c, b] = ledger.take("t", [0, 1]).assemble()
    assert c["h"].flatten().tolist() == [20]
    assert b["h"].flatten().tolist() == [11, 21]
    assert ledger.take("t", [0, 1]).assemble() == [{}, {}]  # nothing left behind


def test_rows_of_several_lengths_concatenate_in_save_order():
    ledger = SaveLedger()
    ledger.add("t", "x", _rows(1, 2, 3), owners=np.array([5, 7]), starts=np.array([0, 2]), stops=np.array([2, 3]))
    ledger.add("t", "x", _rows(4, 5), owners=np.array([7, 5]), starts=np.array([0, 1]), stops=np.array([1, 2]))
    seven, five = ledger.take("t", [7, 5]).assemble()
    assert five["x"].flatten().tolist() == [1, 2, 5]
    assert seven["x"].flatten().tolist() == [3, 4]
