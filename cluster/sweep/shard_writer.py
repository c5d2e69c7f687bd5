"""A sweep's shards, run and written where the engine runs (inside a Ray Data actor).

:class:`ShardRunner` is the batch function of a sweep's ``map_batches``: each actor of the pool
hosts one engine replica in its own process (the same :class:`~interlace.cluster.replica.Replica`
the cluster's actors wrap, driven through its ``run_here``), turns one shard of prompts into one
trace on it, and writes the shard's files itself, so saved tensors go from the workers' reports
to disk on this node and never through the driver. The driver only gets a small record back.

Files of shard k in a local output folder, each written under a temporary name and renamed into
place, in this order (an object-store output names the first two per attempt instead, since it
cannot rename: see :mod:`interlace.cluster.sweep.store`):

- ``shard-0000k.safetensors``: every save name's rows concatenated over the shard's prompts (in
  prompt id order), plus the shard's partial trace-shared values under ``__shared__/<name>``;
- ``shard-0000k.parquet``: the index, one row per prompt (:data:`INDEX_COLUMNS`, then
  ``<name>.offset`` / ``<name>.length`` rows per save name);
- ``shard-0000k.json``: the shard's record. Its rename is the commit: a shard is done iff its
  record exists and names files of the recorded sizes, so a shard re-run after a crash writes the
  same names over whatever an interrupted attempt left.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from interlace.core.merge import merge_values
from interlace.cluster.replica import Replica
from interlace.cluster.sweep.store import SweepStore, attempt_stem, without_secret
from interlace.cluster.sweep.tensor_file import joined_shape, storable
from interlace.core.trace import Invoke, check_ops, encode_payloads
from interlace.core.wire import ShardTask, printed_text
from interlace.workers.points import ModuleTree

SHARED_PREFIX = "__shared__/"
SHARED_META = "interlace.shared"
INDEX_COLUMNS = ("prompt_id", "source_row", "shard", "prompt", "prompt_token_ids", "token_ids", "text",
                 "prompt_tokens", "error", "printed")


def shard_stem(shard: int) -> str:
    return f"shard-{shard:05d}"


@dataclass
class PromptRow:
    """One input row: its place in the sweep and its prompt, or why it cannot run."""

    prompt_id: int  # position in the sweep (after shuffle and limit); fixes its shard
    source_row: int  # row number in the input files, in file order
    prompt: str | list[int] | None
    problem: str | None = None  # a malformed row: reported in the index, never run


@dataclass
class RunPlan:
    """What every shard runner needs, cloudpickled once by the driver (programs by value)."""

    sweep_id: str
    output: str
    model: dict  # ModelConfig fields
    program: Callable | None
    steps: list[int] | None
    ops: list[dict]
    settings: dict  # SamplingParams fields
    timeout_s: float
    max_save_bytes: int
    engine_overrides: dict = field(default_factory=dict)


@dataclass
class Outcome:
    """One prompt after its run: its completion, saves, shared contributions, error."""

    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    saves: dict[str, Any] = field(default_factory=dict)
    shared: list[tuple] = field(default_factory=list)
    error: str | None = None
    prompt_tokens: int | None = None
    printed: str | None = None  # what its program printed


class ShardRunner:
    """Ray Data batch function (a callable class): batches of ``{"shard", "rows"}`` in, one record
    per shard out. Hosts one engine; shards may arrive from several threads at once."""

    def __init__(self, plan: bytes):
        import cloudpickle

        self.plan: RunPlan = cloudpickle.loads(plan)
        self.out = SweepStore(self.plan.output)
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="interlace-sweep", daemon=True).start()
        slot = os.environ.get("INTERLACE_SWEEP_SLOT", "0")  # fixed per pool slot: a restart cleans its folder
        self.replica = Replica(self.plan.model, int(slot), None, f"sweep-{self.plan.sweep_id}-{slot}",
                               self.plan.engine_overrides)
        try:
            info = self._call(self.replica.ready())
        except BaseException:  # Ray Data constructs the runner again (a sweep's engine start retries)
            self.replica.shutdown()
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise
        _reap_on_exit(self.replica.engine_pids())
        self.fatal = self._check_ops(info["module_names"])
        engine = self.replica._engine  # started by ready(); its tokenizer checks prompt lengths as vLLM counts them
        self.tokenizer = engine.get_tokenizer()
        self._tokenizing = threading.Lock()  # shards arrive on several threads; HF tokenizers are not re-entrant
        self.vocab = engine.model_config.get_vocab_size()
        self.max_model_len = engine.model_config.max_model_len

    def __del__(self):
        # Ray Data drops a finished pool's UDFs: stop the engine here rather than leave its
        # processes to Ray's clean-up of the actor's children.
        replica = getattr(self, "replica", None)
        if replica is not None:
            replica.shutdown()
        loop = getattr(self, "_loop", None)
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)

    def _check_ops(self, module_names: list[str]) -> str | None:
        try:
            check_ops(self.plan.ops, ModuleTree(names=module_names), self.plan.settings["max_tokens"])
        except (TypeError, ValueError, KeyError, AttributeError) as exc:  # AttributeError: a module the model lacks
            return f"the sweep's ops cannot run on this model: {exc}"
        return None

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def __call__(self, batch: dict) -> dict:
        import cloudpickle
        import numpy as np

        records = []
        for shard, blob in zip(batch["shard"], batch["rows"]):
            if self.fatal:
                records.append({"shard": int(shard), "fatal": self.fatal})
            else:
                records.append(self.run_shard(int(shard), cloudpickle.loads(blob)))
        return {"shard": np.array([r["shard"] for r in records]),
                "record": np.array([json.dumps(r) for r in records], dtype=object)}

    # --- one shard ---------------------------------------------------------------------------

    def run_shard(self, shard: int, rows: list[PromptRow]) -> dict:
        # Ray Data sends a shard again when the actor that ran it died before its answer reached
        # the driver, though it may have committed first (a node lost right after a commit). The
        # shard is done: running it again would replace the committing attempt's record.
        record = committed_record(self.out, shard)
        if record is not None:
            return record
        started = time.monotonic()
        outcomes = {r.prompt_id: Outcome(error=r.problem) for r in rows}
        runnable = []
        for row in rows:
            if outcomes[row.prompt_id].error is None:
                count, problem = self._measure(row.prompt)
                outcomes[row.prompt_id].prompt_tokens = count
                outcomes[row.prompt_id].error = problem
                if problem is None:
                    runnable.append(row)
        if runnable:
            self._run(runnable, outcomes)
        try:
            return write_shard(self.out, shard, rows, outcomes, run_s=round(time.monotonic() - started, 4),
                               host=socket.gethostname(), pid=os.getpid())
        except OSError as exc:
            # The output is full, read-only or unreachable: no later shard would fare better, so
            # the sweep stops with this cause (a fatal record) rather than Ray Data's "UDF failed to
            # process a data block". Nothing of this attempt counts: its record was not written.
            return {"shard": shard, "fatal": f"cannot write its files to {without_secret(self.out.output)} "
                    f"({type(exc).__name__}: {exc}); free space or fix the output, then rerun the same "
                    "command: committed shards are kept"}

    def _measure(self, prompt: str | list[int]) -> tuple[int | None, str | None]:
        """The prompt's token count, or why it cannot run (ids outside the vocabulary, too long)."""
        if isinstance(prompt, str):
            with self._tokenizing:
                ids = self.tokenizer.encode(prompt)
        else:
            ids = prompt
            bad = [t for t in ids if not 0 <= t < self.vocab]
            if bad:
                return len(ids), f"token ids outside the vocabulary (0..{self.vocab - 1}): {bad[:8]}"
        room = self.max_model_len - self.plan.settings["max_tokens"]
        if len(ids) > room:
            return len(ids), (f"prompt of {len(ids)} tokens plus max_tokens={self.plan.settings['max_tokens']} "
                              f"exceeds max_model_len={self.max_model_len}; shorten it or raise max_model_len")
        return len(ids), None

    def _run(self, rows: list[PromptRow], outcomes: dict[int, Outcome]) -> None:
        plan = self.plan
        invokes = [Invoke(r.prompt, plan.program, list(plan.ops), plan.steps) for r in rows]
        trace = f"{plan.sweep_id}-{uuid.uuid4().hex[:8]}"  # fresh per attempt: workers never see an old one's state
        payloads = encode_payloads(invokes, trace, "", plan.timeout_s, plan.max_save_bytes)
        stages = int(plan.model.get("pipeline_parallel_size", 1))
        task = ShardTask(trace, 0, 0, [r.prompt for r in rows], payloads, plan.settings, stages)
        outcome = self._call(self.replica.run_here(task))
        completions, reports = outcome.completions, outcome.reports
        for row, done in zip(rows, completions):
            outcome = outcomes[row.prompt_id]
            outcome.token_ids, outcome.text = list(done.token_ids), done.text
        by_invoke: dict[int, list] = {}
        for report in sorted(reports, key=lambda r: (r.invoke, r.stage)):
            by_invoke.setdefault(report.invoke, []).append(report)
            outcome = outcomes[rows[report.invoke].prompt_id]
            twice = outcome.saves.keys() & report.saves.keys()
            if twice and outcome.error is None:
                outcome.error = (f"saves {sorted(twice)} were made on more than one pipeline stage; give the "
                                 "values saved on different stages different names")
            outcome.saves.update(report.saves)
            outcome.shared += report.shared
            if report.error is not None and outcome.error is None:
                e = report.error
                outcome.error = f"{e.type} at {e.where}: {e.message}\n{e.traceback}".rstrip()
        for invoke, its_reports in by_invoke.items():
            outcomes[rows[invoke].prompt_id].printed = printed_text(its_reports) or None


