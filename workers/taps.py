"""Graph taps: declarative ops at declared points, run inside a compiled engine's CUDA graphs.

Hooks never run in a captured CUDA graph or a compiled forward, so on a compiled engine a step
whose ops act at ordinary points runs eager (graphs.py). A *tap* is a point declared in the engine
config (``ModelConfig.graph_taps``) that vLLM builds into the model before it compiles it
(:func:`install`, called at model load by the plugin in plugin.py):

    layers.3.resid          a decoder layer's residual stream: the layer's forward ends in the
                            custom op ``interlace::tap`` on its (hidden, residual)
    layers.3.mlp.output     the output of a decoder layer's direct child (mlp, self_attn), where
                            it is whole on every tensor-parallel rank: the child's forward ends in
                            ``interlace::tap_output``

torch.compile traces these ops into the graph like any other op and CUDA graphs capture them. The
ops take what to do from persistent device buffers that the host fills before each step, so one
captured graph serves every step:

    for each row r of the step's flat batch, with s the tapped value (resid: hidden + residual):
        edited[r] == 0      the row is left as it is (every row of a step without ops)
        sets[r]             s' = vectors[row[r]]                   (replace; zero: row 0)
        otherwise           s' = s * mul[r] + vectors[row[r]]      (add: mul 1; scale: row 0)
        saved[r]            s' if after[r] else s                  (a save after, or before, the edit)

An edited resid row gets hidden = s' and residual = 0, which is what the hook path writes (see
points.PointAccess.write), and every formula above rounds as the hook path's ops do, so both paths
give the same numbers. A step runs its ops through taps only when every intervened request in it
can be tapped (:meth:`Taps.can_run`): no program, every op at a declared tap, at most one editing
op per tap (saves before or after it), and a vector (for add and replace) of the hidden size.
Every other step runs eager with hooks, as on an engine without taps, and is counted as such.

The ops are ``torch.library`` custom ops that read buffers by tap number from this process's
:class:`Taps`, the way vLLM's attention ops find their layer by name: passing the buffers as
arguments would make torch.compile functionalize their writes (a copy of every buffer per step).
"""

from __future__ import annotations

import functools
import operator
import re
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from interlace.workers.points import ModuleTree, device_index
from interlace.workers.saves import TraceOwners
from interlace.workers.tensor_parallel import ends_in_reduction

_TAPS: "Taps | None" = None  # this process's taps (one model per vLLM worker process)
_EDITED, _MUL, _ROW, _SETS, _AFTER = range(5)  # the columns of a tap's control rows
_IDLE, _SAVES, _EDITS = range(3)  # what a step asks of a tap: nothing, saves only, an edit (saves or not)
EDITING = ("add", "scale", "replace", "zero")


@torch.library.custom_op("interlace::tap", mutates_args=("hidden", "residual"))
def tap(hidden: torch.Tensor, residual: torch.Tensor, index: int) -> None:
    """A tapped decoder layer's (hidden, residual), edited in place by the step's ops and programs."""
    _TAPS.run(hidden, residual, index)


@tap.register_fake
def _(hidden: torch.Tensor, residual: torch.Tensor, index: int) -> None:
    return None


@torch.library.custom_op("interlace::tap_output", mutates_args=("value",))
def tap_output(value: torch.Tensor, index: int) -> None:
    """A tapped module's output, edited in place by the step's ops and programs."""
    _TAPS.run_output(value, index)


@tap_output.register_fake
def _(value: torch.Tensor, index: int) -> None:
    return None


# The ops split vLLM's compiled graph (engine.py adds them to compilation_config.splitting_ops), so
# between CUDA-graph pieces vLLM calls their Python on every PIECEWISE replay and eager step, as it
# does attention. That is where programs run on a compiled engine. A splitting op's outputs would
# get a fresh address each step while the next piece replays against the address it captured, so
# the ops return nothing and write in place, as vLLM's own attention op does into its output buffer.
# Their names: plugin.SPLITTING_OPS.


