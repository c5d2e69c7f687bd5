"""The one trace path, shared by every target (the local engine, a Ray cluster's replicas).

A target takes a validated trace, turns its invokes into vLLM requests with
:func:`build_requests`, runs them, gathers the workers' reports (:class:`ReportWatcher` reads a
``dir:`` sink as reports appear) and hands completions and reports to :func:`assemble`, which
builds the :class:`TraceResult` (or raises the trace's :class:`InterventionError`). Keeping these
in one place is what keeps ``Model`` and ``Cluster`` results equal.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from interlace.core.merge import MergeError, merge_shared
from interlace.core.trace import InterventionError, Invoke, InvokeResult, TraceResult, payload_bytes
from interlace.core.wire import Completion, ErrorRecord, InvokePayload, Report, printed_text
from interlace.workers.scheduler import GANG_KEY, PROGRAM_KEY, WHOLE_PROMPT_KEY
from interlace.workers.sink import INLINE_BYTES, park, read_new_reports, writing_reports


def build_requests(prompts: Sequence[str | list[int]], payloads: Sequence[InvokePayload | None], settings: dict,
                   wire_trace: str, sink: str | None = None) -> tuple[list[dict], list]:
    """vLLM prompts and ``SamplingParams`` for the invokes of a trace (or one shard of it).

    ``wire_trace`` is the id the workers know these requests by (the trace's own id locally; a
    shard attempt's id on a cluster); ``sink`` replaces the payloads' sink where given (a
    replica's node-local folder).
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # Only the final output is read: an async engine (a replica) otherwise builds and yields every
    # request's output at every step (vllm.LLM sets this itself).
    settings, user_extra = _sampling_settings({"output_kind": RequestOutputKind.FINAL_ONLY, **settings})
    _check_as_the_engine_reads(SamplingParams(**settings, extra_args=dict(user_extra) or None))
    gang_size = sum(p is not None for p in payloads)  # enter vLLM's scheduler together (workers/scheduler.py)
    requests, params = [], []
    parked: dict[int, dict] = {}  # id of a payload's program or ops bytes -> what its requests carry instead
    for text_or_ids, payload in zip(prompts, payloads):
        prompt: dict = {"prompt": text_or_ids} if isinstance(text_or_ids, str) else {"prompt_token_ids": list(text_or_ids)}
        extra = None
        if payload is not None:
            # A unique salt keeps prefix caching from skipping this request's prompt tokens,
            # which its hooks must see; plain requests keep the cache.
            prompt["cache_salt"] = f"interlace-{wire_trace}-{payload.invoke}"
            where = sink or payload.sink
            changes = _parked(payload, where, wire_trace, parked) if where.startswith("dir:") else {}
            extra = {"interlace": payload_bytes(payload, trace=wire_trace, sink=where, **changes),
                     GANG_KEY: [wire_trace, payload.invoke, gang_size]}
            if payload.program is not None:
                extra[PROGRAM_KEY] = True  # preempted last: its accesses cannot be replayed
                if payload.steps is None or 0 in payload.steps:
                    extra[WHOLE_PROMPT_KEY] = True  # the program sees the prompt at once
        requests.append(prompt)
        params.append(SamplingParams(**settings, extra_args={**user_extra, **extra} if extra else dict(user_extra) or None))
    return requests, params


def _sampling_settings(settings: dict) -> tuple[dict, dict]:
    """The trace's ``SamplingParams`` fields, and the user's own ``extra_args`` (for their
    logits processors), which interlace's keys join in each intervened request: passed as a
    field they collided with them ("got multiple values for keyword argument 'extra_args'").
    ``structured_outputs`` may be a dict (a sweep's YAML, a script): vLLM wants its
    ``StructuredOutputsParams``, and failed with "'dict' object has no attribute '_backend'"."""
    settings = dict(settings)
    user_extra = settings.pop("extra_args", None) or {}
    if not isinstance(user_extra, dict):
        raise TypeError(f"extra_args must be a dict, got {type(user_extra).__name__}")
    taken = sorted(key for key in user_extra if str(key).startswith("interlace"))
    if taken:
        raise ValueError(f"extra_args keys starting with 'interlace' are interlace's own; rename {taken}")
    if isinstance(settings.get("structured_outputs"), dict):
        from vllm.sampling_params import StructuredOutputsParams

        settings["structured_outputs"] = StructuredOutputsParams(**settings["structured_outputs"])
    return settings, user_extra


def check_sampling(settings: dict) -> None:
    """Refuse sampling settings vLLM would not take, before a sweep starts its engines (each
    trace's requests are checked again where they are built). Raises ImportError without vLLM."""
    from vllm import SamplingParams

    settings, user_extra = _sampling_settings(settings)
    _check_as_the_engine_reads(SamplingParams(**settings, extra_args=dict(user_extra) or None))


def _check_as_the_engine_reads(params: Any) -> None:
    """Encode and decode ``params`` as vLLM's engine core does (typed msgpack), and refuse them
    here if that fails. vLLM builds SamplingParams without checking most fields' types: seed="abc",
    seed=1.5, ignore_eos="yes" or logit_bias={"a": 1.0} passed, then failed to decode in the engine
    core's input thread, which died with the error: that request never answered, nor did any later
    one on that engine (a script hung at its next trace; a replica stopped serving)."""
    import msgspec
    from vllm import SamplingParams
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    try:
        MsgpackDecoder(SamplingParams).decode(MsgpackEncoder().encode(params))
    except msgspec.ValidationError as exc:  # "Expected `int | null`, got `str` - at `$.seed`"
        field = str(exc).rpartition("$.")[2].rstrip("`") or "a field"
        raise TypeError(f"sampling setting {field}: {exc}; pass the type vllm.SamplingParams declares") from None
    except TypeError as exc:  # a value msgpack cannot carry (an object in extra_args)
        raise TypeError(f"sampling settings cannot be sent to the engine: {exc}") from None


def _parked(payload: InvokePayload, sink: str, wire_trace: str, parked: dict[int, dict]) -> dict:
    """The payload's program and ops larger than INLINE_BYTES, written once into the trace's
    folder of the ``dir:`` sink its ranks read (workers/sink.py, ``park``): the changes that
    leave them out of its request. (A ``ray:`` sink's ranks may be on other nodes: they stay inline.)"""
    changes: dict = {}
    for part, data, key in (("program", payload.program, payload.program_key), ("ops", payload.ops, payload.ops_key)):
        if data is None or len(data) <= INLINE_BYTES:
            continue
        if id(data) not in parked:  # one object per distinct program or op list (encode_payloads)
            park(sink, wire_trace, part, key, data)
            parked[id(data)] = {part: None, f"{part}_parked": True}
        changes.update(parked[id(data)])
    return changes


class ReportsMissing(RuntimeError):
    """Reports due from the workers did not come within the grace."""


class ReportWatcher:
    """Waits for the reports of ``wanted`` (invoke, stage) pairs in one trace's sink folder.

    Call :meth:`poll` until :attr:`done` (the caller sleeps in between, in a thread or a coroutine).
    A report is *due* once its invoke finished generating: every wanted one from the start, or,
    with ``due=()``, those named to :meth:`mark_due` since (a stream watches while its invokes
    still generate, for as long as they take). A due report still missing ``grace_s`` after it
    became due raises, unless some rank is writing a report right now (reports are written in
    order, so one under way means the workers are alive).
    """

    def __init__(self, root: Path, folder: str, wanted: set[tuple[int, int]], grace_s: float,
                 due: Iterable[tuple[int, int]] | None = None):
        self.root, self.folder = root, root / folder
        self.wanted = set(wanted)
        self.grace_s = grace_s
        self.reports: list[dict] = []
        self._seen: set[str] = set()
        self._due = set(self.wanted if due is None else due)
        self._deadline = time.monotonic() + grace_s

    @property
    def done(self) -> bool:
        return not self.wanted

    def mark_due(self, pairs: Iterable[tuple[int, int]]) -> None:
        """These reports are due from now on (their invoke finished)."""
        new = (set(pairs) & self.wanted) - self._due
        if new:
            self._due |= new
            self._deadline = time.monotonic() + self.grace_s

    def poll(self) -> None:
        for report in read_new_reports(self.folder, self._seen):
            self.wanted.discard((report["invoke"], report["stage"]))
            self.reports.append(report)
        missing = self.wanted & self._due
        if missing and time.monotonic() > self._deadline:
            if writing_reports(self.root):
                self._deadline = time.monotonic() + self.grace_s
                return
            raise ReportsMissing(f"trace {self.folder.name}: no report from (invoke, stage) {sorted(missing)} "
                                 f"within {self.grace_s:.0f}s after they were due: the engine's workers died or "
                                 "can no longer write reports")


def assemble(invokes: Sequence[Invoke], completions: Sequence[Completion],
             reports: dict[int, list[Report]], shared: dict[str, Any] | None = None,
             merge_error: MergeError | None = None) -> TraceResult:
    """The trace's result from each invoke's completion and its reports (one per pipeline stage;
    a cluster's come from several replicas); raises the first failure as InterventionError.
    ``shared``: the trace's shared values merged already (a cluster's collector does), or
    ``merge_error``: why they could not be (the trace fails with every invoke's results kept)."""
    results, contributions, first_error = [], [], None
    for index, (inv, done) in enumerate(zip(invokes, completions)):
        saves: dict[str, Any] = {}
        for report in sorted(reports.get(index, []), key=lambda r: r.stage):
            twice = saves.keys() & report.saves.keys()
            if twice and first_error is None:  # their order across steps is lost between stages
                first_error = (index, ErrorRecord(
                    "ValueError", f"merging pipeline stage {report.stage}",
                    f"saves {sorted(twice)} were made on more than one pipeline stage; "
                    "give the values saved on different stages different names", ""))
            saves.update(report.saves)
            contributions += [(index, name, how, value) for name, how, value in report.shared]
            if report.error is not None and first_error is None:
                first_error = (index, report.error)
        results.append(InvokeResult(inv.prompt, list(done.token_ids), done.text, saves, done.logprobs,
                                    printed_text(reports.get(index, []))))
    result = TraceResult(results, {})
    if first_error is not None:
        raise InterventionError(first_error[0], first_error[1].to_dict(), partial=result)
    try:
        if merge_error is not None:
            raise merge_error
        result.shared = merge_shared(contributions) if shared is None else shared
    except MergeError as exc:
        record = ErrorRecord("MergeError", f"merging the shared value {exc.name!r}", str(exc), "")
        raise InterventionError(exc.invoke, record.to_dict(), partial=result) from None
    return result
