"""Report files: a rank's saved rows for a trace, and its reports in batches, mapped by the driver.

    .data/<stage>-<pid>-<n>.data       saved rows: every batch a rank reports for one trace, appended
                                       region by region (each tensor 64-byte aligned, each region
                                       page aligned); reused by a later trace once read and dropped
    <trace>/<stage>-<invoke>.reports   one batch: [prefix: data file, region][header: pickled reports]
    .data/<data>.<batch>-<pid>-<n>.claim   a reader's hard link to a batch file, while it maps the region

Gathering a sweep's saves into memory that nobody has touched yet is mostly the kernel finding and
mapping pages (of 0.33 s for 512 MiB on an H200 host, most was that, not copying), and on a GPU
registering them with CUDA (pinning) holds the driver's lock that the engine thread's launches
take. So the data file is reserved ahead: while the trace runs, the reporter thread (idle then)
allocates, maps and pins pages as the saves grow (:meth:`DataFile.reserve`), and gathering a batch
into its region is a plain copy. And once every batch's results have been dropped by their readers,
the rank reuses the file, its pages mapped and pinned already, for its next trace
(:meth:`DataFile.free`): a loop of traces or a sweep's shards reserves nothing after its first.

The header holds everything else (the report dicts, values that are not rows, shared
contributions, errors), pickled with each tensor of the batch's region replaced by a reference to
it (offset, dtype, shape, strides); any other tensor is pickled whole. A reader links the batch
file into ``.data`` (its claim), maps the region copy-on-write and rebuilds those tensors as views
of it: nothing is copied on read, and a user editing a result does not change the file. The claim
goes when the last of those views does. The rank keeps each batch file open and reuses the data
file only when none of them has a name left (the trace's folder removed, every claim gone), so
results held for as long as the user likes stay as they were read. A batch with few rows (at most
:data:`ROWS_IN_HEADER`, a server's one-invoke trace) has no region: its rows are pickled in the
header, and read back as tensors of their own.

    data = DataFile(folder / "0-123-0.data"); data.reserve(512 << 20)   (ahead, reporter thread)
    writer = ReportFileWriter(fd, lambda: data, header_folder)
    l3, l4 = writer.allocate([((n, 2048), torch.bfloat16), ((n, 2048), torch.bfloat16)])
    ...gather rows into l3 and l4; put views of them in the reports...
    writer.finish(reports); data.watch(open batch file)
    read_report_file(path)  ->  the reports; their rows are views of one copy-on-write mapping
    data.free()  ->  True once the batch files are gone and every reader dropped its rows
"""

from __future__ import annotations

import ctypes
import functools
import io
import itertools
import math
import mmap
import os
import pickle
import queue
import struct
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

_ALIGN = 64  # every tensor starts on a cache line, and at a multiple of any element size
_PAGE = mmap.ALLOCATIONGRANULARITY  # regions start on a page: the driver maps each one alone
_VIRTUAL_BYTES = 1 << 38  # a data file's address space (the file is sparse: no memory until reserved)
_PREFIX = struct.Struct("<8sQQH")  # magic, region start, region length, data file name length
_MAGIC = b"ilreport"
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; in Python 3.13's mmap module only
_MADV_DONTNEED = 4
# madvise through ctypes, which lets go of the GIL for the call: mmap.madvise holds it, and mapping
# a quarter of a 512 MiB trace's saves takes tens of milliseconds during which the engine thread
# could not launch a step (the reporter reserves ahead while the trace runs).
try:
    _MADVISE = ctypes.CDLL(None, use_errno=True).madvise
    _MADVISE.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
except (OSError, TypeError, AttributeError):  # no C library to call (Windows): a write per page
    _MADVISE = None