class Taps:
    """The tapped layers of one model and the device buffers their ops read."""

    def __init__(self, local: list[str], declared: set[tuple[str, str]], hidden_size: int, max_tokens: int,
                 max_vectors: int, dtype: torch.dtype, device: torch.device, graph_rows: int | None = None):
        self.index = {name: i for i, name in enumerate(local)}  # this stage's tapped modules -> tap number
        self.modules = list(local)
        # Set by the interleaver for a step whose programs run at the taps (between graph pieces):
        # called with (module, live value) at each tap; ``served`` counts the calls, so a step that
        # never reached them (an op not split out of the graph) fails instead of passing silently.
        self.serve = None
        self.served = 0
        # FULL graphs cut at the taps (tap_graphs.py): whether this engine captures them, the
        # capture under way (its breaks record the tap's Python), and the graphs by batch descriptor.
        self.breaks_graphs = False
        self.breaking = None
        self.broken: dict = {}
        # FULL graphs captured with every tap idle (no kernel at all), for steps that ask nothing
        # of the taps (tap_graphs.py): ``idling`` while they are captured, then by batch descriptor.
        self.idling = False
        self.idle: dict = {}
        self.declared = declared  # every stage's (module, kind): each stage decides alike from the same ops
        self.max_tokens = max_tokens
        shape = (max_tokens, len(local), 5)  # rows first: a step copies only its own rows
        self.control = torch.zeros(shape, dtype=torch.float32, device=device)
        self._clear = np.zeros(shape[1:], dtype=np.float32)  # a row with nothing to do
        self._clear[:, _MUL] = 1.0
        self._clear_rows(0, max_tokens)
        self.vectors = torch.zeros(max_vectors, hidden_size, dtype=dtype, device=device)  # row 0: zeros
        # Saves land in fixed rows only in forwards a graph captures: no more rows than the largest
        # capture (512 tokens by default). A buffer of every tap x the scheduler's whole budget took
        # 80 x 8,192 x 8,192 bf16 = 10 GiB per GPU at the 70B shape (taken from the KV cache), and a
        # second engine beside plain vLLM found no memory left for its cache (four H200s, 2026-11-28).
        # A wider forward runs the ops' Python every time, and saves into rows of its own (wide).
        graph_rows = min(max_tokens, graph_rows or max_tokens)
        self.saved = torch.zeros(len(local), graph_rows, hidden_size, dtype=dtype, device=device)
        self.wide: dict[int, torch.Tensor] = {}  # tap number -> this step's saves, in a forward wider than saved
        self.ran = torch.zeros(len(local), dtype=torch.int64, device=device)  # forwards that ran each tap's ops
        self.hidden_size = hidden_size
        self._on_gpu = device.type == "cuda"
        # On a GPU each tap call is one kernel (tap_kernels.py) that reads what the step asks of its
        # tap from ``asked`` (set with the control rows), so a graph replayed for ops at a few taps
        # pays one launch, and no work, at each of the others.
        self.asked = torch.zeros(len(local), dtype=torch.int32, device=device)
        self._asked_on_device = False  # some entry of self.asked may be set
        self.kernel = _tap_kernel() if self._on_gpu else None
        self._dirty = 0  # rows of self.control that may hold a step's settings
        self._current: _Staged | None = None  # the staged rows self.control holds
        self._asked = [_IDLE] * len(local)  # what this step asks of each tap (a forward no graph captures reads it)
        self._vector_rows: dict[str, list[int]] = {}  # op key -> [row, holders]
        self._free_rows = list(range(max_vectors - 1, 0, -1))

    # --- in the forward (captured once per graph; the buffers decide each replay) ----------------

    def wanted(self) -> bool:
        """Whether this forward runs the tap op: always where it is compiled or captured (the graph
        serves every later step), and in an eager forward only when this step set some rows, so
        an eager step of a program pays nothing for the taps."""
        return (torch.compiler.is_compiling() or self._dirty > 0 or self.serve is not None
                or (self._on_gpu and torch.cuda.is_current_stream_capturing()))

    def run(self, hidden: torch.Tensor, residual: torch.Tensor, index: int) -> None:
        asked = self._work(hidden, index)
        if asked != _IDLE and self.kernel is not None and self.kernel.usable(hidden, residual):
            self.kernel.run(hidden, residual, self.control, index, self.asked, self.vectors,
                            self._saves_of(index, hidden.shape[0]), self.ran)
        elif asked == _SAVES:  # the stream as the full path below computes it for rows it leaves alone
            torch.add(hidden, residual, out=self._saves_of(index, hidden.shape[0]))
            self.ran[index] += 1
        elif asked == _EDITS:
            keep, edit = self._apply(hidden + residual, index)
            hidden.copy_(torch.where(keep, hidden, edit))
            residual.masked_fill_(~keep, 0)
        if self.breaking is not None:
            self._break(index, (hidden, residual))
        elif self.serve is not None:
            self._serve(index, (hidden, residual))

    def run_output(self, value: torch.Tensor, index: int) -> None:
        asked = self._work(value, index)
        if asked != _IDLE and self.kernel is not None and self.kernel.usable(value):
            self.kernel.run(value, None, self.control, index, self.asked, self.vectors,
                            self._saves_of(index, value.shape[0]), self.ran)
        elif asked == _SAVES:
            self._saves_of(index, value.shape[0]).copy_(value)
            self.ran[index] += 1
        elif asked == _EDITS:
            keep, edit = self._apply(value, index)
            value.copy_(torch.where(keep, value, edit))
        if self.breaking is not None:
            self._break(index, value)
        elif self.serve is not None:
            self._serve(index, value)

    def _serve(self, index: int, value) -> None:
        """Hand the live value to the step's programs and ops (the interleaver's dispatch), which
        write into it in place; never while a graph is captured (a capture has no step)."""
        if not (self._on_gpu and torch.cuda.is_current_stream_capturing()):
            self.served += 1
            self.serve(self.modules[index], value)

    def _break(self, index: int, value) -> None:
        """In the capture of a FULL graph cut at the taps (tap_graphs.py): end the segment here,
        and record a call of the step's programs on the tensors at these addresses, which every
        replay of the segments before writes (weak references: the graph pool owns them)."""
        from vllm.utils.torch_utils import weak_ref_tensor

        weak = tuple(map(weak_ref_tensor, value)) if isinstance(value, tuple) else weak_ref_tensor(value)
        self.breaking.add_eager(functools.partial(self._at_break, self.modules[index], weak))

    def _at_break(self, module: str, value) -> None:
        if self.serve is not None:
            self.served += 1
            self.serve(module, value)

    def _work(self, stream: torch.Tensor, index: int) -> int:
        """What this call of a tap op must do. A captured graph serves every later step, so a
        capture does everything. Elsewhere the op runs only in forwards that no graph captures
        (vLLM runs batches past its largest capture size, 512 tokens by default, and large
        prefills through the compiled code without a graph, calling this op's Python each time),
        and does only what the step asks of this tap: nothing, saves, or the whole path. On one
        H200, plain traffic of 1,024 prompts ran at 0.80x plain vLLM with 5 taps doing their whole
        work in such forwards, at 1.02x with no taps declared, and at 1.08x once taps with nothing
        asked only copied their inputs (bench/none_probe.py, 2026-11-26). Rows past the
        scheduler's budget are no step's: no op selects them."""
        if stream.shape[0] > self.max_tokens:
            return _IDLE
        if self._on_gpu and torch.cuda.is_current_stream_capturing():
            return _IDLE if self.idling else _EDITS
        return self._asked[index]

    def _apply(self, stream: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Which rows of ``stream`` stay as they are, and what the edited ones become; saves each
        row, before or after its edit, into the tap's buffer."""
        n = stream.shape[0]
        control = self.control[:n, index]
        vector = self.vectors.index_select(0, control[:, _ROW].long())
        edit = torch.where(control[:, _SETS, None] != 0, vector,
                           (stream * control[:, _MUL, None] + vector).to(stream.dtype))
        keep = control[:, _EDITED, None] == 0
        after = torch.where(keep, stream, edit)
        self._saves_of(index, n).copy_(torch.where(control[:, _AFTER, None] != 0, after, stream))
        self.ran[index] += 1
        return keep, edit

    def _saves_of(self, index: int, n: int) -> torch.Tensor:
        """Where this forward's saves at tap ``index`` go: the fixed rows a graph captures, or in a
        forward wider than any graph, rows of its own, kept until the next step's (fill, clear)."""
        if n <= self.saved.shape[1]:
            return self.saved[index, :n]
        if self._on_gpu and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"a graph of {n} tokens captured past the taps' {self.saved.shape[1]} saved rows")
        wide = self.wide[index] = torch.empty(n, self.hidden_size, dtype=self.saved.dtype, device=self.saved.device)
        return wide

    # --- on the host, per request ---------------------------------------------------------------

    def can_run(self, ops: list[dict]) -> bool:
        """Whether an invoke with no program and these ops (each with its resolved ``_point``)
        can run its ops through taps. Every op counts, whichever stage runs it, so every pipeline
        stage and TP rank takes the same decision (their forwards must agree on graph or eager)."""
        edits: dict[str, int] = {}
        saves_after: dict[str, set] = {}
        for op in ops:
            point = op.get("_point")
            if point is None or (point.module, point.kind) not in self.declared:
                return False
            if op["op"] in EDITING:
                if point.module in edits or not self._fits(op):
                    return False
                edits[point.module] = 1
            else:
                saves_after.setdefault(point.module, set()).add(point.module in edits)
        # a tap saves a row from one place: before the row's edit or after it, not both
        return all(len(places) == 1 for places in saves_after.values())

    def _fits(self, op: dict) -> bool:
        value = op.get("value")
        if op["op"] in ("add", "replace"):
            return isinstance(value, torch.Tensor) and value.numel() in (1, self.hidden_size) and value.dim() <= 1
        return True

    def hold(self, op: dict) -> bool:
        """Keep a vector row for an add or replace op while an invoke carrying it lives; False
        when every row is taken."""
        if op["op"] not in ("add", "replace"):
            return True
        entry = self._vector_rows.get(op["key"])
        if entry is None:
            if not self._free_rows:
                return False
            entry = self._vector_rows[op["key"]] = [self._free_rows.pop(), 0]
            value = op["value"].reshape(-1).to(self.vectors.device, self.vectors.dtype)
            self.vectors[entry[0]].copy_(value.expand(self.hidden_size))
        entry[1] += 1
        return True

    def let_go(self, op: dict) -> None:
        entry = self._vector_rows.get(op["key"]) if op["op"] in ("add", "replace") else None
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self._free_rows.append(self._vector_rows.pop(op["key"])[0])

    def save_groups(self, tapped: list) -> list["TappedSaves"]:
        """The step's saves that ran in taps (the interleaver's (point, StepOp) list), grouped so
        that each group is one gather from :attr:`saved` per step: saves of the same rows first
        (a sweep saving 4 layers' last token), then those groups that save the same taps under
        the same names, whatever their trace (a server's one-invoke traces, each saving the last
        token of one layer: one gather and one ledger entry per step for all of them, where a
        group each cost 64 of both at every step). Made once per epoch of decoding (the plans
        keep their StepOps for it)."""
        by_rows: dict[tuple[bytes, ...], list] = {}
        for entry in tapped:  # a plan's invokes belong to one trace
            step_op = entry[1]
            key = tuple(a.tobytes() for a in (step_op.slots, step_op.rows, step_op.starts, step_op.stops))
            by_rows.setdefault(key, []).append(entry)
        # An invoke's rows under one name are its saves' in the order made: a name saved in two
        # groups of one trace (different rows) keeps that order only if nothing is regrouped.
        names = [{(m[1].invokes[0].trace, _name(m[1].op)) for m in members} for members in by_rows.values()]
        if sum(map(len, names)) != len(set().union(*names)):
            return [TappedSaves([[entry]], self) for entry in tapped]
        # Each (trace, name) is in one group now, so groups merged by what they save hold
        # distinct invokes: each invoke's rows are in one part of the merged gather.
        by_taps: dict[tuple, list[list]] = {}
        for members in by_rows.values():
            signature = tuple((point.module, _name(step_op.op)) for point, step_op in members)
            by_taps.setdefault(signature, []).append(members)
        return [TappedSaves(parts, self) for parts in by_taps.values()]

    # --- on the host, per step ------------------------------------------------------------------

    def fill(self, ops_by_hook: dict, memo: dict) -> None:
        """Set this step's control rows from its ops (the interleaver's per-hook lists of
        (point, StepOp), each list in its invokes' order) and copy them to the device.

        The rows are staged on the host once per epoch, kept in the epoch's ``memo`` (the
        interleaver's, as the plans keep their StepOps for an epoch of decoding), in a pinned
        buffer of their own, so a later step of the epoch only copies
        them again, and only if another batch's rows were copied since (under pipeline
        parallelism vLLM's batches in flight take turns). Nothing here waits for the GPU: torch
        reuses a pinned block only once the copies from it have run."""
        self.wide = {}
        step_ops = [step_op for at_hook in ops_by_hook.values() for _point, step_op in at_hook]
        staged = memo.get("tap rows")
        if staged is None or len(step_ops) != len(staged.step_ops) or not all(map(operator.is_, step_ops, staged.step_ops)):
            staged = memo["tap rows"] = self._stage(ops_by_hook, step_ops)
        self._asked = staged.asked
        if staged is self._current:
            return  # the device rows are these already (one batch decoding)
        if staged.used:
            self.control[: staged.used].copy_(staged.rows, non_blocking=True)
        self.asked.copy_(staged.asked_rows, non_blocking=True)
        self._asked_on_device = True
        if self._dirty > staged.used:  # the last step's rows past this one's
            self._clear_rows(staged.used, self._dirty)
        self._dirty, self._current = staged.used, staged

    def _stage(self, ops_by_hook: dict, step_ops: list) -> "_Staged":
        used = max((int(step_op.rows.max()) + 1 for step_op in step_ops if len(step_op.rows)), default=0)
        rows = torch.empty((used, *self._clear.shape), dtype=torch.float32, pin_memory=self._on_gpu)
        host = rows.numpy()
        host[:] = self._clear
        asked = [_IDLE] * len(self._asked)
        for (module, _family), at_hook in ops_by_hook.items():
            index = self.index[module]
            for _point, step_op in at_hook:
                rows_of, op = step_op.rows, step_op.op
                kind = op["op"]
                if len(rows_of):
                    asked[index] = max(asked[index], _SAVES if kind == "save" else _EDITS)
                if kind == "save":  # after its own invoke's edit, if that came first (can_run)
                    host[rows_of, index, _AFTER] = host[rows_of, index, _EDITED]
                    continue
                host[rows_of, index, _EDITED] = 1.0
                if kind == "scale":
                    host[rows_of, index, _MUL] = float(op["value"])
                elif kind in ("add", "replace"):
                    host[rows_of, index, _ROW] = self._vector_rows[op["key"]][0]
                host[rows_of, index, _SETS] = 1.0 if kind in ("replace", "zero") else 0.0
        asked_rows = torch.tensor(asked, dtype=torch.int32).pin_memory() if self._on_gpu else torch.tensor(asked, dtype=torch.int32)
        return _Staged(step_ops, rows, used, asked, asked_rows)

    def clear(self) -> None:
        """Before a step without tapped ops: no row keeps the last one's settings."""
        self._asked, self._current, self.wide = [_IDLE] * len(self._asked), None, {}
        if self._asked_on_device:
            self.asked.zero_()
            self._asked_on_device = False
        if self._dirty:
            self._clear_rows(0, self._dirty)
            self._dirty = 0

    def _clear_rows(self, start: int, stop: int) -> None:
        """Clear control rows on the device, in stream order (no copy from the host to wait for)."""
        rows = self.control[start:stop]
        rows.zero_()
        rows[:, :, _MUL] = 1.0


