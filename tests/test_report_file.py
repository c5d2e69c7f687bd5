"""Report files, without an engine: saved rows laid out in a trace's data file come back as views
of one mapping, everything else round-trips through the header, room never written takes no
memory, the data file is truncated at the end, and failures leave no batch behind or say why."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from interlace.workers import sink as sink_module
from interlace.workers.saves import SaveChunk
from interlace.workers.sink import DirSink, read_new_reports


def _chunk(name: str, rows: torch.Tensor, owners: list[int], ranges: list[tuple[int, int]], steps_left=0) -> SaveChunk:
    bounds = np.array(ranges, dtype=np.int64).reshape(-1, 2)
    return SaveChunk.of("t", name, rows, np.array(owners, dtype=np.int64), bounds[:, 0], bounds[:, 1],
                        np.full(len(owners), steps_left, np.int64))


def _take_in(sink: DirSink) -> list[dict]:
    """Invokes 0..2: "resid" (bfloat16) saved at two steps by all three; "probs" (float32, 3-d)
    by invokes 2 and 0 only, in that order of rows. Returns what each should get back."""
    torch.manual_seed(0)
    step0, step1 = torch.randn(6, 8, dtype=torch.bfloat16), torch.randn(3, 8, dtype=torch.bfloat16)
    probs = torch.randn(3, 2, 4)
    sink.take_in(0, _chunk("resid", step0, [0, 1, 2], [(0, 2), (2, 4), (4, 6)], steps_left=1))
    sink.take_in(0, _chunk("probs", probs, [2, 0], [(0, 1), (1, 3)]))
    sink.take_in(0, _chunk("resid", step1, [0, 1, 2], [(0, 1), (1, 2), (2, 3)]))
    return [{"resid": torch.cat([step0[0:2], step1[0:1]]), "probs": probs[1:3]},
            {"resid": torch.cat([step0[2:4], step1[1:2]])},
            {"resid": torch.cat([step0[4:6], step1[2:3]]), "probs": probs[0:1]}]


def _report(invoke: int, saves: dict, **extra) -> dict:
    return {"trace": "t", "invoke": invoke, "stage": 0, "saves": saves, "shared": [], "error": None} | extra


def test_saves_taken_in_come_back_as_views_of_one_mapping(tmp_path):
    sink = DirSink(str(tmp_path))
    expected = _take_in(sink)
    small = torch.arange(5, dtype=torch.float32)
    saves = sink.take("t", 0, [0, 1, 2])
    saves[1]["note"] = {"text": "kept", "n": [1, 2.5, None]}  # not a tensor
    with sink.batch("t", 0) as batch:
        batch.finish([_report(i, s, shared=[("total", "sum", small)]) for i, s in enumerate(saves)])
    assert sorted(p.suffix for p in (tmp_path / "t").iterdir()) == [".data", ".reports"]
    assert (tmp_path / "t" / next(p.name for p in (tmp_path / "t").iterdir() if p.suffix == ".reports")).stat().st_size < 4096

    back = read_new_reports(tmp_path / "t", set())
    assert [r["invoke"] for r in back] == [0, 1, 2]
    for report, want in zip(back, expected):
        assert report["saves"].keys() - {"note"} == want.keys()
        for name, value in want.items():
            assert report["saves"][name].dtype == value.dtype and torch.equal(report["saves"][name], value)
    assert back[1]["saves"]["note"] == {"text": "kept", "n": [1, 2.5, None]}
    assert torch.equal(back[2]["shared"][0][2], small)  # a tensor not in the data file
    mapped = {r["saves"][name].untyped_storage().data_ptr() for r in back for name in ("resid", "probs") if name in r["saves"]}
    assert len(mapped) == 1  # bfloat16 and float32 rows alike: views of one mapping
    assert back[2]["shared"][0][2].untyped_storage().data_ptr() not in mapped

    back[0]["saves"]["resid"].zero_()  # the mapping is private: editing a result leaves the file as it was
    again = read_new_reports(tmp_path / "t", set())
    assert torch.equal(again[0]["saves"]["resid"], expected[0]["resid"])


def test_results_stay_readable_after_the_folder_is_removed(tmp_path):
    sink = DirSink(str(tmp_path))
    expected = _take_in(sink)
    with sink.batch("t", 0) as batch:
        batch.finish([_report(i, s) for i, s in enumerate(sink.take("t", 0, [0, 1, 2]))])
    sink.close("t", 0)
    back = read_new_reports(tmp_path / "t", set())
    for path in (tmp_path / "t").iterdir():
        path.unlink()
    assert torch.equal(back[2]["saves"]["probs"], expected[2]["probs"])


def test_empty_saves_and_reports_without_rows(tmp_path):
    sink = DirSink(str(tmp_path))
    with sink.batch("t", 1) as batch:
        batch.finish([_report(i, s, stage=1) for i, s in enumerate(sink.take("t", 1, [0, 1]))])
    sink.write("t", 0, [_report(7, {}, error={"message": "boom"})])
    back = read_new_reports(tmp_path / "t", set())
    assert [(r["stage"], r["invoke"], r["saves"], r["error"]) for r in back] == [
        (0, 7, {}, {"message": "boom"}), (1, 0, {}, None), (1, 1, {}, None)]


def test_a_failed_write_leaves_no_file_and_the_rows_readable(tmp_path):
    sink = DirSink(str(tmp_path))
    expected = _take_in(sink)
    saves = sink.take("t", 0, [0])
    with pytest.raises(TypeError, match="pickle"):
        with sink.batch("t", 0) as batch:
            batch.finish([_report(0, {**saves[0], "lock": threading.Lock()})])
    assert [p.suffix for p in (tmp_path / "t").iterdir()] == [".data"]  # no batch
    sink.write("t", 0, [_report(0, saves[0])])  # the report alone, as the fallback writes it
    assert torch.equal(read_new_reports(tmp_path / "t", set())[0]["saves"]["resid"], expected[0]["resid"])


def test_room_never_written_takes_no_memory_and_close_cuts_the_file_to_its_runs(tmp_path):
    sink = DirSink(str(tmp_path))
    hidden, invokes, steps = 1024, 64, 4  # float32 rows of 4 KiB: a page each
    owners = list(range(invokes))
    for step in range(steps):  # every step saves a row per invoke, with room for 200 steps
        rows = torch.full((invokes, hidden), float(step))
        sink.take_in(0, _chunk("h", rows, owners, [(i, i + 1) for i in owners], steps_left=200 - step))
    (data,) = (tmp_path / "t").glob("*.data")
    written = invokes * steps * hidden * 4  # 1 MiB
    assert data.stat().st_blocks * 512 < 2 * written  # the room for 200 steps (51 MiB) is a hole

    half = sink.take("t", 0, owners[:32])  # two batches of the same trace: one data file
    with sink.batch("t", 0) as batch:
        batch.finish([_report(i, s) for i, s in enumerate(half)])
    rest = sink.take("t", 0, owners[32:])
    with sink.batch("t", 0) as batch:
        batch.finish([_report(32 + i, s) for i, s in enumerate(rest)])
    size = data.stat().st_size
    sink.close("t", 0)
    assert data.stat().st_size < size  # cut to the regions handed out
    back = read_new_reports(tmp_path / "t", set())
    assert [r["invoke"] for r in back] == owners
    for report in back:
        assert report["saves"]["h"].shape == (steps, hidden)
        assert report["saves"]["h"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_saves_that_cannot_be_stored_fail_their_trace_with_the_reason(tmp_path, monkeypatch):
    sink = DirSink(str(tmp_path))
    monkeypatch.setattr(sink_module, "_SPARE_BYTES", 1 << 62)  # more room than any folder has
    sink.take_in(0, _chunk("h", torch.ones(2, 4), [0, 1], [(0, 1), (1, 2)]))
    monkeypatch.undo()
    sink.take_in(0, _chunk("h", torch.ones(2, 4), [0, 1], [(0, 1), (1, 2)]))  # the trace's saves are lost
    with pytest.raises(RuntimeError, match="could not be stored.*no room for saves"):
        sink.take("t", 0, [0])
    sink.close("t", 0)
    assert sink.take("t", 0, [0]) == [{}]  # a new trace of that name starts clean
