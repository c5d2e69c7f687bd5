"""The model handle: a vLLM engine plus the trace API.

    >>> import torch, interlace
    >>> model = interlace.Model("tiny-llama")          # the embedded default; or a config path
    >>> out = model.generate("The capital of France is", max_tokens=5)
    >>> out.text

Read activations with a program (a plain function, called once per generation step)::

    >>> def keep(m):
    ...     m.save("resid2", m.layers[2].resid)           # [prompt tokens, hidden] at step 0
    >>> model.generate("Hello", program=keep).saves["resid2"].shape

Steer, patch and compare several prompts in one trace::

    >>> vec = torch.randn(128)
    >>> with model.trace(max_tokens=8) as tr:
    ...     tr.invoke("I think that", ops=[interlace.ops.add("layers.1.resid", vec)])
    ...     tr.invoke("I think that")                      # plain: runs untouched
    >>> tr.result[0].text, tr.result[1].text
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable

from interlace.cluster.assembly import ReportsMissing, ReportWatcher, assemble, build_requests
from interlace.cluster.config import ModelConfig
from interlace.cluster.engine import all_module_names, refuse_graph_settings, shutdown_engine, start_engine
from interlace.core.janitor import remove_on_exit
from interlace.core import settings as interlace_settings
from interlace.core.ops import step_list
from interlace.core.trace import (
    Invoke,
    InterventionError,
    InvokeResult,
    ProgramEndedEngine,
    TraceResult,
    WorkerDied,
    check_program,
    check_programless,
    check_trace,
    echo_printed,
    encode_payloads,
    new_trace_id,
    op_list,
    prompt_of,
)
from interlace.core.wire import Completion, Report
from interlace.workers.flight import FOLDER as FLIGHT
from interlace.workers.flight import culprit, read_records
from interlace.workers.points import ModuleTree
from interlace.workers.flight import close_recorder
from interlace.workers.sink import DATA, close_sink, discard, read_new_reports

DEFAULT_MAX_SAVE_BYTES = 1 << 30
_REPORT_GRACE_S = 30.0  # how long to wait for workers' reports after generation ends


class Model:
    """A model served by a local vLLM engine (started on first use).

    Keyword arguments override the config's fields (``tensor_parallel_size=2``,
    ``pipeline_parallel_size=2``, ``dtype``...) or, for anything else, vLLM's engine arguments::

        >>> model = interlace.Model("tiny-llama", tensor_parallel_size=2, max_num_seqs=64)
    """

    def __init__(self, config: str | Path | ModelConfig = "tiny-llama", **overrides: Any):
        config = config if isinstance(config, ModelConfig) else ModelConfig.load(config)
        self.config, overrides = config.with_overrides(overrides)

        refuse_graph_settings({**self.config.engine_args, **overrides})  # here, not when the engine starts
        self.engine_overrides = overrides
        self._engine = None
        self._tree: ModuleTree | None = None
        # One thread at a time talks to the engine (a trace's generate(), an RPC): vllm.LLM is not
        # thread-safe, and two threads on its socket ended the process in a ZMQ assertion.
        self._lock = threading.Lock()
        self._starting = threading.Lock()
        self._sink_root = Path(tempfile.mkdtemp(prefix="interlace-", dir=interlace_settings.fast_tmp_dir()))
        # Reports live in memory-backed /dev/shm: remove them even if close() is never called, and
        # if this process is killed (a SIGKILLed script left its folder behind).
        weakref.finalize(self, shutil.rmtree, str(self._sink_root), True)
        remove_on_exit(self._sink_root)

    # --- engine ------------------------------------------------------------------------------

    @property
    def engine(self):
        """The underlying ``vllm.LLM`` (started on first access)."""
        engine = self._engine
        if engine is None:
            # one engine for traces that several threads start at once: each started its own, and
            # all but the last one's traces failed as if the model had been closed under them
            with self._starting:
                if self._engine is None:
                    self._engine = start_engine(self.config, **self.engine_overrides)
                engine = self._engine
        return engine

    @property
    def tokenizer(self):
        return self.engine.get_tokenizer()

    @property
    def tree(self) -> ModuleTree:
        """The model's module names, as the workers see them (used to check ops early)."""
        if self._tree is None:
            with self._lock:  # the engine's RPC socket serves one thread at a time (ZMQ aborts the process)
                if self._tree is None:
                    self._tree = ModuleTree(names=all_module_names(self.engine.collective_rpc("interlace_module_names")))
        return self._tree

    def step_counts(self) -> list[dict[str, Any]]:
        """Each rank's step counters, the same as one replica's entry of ``Cluster.step_counts()``:
        ``graph_steps``, a compiled engine's steps that replayed CUDA graphs, ran ops in graph taps
        or ran eager (None on an eager engine), ``taps``, the steps whose ops ran in graph taps
        and the forwards through each tap (None without taps), and ``replays``, the chunks vLLM
        recomputed after preempting a request, on which ops and programs' logged writes were
        replayed, ``write_logs``, the program invokes that kept a write log for that
        (``kept``) and those that did not because vLLM could never preempt them (``skipped``), and
        ``saves``, programs' tensor saves held to their step's end and recorded together
        (``held``) or recorded where made (``at_once``: too large to hold, or near a limit)::

            >>> model = interlace.Model("tiny-llama", graph_taps=["layers.1.resid"])
            >>> _ = model.generate("Hello", ops=[interlace.ops.save("layers.1.resid")], max_tokens=2)
            >>> [rank] = model.step_counts()
            >>> rank["taps"]["steps"]
            2
        """
        with self._lock:  # not beside another thread's trace: one RPC socket
            return self.engine.collective_rpc("interlace_step_counts")

    def close(self) -> None:
        """Shut the engine down and remove the report folder."""
        engine, self._engine = self._engine, None  # first: a trace running meanwhile sees it gone (_run)
        if engine is not None:
            shutdown_engine(engine)
        close_sink(f"dir:{self._sink_root}")  # an engine in this process kept its data files open here
        close_recorder(f"dir:{self._sink_root}")  # and its flight record (workers/flight.py)
        shutil.rmtree(self._sink_root, ignore_errors=True)

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- traces ------------------------------------------------------------------------------

    def trace(self, max_tokens: int = 1, temperature: float = 0.0, seed: int | None = None,
              logprobs: bool = False, timeout_s: float | None = None,
              max_save_bytes: int = DEFAULT_MAX_SAVE_BYTES, **sampling: Any) -> "Trace":
        """Start a trace; add invokes with ``tr.invoke(...)``; it runs when the ``with`` block ends.

        ``sampling`` passes further ``vllm.SamplingParams`` fields (``ignore_eos``, ``top_p``...).
        """
        settings = dict(max_tokens=max_tokens, temperature=temperature, seed=seed,
                        logprobs=0 if logprobs else None, **sampling)
        return Trace(self, settings, timeout_s or interlace_settings.trace_timeout_s(), max_save_bytes)

    def generate(self, prompt: str | list[int], program: Callable | None = None,
                 ops: Iterable[dict] | None = (), steps: Iterable[int] | None = None, **trace_kwargs: Any) -> InvokeResult:
        """One invoke in its own trace; returns its :class:`InvokeResult`."""
        with self.trace(**trace_kwargs) as tr:
            tr.invoke(prompt, program=program, ops=ops, steps=steps)
        return tr.result[0]

    def _run(self, trace: "Trace") -> TraceResult:
        check_trace(trace.invokes, trace.settings, self.tree)
        trace_id = new_trace_id()
        payloads = encode_payloads(trace.invokes, trace_id, f"dir:{self._sink_root}", trace.timeout_s,
                                   trace.max_save_bytes)
        prompts, params = build_requests([inv.prompt for inv in trace.invokes], payloads, trace.settings, trace_id)
        with self._lock:
            engine = self.engine
            outputs = self._generate(trace_id, prompts, params)
            if self._engine is not engine:
                # close() from another thread shut the engine down under generate(), which then
                # returned every request cut short, as if finished: the trace looked complete
                raise RuntimeError(f"trace {trace_id}: the model was closed (Model.close()) while this trace ran, "
                                   "so its generation was cut short and its results are lost; run it again (the "
                                   "model starts a new engine)")
            if type(engine.llm_engine.engine_core).__name__ == "InprocClient":
                # VLLM_ENABLE_V1_MULTIPROCESSING=0: nothing steps the engine once generate() is
                # done, and workers learn which requests finished (and report them) in a step
                engine.llm_engine.step()
        reports = self._collect(trace_id, [i for i, p in enumerate(payloads) if p is not None])
        typed = {i: [Report.from_worker(r) for r in rs] for i, rs in reports.items()}
        return assemble(trace.invokes, [Completion.from_vllm(out) for out in outputs], typed)

    def _generate(self, trace_id: str, prompts: list[dict], params: list) -> list:
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            return self.engine.generate(prompts, params, use_tqdm=False)
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C, or SIGTERM (core.sigterm's Terminated)
            self._abort_unfinished()
            raise
        except EngineDeadError as exc:
            self._drop_dead_engine()
            stopped = self._last_words(trace_id)
            running = culprit(read_records(self._sink_root))  # the dead ranks' flight records
            shutil.rmtree(self._sink_root / FLIGHT, ignore_errors=True)
            if stopped:  # interlace ended the worker itself (workers/calls.py's last resort)
                raise ProgramEndedEngine(f"trace {trace_id}: {stopped}", running and running["invoke"], "time_limit") from exc
            if running is not None and running["trace"] == trace_id:
                raise ProgramEndedEngine(
                    f"trace {trace_id}: the engine's worker process died while invoke {running['invoke']}'s "
                    "program ran (it called os._exit, crashed the interpreter or a C extension, or the process "
                    "was killed while it ran, e.g. for memory). This trace's results are lost; the next trace "
                    "starts a new engine.", running["invoke"], "exited") from exc
            raise WorkerDied(
                f"trace {trace_id}: the engine's worker process died while running it (a program "
                "that crashed the interpreter, or the system killing the process, e.g. for memory). "
                "This trace's results are lost; the next trace starts a new engine."
            ) from exc

    def _abort_unfinished(self) -> None:
        """Abort the requests an interrupted trace left in the engine (one trace runs at a time:
        every unfinished request is its). vLLM's ``LLM`` keeps them running, and its next
        ``generate`` returns their outputs with its own: the next trace got this one's tokens."""
        engine = self._engine
        if engine is None:
            return
        try:
            states = engine.llm_engine.output_processor
            unfinished = list(states.request_states)
            if unfinished and hasattr(states, "external_req_ids"):  # vLLM 0.26 and 0.32: keys are internal ids
                engine.llm_engine.abort_request(unfinished, internal=True)
            elif unfinished:
                engine.llm_engine.abort_request(unfinished)
            if states.request_states:
                raise RuntimeError("requests left after the abort")
        except Exception:  # noqa: BLE001 - an engine we cannot clean: the next trace starts a new one
            self._drop_dead_engine()

    def _last_words(self, trace_id: str) -> str:
        """Why a worker ended itself, from the error reports it wrote first (a program that
        ignored its time limit), or "" when no such report exists."""

        try:
            reports = read_new_reports(self._sink_root / trace_id, set())
        except Exception:  # noqa: BLE001 - a half-written report: the generic message stands
            return ""
        for report in sorted(reports, key=lambda r: r["invoke"]):
            error = report.get("error") or {}
            if error.get("type") == "ProgramIgnoredTimeLimit":
                return f"invoke {report['invoke']} ({error.get('where')}): {error.get('message')}"
        return ""

    def _drop_dead_engine(self) -> None:
        engine, self._engine = self._engine, None
        try:
            shutdown_engine(engine)  # reap what is left of its processes
        except Exception:  # noqa: BLE001 - it is dead already; a fresh one is started on next use
            pass
        # Its ranks' data files, kept for traces it will never run (rows already read stay valid).
        shutil.rmtree(self._sink_root / DATA, ignore_errors=True)

    def _collect(self, trace_id: str, intervened: list[int]) -> dict[int, list[dict]]:
        """Every intervened invoke's report from every pipeline stage, by invoke."""
        wanted = {(i, s) for i in intervened for s in range(self.config.pipeline_parallel_size)}
        watcher = ReportWatcher(self._sink_root, trace_id, wanted, _REPORT_GRACE_S)
        try:
            watcher.poll()
            while not watcher.done:
                time.sleep(0.002)
                watcher.poll()
        except ReportsMissing as exc:
            # Workers that generate but no longer deliver reports (a worker that died after its
            # tokens, files it can no longer open) would fail every later trace the same way.
            self._drop_dead_engine()
            raise WorkerDied(f"{exc}. This trace's results are lost; the next trace starts a new engine.") from exc
        reports: dict[int, list[dict]] = {}
        for report in watcher.reports:
            reports.setdefault(report["invoke"], []).append(report)
        discard(watcher.folder)
        for invoke_reports in reports.values():
            invoke_reports.sort(key=lambda r: r["stage"])
        return reports


def submitted(trace: object) -> "Trace":
    """``trace`` if it is one: ``submit("a prompt")`` failed with "'str' object has no attribute
    'invokes'"."""
    if not isinstance(trace, Trace):
        raise TypeError(f"submit() takes a trace (tr = cluster.trace(...); tr.invoke(prompt, ...)), got "
                        f"{type(trace).__name__} {trace!r:.80}")
    return trace


class Trace:
    """A trace being built: ``with model.trace(...) as tr: tr.invoke(...)``; then ``tr.result``.

    Its target runs it: a :class:`Model` (one local engine) or an ``interlace.Cluster``; both
    build requests and results with :mod:`interlace.cluster.assembly`.
    """

    def __init__(self, target: "Model", settings: dict, timeout_s: float, max_save_bytes: int):
        self.target = target
        self.settings = settings
        self.timeout_s = timeout_s
        self.max_save_bytes = max_save_bytes
        self.invokes: list[Invoke] = []
        self._result: TraceResult | None = None

    @property
    def result(self) -> TraceResult:
        """What the trace's run gave: one :class:`InvokeResult` per invoke (``result[i]``) and its
        shared values. Read before the run (inside the ``with`` block), or after a failed one, it
        raises rather than give None, which failed later and far from the cause."""
        if self._result is None:
            raise RuntimeError("the trace has no result yet: it runs when its with block ends (or at tr.run(); "
                               "a trace given to submit() has its result in the future submit returned); if the run "
                               "raised, that error says why")
        return self._result

    def invoke(self, prompt: str | list[int], program: Callable | None = None,
               ops: Iterable[dict] | None = (), steps: Iterable[int] | None = None) -> int:
        """Add a prompt (text, or token ids: see core.trace.prompt_of) with an optional program and
        ops; returns its index."""
        if self._result is not None:  # it would not run, and tr.result would silently lack it
            raise RuntimeError("the trace has run already (its with block ended): an invoke added now would not run; "
                               "add invokes inside the with block, or start a new trace for more")
        prompt = prompt_of(prompt)
        if program is not None:
            check_program(program)
        else:
            check_programless(steps)
        self.invokes.append(Invoke(prompt, program, op_list(ops), step_list(steps)))
        return len(self.invokes) - 1

    def run(self) -> TraceResult:
        if not self.invokes:
            raise ValueError("the trace has no invokes; add one with tr.invoke(prompt, ...)")
        try:
            self._result = self.target._run(self)
        except InterventionError as exc:  # what the programs printed helps most here
            echo_printed(exc.partial)
            raise
        echo_printed(self._result)
        return self._result

    @property
    def model(self) -> "Model":
        return self.target

    def __enter__(self) -> "Trace":
        return self

    def __exit__(self, exc_type, *_: Any) -> None:
        if exc_type is None:
            self.run()