@dataclass
class _Staged:
    """One epoch's control rows on the host (pinned on a GPU), as :meth:`Taps.fill` set them."""

    step_ops: list  # the StepOps they were set from
    rows: torch.Tensor  # [used, taps, 5]
    used: int  # rows 0..used-1 of the step's flat batch (every later row is clear)
    asked: list[int]  # what the step asks of each tap
    asked_rows: torch.Tensor  # the same on the host for Taps.asked (pinned on a GPU)


class TappedSaves:
    """Saves that select the same rows at the same taps under the same names, for the invokes of
    one or more groups (``parts``, each a list of (point, StepOp) with the same rows, in the
    same order of taps): one gather per step, and one entry in the save ledger.

    ``gather`` returns one fresh tensor per save (views of one [saves, rows, hidden] copy, or in a
    forward wider than any graph one copy per save), in the order given; invoke i of
    :attr:`invokes` owns rows ``starts[i]:stops[i]`` of each. :attr:`traces` is None when every
    invoke is of one trace, else which trace each invoke is of (the save ledger hands rows out
    by trace)."""

    def __init__(self, parts: list[list], taps: Taps):
        firsts = [members[0][1] for members in parts]
        self.invokes = [state for step_op in firsts for state in step_op.invokes]
        self.slots = np.concatenate([step_op.slots for step_op in firsts])
        offsets = np.cumsum([0] + [len(step_op.rows) for step_op in firsts[:-1]])
        self.starts = np.concatenate([step_op.starts + offset for step_op, offset in zip(firsts, offsets)])
        self.stops = np.concatenate([step_op.stops + offset for step_op, offset in zip(firsts, offsets)])
        rows = np.concatenate([step_op.rows for step_op in firsts])
        members = parts[0]
        self.names = [_name(step_op.op) for _point, step_op in members]
        self.where = ", ".join(sorted({str(point) for point, _step_op in members}))
        self.traces = TraceOwners.of([state.trace for state in self.invokes])
        taps_of = np.array([taps.index[point.module] for point, _step_op in members], dtype=np.int64)
        self.taps_of = taps_of.tolist()
        flat = (taps_of[:, None] * taps.saved.shape[1] + rows[None, :]).reshape(-1)  # rows of saved as [taps*tokens, hidden]
        self.index = device_index(torch.from_numpy(flat), taps.saved.device)  # a blocking copy would wait for the GPU
        self.rows = device_index(torch.from_numpy(rows), taps.saved.device)  # of a wide forward's saves
        self.shape = (len(members), len(rows), taps.hidden_size)
        self.steps_saved = 0  # steps this group saved at (from the second on, into a run: SaveLedger.run_rows)
        self._scratch: torch.Tensor | None = None  # one step's rows on their way into a run

    def gather(self, taps: Taps) -> list[torch.Tensor]:
        with torch.inference_mode(False):  # normal tensors, as the hook path's saves are
            if taps.wide:
                return [taps.wide[tap].index_select(0, self.rows) for tap in self.taps_of]
            saved = taps.saved
            rows = saved.view(-1, saved.shape[-1]).index_select(0, self.index).view(self.shape)
        return list(rows.unbind(0))

    def gather_into(self, taps: Taps, into: torch.Tensor) -> None:
        """This step's rows into ``into`` (``[saves, rows, hidden]``, a run's step: strided across
        saves), through a buffer of the group's own (index_select writes only contiguous rows;
        the next step's gather is queued behind this copy, so reusing it is safe)."""
        saved = taps.saved
        if self._scratch is None:
            with torch.inference_mode(False):
                self._scratch = torch.empty(len(self.index), saved.shape[-1], dtype=saved.dtype, device=saved.device)
        torch.index_select(saved.view(-1, saved.shape[-1]), 0, self.index, out=self._scratch)
        into.copy_(self._scratch.view(self.shape))


