"""Report files: saves gathered into a batch's region come back as views of one mapping, everything
else round-trips through the header, the data file is reserved ahead, reused by a later trace only
once nobody can read its rows, and truncated when let go of, and a failed write leaves no batch
behind; a batch of few rows goes in its header, with no data file. All without an engine but the
last test, which runs the session's."""

from __future__ import annotations

import gc
import os
import threading
import time

from pathlib import Path

import numpy as np
import pytest
import torch

from interlace.workers import report_file
from interlace.workers.save_gather import TakenSaves
from interlace.workers.saves import SaveChunk
from interlace.workers import sink as sink_module
from interlace.workers.sink import DATA, DirSink, discard, read_new_reports

SMALL_IN_HEADER = report_file.ROWS_IN_HEADER


@pytest.fixture(autouse=True)
def rows_in_the_data_file(monkeypatch):
    """These tests are about the data file: every batch with rows gets a region of it, however few
    (a batch of at most ROWS_IN_HEADER goes in its header otherwise; the test of that sets it back)."""
    monkeypatch.setattr(report_file, "ROWS_IN_HEADER", 0)


def _chunk(name: str, rows: torch.Tensor, owners: list[int], ranges: list[tuple[int, int]]) -> SaveChunk:
    bounds = np.array(ranges, dtype=np.int64).reshape(-1, 2)
    return SaveChunk(name, rows, None, np.array(owners, dtype=np.int64), bounds[:, 0], bounds[:, 1], len(owners))


def _taken() -> TakenSaves:
    """Invokes 0..2: "resid" (bfloat16) saved at two steps by all three; "probs" (float32, 3-d)
    by invokes 2 and 0 only, in that order of rows."""
    torch.manual_seed(0)
    step0, step1 = torch.randn(6, 8, dtype=torch.bfloat16), torch.randn(3, 8, dtype=torch.bfloat16)
    probs = torch.randn(3, 2, 4)
    everyone = np.ones(3, dtype=bool)
    return TakenSaves({
        "resid": [(_chunk("resid", step0, [0, 1, 2], [(0, 2), (2, 4), (4, 6)]), everyone),
                  (_chunk("resid", step1, [0, 1, 2], [(0, 1), (1, 2), (2, 3)]), everyone)],
        "probs": [(_chunk("probs", probs, [2, 0], [(0, 1), (1, 3)]), np.ones(2, dtype=bool))],
    }, np.array([0, 1, 2]))


def _report(invoke: int, saves: dict, **extra) -> dict:
    return {"trace": "t", "invoke": invoke, "stage": 0, "saves": saves, "shared": [], "error": None} | extra


def test_saves_gathered_into_the_file_come_back_as_views_of_one_mapping(tmp_path):
    taken = _taken()
    expected = taken.assemble()  # the same gather into ordinary host tensors
    small = torch.arange(5, dtype=torch.float32)
    part = torch.arange(1 << 20, dtype=torch.float32)[10:13]  # a view of 4 MiB: its own 12 bytes go
    with DirSink(str(tmp_path)).batch("t", 0) as batch:
        saves = taken.assemble(batch.allocate)
        saves[1]["note"] = {"text": "kept", "n": [1, 2.5, None]}  # not a tensor
        saves[2]["part"] = part
        batch.finish([_report(i + 3, s, shared=[("total", "sum", small)]) for i, s in enumerate(saves)])
    assert sum(p.stat().st_size for p in (tmp_path / "t").iterdir()) < 64 << 10
    assert [p.suffix for p in (tmp_path / "t").iterdir()] == [".reports"]
    assert [p.suffix for p in (tmp_path / DATA).iterdir()] == [".data"]

    back = read_new_reports(tmp_path / "t", set())
    assert [r["invoke"] for r in back] == [3, 4, 5]
    for report, want in zip(back, expected):
        assert report["saves"].keys() - {"note", "part"} == want.keys()
        for name, value in want.items():
            assert report["saves"][name].dtype == value.dtype and torch.equal(report["saves"][name], value)
    assert back[1]["saves"]["note"] == {"text": "kept", "n": [1, 2.5, None]}
    assert torch.equal(back[2]["saves"]["part"], part)
    assert torch.equal(back[2]["shared"][0][2], small)  # a tensor not in the file's data region
    mapped = {r["saves"][name].untyped_storage().data_ptr() for r in back for name in ("resid", "probs") if name in r["saves"]}
    assert len(mapped) == 1  # bfloat16 and float32 rows alike: views of one mapping
    assert back[2]["shared"][0][2].untyped_storage().data_ptr() not in mapped

    back[0]["saves"]["resid"].zero_()  # the mapping is private: editing a result leaves the file as it was
    again = read_new_reports(tmp_path / "t", set())  # a second reader: one more claim
    assert torch.equal(again[0]["saves"]["resid"], expected[0]["resid"])
    assert len(list((tmp_path / DATA).glob("*.claim"))) == 2


