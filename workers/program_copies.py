"""Each invoke's own copy of its program: the Python state a program keeps is its invoke's.

A program keeps state across its steps in what it captured (``first = {}``, a global counter, a
tensor it accumulates into). The driver pickles a program object once per trace, and a rank
unpickles equal bytes once while any invoke needs them: so every invoke of a trace that passed the
same function ran one function object, and each saw the others' state (on the 2-core CPU a
counter kept in a captured dict read 1, 3, 5, 7 for one invoke and 2, 4, 6, 8 for the other). On a
cluster the same trace's invokes, split over replicas, saw other values; and two traces sending
equal bytes (a lab's shared script, through the endpoint) shared state across users.

So each invoke runs its own copy, as on an engine of its own, and the answer is the same on a
laptop and a cluster. Values meant to cross invokes go through ``m.share`` and ``send``/``recv``.
A batched program is one call per step for its trace's invokes: one copy per trace.

A copy is unpickled from the program's bytes as the rank first loaded it (made once per
program, before any invoke ran it), with its tensors kept apart: those of at most
:data:`COPIED_BYTES` are cloned into each copy (a vector it steers with, an accumulator), larger
ones (an SAE's or a probe's weights) are one tensor for every copy, moved to the model's device
once; long strings and bytes are shared too. A copy costs one unpickling of the program's code
and other objects, about 10 us for the bench's steering program on the 2-core CPU; a program
whose other objects are large (a tokenizer, a vocabulary dict: milliseconds to unpickle) is
copied once per trace instead (:data:`COPIED_PROGRAM_BYTES`), its invokes sharing that copy. A
program that cannot be pickled again on the rank (something its unpickling made, e.g. a lock)
runs as one object for every invoke and trace, as before.
"""

from __future__ import annotations

import collections
import io
import pickle
from copy import deepcopy
from typing import Any, Callable

import cloudpickle
import numpy as np
import torch

from interlace.workers.prologue import share_prologue

# Captured tensors (and numpy arrays) up to this size are each invoke's own; larger ones are shared.
COPIED_BYTES = 1 << 20
# Strings and bytes longer than this are shared (they cannot change): not unpickled per invoke.
SHARED_TEXT = 1 << 12
# A program whose other objects pickle to more than this (a tokenizer, a vocabulary dict: 13 ms to
# unpickle 50,000 entries on the 2-core CPU) is copied once per trace, not per invoke.
COPIED_PROGRAM_BYTES = 64 << 10


class Loaded:
    """The programs and ops a rank has loaded for its live invokes, each once per key (a sweep's
    shards share them), and dropped with the last invoke that uses it: a busy server never runs
    out of live invokes. Each invoke records the keys it holds in its ``keys`` list."""

    def __init__(self):
        self._ops: dict[str, list[dict]] = {}  # ops key -> the ops, points resolved
        self._programs: dict[str, ProgramCopies] = {}  # program key -> the program, copied per invoke
        self._per_trace: dict[str, Any] = {}  # trace/program key -> a batched or large program's copy
        self._users: collections.Counter[str] = collections.Counter()  # live invokes by key

    def ops(self, key: str, load: Callable[[], list[dict]], keys: list[str]) -> list[dict]:
        """The ops of ``key`` (``load()`` them if none are loaded), held for an invoke."""
        ops = self._ops.get(key)
        if ops is None:
            ops = self._ops[key] = load()
        self._hold(keys, key)
        return ops

    def program(self, key: str, trace: str, batched: bool, keys: list[str], load: Callable[[], Any]) -> Any:
        """An invoke's own copy of the program of ``key`` (``load()`` it if it is not loaded), or
        its trace's for a batched or large program, held for the invoke."""
        copies = self._programs.get(key)
        if copies is None:
            copies = self._programs[key] = ProgramCopies(load())
        if not (batched or copies.large):
            self._hold(keys, key)
            return copies.take()
        in_trace = f"{trace}/{key}"
        program = self._per_trace.get(in_trace)
        if program is None:
            program = self._per_trace[in_trace] = copies.take()
        self._hold(keys, key, in_trace)
        return program

    def _hold(self, keys: list[str], *held: str) -> None:
        keys += held
        self._users.update(held)

    def let_go(self, keys: list[str]) -> None:
        """An invoke is done with what it held: the last user of each drops it."""
        users = self._users
        for key in keys:
            users[key] -= 1
            if users[key] <= 0:
                del users[key]
                for loaded in (self._ops, self._programs, self._per_trace):
                    loaded.pop(key, None)

    def clear(self) -> None:
        self._users.clear()
        for loaded in (self._ops, self._programs, self._per_trace):
            loaded.clear()


class ProgramCopies:
    """One program as a rank loaded it, and a copy of it per :meth:`take`."""

    def __init__(self, program: Any):
        self.program = program
        self._given = False  # the first take gets the loaded program itself
        self._arrays: list[Any] = []
        buffer = io.BytesIO()
        try:
            _Apart(buffer, self._arrays).dump(program)
            self._bytes: bytes | None = buffer.getvalue()
        except Exception:  # noqa: BLE001 - not picklable again here: every invoke shares it
            self._bytes = None
        self.large = self._bytes is None or len(self._bytes) > COPIED_PROGRAM_BYTES  # copied per trace

    def take(self) -> Any:
        """A copy of the program for one invoke (or one trace, see :class:`Loaded`)."""
        if not self._given or self._bytes is None:
            self._given = True
            return self.program
        try:
            copy = _Together(io.BytesIO(self._bytes), self._arrays).load()
        except Exception:  # noqa: BLE001 - its objects rebuild only once (a reconstructor with side effects)
            self._bytes, self.large = None, True  # shared from now on, as before copies
            return self.program
        share_prologue(copy, self.program)
        return copy


class _Apart(cloudpickle.Pickler):
    """Pickles a program with its tensors and arrays by reference (an index into ``arrays``)."""

    def __init__(self, file, arrays: list[Any]):
        super().__init__(file, protocol=cloudpickle.DEFAULT_PROTOCOL)
        self._arrays = arrays
        self._ids: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:
        if not isinstance(obj, (torch.Tensor, np.ndarray)) and not (
                isinstance(obj, (str, bytes)) and len(obj) > SHARED_TEXT):
            return None
        index = self._ids.get(id(obj))
        if index is None:
            index = self._ids[id(obj)] = len(self._arrays)
            self._arrays.append(obj)
        return index


class _Together(pickle.Unpickler):
    """Unpickles :class:`_Apart`'s bytes: small tensors and arrays cloned, large ones shared."""

    def __init__(self, file, arrays: list[Any]):
        super().__init__(file)
        self._arrays = arrays
        self._copies: dict[int, Any] = {}  # one copy of an array the program holds twice

    def persistent_load(self, index: int) -> Any:
        value = self._arrays[index]
        if isinstance(value, (str, bytes)) or value.nbytes > COPIED_BYTES:  # (text cannot change)
            return value
        copy = self._copies.get(index)
        if copy is None:
            if type(value) is torch.Tensor:
                copy = value.clone()
            elif isinstance(value, np.ndarray):
                copy = value.copy()
            else:  # a tensor subclass (an nn.Parameter of a captured module)
                copy = deepcopy(value)
            self._copies[index] = copy
        return copy