def _tap_kernel():
    """tap_kernels (Triton), where this process can import it; else None (the torch path)."""
    try:
        from interlace.workers import tap_kernels  # imports Triton, which a CPU build may lack
    except ImportError:
        return None
    return tap_kernels


def _name(op: dict) -> str:
    return op.get("name") or op["point"]


def install(model: nn.Module, specs: list[str] | str, max_tokens: int, max_vectors: int, dtype: torch.dtype,
            graph_rows: int | None = None) -> Taps:
    """Tap the points named by ``specs`` (``"layers.3.resid"``, ``"layers.3.mlp.output"``, or
    ``"resid"``/``"all"`` for every layer's) before vLLM compiles the model: each tapped module
    becomes an instance of a subclass whose forward ends in a tap op. Points another pipeline stage
    runs are declared (every stage decides alike) but not tapped here."""
    global _TAPS

    tree = ModuleTree(model)
    if isinstance(specs, str):
        specs = every_layer(tree, specs)
    hidden_size = model.config.hidden_size if hasattr(model, "config") else _hidden_size(model)
    declared: list[tuple[str, str]] = []
    for spec in specs:
        point = _tap_point(tree, spec)
        if point not in declared:
            declared.append(point)
    local = [(module, kind) for module, kind in declared if tree.modules.get(module) is not None]  # this stage's
    device = next(p for p in model.parameters() if p.is_floating_point()).device
    taps = Taps([module for module, _kind in local], set(declared), hidden_size, max_tokens, max_vectors, dtype, device,
                graph_rows)
    for module, kind in local:
        tapped = tree.modules[module]
        tapped.__class__ = _tapped_class(type(tapped), kind)
        tapped._interlace_tap = taps.index[module]
    _TAPS = taps
    model._interlace_taps = taps
    return taps