def test_a_batch_of_few_rows_goes_in_its_header_and_its_trace_makes_no_data_file(tmp_path, monkeypatch):
    """A server's one-invoke trace saves a few hundred KiB: its rows go in the batch's header,
    each result a tensor of its own (only its own bytes), and no data file is made, reserved or
    kept for the trace. A trace that reserved one ahead but reports few rows uses it for nothing."""
    monkeypatch.setattr(report_file, "ROWS_IN_HEADER", SMALL_IN_HEADER)
    taken = _taken()
    expected = taken.assemble()
    sink = DirSink(str(tmp_path))
    with sink.batch("t", 0) as batch:
        saves = taken.assemble(batch.allocate)
        batch.finish([_report(i, s) for i, s in enumerate(saves)])
    sink.close("t", 0)
    assert not (tmp_path / DATA).exists()
    (path,) = (tmp_path / "t").glob("*.reports")
    assert path.stat().st_size < 4096  # each invoke's own rows, not the gathered tensor per view

    back = read_new_reports(tmp_path / "t", set())
    for report, want in zip(back, expected):
        assert report["saves"].keys() == want.keys()
        for name, value in want.items():
            got = report["saves"][name]
            assert got.dtype == value.dtype and torch.equal(got, value)
            assert got.untyped_storage().nbytes() == got.nbytes  # a tensor of its own
    back[0]["saves"]["resid"].zero_()  # writable, and the file keeps its rows
    assert torch.equal(read_new_reports(tmp_path / "t", set())[0]["saves"]["resid"], expected[0]["resid"])
    assert not (tmp_path / DATA).exists()  # nor any reader's claim

    sink.reserve("u", 0, 1 << 20)  # reserved ahead, then a small report
    with sink.batch("u", 0) as batch:
        batch.finish([_report(0, taken.assemble(batch.allocate)[0])])
    sink.close("u", 0)
    assert torch.equal(read_new_reports(tmp_path / "u", set())[0]["saves"]["resid"], expected[0]["resid"])

    big = torch.ones(SMALL_IN_HEADER // 2048 + 1, 1024, dtype=torch.bfloat16)  # past the limit: a region
    saves = TakenSaves({"big": [(_chunk("big", big, [0], [(0, len(big))]), np.ones(1, dtype=bool))]}, np.array([0]))
    with sink.batch("v", 0) as batch:
        batch.finish([_report(0, s) for s in saves.assemble(batch.allocate)])
    assert batch.has_region and len(list((tmp_path / DATA).glob("*.data"))) == 1
    assert torch.equal(read_new_reports(tmp_path / "v", set())[0]["saves"]["big"], big)


def test_results_stay_readable_after_the_folder_is_removed(tmp_path):
    taken = _taken()
    with DirSink(str(tmp_path)).batch("t", 0) as batch:
        batch.finish([_report(i, s) for i, s in enumerate(taken.assemble(batch.allocate))])
    back = read_new_reports(tmp_path / "t", set())
    for path in (tmp_path / "t").iterdir():
        path.unlink()
    assert torch.equal(back[2]["saves"]["probs"], taken.assemble()[2]["probs"])


def test_empty_saves_and_reports_without_rows(tmp_path):
    sink = DirSink(str(tmp_path))
    with sink.batch("t", 1) as batch:
        none = TakenSaves({}, np.array([0, 1])).assemble(batch.allocate)
        batch.finish([_report(i, s, stage=1) for i, s in enumerate(none)])
    sink.write("t", 0, [_report(7, {}, error={"message": "boom"})])
    back = read_new_reports(tmp_path / "t", set())
    assert [(r["stage"], r["invoke"], r["saves"], r["error"]) for r in back] == [
        (0, 7, {}, {"message": "boom"}), (1, 0, {}, None), (1, 1, {}, None)]


def test_a_failed_write_leaves_no_file_and_the_rows_readable(tmp_path):
    taken = _taken()
    sink = DirSink(str(tmp_path))
    with pytest.raises(TypeError, match="pickle"):
        with sink.batch("t", 0) as batch:
            saves = taken.assemble(batch.allocate)
            batch.finish([_report(0, {**saves[0], "lock": threading.Lock()})])
    assert not list((tmp_path / "t").iterdir())  # no batch
    # the fallback writes the report alone: its rows, views of the abandoned mapping, are pickled
    # whole, with only their own bytes
    sink.write("t", 0, [_report(0, saves[0])])
    (path,) = (tmp_path / "t").glob("*.reports")
    assert path.stat().st_size < 4096
    assert torch.equal(read_new_reports(tmp_path / "t", set())[0]["saves"]["resid"], taken.assemble()[0]["resid"])


def test_the_data_file_is_reserved_ahead_batches_append_and_letting_go_gives_back_the_rest(tmp_path, monkeypatch):
    sink = DirSink(str(tmp_path))
    sink.reserve("t", 0, 8 << 20)  # ahead, while the trace runs
    (data,) = (tmp_path / DATA).glob("*.data")
    assert data.stat().st_blocks * 512 >= 8 << 20  # allocated, not a hole

    taken = _taken()
    expected = taken.assemble()
    for first in (0, 3):  # two batches of the same trace: two regions of one data file
        with sink.batch("t", 0) as batch:
            batch.finish([_report(first + i, s) for i, s in enumerate(taken.assemble(batch.allocate))])
    assert data.stat().st_blocks * 512 < 9 << 20  # the batches used the reservation, nothing more
    sink.close("t", 0)
    assert data.stat().st_blocks * 512 >= 8 << 20  # kept whole, for a later trace

    back = read_new_reports(tmp_path / "t", set())
    assert [r["invoke"] for r in back] == [0, 1, 2, 3, 4, 5]
    for report, want in zip(back, expected + expected):
        assert all(torch.equal(report["saves"][name], value) for name, value in want.items())
    assert back[0]["saves"]["resid"].data_ptr() != back[3]["saves"]["resid"].data_ptr()

    monkeypatch.setattr(sink_module, "KEEP_FILES", 0)  # the next trace's close lets go of both
    _write_trace(sink, "u", 1.0)  # (rows in a data file of its own, then closed)
    assert data.stat().st_size == 2 * 4096  # truncated to the two regions (a page each)
    assert all(torch.equal(r["saves"]["resid"], want["resid"]) for r, want in zip(back, expected + expected))


def _write_trace(sink: DirSink, trace: str, value: float) -> None:
    rows = torch.full((4, 8), value)
    saves = TakenSaves({"x": [(_chunk("x", rows, [0], [(0, 4)]), np.ones(1, dtype=bool))]}, np.array([0]))
    with sink.batch(trace, 0) as batch:
        batch.finish([_report(0, s) for s in saves.assemble(batch.allocate)])
    sink.close(trace, 0)


def _claims(root: Path) -> set[Path]:
    return set((root / DATA).glob("*.claim"))


def _wait_for_claims_to_go(root: Path, stale: set[Path] = frozenset()) -> None:
    """Every claim but ``stale`` ones goes: those of results an earlier test held when the fork
    test's child took claims of its own (it ends through os._exit, leaving them, as documented)."""
    deadline = time.monotonic() + 10
    while _claims(root) - stale and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _claims(root) - stale, "a claim outlived the results it was for"


def test_a_data_file_is_written_again_only_once_nobody_can_read_its_rows(tmp_path):
    """A rank reuses a trace's data file for a later trace (its pages are mapped, and on a GPU
    pinned, already), but only once its batch files are gone and every reader has dropped the
    rows it mapped: results held for as long as the user likes keep their values."""
    sink = DirSink(str(tmp_path))

    def files() -> list[str]:
        return sorted(p.name for p in (tmp_path / DATA).glob("*.data"))

    _write_trace(sink, "a", 1.0)
    held = read_new_reports(tmp_path / "a", set())
    discard(tmp_path / "a")  # read and discarded, as the driver does; the rows are still held
    _write_trace(sink, "b", 2.0)
    assert len(files()) == 2  # a's file is still someone's
    assert held[0]["saves"]["x"].eq(1.0).all()

    unread = files()
    _write_trace(sink, "c", 3.0)  # b's batch is unread and its folder still there: a third file
    assert len(files()) == 3
    discard(tmp_path / "b")  # b's folder goes unread: nobody can read its rows
    _write_trace(sink, "d", 4.0)
    assert len(files()) == 3  # b's file was reused
    assert held[0]["saves"]["x"].eq(1.0).all()

    del held
    _wait_for_claims_to_go(tmp_path)
    for trace in ("c", "d"):
        discard(tmp_path / trace)
    reused = files()
    for value, trace in enumerate("efg"):  # one at a time, each read and dropped: no new file
        _write_trace(sink, trace, 5.0 + value)
        got = read_new_reports(tmp_path / trace, set())
        assert got[0]["saves"]["x"].eq(5.0 + value).all()
        discard(tmp_path / trace)
        del got
        _wait_for_claims_to_go(tmp_path)
    assert files() == reused and set(unread) <= set(files())


def test_a_forked_child_keeps_the_rows_it_holds_after_the_parent_drops_its_own(tmp_path):
    """A child forked while results are held (a data loader's worker, say) sees the same private
    mapping and takes claims of its own: the parent dropping its results does not let the rank
    write there while the child may still read them."""
    import multiprocessing

    sink = DirSink(str(tmp_path))
    _write_trace(sink, "a", 1.0)
    held = read_new_reports(tmp_path / "a", set())
    discard(tmp_path / "a")
    fork = multiprocessing.get_context("fork")
    go, sums = fork.Event(), fork.Queue()

    def child() -> None:
        go.wait(30)
        sums.put(float(held[0]["saves"]["x"].sum()))

    reader = fork.Process(target=child)
    reader.start()
    try:
        del held
        deadline = time.monotonic() + 10
        while len(list((tmp_path / DATA).glob("*.claim"))) > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(list((tmp_path / DATA).glob("*.claim"))) == 1  # the child's
        _write_trace(sink, "b", 7.0)
        assert len(list((tmp_path / DATA).glob("*.data"))) == 2  # a's file is still the child's
        go.set()
        assert sums.get(timeout=30) == 32.0  # 4 x 8 ones, not sevens
    finally:
        go.set()
        reader.join(30)


def _longest_pause_while(work) -> float:
    """The longest this thread went without running while ``work`` ran in another thread."""
    failed: list[BaseException] = []
    worker = threading.Thread(target=lambda: _keep_failure(work, failed))
    gaps, last = [], time.perf_counter()
    worker.start()
    while worker.is_alive():  # the engine thread's stand-in: short work, often
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        time.sleep(0.0005)
    worker.join()
    gaps.append(time.perf_counter() - last)  # the last stretch: all of it, if work held the GIL throughout
    if failed:
        raise failed[0]
    return max(gaps)


def _keep_failure(work, failed: list) -> None:
    try:
        work()
    except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
        failed.append(exc)


def test_reserving_ahead_lets_the_engine_thread_run(tmp_path):
    """The reporter thread reserves while the engine thread launches steps: mapping 256 MiB takes
    tens of milliseconds or more, none of which may hold the GIL. Against Python's mmap.madvise on
    the same size (which holds it: the engine thread waits the whole call), in any of three tries."""
    import mmap

    from interlace.workers.report_file import _MADV_POPULATE_WRITE

    size = 256 << 20
    pauses = []  # (ours, mmap.madvise's) per attempt: the machine's load changes both alike
    for attempt in range(3):
        sink = DirSink(str(tmp_path))
        ours = _longest_pause_while(lambda: sink.reserve(f"t{attempt}", 0, size))
        sink.close(f"t{attempt}", 0)
        with open(tmp_path / f"held{attempt}", "w+b") as f:
            os.posix_fallocate(f.fileno(), 0, size)
            with mmap.mmap(f.fileno(), size) as mapping:
                held = _longest_pause_while(lambda: mapping.madvise(_MADV_POPULATE_WRITE, 0, size))
        pauses.append((ours, held))
        if ours < 0.5 * held:
            return
    pytest.fail(f"the longest pause while reserving was not under half of mmap.madvise's: {pauses}")


def _longest_map_wait_while(work) -> float:
    """The longest another thread waited to map and unmap 1 MiB (which takes the process's memory
    map lock, as malloc, Python's arenas and CUDA do on the engine thread) while ``work`` ran."""
    import mmap

    waits, done = [], threading.Event()

    def mapper():
        while not done.is_set():
            started = time.perf_counter()
            mmap.mmap(-1, 1 << 20).close()
            waits.append(time.perf_counter() - started)
            time.sleep(0.0002)

    thread = threading.Thread(target=mapper)
    thread.start()
    time.sleep(0.02)
    try:
        work()
    finally:
        done.set()
        thread.join()
    return max(waits)


def test_reserving_and_unmapping_a_data_file_never_hold_the_memory_map_long(monkeypatch):
    """Mapping or unmapping a range holds the process's memory map lock throughout, and the engine
    thread maps memory every step: reserving 256 MiB of /dev/shm in one call, or unmapping it in
    one munmap, stalled a mapping thread for 50-900 ms on a 2-core CPU. The reporter does both in
    slices. Against one call each (reserving with a slice larger than the file; closing without
    letting go of the pages first), in any of three tries."""
    import tempfile

    from interlace.workers import report_file
    from interlace.workers.report_file import DataFile

    size, ours = 256 << 20, report_file._SLICE
    tries = []
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:  # where reports go (tmpfs)
        for attempt in range(3):
            waits = []  # (reserving, unmapping) for ours, then for one call
            for slice_ in (ours, 1 << 40):
                monkeypatch.setattr(report_file, "_SLICE", slice_)
                data = DataFile(Path(folder) / f"{attempt}-{len(waits)}.data")
                reserving = _longest_map_wait_while(lambda: data.reserve(size))
                _start, rows = data.region(size)
                rows.fill_(7)  # a trace's rows written into the file
                view = rows[-4096:]
                if slice_ == ours:
                    data.close()
                else:  # closed without letting go of the pages: the last view's munmap does it
                    os.ftruncate(data._fd, data.used)
                    os.close(data._fd)
                    data.bytes = None
                held = [data, rows]
                del data, rows
                unmapping = _longest_map_wait_while(held.clear)  # one view left: still mapped
                assert view.eq(7).all()  # a view kept after close reads its rows
                held = [view]
                del view
                unmapping = max(unmapping, _longest_map_wait_while(held.clear))  # the last: munmap
                waits.append((reserving, unmapping))
            tries.append(waits)
            (ours_reserving, ours_unmapping), (one_reserving, one_unmapping) = waits
            # Where one call itself held the lock under 2 ms (one H100 host unmapped 256 MiB in
            # 0.1 ms), there is nothing to cut: that phase passes if ours is as short.
            if ours_reserving < max(0.25 * one_reserving, 0.002) and ours_unmapping < max(0.25 * one_unmapping, 0.002):
                return
    pytest.fail(f"slices did not cut the longest map wait to under a quarter of one call's: {tries}")


def test_copies_into_pinned_slices_are_cut_at_their_edges(tmp_path, monkeypatch):
    """CUDA refuses one copy across two registrations, so a copy into a data file's pinned slices
    goes one slice at a time, and past the pinned ones in one piece. The cutting, on the CPU: the
    file's first slices marked pinned as a GPU process's are, bytes compared after the copy."""
    from interlace.workers import report_file
    from interlace.workers.report_file import DataFile, copy_to_host

    monkeypatch.setattr(report_file, "_SLICE", 64 << 10)
    data = DataFile(tmp_path / "0.data")
    data.reserve(1 << 20)
    data.pinned = 5 * report_file._SLICE  # as if registered; past it, pageable
    monkeypatch.setitem(report_file._pinned_files, data.bytes.data_ptr(), data)
    cuts = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda into, src, non_blocking=False: (
        cuts.append((into.data_ptr() - data.bytes.data_ptr(), into.nbytes)), real_copy(into, src, non_blocking))[1])
    rows = torch.randn(200, 1000).to(torch.bfloat16)  # 400,000 bytes from offset 100,000
    out = data.bytes[100_000 : 100_000 + rows.nbytes].view(torch.bfloat16).view(200, 1000)
    copy_to_host(out, rows)
    monkeypatch.undo()
    assert torch.equal(out, rows)
    slice_ = 64 << 10
    assert cuts[0] == (100_000, 2 * slice_ - 100_000)  # to the end of the slice it starts in
    assert all(start % slice_ == 0 for start, _ in cuts[1:])
    assert all(start + size <= (start // slice_ + 1) * slice_ for start, size in cuts if start < 5 * slice_)
    assert cuts[-1] == (5 * slice_, 500_000 - 5 * slice_)  # the pageable rest in one copy
    data.pinned = 0  # nothing was registered for real
    data.close()


@pytest.mark.gpu
def test_a_gpu_process_pins_its_data_file_and_copies_into_it(tmp_path):
    """In a process using a GPU, reserved slices are registered with CUDA (pinned), copies from
    the device land whole across slice edges, a file CUDA refuses (on disk) stays pageable
    without leaving an error for the next kernel, and close() unregisters before truncating."""
    import tempfile

    from interlace.workers import report_file
    from interlace.workers.report_file import DataFile, copy_to_host

    rows = torch.randn(3000, 1024, device="cuda").to(torch.bfloat16)  # 6 MB: three 2 MiB slices
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        data = DataFile(Path(folder) / "0.data")
        data.reserve(8 << 20)
        assert data.pinned == 8 << 20
        _start, region = data.region(rows.nbytes + 4096)
        out = region[4096:].view(torch.bfloat16).view(rows.shape)
        copy_to_host(out, rows)
        assert torch.equal(out, rows.cpu())
        data.close()  # other tests' engines may have pinned files of their own in this process
        assert data.pinned == 0 and all(other is not data for other in report_file._pinned_files.values())
    on_disk = DataFile(tmp_path / "1.data")  # CUDA refused files on disk on an H100 host
    on_disk.reserve(4 << 20)
    (rows * 2).sum().item()  # a kernel launch and a sync: no error left over from a refusal
    _start, region = on_disk.region(rows.nbytes)
    out = region.view(torch.bfloat16).view(rows.shape)
    copy_to_host(out, rows)
    assert torch.equal(out, rows.cpu())
    on_disk.close()


@pytest.mark.gpu
def test_a_batch_of_few_gpu_rows_goes_in_its_header_whole(tmp_path, monkeypatch):
    """Rows kept on the GPU, few enough for the header: gathered there and copied into pageable
    host tensors, which are whole when the header is pickled (a copy into pageable memory returns
    once done), so every invoke reads back exactly its rows, bfloat16 and float32 alike, and the
    trace makes no data file."""
    monkeypatch.setattr(report_file, "ROWS_IN_HEADER", SMALL_IN_HEADER)
    taken = _taken()
    expected = taken.assemble()
    on_gpu = TakenSaves({name: [(_chunk(c.name, c.rows.cuda(), c.owners.tolist(), list(zip(c.starts.tolist(), c.stops.tolist()))), wanted)
                                for c, wanted in parts] for name, parts in taken.parts.items()}, taken.wanted)
    big = torch.randn(4000, 64, device="cuda")  # 256 KiB of it in the header too, with the rest
    on_gpu.parts["big"] = [(_chunk("big", big, [1], [(0, 1024)]), np.ones(1, dtype=bool))]
    sink = DirSink(str(tmp_path))
    with sink.batch("t", 0) as batch:
        saves = on_gpu.assemble(batch.allocate)
        batch.finish([_report(i, s) for i, s in enumerate(saves)])
    sink.close("t", 0)
    assert not batch.has_region and not (tmp_path / DATA).exists()
    back = read_new_reports(tmp_path / "t", set())
    for report, want in zip(back, expected):
        for name, value in want.items():
            got = report["saves"][name]
            assert got.device.type == "cpu" and got.dtype == value.dtype and torch.equal(got, value)
    assert torch.equal(back[1]["saves"]["big"], big[:1024].cpu())


def _mappings_of(path) -> list[str]:
    with open("/proc/self/maps") as maps:
        return [line for line in maps if str(path) in line]


def test_dropping_read_results_leaves_freeing_their_pages_to_a_thread(tmp_path, monkeypatch):
    """Once a trace's files are removed, whoever unmaps the data file last frees its pages: about
    60 ms per 512 MiB on a 2-core CPU, wherever results are dropped (a sweep's loop, a replica's
    event loop). Results read from a report leave that to a thread: dropping them takes under half
    the time of dropping a plain private mapping of the same file, in any of three tries, and no
    mapping of the file is left afterwards (its pages are given back)."""
    import mmap

    size = 128 << 20
    rows = torch.ones(size // 4096, 2048, dtype=torch.bfloat16)
    saves = TakenSaves({"big": [(_chunk("big", rows, [0], [(0, len(rows))]), np.ones(1, dtype=bool))]}, np.array([0]))
    drops = []  # (ours, plain) per attempt
    monkeypatch.setattr(sink_module, "KEEP_FILES", 0)  # the rank lets go of the data file at once
    for attempt in range(3):
        sink = DirSink(str(tmp_path))
        with sink.batch(f"t{attempt}", 0) as batch:
            batch.finish([_report(0, s) for s in saves.assemble(batch.allocate)])
        sink.close(f"t{attempt}", 0)
        del batch  # the writer's mapping (a rank's), with the rows it wrote
        back = read_new_reports(tmp_path / f"t{attempt}", set())
        assert torch.equal(back[0]["saves"]["big"][-1], rows[-1])
        data = next(p for p in (tmp_path / DATA).glob("*.data") if _mappings_of(p))
        data.unlink()
        for path in (tmp_path / f"t{attempt}").iterdir():
            path.unlink()
        started = time.perf_counter()
        del back
        ours = time.perf_counter() - started

        plain_path = tmp_path / f"plain{attempt}"
        with open(plain_path, "w+b") as f:
            f.write(rows.view(torch.uint8).numpy().tobytes())
            mapping = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        plain = torch.frombuffer(mapping, dtype=torch.uint8)
        del mapping
        plain_path.unlink()
        started = time.perf_counter()
        del plain
        drops.append((ours, time.perf_counter() - started))

        deadline = time.monotonic() + 10
        while _mappings_of(data) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _mappings_of(data), "the data file is still mapped after its results were dropped"
        if drops[-1][0] < 0.5 * drops[-1][1]:
            return
    pytest.fail(f"dropping read results was not under half of a plain mapping's drop: {drops}")


def test_a_script_that_ends_holding_read_results_exits_quietly(tmp_path):
    """Results still held when the interpreter exits are left to the system: the thread that gives
    dropped results back is not started then (Python 3.12 refuses new threads at shutdown, which
    printed a traceback after the user's script)."""
    import subprocess
    import sys

    script = f"""
import numpy as np, torch
from interlace.workers.save_gather import TakenSaves
from interlace.workers.saves import SaveChunk
from interlace.workers import sink as sink_module
from interlace.workers.sink import DATA, DirSink, discard, read_new_reports
from interlace.workers import report_file
report_file.ROWS_IN_HEADER = 0  # rows in a data file, mapped by the reader
rows = torch.ones(8, 4)
one = np.array([0])
saves = TakenSaves({{"x": [(SaveChunk("x", rows, None, one, one, one + 8, 1), np.ones(1, dtype=bool))]}}, one)
with DirSink({str(tmp_path)!r}).batch("t", 0) as batch:
    batch.finish([{{"trace": "t", "invoke": 0, "stage": 0, "saves": s, "shared": [], "error": None}}
                  for s in saves.assemble(batch.allocate)])
held = read_new_reports(__import__("pathlib").Path({str(tmp_path)!r}) / "t", set())
assert torch.equal(held[0]["saves"]["x"], rows)
print("read")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "read", done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_a_watcher_waits_for_a_report_only_once_it_is_due(tmp_path):
    """A stream's watcher runs while its invokes generate, however long: a report counts against
    the grace only from the moment its invoke finished (before, a stream generating for longer
    than the grace failed with "a worker may have died")."""
    import time

    from interlace.cluster.assembly import ReportWatcher

    watcher = ReportWatcher(tmp_path, "t", {(0, 0), (1, 0)}, grace_s=0.2, due=())
    time.sleep(0.3)
    watcher.poll()  # both invokes still generating: nothing due, no error
    watcher.mark_due([(0, 0)])
    watcher.poll()  # due, within its grace
    DirSink(str(tmp_path)).write("t", 0, [_report(0, {})])
    time.sleep(0.3)
    watcher.poll()  # (0, 0) arrived; (1, 0) is not due yet
    assert watcher.wanted == {(1, 0)} and [r["invoke"] for r in watcher.reports] == [0]
    watcher.mark_due([(1, 0)])
    time.sleep(0.3)
    with pytest.raises(RuntimeError, match=r"no report from \(invoke, stage\) \[\(1, 0\)\] within 0s"):
        watcher.poll()
    eager = ReportWatcher(tmp_path, "u", {(0, 0)}, grace_s=0.2)  # after generation: due at once
    time.sleep(0.3)
    with pytest.raises(RuntimeError, match="workers died or can no longer write reports"):
        eager.poll()


def test_an_engine_writes_a_data_file_again_only_after_the_results_in_it_are_dropped(llama):
    """The same on a real engine: results held while later traces run keep their values, and a
    loop that drops each trace's results before the next one runs reuses one data file. (Each
    trace saves more than ROWS_IN_HEADER, so its rows go to a data file.)"""
    from interlace import ops

    save = [ops.save(f"layers.{layer}.resid") for layer in range(4)] + [ops.save("logits")]
    tokens = 300
    data_files = lambda: sorted((llama._sink_root / DATA).glob("*.data"))  # noqa: E731
    gc.collect()  # results earlier tests dropped in reference cycles
    stale = _claims(llama._sink_root)  # the session's engine ran those tests (one run failed on one)

    held = llama.generate("The capital of France is", ops=save, max_tokens=tokens, ignore_eos=True)
    assert sum(value.nbytes for value in held.saves.values()) > SMALL_IN_HEADER
    kept = held.saves["layers.1.resid"].clone()
    for prompt in ("Once upon a time", "1, 2, 3, 4, 5,"):  # other rows, written while held is held
        other = llama.generate(prompt, ops=save, max_tokens=tokens, ignore_eos=True)
        assert not torch.equal(other.saves["layers.1.resid"][-1], kept[-1])
    assert torch.equal(held.saves["layers.1.resid"], kept)

    del held, other
    _wait_for_claims_to_go(llama._sink_root, stale)
    before = data_files()
    for _ in range(3):
        out = llama.generate("The capital of France is", ops=save, max_tokens=tokens, ignore_eos=True)
        assert torch.equal(out.saves["layers.1.resid"], kept)
        del out
        _wait_for_claims_to_go(llama._sink_root, stale)
    assert data_files() == before
