"""Step probe: where interlace's time goes inside the engine, per step (a diagnostic, not a figure).

Runs the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, TP=1) so the worker's
interleaver can be timed directly: wall time of each runner step, and within it the interleaver's
phases (begin_step, hooks, end_step, reports) and the engine's waits for program threads. On a GPU
it also reports synchronising CUDA calls made inside interlace's own code (torch's sync debug
mode, switched on only while interlace code runs), the usual reason a hook stalls vLLM's
asynchronous scheduling.

PROBE_GC_TYPES=1 counts the objects in Python's youngest generation, by type, whenever a collection
starts (what a step leaves for the garbage collector).

PROBE_LIGHT=1 times interlace's calls without checking them for CUDA syncs (each check costs
microseconds per call, which inflates the finer phases). PROBE_FINE=1 times a program per invoke's
path part by part, and prints how many Python frames deep the engine is where it hands programs
to the hub (greenlet walks those at every switch on Python 3.12+); PROBE_NO_HUB=1 has the engine switch into programs itself instead of through
the hub (greenlets.run_shallow), for an A/B. PROBE_NO_PROLOGUE=1 starts every program at its step's start, also
those that could start at their first point (prologue.py), for an A/B. PROBE_NO_RUNS=1 adds the saves made
in graph taps to the save ledger step by step, as before runs (saves.py), for an A/B.

Usage: python bench/step_probe.py [--cases ops-save4,prog-save4] [--n 256] [--in 128] [--out 128] [--shape 1b]
       [--graphs [--case-taps]] [--taps] [--kv-gib G] [--no-baseline] [--profile N] [--reserve-ab] [--threads-ab N] [--ablate keep|ops|dispatch|step]...
       [--blocking-sync] [--timeline] [--profile-in module.Class.method,...]
Variants (``--reserve-ab``, ``--threads-ab``, ``--ablate``) run each case again in the same process;
the machine may drift between runs minutes apart, so compare a case with its own variants.
A case named ``NAME@host`` runs NAME with saves copied to pinned host memory at once instead of
kept on the GPU (as before saves stayed on the device), for an A/B in one process.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import sys
import time

import shapes  # bench/, this script's folder
import warnings

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

TOTALS: dict[str, float] = collections.defaultdict(float)
CPU_TOTALS: dict[str, float] = collections.defaultdict(float)  # the calling thread's CPU time in each label
COUNTS: dict[str, int] = collections.defaultdict(int)
SYNCS: collections.Counter = collections.Counter()
LAST_STEP_END = [None]  # when the interleaver last ended a step (the trace's last forward pass)
SAVES_ON_HOST = [False]  # a case@host: the device room refuses every save
PROFILE: list = [None]  # --profile: a cProfile.Profile enabled only inside the runner's steps
DEPTHS: dict[str, int] = {}  # PROBE_FINE: the engine's frame depth where programs run (see _frames_at)
EVENTS: list[tuple[str, float, float]] = []  # (label, start, end) of every timed call, for the tail's timeline
STEPS: list[tuple[int, float, float]] = []  # per runner step: tokens scheduled, wall seconds, engine thread CPU seconds
STEP_STARTS: list[tuple[int, int]] = []  # per runner step: tokens scheduled, time.time_ns() at its start (--timeline)
STEP_PERF: list[tuple[int, float]] = []  # the same, time.perf_counter() (the clock of EVENTS)


def timed(owner, name: str, label: str, debug_sync: bool = True) -> None:
    import torch

    original = getattr(owner, name, None)
    if original is None:  # not in this version of interlace (the probe also times other checkouts)
        return
    cuda = torch.cuda.is_available()

    if not debug_sync or os.environ.get("PROBE_LIGHT"):  # no sync checks: a few us less per call
        @functools.wraps(original)
        def light(*args, **kwargs):
            started, cpu = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                ended = time.perf_counter()
                TOTALS[label] += ended - started
                CPU_TOTALS[label] += time.thread_time() - cpu
                COUNTS[label] += 1
                EVENTS.append((label, started, ended))

        setattr(owner, name, light)
        return

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        started, cpu = time.perf_counter(), time.thread_time()
        mode = torch.cuda.get_sync_debug_mode() if cuda and debug_sync else None
        if mode is not None:
            torch.cuda.set_sync_debug_mode(1)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                return original(*args, **kwargs)
        finally:
            if mode is not None:
                torch.cuda.set_sync_debug_mode(mode)
                for w in caught:
                    if "synchroniz" in str(w.message):
                        SYNCS[f"{label}: {w.filename}:{w.lineno}"] += 1
            ended = time.perf_counter()
            TOTALS[label] += ended - started
            CPU_TOTALS[label] += time.thread_time() - cpu
            COUNTS[label] += 1
            EVENTS.append((label, started, ended))

    setattr(owner, name, wrapper)


def time_steps(owner) -> None:
    """Each runner step's wall time and the engine thread's CPU time in it, by tokens scheduled:
    whether a case's extra time is spread over every step or lands in a few, and whether the
    engine thread spends it working or waiting (for the GIL, a lock, the GPU)."""
    original = owner.execute_model

    @functools.wraps(original)
    def wrapper(self, scheduler_output, *args, **kwargs):
        wall, cpu = time.perf_counter(), time.thread_time()
        STEP_STARTS.append((getattr(scheduler_output, "total_num_scheduled_tokens", 0), time.time_ns()))
        STEP_PERF.append((STEP_STARTS[-1][0], wall))
        if PROFILE[0] is not None:
            PROFILE[0].enable()
        try:
            return original(self, scheduler_output, *args, **kwargs)
        finally:
            if PROFILE[0] is not None:
                PROFILE[0].disable()
            tokens = getattr(scheduler_output, "total_num_scheduled_tokens", 0)
            STEPS.append((tokens, time.perf_counter() - wall, time.thread_time() - cpu))

    owner.execute_model = wrapper

    sample = getattr(owner, "sample_tokens", None)  # vLLM's runners sample (and interlace ends its step) here
    if sample is not None:
        @functools.wraps(sample)
        def sample_wrapper(self, *args, **kwargs):
            if PROFILE[0] is not None:
                PROFILE[0].enable()
            try:
                return sample(self, *args, **kwargs)
            finally:
                if PROFILE[0] is not None:
                    PROFILE[0].disable()

        owner.sample_tokens = sample_wrapper


def print_steps() -> None:
    import numpy as np

    if not STEPS:
        return
    tokens, wall, cpu = (np.array(column) for column in zip(*STEPS))
    for label, mask in (("decode steps", tokens <= 512), ("prefill steps", tokens > 512)):
        if mask.any():
            w, c = 1000 * wall[mask], 1000 * cpu[mask]
            print(f"  {label:14} {mask.sum():4d}: wall ms median {np.median(w):7.3f} p90 {np.percentile(w, 90):7.3f} "
                  f"max {w.max():7.3f} sum {w.sum():8.1f} | engine thread CPU ms median {np.median(c):7.3f} sum {c.sum():8.1f}")
    slowest = np.argsort(-wall)[:5]
    print("  slowest steps (index, tokens, wall ms, cpu ms): "
          + ", ".join(f"({i}, {tokens[i]}, {1000 * wall[i]:.1f}, {1000 * cpu[i]:.1f})" for i in sorted(slowest)))


def print_decode_parts(top: int = 16) -> None:
    """The median time of each timed call per decode step (from one runner step's start to the
    next's, both decode steps): the averages above mix in the prefill steps, which differ between
    cases (an intervened request's prompt skips the prefix cache)."""
    import numpy as np

    pairs = [(a[1], b[1]) for a, b in zip(STEP_PERF, STEP_PERF[1:]) if 0 < a[0] <= 512 and 0 < b[0] <= 512]
    if not pairs:
        return
    starts, ends = (np.array(column) for column in zip(*pairs))
    per: dict[str, np.ndarray] = collections.defaultdict(lambda: np.zeros(len(pairs)))
    for label, started, ended in EVENTS:
        k = int(np.searchsorted(starts, started, side="right")) - 1
        if k >= 0 and started < ends[k]:
            per[label][k] += ended - started
    rows = sorted(((float(np.median(v)) * 1000, label) for label, v in per.items()), reverse=True)[:top]
    print(f"  per decode step ({len(pairs)}, start to next start), median ms: whole {1000 * np.median(ends - starts):.3f}")
    for ms, label in rows:
        print(f"    {ms:8.3f}  {label.strip()}")


def print_timeline(events, seconds: float, top: int = 12) -> None:
    """What the GPU did during one trace (CUDA activity of torch's profiler: kernels, copies,
    memsets, graph replays' kernels included): how long it was busy, how long it sat idle between
    kernels (waiting for the host), and, per decode step, busy time against the step's wall time.
    A case whose steps add host work shows as more idle time at the same busy time; one that adds
    GPU work, as more busy time."""
    import numpy as np

    gpu = sorted((e.start_ns(), e.end_ns(), e.name()) for e in events
                 if str(e.device_type()).endswith("CUDA") and e.end_ns() > e.start_ns())
    if not gpu:
        print("  timeline: no GPU activity recorded")
        return
    starts = np.array([g[0] for g in gpu], dtype=np.int64)
    ends = np.maximum.accumulate(np.array([g[1] for g in gpu], dtype=np.int64))
    gaps = np.maximum(0, starts[1:] - ends[:-1])  # idle between one kernel's end (or an overlapping one's) and the next start
    span = ends[-1] - starts[0]
    idle = int(gaps.sum())
    print(f"  timeline: GPU span {span / 1e6:.1f} ms of a {1000 * seconds:.1f} ms trace, busy {(span - idle) / 1e6:.1f} ms, "
          f"idle between kernels {idle / 1e6:.1f} ms ({(gaps > 50_000).sum()} gaps over 50 us: {gaps[gaps > 50_000].sum() / 1e6:.1f} ms)")
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for start, end, name in gpu:
        entry = by_name[name[:90]]
        entry[0] += (end - start) / 1e6
        entry[1] += 1
    for name, (ms, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    {ms:8.2f} ms {count:6d}x  {name}")
    marks = [(tokens, ns) for tokens, ns in STEP_STARTS if starts[0] - 10**9 < ns < ends[-1] + 10**9]
    if len(marks) < 3:
        print(f"  timeline: steps not aligned with the GPU clock ({len(STEP_STARTS)} step marks)")
        return
    busy_in, walls = [], []
    for (tokens, begin), (_t, end) in zip(marks, marks[1:]):
        if tokens > 512:
            continue
        lo, hi = np.searchsorted(starts, begin), np.searchsorted(starts, end)
        busy = np.clip(np.minimum(ends[lo:hi], end) - np.maximum(starts[lo:hi], begin), 0, None)
        busy_in.append(busy.sum() / 1e6)  # overlapping kernels count twice: an upper bound
        walls.append((end - begin) / 1e6)
    busy_in, walls = np.array(busy_in), np.array(walls)
    print(f"  timeline, decode steps ({len(walls)}), start to next start: wall ms median {np.median(walls):.3f}, "
          f"GPU busy ms median {np.median(busy_in):.3f}, GPU busy / wall {busy_in.sum() / walls.sum():.2f}")


def print_copy_sources(prof, top: int = 8) -> None:
    """Which host calls launched the trace's device-to-host copies (CPU and CUDA activity, with
    Python stacks): counts by launching op and the innermost frames of interlace or vLLM."""
    sources: collections.Counter = collections.Counter()
    for event in prof.events():
        copies = [k for k in getattr(event, "kernels", []) if "DtoH" in k.name or "HtoD" in k.name]
        if not copies:
            continue
        frames = [f for f in (event.stack or []) if "interlace" in f or "vllm" in f or "workers/" in f][:4]
        sources[(copies[0].name, event.name, " < ".join(frames))] += len(copies)
    print("  copies between host and device, by launching call:")
    for (kind, name, frames), count in sources.most_common(top):
        print(f"    {count:6d}x {kind} from {name}: {frames}")


GC_TYPES: collections.Counter = collections.Counter()  # PROBE_GC_TYPES: objects in gen 0 when a collection starts


def _gc_timer(phase: str, info: dict) -> None:
    if phase == "start":
        if GC_TYPES is not None and os.environ.get("PROBE_GC_TYPES"):
            import gc

            GC_TYPES.update(type(o).__qualname__ for o in gc.get_objects(generation=0))
        TOTALS["_gc_started"] = time.perf_counter()
    else:
        label, ended = f"python gc (gen {info['generation']})", time.perf_counter()
        started = TOTALS.pop("_gc_started", ended)
        TOTALS[label] += ended - started
        COUNTS[label] += 1
        EVENTS.append((label, started, ended))


def _add(label: str, seconds: float) -> None:
    TOTALS[label] += seconds
    COUNTS[label] += 1


def probe_handoffs() -> None:
    """Split the engine's waits for programs into the program's own running time and the two
    handoffs (engine to program thread, and back), by timestamps on each side (revisions that ran
    programs on threads; programs are greenlets on the engine's thread since)."""
    from interlace.workers.calls import ProgramCall

    if not hasattr(ProgramCall, "_wait_for_program"):
        return
    now = time.perf_counter
    start, resume, wait_at, wait = (ProgramCall.start, ProgramCall.resume, ProgramCall.wait_at,
                                    ProgramCall._wait_for_program)

    def start_(self):
        program = self.program

        def timed_program(view):
            woken(self)
            try:
                return program(view)
            finally:
                blocked(self)

        self.program = timed_program
        self._probe_released = now()
        start(self)

    def resume_(self, value):
        self._probe_released = now()
        resume(self, value)

    def woken(self):
        self._probe_woken = now()
        _add("  handoff engine -> program", self._probe_woken - self._probe_released)

    def blocked(self):
        self._probe_blocked = now()
        _add("  program runs (its own Python)", self._probe_blocked - self._probe_woken)

    def wait_at_(self, point):
        blocked(self)
        try:
            return wait_at(self, point)
        finally:
            woken(self)

    def wait_(self):
        wait(self)
        if hasattr(self, "_probe_blocked"):
            _add("  handoff program -> engine", now() - self._probe_blocked)

    ProgramCall.start, ProgramCall.resume, ProgramCall.wait_at = start_, resume_, wait_at_
    ProgramCall._wait_for_program = wait_


def install_probes() -> None:
    import gc

    gc.callbacks.append(_gc_timer)
    from vllm.v1.worker.gpu_worker import Worker

    from interlace import model as driver_model
    from interlace.workers import (calls, dispatch, interleaver, ops, pinned, program_services, report_file, reports,
                                   save_gather, saves,
                                   scheduler, step_schedule, write_log)
    from interlace.workers import taps as taps_module

    time_steps(Worker)
    take = saves.DeviceRoom.take

    def take_(self, nbytes, device):
        kept = not SAVES_ON_HOST[0] and take(self, nbytes, device)
        _add(f"  saves kept on the device: {kept} (room limit {self.limit})", 0.0)
        return kept

    saves.DeviceRoom.take = take_
    timed(Worker, "execute_model", "runner.execute_model", debug_sync=False)
    timed(Worker, "sample_tokens", "runner.sample_tokens", debug_sync=False)
    # vLLM's own phases, to see which of them a case slows down (V2 runner names; V1 lacks some)
    with contextlib.suppress(ImportError):
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner

        for phase in ("finish_requests", "add_requests", "update_requests", "prepare_inputs", "prepare_attn",
                      "sample", "postprocess_sampled"):
            timed(V2Runner, phase, f"  vllm: {phase}", debug_sync=False)
    # the engine core's loop around the runner (this probe runs it in the engine thread): where a
    # step's time goes outside the runner, and how long the loop waits for the GPU's outputs
    with contextlib.suppress(ImportError):
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.engine.output_processor import OutputProcessor

        from vllm.v1.engine.llm_engine import LLMEngine

        timed(LLMEngine, "step", "llm engine: step", debug_sync=False)
        timed(EngineCore, "step_with_batch_queue", "engine core: step (batch queue)", debug_sync=False)
        timed(EngineCore, "step", "engine core: step", debug_sync=False)
        timed(Scheduler, "schedule", "  engine core: schedule", debug_sync=False)
        timed(Scheduler, "update_from_output", "  engine core: update_from_output", debug_sync=False)
        timed(OutputProcessor, "process_outputs", "output processor: process_outputs", debug_sync=False)
    with contextlib.suppress(ImportError):
        from vllm.v1.worker.gpu import async_utils

        for name in dir(async_utils):
            owner = getattr(async_utils, name)
            if isinstance(owner, type) and "get_output" in vars(owner):
                timed(owner, "get_output", f"  engine core: {name}.get_output (waits for the GPU)", debug_sync=False)
    from vllm.model_executor.models.llama import LlamaForCausalLM

    timed(LlamaForCausalLM, "forward", "  vllm: model forward (hooks included)", debug_sync=False)
    timed(interleaver.Interleaver, "begin_step", "interleaver.begin_step")
    timed(dispatch.PointDispatcher, "dispatch", "interleaver.hooks")
    timed(step_schedule.StepScheduler, "schedule", "  begin_step: schedule (arrays)")
    timed(step_schedule.StepScheduler, "program_groups", "  begin_step: program groups")
    timed(ops.OpPlan, "for_step", "  begin_step: op plans")
    timed(interleaver.Interleaver, "end_step", "interleaver.end_step")
    timed(dispatch.PointDispatcher, "take_tapped", "  end_step: saves made in the taps (gather, ledger)")
    timed(program_services.ProgramServices, "save_tapped", "    take_tapped: save_tapped (limits, ledger)")
    timed(taps_module.TappedSaves, "gather", "      save_tapped: gather (a step of its own)")
    timed(taps_module.TappedSaves, "gather_into", "      save_tapped: gather into a run")
    timed(saves.SaveLedger, "run_rows", "      save_tapped: ledger.run_rows")
    timed(saves.SaveLedger, "add", "      save_tapped, _save_rows: ledger.add")
    timed(reports.ReportBatcher, "reserve_ahead", "      save_tapped, _save_rows: reserve_ahead")
    # a squeezed cache: the write log's copies to the host and its replays (write_log.py)
    timed(interleaver.Interleaver, "_replays", "  begin_step: replays (gather, copy to the device)")
    timed(write_log.WriteBook, "replay", "    replays: book.replay")
    timed(dispatch.PointDispatcher, "_log_writes", "  hooks: log programs' writes")
    timed(dispatch, "_joined_to_host", "    log: copies to the host")
    timed(pinned.PinnedSlabs, "empty", "    pinned: empty")
    timed(dispatch.PointDispatcher, "_replay", "  hooks: replay logged writes")
    timed(scheduler.GangAdmission, "schedule", "engine core: schedule, interlace's gang scheduler (vLLM's inside)",
          debug_sync=False)
    end_step = interleaver.Interleaver.end_step

    def end_step_(self):
        try:
            return end_step(self)
        finally:
            LAST_STEP_END[0] = time.perf_counter()

    interleaver.Interleaver.end_step = end_step_
    timed(interleaver.Interleaver, "finish", "interleaver.finish (reports)")
    timed(calls.ProgramCall, "_wait_for_program", "engine waits for programs", debug_sync=False)
    timed(calls.ProgramCall, "_switch_in", "engine runs programs (greenlets)", debug_sync=False)
    for module, site in ((dispatch, "a hook"), (interleaver, "a step's start or end")):
        inner = (lambda fn, *args: fn(*args)) if os.environ.get("PROBE_NO_HUB") else module.run_shallow
        if os.environ.get("PROBE_NO_HUB"):  # an A/B of greenlets.run_shallow: the engine switches into programs itself
            module.run_shallow = inner
        if os.environ.get("PROBE_FINE"):  # how deep the engine is there (greenlet walks that on Python 3.12+)
            module.run_shallow = _frames_at(site, inner)
    if os.environ.get("PROBE_NO_PROLOGUE"):  # an A/B of prologue.py: every program starts at the step's start
        interleaver.prologue_of = lambda program: None
    if os.environ.get("PROBE_NO_RUNS"):  # an A/B of runs (saves.py): tapped saves added to the ledger each step
        from interlace.workers import saves
        saves.SaveLedger.run_rows = lambda self, *args, **kwargs: None
    if os.environ.get("PROBE_FINE"):  # a program per invoke's path, part by part (each timer adds ~0.5 us)
        from interlace.workers import holds, points, states, view
        for owner, name, label in (
            (dispatch.PointDispatcher, "_deliver", "    hooks: deliver (read, resume the program, write back)"),
            (dispatch.PointDispatcher, "after_resume", "      after_resume (write back, want the next point)"),
            (dispatch.PointDispatcher, "_write_back", "        _write_back"),
            (points.TapAccess, "read", "      TapAccess.read"),
            (points.PointAccess, "read", "      PointAccess.read"),
            (holds.Holdings, "close", "    hooks: holds.close"),
            (calls.ProgramCall, "start", "    begin_step: call.start (runs the program to its first wait)"),
            (calls.ProgramCall, "__init__", "    begin_step: ProgramCall()"),
            (states.CallContext, "__init__", "    begin_step: CallContext()"),
            (view.ProgramView, "__init__", "    begin_step: ProgramView()"),
            (dispatch.PointDispatcher, "close_calls", "    end_step: close_calls"),
            (calls.ProgramCall, "release", "    end_step: call.release"),
        ):
            timed(owner, name, label, debug_sync=False)
    probe_handoffs()
    timed(saves, "host_copy", "saves.host_copy")
    timed(saves.SaveLedger, "take", "reports: ledger.take")
    timed(save_gather.TakenSaves, "assemble", "reports: gather into the file (reporter)", debug_sync=False)
    timed(reports, "_write_reports", "reports: a batch, header and copies included (reporter)", debug_sync=False)
    timed(reports, "_write_together", "reports: traces' batches together, headers and copies included (reporter)", debug_sync=False)
    timed(report_file.ReportFileWriter, "allocate", "  gather: region of the data file", debug_sync=False)
    timed(save_gather, "_plan", "  gather: plan", debug_sync=False)
    timed(save_gather, "_copy", "  gather: copies", debug_sync=False)
    timed(report_file.ReportFileWriter, "finish", "reports: header (reporter)", debug_sync=False)
    timed(report_file.DataFile, "reserve", "reports: reserving the data file (reporter, ahead)", debug_sync=False)
    timed(driver_model, "read_new_reports", "driver: read reports", debug_sync=False)
    timed(driver_model.Model, "_generate", "driver: generate", debug_sync=False)
    timed(driver_model.Model, "_collect", "driver: collect reports", debug_sync=False)


def _frames_at(site: str, inner):
    """``inner`` (greenlets.run_shallow or a direct call), noting in DEPTHS the most Python frames its
    callers at ``site`` were deep."""
    def run(fn, *args):
        depth, frame = 0, sys._getframe(1)
        while frame is not None:
            depth, frame = depth + 1, frame.f_back
        DEPTHS[site] = max(DEPTHS.get(site, 0), depth)
        return inner(fn, *args)
    return run


def print_tail() -> None:
    """What ran between the trace's last forward pass and its results, in ms from that pass's end
    (calls that ended before it are left out)."""
    end = LAST_STEP_END[0]
    if end is None:
        return
    tail = sorted((e for e in EVENTS if e[2] > end and e[0] != "driver: read reports" or e[2] - e[1] > 1e-3), key=lambda e: e[1])
    print("  tail (ms from the last step's end: start..end):")
    for label, started, ended in tail:
        if ended > end:
            print(f"    {1000 * (started - end):8.1f} .. {1000 * (ended - end):8.1f}  {label.strip()}")


def _write_logs_kept(model) -> int:
    """Program invokes admitted with a write log so far (workers/write_log.py): where the KV cache
    could preempt them, a case measures the logging path, not the one an ample cache takes."""
    return sum(rank["write_logs"].get("kept", 0) for rank in model.step_counts())


def _print_profile(profile, top: int, steps: int) -> None:
    """The runner steps' functions with the most own time, per step (times are cProfile's, so
    inflated for Python-heavy code: compare cases, not with the wall times above)."""
    import pstats

    if os.environ.get("PROBE_PROFILE_DUMP"):  # for pstats' print_callees, e.g. of Interleaver.end_step
        profile.dump_stats(os.environ["PROBE_PROFILE_DUMP"])
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, primitive calls, own, cumulative, callers)
    ours = os.environ.get("PROBE_PROFILE_OURS")  # e.g. "interlace|workers": those files only, by cumulative time
    if ours:
        rows = sorted(((k, v) for k, v in stats.items() if any(w in k[0] for w in ours.split("|"))), key=lambda kv: -kv[1][3])[:top]
    else:
        rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    callers_of = os.environ.get("PROBE_PROFILE_CALLERS")  # e.g. "copy_": who calls functions with that in their name
    if callers_of:
        for (file, line, name), (calls, _, own, _, callers) in stats.items():
            if callers_of in name:
                print(f"  callers of {name} ({file}:{line}; {1000 * own / steps:.3f} ms/step own, {calls / steps:.1f} calls/step):")
                for (cfile, cline, cname), caller in sorted(callers.items(), key=lambda kv: -kv[1][2])[:8]:
                    print(f"    {1000 * caller[2] / steps:7.3f} ms/step {caller[0] / steps:6.1f} calls/step  "
                          f"{'/'.join(cfile.split('/')[-3:])}:{cline}({cname})")
    print(f"  profile: {sum(v[2] for v in stats.values()) * 1000 / steps:.3f} ms/step of own time in all; the top {top}:")
    for (file, line, name), (calls, _, own, cumulative, _) in rows:
        where = f"{'/'.join(file.split('/')[-3:])}:{line}({name})"
        print(f"    {1000 * own / steps:7.3f} own {1000 * cumulative / steps:8.3f} cum ms/step {calls / steps:7.1f} calls/step  {where}")


@contextlib.contextmanager
def _switched_off(owner, name: str, replacement):
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _ablate_keep():
    """Saved rows are made (gathered, limits checked) but not kept: nothing held, nothing reported."""
    from interlace.workers import saves

    stack = contextlib.ExitStack()
    stack.enter_context(_switched_off(saves.SaveLedger, "run_rows", lambda *args, **kwargs: None))
    stack.enter_context(_switched_off(saves.SaveLedger, "add", lambda *args, **kwargs: None))
    return stack


def _ablate_ops():
    """Declarative ops do nothing at their hooks (the hooks, schedules and plans stay)."""
    from interlace.workers import dispatch

    return _switched_off(dispatch.PointDispatcher, "_apply_op", lambda *args, **kwargs: None)


def _ablate_dispatch():
    """Hooks return at once (begin_step still schedules, plans, and starts programs)."""
    from interlace.workers import dispatch

    return _switched_off(dispatch.PointDispatcher, "dispatch", lambda self, step, module, family, hooked: hooked)


def _ablate_step():
    """No steps at all: requests are admitted and finished, hooks installed, and called for nothing."""
    from interlace.workers import interleaver

    return _switched_off(interleaver.Interleaver, "begin_step", lambda self, layout: None)


ABLATIONS = {"keep": _ablate_keep, "ops": _ablate_ops, "dispatch": _ablate_dispatch, "step": _ablate_step}


def _blocking_cuda_sync() -> None:
    """cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync) before the device's context exists."""
    import ctypes

    import torch  # loads libcudart

    import glob

    with open("/proc/self/maps") as maps:
        loaded = [line.split()[-1] for line in maps if "libcudart.so" in line]
    site = os.path.dirname(os.path.dirname(torch.__file__))
    path = (loaded + sorted(glob.glob(f"{site}/nvidia/**/libcudart.so*", recursive=True)))[0]
    assert ctypes.CDLL(path).cudaSetDeviceFlags(0x04) == 0, "cudaSetDeviceFlags failed"
    print(f"CUDA waits block (cudaDeviceScheduleBlockingSync, {path})")


def _variant(name: str):
    """A context for one --ab variant: the default (pinned report files on a GPU), or one part
    changed: pageable report files, no reserving ahead, or saves made but not kept."""
    from interlace.workers import report_file, reports

    if name == "pageable":
        return _switched_off(report_file._Cudart, "get", classmethod(lambda cls: None))
    if name == "no-reserve":
        return _switched_off(reports, "RESERVE_MIN", 1 << 62)
    if name == "no-keep":
        return _ablate_keep()
    return contextlib.nullcontext()


def ab(model, data, args, cases) -> None:
    """Variants of the same traces alternating on one engine, round by round (timings drift too
    much between lent machines and runs for an A/B across processes)."""
    import statistics

    from runner_bench import run_interlace

    variants = args.ab_variants.split(",")
    for name in args.cases.split(","):
        timings: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
        run_interlace(model, data, args.out, cases[name])  # warm
        for round_ in range(args.ab):
            for variant in (variants if round_ % 2 == 0 else variants[::-1]):
                LAST_STEP_END[0] = None
                with _variant(variant):
                    seconds, _tokens, _saved = run_interlace(model, data, args.out, cases[name])
                tail = time.perf_counter() - LAST_STEP_END[0] if LAST_STEP_END[0] else float("nan")
                timings[variant].append((seconds, tail))
        for variant, runs in timings.items():
            seconds, tails = [r[0] for r in runs], [r[1] for r in runs]
            print(f"{name} ({variant}, {len(runs)} traces): trace s median {statistics.median(seconds):.3f} "
                  f"min {min(seconds):.3f}; last step to results s median {statistics.median(tails):.3f} min {min(tails):.3f}",
                  flush=True)


def _device_segments() -> int:
    """How many device memory segments torch's caching allocator has obtained so far (cudaMalloc calls)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    return torch.cuda.memory_stats().get("segment.all.allocated", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="ops-save4,prog-save4,prog-steer1")
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--in", dest="inp", type=int, default=128)
    parser.add_argument("--out", type=int, default=128)
    shapes.add_argument(parser)
    parser.add_argument("--no-baseline", action="store_true", help="skip the 'none' case (e.g. under a profiler)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile the runner's steps (cProfile) and print the N functions with the most own time")
    parser.add_argument("--reserve-ab", action="store_true",
                        help="run each case also without reserving report data files ahead (an A/B in one process)")
    parser.add_argument("--threads-ab", type=int, default=0, metavar="N",
                        help="run each case also with N torch intra-op threads (interlace serves a GPU with 1)")
    parser.add_argument("--ablate", action="append", default=[], choices=sorted(ABLATIONS),
                        help="run each case also with this part of interlace switched off (results are then "
                             "incomplete: a diagnostic of where time goes)")
    parser.add_argument("--graphs", action="store_true",
                        help="a compiled engine with CUDA graphs (enforce_eager=False) with interlace's default graph "
                             "taps (every layer's resid), as runner_bench --graphs")
    parser.add_argument("--case-taps", action="store_true",
                        help="declare only the cases' points as graph taps (as runner_bench --case-taps)")
    parser.add_argument("--kv-gib", type=float, default=None,
                        help="KV cache per rank in GiB (as runner_bench's): small enough and vLLM preempts")
    parser.add_argument("--taps", action="store_true",
                        help="the ops cases' points are graph taps (on a CPU, taps run in the eager forward)")
    parser.add_argument("--ab", type=int, default=0, metavar="ROUNDS",
                        help="only this: each case's traces in --ab-variants, alternating on one engine for ROUNDS "
                             "rounds; medians and minima of the trace and of its tail")
    parser.add_argument("--ab-variants", default="default,pageable",
                        help="from default, pageable (report files not pinned), no-reserve (nothing reserved ahead), "
                             "no-keep (saves made, not kept)")
    parser.add_argument("--profile-all", action="store_true",
                        help="with --profile: profile the whole trace on the engine thread (scheduler, output "
                             "processing, the driver's loop: this probe runs them in one thread), not only the runner's steps")
    parser.add_argument("--copy-sources", action="store_true",
                        help="profile each timed trace with CPU and CUDA activity and Python stacks (slow) and "
                             "print which calls launched copies between host and device")
    parser.add_argument("--timeline", action="store_true",
                        help="record the GPU's activity during each timed trace (torch profiler, CUDA only): busy "
                             "and idle time, top kernels, GPU busy time per decode step")
    parser.add_argument("--blocking-sync", action="store_true",
                        help="CUDA waits block instead of spinning, so time the engine thread waits for the GPU "
                             "shows as wall time above its CPU time")
    parser.add_argument("--profile-in", default="",
                        help="comma-separated module.Class.method (under interlace.workers): a cProfile of each, "
                             "enabled only while it runs, printed by cumulative time (e.g. dispatch.PointDispatcher.take_tapped)")
    args = parser.parse_args()
    if args.blocking_sync:
        _blocking_cuda_sync()

    import interlace
    from runner_bench import config, graph_taps, interlace_cases, prompts, run_interlace

    args.tp, args.pp = 1, 1
    cfg = config(args)
    if args.taps or args.case_taps:  # the ops cases' points are graph taps (taps.py); --graphs alone: the default taps
        from transformers import AutoConfig

        cfg = cfg.model_copy(update={"graph_taps": graph_taps(AutoConfig.from_pretrained(cfg.checkpoint_path()).num_hidden_layers)})
    model = interlace.Model(cfg)
    hf = model.engine.llm_engine.model_config.hf_config
    cases = interlace_cases(hf.hidden_size, hf.num_hidden_layers)
    data = prompts(args.n, args.inp, min(1000, hf.vocab_size))
    install_probes()
    profiled = _profile_in(args.profile_in)
    if args.ab:
        ab(model, data, args, cases)
        return
    from interlace.workers import reports

    import torch

    threads = torch.get_num_threads()
    variants = [("", reports.RESERVE_MIN, threads, None)]
    variants += [(" (no reserving ahead)", 1 << 62, threads, None)] if args.reserve_ab else []
    variants += [(f" (torch threads {args.threads_ab})", reports.RESERVE_MIN, args.threads_ab, None)] if args.threads_ab else []
    variants += [(f" (ablated: {name})", reports.RESERVE_MIN, threads, name) for name in args.ablate]
    for name in ([] if args.no_baseline else ["none"]) + args.cases.split(","):
        case, _, where = name.partition("@")
        SAVES_ON_HOST[0] = where == "host"
        for (variant, reserve_min, torch_threads, ablation), warm in [(v, w) for w in (True, False) for v in variants]:
            reports.RESERVE_MIN = reserve_min
            torch.set_num_threads(torch_threads)
            ablated = ABLATIONS[ablation]() if ablation else contextlib.nullcontext()
            TOTALS.clear(), CPU_TOTALS.clear(), COUNTS.clear(), SYNCS.clear(), STEPS.clear(), EVENTS.clear(), STEP_STARTS.clear()
            STEP_PERF.clear()
            DEPTHS.clear(), GC_TYPES.clear()
            LAST_STEP_END[0] = None
            segments = _device_segments()
            if args.profile and not warm:
                import cProfile

                PROFILE[0] = cProfile.Profile()
            process_cpu = time.process_time()
            timeline = contextlib.nullcontext()
            if args.timeline and not warm and torch.cuda.is_available():
                from torch.profiler import ProfilerActivity, profile as torch_profile

                timeline = torch_profile(activities=[ProfilerActivity.CUDA])
            if args.copy_sources and not warm and torch.cuda.is_available():
                from torch.profiler import ProfilerActivity, profile as torch_profile

                timeline = torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True)
            whole = PROFILE[0] if args.profile_all else None
            PROFILE[0] = None if whole is not None else PROFILE[0]
            logs_kept = _write_logs_kept(model)
            with ablated, timeline as recorded:
                if whole is not None:
                    whole.enable()
                seconds, tokens, saved = run_interlace(model, data, args.out, cases[case])
                if whole is not None:
                    whole.disable()
                    PROFILE[0] = whole
            process_cpu = time.process_time() - process_cpu
            logs_kept = _write_logs_kept(model) - logs_kept
            segments = _device_segments() - segments
            profile, PROFILE[0] = PROFILE[0], None
            inside = {label: prof for label, prof in profiled.items()}
            for label in profiled:
                profiled[label] = __import__("cProfile").Profile()  # the next trace's own
            tail = f"{time.perf_counter() - LAST_STEP_END[0]:.3f} s" if LAST_STEP_END[0] else "-"
            if warm:
                continue
            steps = max(1, COUNTS["runner.execute_model"])
            print(f"\n{name}{variant}: {seconds:.3f} s, {tokens / seconds:.0f} tok/s, {steps} steps, {saved:.0f} MiB saved, "
                  f"{tail} from the last step to the results, {segments} device memory segments allocated (cudaMalloc); "
                  f"process CPU {process_cpu:.3f} s in all threads, torch intra-op threads {torch.get_num_threads()}"
                  + (f"; {logs_kept} invoke(s) kept a write log (the KV cache could preempt them: their programs' "
                     "writes were logged, and each started alone; --kv-gib for an ample cache)" if logs_kept else ""))
            for label, total in sorted(TOTALS.items(), key=lambda kv: -kv[1]):
                print(f"  {label:34} {total:8.3f} s  {1000 * total / steps:8.3f} ms/step  ({COUNTS[label]} calls)"
                      + (f"  thread CPU {CPU_TOTALS[label]:.3f} s" if label in CPU_TOTALS else ""))
            print_steps()
            print_decode_parts()
            if GC_TYPES:
                print("  objects in generation 0 when collections started (PROBE_GC_TYPES), most: "
                      + ", ".join(f"{name} {n}" for name, n in GC_TYPES.most_common(25)))
            if DEPTHS:
                print("  the engine's Python frames where it hands programs to the hub (most): "
                      + ", ".join(f"{site} {depth}" for site, depth in DEPTHS.items()))
            if recorded is not None and args.copy_sources:
                print_copy_sources(recorded)
            elif recorded is not None:
                print_timeline(recorded.profiler.kineto_results.events(), seconds)
            print_tail()
            if profile is not None:
                _print_profile(profile, args.profile, steps)
            for label, prof in inside.items():
                _print_inside(label, prof, steps)
            for where, count in SYNCS.most_common(10):
                print(f"  sync x{count}: {where}")
    with contextlib.suppress(Exception):
        model.close()


def _profile_in(spec: str) -> dict:
    """``--profile-in``: wrap each named method so that a cProfile (one per method, replaced per
    trace) records only inside it. Returns label -> the current profile."""
    import cProfile
    import importlib

    profiled: dict = {}
    for name in filter(None, spec.split(",")):
        module_name, cls_name, method = name.rsplit(".", 2)
        owner = getattr(importlib.import_module(f"interlace.workers.{module_name}"), cls_name)
        original = getattr(owner, method)
        profiled[name] = cProfile.Profile()

        def wrapper(*args, _original=original, _name=name, **kwargs):
            prof = profiled[_name]
            try:  # Python 3.12+: one profiler at a time in a process (sys.monitoring); nested ones run unrecorded
                prof.enable()
            except ValueError:
                return _original(*args, **kwargs)
            try:
                return _original(*args, **kwargs)
            finally:
                prof.disable()

        setattr(owner, method, functools.wraps(original)(wrapper))
    return profiled


def _print_inside(label: str, prof, steps: int) -> None:
    import pstats

    stats = pstats.Stats(prof)
    print(f"  inside {label} (cProfile, its overhead included; ms per step, cumulative):")
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:int(os.environ.get("PROBE_TOP", "25"))]
    for (path, line, func), (_cc, calls, own, cum, _callers) in rows:
        where = path.split("/site-packages/")[-1].split("/main/")[-1]
        print(f"    {1000 * cum / steps:8.3f} cum {1000 * own / steps:8.3f} own  {calls / steps:6.1f}/step  {where}:{line}({func})")


if __name__ == "__main__":
    main()