def every_layer(tree: ModuleTree, which: str) -> list[str]:
    """Every decoder layer's resid tap (``which="resid"``), or its resid, attention and MLP
    output taps (``"all"``), by the names of the whole model (other stages' layers included)."""
    layers = sorted((name for name in tree.modules if tree.is_layer(name)), key=lambda n: int(n.rsplit(".", 1)[1]))
    specs = [f"{layer}.resid" for layer in layers]
    if which == "all":
        local = next((layer for layer in layers if tree.modules[layer] is not None), None)
        children = [child for child in ("self_attn", "mlp") if local is not None and f"{local}.{child}" in tree.modules]
        specs += [f"{layer}.{child}.output" for layer in layers for child in children]
    elif which != "resid":
        raise ValueError(f"graph_taps {which!r}: a list of taps, 'resid' or 'all'")
    return specs


# As cluster/config.py checks graph_taps: a layer's resid, or a direct child's output.
_TAP = re.compile(r"(?P<layer>(?:model\.)?layers\.\d+)(?P<child>\.[A-Za-z_]\w*)?\.(?P<kind>resid|output)")
TAP_FORMS = "a decoder layer's residual stream ('layers.3.resid') or the output of its mlp or attention ('layers.3.mlp.output')"


def _tap_point(tree, spec: str) -> tuple[str, str]:
    """The (module, kind) a tap spec names; raises for a point that cannot be a tap."""
    match = _TAP.fullmatch(spec)
    if match is None or (match["kind"] == "resid") != (match["child"] is None):
        raise ValueError(f"graph tap {spec!r}: a tap is {TAP_FORMS}")
    kind, child = match["kind"], match["child"] or ""
    layer = tree.resolve(match["layer"])
    if kind == "resid" or tree.modules[layer] is None:  # a layer another pipeline stage runs: it checks
        return layer + child, kind
    try:
        module = tree.resolve(layer + child)
    except AttributeError as exc:  # a typo: the message lists the layer's children
        raise ValueError(f"graph tap {spec!r}: {exc}") from None
    if not ends_in_reduction(tree.modules, module):
        raise ValueError(f"graph tap {spec!r}: {type(tree.modules[module]).__name__} is not an attention or MLP block "
                         f"(one that ends in a reduced row-parallel layer, so its output is whole on every "
                         f"tensor-parallel rank); a tap is {TAP_FORMS}")
    return module, kind