# The kernel holds the process's memory map lock while it maps or unmaps a range, and every other
# thread of the process that maps memory (malloc, Python's arenas, CUDA) waits for it: mapping 128
# MiB in one call stalled such a thread for 107 ms on an H100 host (200-900 ms on a 2-core CPU), in
# 2 MiB slices for 16 ms (2-7 ms) (bench/host_probe.py --only maplock). So the reporter maps and
# unmaps in slices.
_SLICE = 2 << 20

# A batch whose rows total at most this is written inside its header (its tensors pickled there),
# with no data file: a server's one-invoke traces each save a few hundred KiB (128 tokens of a 1B
# model's last-token residual: 512 KiB), and a data file per trace (made, reserved, pinned on a
# GPU, truncated when a later one evicts it) cost the reporter 0.4 ms of Python a trace on the
# 2-core CPU, which the engine thread waits for (the GIL). Pickling 512 KiB into the header takes
# 0.1 ms, and reading it back as much.
ROWS_IN_HEADER = 1 << 20

TensorSpec = tuple[Sequence[int], torch.dtype]


class _Cudart:
    """The CUDA runtime torch loaded, for pinning data file slices (cudaHostRegister): copies
    from the GPU into pinned pages ran at 9.8-10.3 ms per 512 MiB on an H100 host, against 30-50 ms
    into pageable ones (bench/host_probe.py --only register). Called through ctypes, not
    torch.cuda.cudart(), because a refused registration (a file on disk, say) leaves the thread's
    last CUDA error set, which torch would raise at the reporter's next kernel launch: it is
    cleared here, with the same library's cudaGetLastError."""

    _lib: Any = None

    @classmethod
    def get(cls) -> Any:
        """The library, where this process uses a GPU (None elsewhere, e.g. a CPU engine)."""
        if cls._lib is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "/libcudart.so" in line}
            cls._lib = ctypes.CDLL(sorted(paths)[0]) if paths else False  # False: linked in, not ours to call
            if cls._lib:
                cls._lib.cudaHostRegister.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)
                cls._lib.cudaHostUnregister.argtypes = (ctypes.c_void_p,)
        return cls._lib or None


_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every context, whichever device copies
_pinned_files: dict[int, "DataFile"] = {}  # mapping address -> a data file with pinned slices