# The engine's processes do not watch the process that started them: when this actor is killed
# outright (its raylet gone with a killed driver, or ray.kill), nothing else would end them.
_REAPER = """
import os, signal, sys
if os.fork():  # detach: the actor's exit may kill its own children
    os._exit(0)
sys.stdin.buffer.read()  # returns at EOF: the actor has ended
for item in sys.argv[1:]:
    pid, started = item.split(":")
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[19] == started:  # the same process, not a reused pid
                os.kill(int(pid), signal.SIGKILL)
    except (OSError, IndexError):
        pass
"""
_REAPER_PIPES: list = []  # write ends, held for as long as this process lives


def _reap_on_exit(pids: list[int]) -> None:
    """Kill ``pids`` once this process ends, however it ends (Linux: reads /proc)."""
    import subprocess
    import sys

    if not pids or not Path("/proc/self/stat").exists():
        return
    items = []
    for pid in pids:
        try:
            items.append(f"{pid}:{Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[19]}")
        except (OSError, IndexError):
            continue
    reaper = subprocess.Popen([sys.executable, "-S", "-c", _REAPER, *items], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    reaper.wait()  # the first fork returns at once; its child holds the pipe
    _REAPER_PIPES.append(reaper.stdin)


# --- writing -----------------------------------------------------------------------------------


def committed_record(store: SweepStore, shard: int, sizes: dict[str, int] | None = None) -> dict | None:
    """Shard ``shard``'s record if it is committed: the record exists and the files it names have
    the recorded sizes (the records are the truth: files no record names, such as a killed
    attempt's, never count). ``sizes``: one listing of the output, for a caller checking many."""
    stem = shard_stem(shard)
    if sizes is not None and f"{stem}.json" not in sizes:
        return None
    try:
        record = json.loads(store.read_bytes(f"{stem}.json") or b"")
    except ValueError:
        return None
    for file in record.get("files", {}).values():
        size = sizes.get(file["name"]) if sizes is not None else _size_or_none(store, file["name"])
        if size != file["bytes"]:
            return None
    return record


def _size_or_none(store: SweepStore, name: str) -> int | None:
    try:
        return store.size(name)
    except OSError:  # unreadable counts as uncommitted: the shard runs again, and its record commits it
        return None


def write_shard(store: SweepStore, shard: int, rows: list[PromptRow], outcomes: dict[int, Outcome], **facts: Any) -> dict:
    """Write shard ``shard``'s tensors, index and record (in that order, each committed whole:
    renamed into place, or one object PUT); returns the record (``facts`` added: where and how
    long it ran, and ``write_s``, the seconds its tensors and index took to write)."""
    import pyarrow as pa

    started = time.monotonic()
    tensors, spans, failures = _gather_saves(rows, outcomes)
    shared, shared_meta, shared_errors = _shared_partials(rows, outcomes)
    stem = shard_stem(shard)
    files = attempt_stem(stem, store)
    tensor_file, index_file = f"{files}.safetensors", f"{files}.parquet"
    payload = {**tensors, **{SHARED_PREFIX + n: [v] for n, v in shared.items()}}
    store.put_tensors(tensor_file, payload, {SHARED_META: json.dumps(shared_meta)})
    store.put_table(index_file, pa.table(_index_columns(shard, rows, outcomes, spans)))
    sizes = {name: store.size(name) for name in (tensor_file, index_file)}
    first_error = next(({"prompt_id": r.prompt_id, "error": outcomes[r.prompt_id].error.splitlines()[0]}
                        for r in rows if outcomes[r.prompt_id].error), None)
    record = {
        "shard": shard, "first_prompt": rows[0].prompt_id, "prompts": len(rows), "failures": failures,
        "prompt_tokens": sum(outcomes[r.prompt_id].prompt_tokens or 0 for r in rows if not outcomes[r.prompt_id].error),
        "generated_tokens": sum(len(o.token_ids) for o in outcomes.values()),
        "files": {"tensors": {"name": tensor_file, "bytes": sizes[tensor_file]},
                  "index": {"name": index_file, "bytes": sizes[index_file]}},
        "bytes": sum(sizes.values()),
        "saves": {n: {"rows": joined_shape(parts)[0], "shape": list(parts[0].shape[1:]),
                      "dtype": str(parts[0].dtype).removeprefix("torch.")} for n, parts in tensors.items()},
        "shared": shared_meta, "shared_errors": shared_errors, "first_error": first_error, **facts,
        "write_s": round(time.monotonic() - started, 4),
    }
    store.put_bytes(f"{stem}.json", json.dumps(record, indent=1).encode())  # the commit
    return record


def _gather_saves(rows: list[PromptRow], outcomes: dict[int, Outcome]):
    """Each save name's rows over the shard's prompts, as a list of parts in prompt order (the
    file joins them: :mod:`interlace.cluster.sweep.tensor_file`); a prompt whose saves cannot join the
    others (not a tensor, another shape or dtype) fails with that reason. Failed prompts keep no
    saves."""
    parts: dict[str, list] = {}
    spans: dict[str, dict[int, tuple[int, int]]] = {}
    for row in rows:
        outcome = outcomes[row.prompt_id]
        if outcome.error is None:
            values, problem = _as_rows(outcome.saves, parts)
            if problem:
                outcome.error = problem
            else:
                for name, value in values.items():
                    offset = joined_shape(parts[name])[0] if name in parts else 0
                    parts.setdefault(name, []).append(value)
                    spans.setdefault(name, {})[row.prompt_id] = (offset, value.shape[0])
        if outcome.error is not None:
            outcome.saves, outcome.shared = {}, []
    return parts, spans, sum(outcomes[r.prompt_id].error is not None for r in rows)


def _as_rows(saves: dict[str, Any], parts: dict[str, list]):
    import torch

    values = {}
    for name, value in saves.items():
        if name.startswith(SHARED_PREFIX):
            return {}, f"save name {name!r}: names starting with {SHARED_PREFIX!r} are the sweep's own; rename it"
        if not isinstance(value, torch.Tensor):
            return {}, (f"save {name!r} is a {type(value).__name__}; a sweep stores tensors only "
                        "(save torch.tensor(value), or share it with m.share)")
        if not storable(value.dtype):  # (the whole sweep stopped, at the shard's file)
            return {}, (f"save {name!r} is a {value.dtype} tensor, which a sweep's safetensors file cannot store; "
                        "save torch.view_as_real(x) for a complex one, or x.view(torch.uint8)")
        value = value.detach().cpu().reshape(1) if value.dim() == 0 else value.detach().cpu()
        if name in parts:
            first = parts[name][0]
            if first.shape[1:] != value.shape[1:] or first.dtype != value.dtype:
                return {}, (f"save {name!r} has rows of shape {list(value.shape[1:])} ({value.dtype}), other prompts' "
                            f"{list(first.shape[1:])} ({first.dtype}); a sweep concatenates each name's rows")
        values[name] = value
    return values, None


def _index_columns(shard: int, rows: list[PromptRow], outcomes: dict[int, Outcome], spans) -> dict:
    import pyarrow as pa

    cols: dict[str, Any] = {
        "prompt_id": pa.array([r.prompt_id for r in rows], pa.int64()),
        "source_row": pa.array([r.source_row for r in rows], pa.int64()),
        "shard": pa.array([shard] * len(rows), pa.int32()),
        "prompt": pa.array([r.prompt if isinstance(r.prompt, str) else None for r in rows], pa.string()),
        "prompt_token_ids": pa.array([r.prompt if isinstance(r.prompt, list) else None for r in rows],
                                     pa.list_(pa.int64())),
        "token_ids": pa.array([outcomes[r.prompt_id].token_ids for r in rows], pa.list_(pa.int64())),
        "text": pa.array([outcomes[r.prompt_id].text for r in rows], pa.string()),
        "prompt_tokens": pa.array([outcomes[r.prompt_id].prompt_tokens for r in rows], pa.int64()),
        "error": pa.array([outcomes[r.prompt_id].error for r in rows], pa.string()),
        "printed": pa.array([outcomes[r.prompt_id].printed for r in rows], pa.string()),
    }
    for name in sorted(spans):
        got = spans[name]
        cols[f"{name}.offset"] = pa.array([got[r.prompt_id][0] if r.prompt_id in got else None for r in rows], pa.int64())
        cols[f"{name}.length"] = pa.array([got[r.prompt_id][1] if r.prompt_id in got else None for r in rows], pa.int64())
    return cols


# --- trace-shared values, merged in two levels: per shard here, over the sweep on the driver ---


def _shared_partials(rows: list[PromptRow], outcomes: dict[int, Outcome]):
    """Each shared name's partial over this shard's prompts (in prompt order), in a form the
    driver can merge across shards: sum/max as merged, mean as a sum plus its count, concat
    concatenated, append stacked."""
    import torch

    by_name: dict[str, list] = {}
    hows: dict[str, set] = {}
    for row in rows:
        for name, how, value in outcomes[row.prompt_id].shared:
            by_name.setdefault(name, []).append(torch.as_tensor(value).detach().cpu())
            hows.setdefault(name, set()).add(how)
    partials, meta, errors = {}, {}, []
    for name, values in by_name.items():
        if len(hows[name]) != 1:
            errors.append(f"shared value {name!r} was contributed with different merges {sorted(hows[name])}; use one")
            continue
        how = hows[name].pop()
        try:
            partial = _partial(values, how).contiguous()
        except (RuntimeError, ValueError) as exc:
            errors.append(f"shared value {name!r} ({how}): {exc}")
            continue
        if not storable(partial.dtype):
            errors.append(f"shared value {name!r} ({how}) is a {partial.dtype} tensor, which a sweep's safetensors "
                          "file cannot store; share torch.view_as_real(x) for a complex one, or x.view(torch.uint8)")
            continue
        partials[name] = partial
        meta[name] = {"merge": how, "count": len(values)}
    return partials, meta, errors


def _partial(values: list, how: str):
    import torch

    kind = how.partition(":")[0]
    if kind == "mean":
        return merge_values(values, "sum")
    if kind == "append":
        return torch.stack(values)
    return torch.as_tensor(merge_values(values, how))


def merge_partials(parts: list[tuple[str, Any, int]], how: str):
    """The sweep's value of one shared name from its shards' partials ``(how, value, count)``,
    in shard order."""
    import torch

    values = [v for _, v, _ in parts]
    kind, _, arg = how.partition(":")
    if kind == "mean":
        return merge_values(values, "sum") / sum(c for _, _, c in parts)
    if kind == "append":
        return torch.cat(values)
    return torch.as_tensor(merge_values(values, how))