_TAPPED: dict[tuple[type, str], type] = {}


def _tapped_class(cls: type, kind: str) -> type:
    """``cls`` with a forward that ends in the tap op for ``kind`` (made once per class and kind)."""
    if (cls, kind) not in _TAPPED:
        inner = cls.forward

        def forward_resid(self, *args, **kwargs):
            out = inner(self, *args, **kwargs)
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(f"graph taps need decoder layers that return (hidden, residual); {cls.__name__} "
                                "returns something else: leave graph_taps out for this model")
            hidden, residual = out
            if _TAPS.wanted():
                torch.ops.interlace.tap(hidden, residual, self._interlace_tap)
            return hidden, residual

        def forward_output(self, *args, **kwargs):
            out = inner(self, *args, **kwargs)
            if not (isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[-1] == _TAPS.hidden_size):
                raise TypeError(f"a graph tap at an output needs a [tokens, hidden] tensor; {cls.__name__} returns "
                                "something else: tap another point")
            if _TAPS.wanted():
                torch.ops.interlace.tap_output(out, self._interlace_tap)
            return out

        forward = forward_resid if kind == "resid" else forward_output
        _TAPPED[cls, kind] = type(f"Tapped{cls.__name__}", (cls,), {"forward": forward, "__module__": cls.__module__})
    return _TAPPED[cls, kind]


def _hidden_size(model: nn.Module) -> int:
    embed = next(m for name, m in model.named_modules() if name.endswith("embed_tokens"))
    return embed.embedding_dim