class DataFile:
    """One trace's saved rows on one rank; batches append regions. Used from one thread.

    The file is sparse at a large size and mapped once, so reserving more never remaps and a
    region is a slice of one mapping. Once :meth:`free`, :meth:`restart` makes it a new trace's;
    :meth:`close` truncates it to what batches used and lets go of it.
    """

    def __init__(self, path: Path):
        self.path = path  # created at the first reservation
        self.bytes: torch.Tensor | None = None  # the whole file, as one tensor, once open
        self.used = 0  # bytes handed out to regions
        self.reserved = 0  # bytes allocated and mapped
        self.pinned = 0  # the first bytes, whole slices, registered with CUDA (see copy_to_host)
        self._cudart = _Cudart.get()
        self._refused = False  # CUDA refused a slice: the rest stays pageable
        self._batches: list[int] = []  # open batch files with regions here, since the file was (re)started

    def reserve(self, nbytes: int) -> None:
        """Allocate and map the first ``nbytes`` now, so that writing them later faults nothing."""
        nbytes = _round_up(nbytes, _PAGE)
        if nbytes <= self.reserved:
            return
        if self.bytes is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(self._fd, _VIRTUAL_BYTES)
            self._mapping = mmap.mmap(self._fd, _VIRTUAL_BYTES, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self.bytes = torch.frombuffer(self._mapping, dtype=torch.uint8)  # keeps the mapping alive
        # Allocated first: a full disk or /dev/shm fails here (ENOSPC, a failed report) rather than
        # killing the worker with SIGBUS at a write to a page that cannot be had.
        os.posix_fallocate(self._fd, self.reserved, nbytes - self.reserved)
        # madvise maps pages about 15 % faster than a write per page (older kernels).
        for at in range(self.reserved, nbytes, _SLICE):
            stop = min(at + _SLICE, nbytes)
            if _MADVISE is None or _MADVISE(self.bytes.data_ptr() + at, stop - at, _MADV_POPULATE_WRITE) != 0:
                self.bytes[at:stop:_PAGE].zero_()  # one write per page maps it
        self.reserved = nbytes
        self._pin()

    def _pin(self) -> None:
        """Register every whole slice reserved so far with CUDA, one call per slice: one call for
        512 MiB held the engine thread's kernel launches for 21 ms, a slice at a time for 1.4 ms.
        A refused registration leaves the rest pageable (copies into them are just slower)."""
        if self._cudart is None or self._refused:
            return
        base = self.bytes.data_ptr()
        _pinned_files[base] = self
        while self.pinned + _SLICE <= self.reserved:
            if self._cudart.cudaHostRegister(base + self.pinned, _SLICE, _PORTABLE) != 0:
                self._cudart.cudaGetLastError()
                self._refused = True
                return
            self.pinned += _SLICE

    def region(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """The next ``nbytes`` (reserved now if they were not): their offset, and the bytes."""
        start = self.used
        self.reserve(start + nbytes)
        self.used = _round_up(start + nbytes, _PAGE)
        return start, self.bytes[start : start + nbytes]

    def watch(self, batch_fd: int) -> None:
        """A batch file with a region here was published: ``batch_fd`` is open on it, and kept
        (the file's link count tells when nobody can read the region any more)."""
        self._batches.append(batch_fd)

    def free(self) -> bool:
        """Whether nobody can read this file's regions any more: every batch file has lost all
        its names (its trace's folder removed, every reader's claim given back)."""
        if any(os.fstat(fd).st_nlink for fd in self._batches):
            return False
        self._forget_batches()
        return True

    def restart(self) -> None:
        """A new trace's, from the start; its reserved (and pinned) pages stay. Only once :meth:`free`."""
        if not self.free():
            raise RuntimeError(f"{self.path} still has readers")
        self.used = 0

    def _forget_batches(self) -> None:
        for fd in self._batches:
            os.close(fd)
        self._batches = []

    def close(self) -> None:
        """No more batches: give back reserved pages no region used. Tensors viewing the file keep
        its mapping until they are dropped."""
        self._forget_batches()
        if self.bytes is not None:
            base = self.bytes.data_ptr()
            _pinned_files.pop(base, None)
            for at in range(0, self.pinned, _SLICE):  # before truncating: CUDA holds those pages
                if self._cudart.cudaHostUnregister(base + at) != 0:
                    self._cudart.cudaGetLastError()  # not left for torch to raise at a later launch
            self.pinned = 0
            os.ftruncate(self._fd, self.used)
            os.close(self._fd)
            # The mapping goes when the last view of it does, in one munmap that would stall the
            # process's other threads for the whole used range (about 55 ms per 512 MiB). Letting
            # go of its pages here, in slices, leaves that munmap nothing to do; the data stays in
            # the file, and a view still in use maps its pages again.
            if _MADVISE is not None:
                for at in range(0, self.used, _SLICE):
                    _MADVISE(self.bytes.data_ptr() + at, min(_SLICE, self.used - at), _MADV_DONTNEED)
            self.bytes = None


def copy_to_host(out: torch.Tensor, rows: torch.Tensor, wait: bool = True) -> None:
    """``out.copy_(rows)`` from a GPU, waiting for it; into a data file's pinned slices, as one
    asynchronous copy per slice (CUDA refuses one copy across two registrations), which the
    caller waits for (on the current stream) when not ``wait``."""
    base, data = next(((base, data) for base, data in _pinned_files.items()
                       if base <= out.data_ptr() < base + data.pinned), (0, None))
    if data is None or not out.is_contiguous() or not rows.is_contiguous():
        out.copy_(rows)
        return
    into, src = out.view(-1).view(torch.uint8), rows.reshape(-1).view(torch.uint8)
    start = out.data_ptr() - base
    at = start
    while at < start + out.nbytes:
        stop = min(start + out.nbytes, (at // _SLICE + 1) * _SLICE if at < data.pinned else start + out.nbytes)
        into[at - start : stop - start].copy_(src[at - start : stop - start], non_blocking=at < data.pinned)
        at = stop
    if rows.is_cuda and wait:
        torch.cuda.current_stream(rows.device).synchronize()


class ReportFileWriter:
    """Writes one batch's header file into ``fd`` (an empty file the caller created and names); its
    saved rows go to a region of the trace's data file (``data()``, asked for only when the rows are
    more than :data:`ROWS_IN_HEADER`), which the caller tells of the file (:meth:`DataFile.watch`)."""

    def __init__(self, fd: int, data: Callable[[], DataFile] | None, folder: Path | None = None):
        """``folder``: where the header file will be (the data file is named relative to it)."""
        self._fd = fd
        self._data_file = data
        self.data: DataFile | None = None  # the data file holding the batch's rows, once allocated
        self._folder = folder
        self._region: tuple[int, int] = (0, 0)  # start and length in the data file; none yet
        self.reports: list[dict] | None = None  # set by finish()

    def allocate(self, specs: list[TensorSpec]) -> list[torch.Tensor]:
        """Uninitialised tensors in one region of the data file, one per ``(shape, dtype)``; call at
        most once, before :meth:`finish`. Tensors saved in the reports that are views of these are
        stored by reference."""
        if self._region[1] or self.reports is not None:
            raise RuntimeError("a report batch's region is allocated once, before finish()")
        offsets, end = [], 0
        for shape, dtype in specs:
            offsets.append(end)
            end += _round_up(math.prod(shape) * dtype.itemsize, _ALIGN)
        if end <= ROWS_IN_HEADER or self._data_file is None:  # pickled in the header
            # Fresh pageable memory: a copy from a GPU into it (copy_to_host) has finished when it
            # returns, so the header, written while copies into a region may still be moving,
            # pickles whole rows.
            return [torch.empty(tuple(shape), dtype=dtype) for shape, dtype in specs]
        self.data = self._data_file()
        start, region = self.data.region(end)
        self._region = (start, end)
        return [region[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(tuple(shape))
                for offset, (shape, dtype) in zip(offsets, specs)]

    @property
    def has_region(self) -> bool:
        """Whether the batch's rows went to a region of the data file."""
        return bool(self._region[1])

    def finish(self, reports: list[dict]) -> None:
        """Write the prefix (where the region is) and ``reports`` pickled as the header."""
        name = b""
        if self._region[1]:
            name = (os.path.relpath(self.data.path, self._folder) if self._folder else self.data.path.name).encode()
        with io.BufferedWriter(io.FileIO(self._fd, "wb", closefd=False), buffer_size=1 << 20) as out:
            out.write(_PREFIX.pack(_MAGIC, *self._region, len(name)) + name)
            _HeaderPickler(out, self.data.bytes if self._region[1] else None, *self._region).dump(reports)
        self.reports = reports


def read_report_file(path: Path) -> list[dict]:
    """The reports of a complete batch file; tensors of its region are views of one private
    (copy-on-write) mapping of it, which stays valid after the files are removed."""
    with open(path, "rb") as f:
        magic, start, length, name_len = _PREFIX.unpack(f.read(_PREFIX.size))
        if magic != _MAGIC:
            raise ValueError(f"{path} is not an interlace report file (prefix {magic!r})")
        # resolved now: the claim must stay reachable once the folder the name starts from is gone
        data = Path(os.path.normpath(path.parent / f.read(name_len).decode()))
        if not length:
            return _HeaderUnpickler(f, None).load()
        # The claim, before mapping: while it exists the rank writes none of the region again.
        claim = data.with_name(f"{data.name}.{path.name}-{os.getpid()}-{next(_claims)}.claim")
        os.link(path, claim)
        try:
            region = _map_private(data, start, length, claim)
        except BaseException:
            claim.unlink()
            raise
        return _HeaderUnpickler(f, region).load()


_claims = itertools.count()


def _map_private(path: Path, start: int, length: int, claim: Path) -> torch.Tensor:
    fd = os.open(path, os.O_RDONLY)
    try:
        region = mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
        # Once the folder is removed, whoever unmaps the file last frees its pages: about 65 ms
        # per 512 MiB of /dev/shm on a 2-core CPU, which was the caller's time wherever it dropped
        # a trace's results (a sweep's loop, a replica's event loop). A one-page mapping of the
        # file, unmapped on a thread of ours after the results are, takes that over.
        keeper = mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=start)
    finally:
        os.close(fd)
    _hold(region, keeper, claim)
    return torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive


_held: dict[Path, weakref.finalize] = {}  # this process's claims, until their regions are gone


def _hold(region: mmap.mmap, keeper: mmap.mmap, claim: Path) -> None:
    """Give back ``claim`` (and unmap ``keeper``) once ``region`` is gone."""
    done = weakref.finalize(region, _release, keeper, claim)
    # Called after the region's own unmapping; not at exit, where the system unmaps everything and
    # Python 3.12 refuses to start the thread (a traceback after a script that kept its results).
    done.atexit = False
    _held[claim] = done


def _release(keeper: mmap.mmap, claim: Path) -> None:
    _held.pop(claim, None)
    _unmap_later(keeper, claim)


_unmapping: "queue.SimpleQueue[tuple[mmap.mmap, Path]] | None" = None  # one thread serves it, from first use
# Finalizers run on whichever thread drops results, even one holding this lock (a collection there).
_unmapping_lock = threading.RLock()


def _unmap_later(keeper: mmap.mmap, claim: Path) -> None:
    """After a region's last view is gone: unmap its keeper and give back its claim, on a thread."""
    global _unmapping
    with _unmapping_lock:
        if _unmapping is None:
            _unmapping = queue.SimpleQueue()
            threading.Thread(target=_unmap_forever, args=(_unmapping,), name="interlace-unmap", daemon=True).start()
        _unmapping.put((keeper, claim))


def _unmap_forever(done: "queue.SimpleQueue[tuple[mmap.mmap, Path]]") -> None:
    while True:
        keeper, claim = done.get()
        keeper.close()
        claim.unlink(missing_ok=True)  # the rank may write the region again


_forks = itertools.count()
_for_child: dict[Path, Path] = {}  # claim -> the claim of the child being forked


def _before_fork() -> None:
    """A forked child (a data loader's worker, say) holds the parent's views too, and may read
    them after the parent has dropped its own: it gets claims of its own, made here in the parent
    while the parent still holds them (the parent may drop its own before the child runs a line).
    A child that ends without dropping them (through os._exit) leaves them: the rank then never
    writes those data files again."""
    _for_child.clear()
    for claim in _held.copy():  # a copy: a collection here may give claims back (_release)
        mine = claim.with_name(f"{claim.stem}-{os.getpid()}-fork{next(_forks)}.claim")
        try:
            os.link(claim, mine)
        except FileNotFoundError:  # given back meanwhile, or its sink's folder removed (no rank writes there)
            continue
        _for_child[claim] = mine


def _after_fork_in_parent() -> None:
    _for_child.clear()  # the child's now


def _after_fork_in_child() -> None:
    global _unmapping
    _unmapping = None  # no thread serves it here: the child's first drop starts one
    for claim, done in _held.copy().items():
        _held.pop(claim, None)
        held = done.detach()  # the parent's claim is the parent's to give back
        mine = _for_child.pop(claim, None)
        if held is not None and mine is not None:
            region, _release_it, (keeper, _claim), _kwargs = held
            _hold(region, keeper, mine)
    for mine in _for_child.values():  # a region gone before the fork: nothing to hold
        mine.unlink(missing_ok=True)
    _for_child.clear()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


class _HeaderPickler(pickle.Pickler):
    """Tensors inside the batch's region become references to it; any other tensor is pickled
    whole, and only its own bytes (a view of a large tensor would otherwise carry all of it), as
    its raw bytes (:func:`_inline_tensor`; torch's own pickling writes a zip archive per tensor,
    about 50 us each, which a server's one-invoke reports paid for every save).

    The check is in ``reducer_override``, which pickle skips for plain ints, strings, dicts, lists
    and tuples, not in ``persistent_id``, which it calls for every object: a 256-invoke report
    holds about 15,000 of them, and the header took about twice as long."""

    def __init__(self, file, data: torch.Tensor | None, start: int, length: int):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._data_ptr = data.data_ptr() if data is not None else None
        self._start, self._stop = start, start + length

    def reducer_override(self, obj: Any) -> Any:
        # Every dtype but the quantized ones goes as raw bytes: torch's own pickling cannot read
        # back uint16, uint32, uint64, complex32 or any float8 tensor (the driver failed the whole
        # trace with "UntypedStorage has no attribute 'dtype'", torch 2.13)
        if type(obj) is not torch.Tensor or not obj.is_cpu or obj.layout is not torch.strided:
            return NotImplemented
        if self._data_ptr is not None:  # a view of the region: its first byte lies in it
            offset = obj.data_ptr() - self._data_ptr
            if self._start <= offset < self._stop:
                return _region_view, (_dtype_name(obj.dtype), offset - self._start, tuple(obj.shape), obj.stride())
        if obj.requires_grad or obj.is_conj() or obj.is_neg() or obj.is_quantized:
            if obj.untyped_storage().nbytes() > obj.nbytes:
                return obj.clone().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
            return NotImplemented
        raw = obj.contiguous().view(-1).view(torch.uint8).numpy()  # its own bytes only, not a copy where contiguous
        return _inline_tensor, (_dtype_name(obj.dtype), tuple(obj.shape), pickle.PickleBuffer(raw))


def _inline_tensor(dtype: str, shape: tuple, raw: Any) -> torch.Tensor:
    """A tensor pickled in a header as its bytes (``raw``: a bytearray, which it keeps)."""
    if not len(raw):
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.frombuffer(raw, dtype=torch.uint8).view(getattr(torch, dtype)).view(shape)


def _region_view(dtype: str, offset: int, shape: tuple, stride: tuple) -> torch.Tensor:
    """Stands for a tensor of a batch's region in its header; only read_report_file, which maps
    the region, can make it (_HeaderUnpickler.find_class)."""
    raise pickle.UnpicklingError("a report file's tensors are read with its region (read_report_file)")


class _HeaderUnpickler(pickle.Unpickler):
    def __init__(self, file, data: torch.Tensor | None):
        super().__init__(file)
        self._data = data
        self._typed: dict[str, torch.Tensor] = {}  # the region viewed as each dtype

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == _region_view.__name__:
            if self._data is None:
                raise pickle.UnpicklingError("a tensor of a report file's region, in a batch without one")
            # Not a bound method: the unpickler's memo keeps what this returns, and a reference back
            # to the unpickler would keep the region mapped (and its claim alive) until a GC pass.
            return functools.partial(_view_of, self._data, self._typed)
        return super().find_class(module, name)


def _view_of(data: torch.Tensor, typed_views: dict[str, torch.Tensor], dtype: str, offset: int, shape: tuple,
             stride: tuple) -> torch.Tensor:
    typed = typed_views.get(dtype)
    if typed is None:
        typed = typed_views[dtype] = data.view(getattr(torch, dtype))
    return typed.as_strided(shape, stride, offset // typed.element_size())


def _round_up(nbytes: int, unit: int) -> int:
    return -(-nbytes // unit) * unit


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


_DTYPE_NAMES: dict[torch.dtype, str] = {}
