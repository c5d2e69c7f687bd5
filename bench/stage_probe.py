"""Stage probe: where each rank of a TP/PP engine spends a trace (a diagnostic, not a figure).

bench/step_probe.py times interlace's phases on a one-rank engine run inside its own process.
Under TP or PP the ranks are worker processes, so this probe sends them its timers through
vLLM's ``collective_rpc`` (a function shipped to every worker and called there with the worker)
and reads them back after each trace. It runs the engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) to time the scheduler loop too. Per case and rank it prints:

- the rank's steps (``execute_model`` calls): how many, wall and CPU time in them, and how long the
  rank sat between them (waiting for its next batch: under PP, the stage that waits least is the
  one that sets the pace);
- interlace's phases on that rank (begin_step, hooks, end_step, finish, the reporter's batches),
  in ms per step;
- the tail: when the rank ended its last step and wrote its last report, counted back from the
  moment the driver had the trace's results.

Usage: python bench/stage_probe.py [--pp 2] [--tp 1] [--graphs] [--shape 1b] [--n 256] [--in 128] [--out 128]
       [--cases none,ops-save4,ops-steer1] [--rounds 2] [--syncs]
Each case runs ``--rounds`` times after a warm-up trace; every round prints its own table.
"""

from __future__ import annotations

import argparse
import os
import time

import shapes  # bench/, this script's folder

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

# The worker side. These functions travel to the workers by value (cloudpickle ships functions of
# __main__ whole), so what they keep lives on the worker object, not in this module's globals;
# for the same reason the timer below is its own, not bench/step_probe.py's (which fills that
# module's globals in the one process it probes).


def _install(worker, check_syncs: bool = False) -> int:
    """Wrap the rank's step and interlace's phases with timers; returns the rank's pid. With
    ``check_syncs`` interlace's phases run under torch's sync debug mode, and each synchronising
    CUDA call they make is counted by where it was made."""
    import functools
    import time as clock
    import warnings

    import torch

    from interlace.workers import dispatch, interleaver, reports, save_gather, saves, step_schedule, taps

    if getattr(worker, "_stage_probe", None) is not None:
        return os.getpid()
    probe = worker._stage_probe = {"totals": {}, "counts": {}, "steps": [], "marks": {}, "syncs": {}}
    check_syncs = check_syncs and torch.cuda.is_available()

    def timed(owner, name: str, label: str, step: bool = False) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return
        checked = check_syncs and not step and not label.startswith(("reporter", "  reporter"))  # the engine thread's

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            started, cpu = clock.perf_counter(), clock.thread_time()
            mode = torch.cuda.get_sync_debug_mode() if checked else None
            if mode is not None:
                torch.cuda.set_sync_debug_mode(1)
            caught: list = []
            try:
                if mode is None:  # catch_warnings is process-wide state: only on the checked (engine) thread
                    return original(*args, **kwargs)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    return original(*args, **kwargs)
            finally:
                if mode is not None:
                    torch.cuda.set_sync_debug_mode(mode)
                    for w in caught:
                        if "synchroniz" in str(w.message):
                            where = f"{label}: {w.filename}:{w.lineno}"
                            probe["syncs"][where] = probe["syncs"].get(where, 0) + 1
                ended = clock.perf_counter()
                probe["totals"][label] = probe["totals"].get(label, 0.0) + ended - started
                probe["counts"][label] = probe["counts"].get(label, 0) + 1
                probe["marks"][label] = clock.time()  # wall clock: comparable with the driver's
                if step:
                    probe["steps"].append((started, ended, clock.thread_time() - cpu))

        setattr(owner, name, wrapper)

    timed(type(worker), "execute_model", "rank: execute_model", step=True)
    timed(type(worker), "sample_tokens", "rank: sample_tokens")
    timed(interleaver.Interleaver, "begin_step", "interleaver.begin_step")
    timed(dispatch.PointDispatcher, "dispatch", "interleaver.hooks")
    timed(interleaver.Interleaver, "end_step", "interleaver.end_step")
    timed(interleaver.Interleaver, "finish", "interleaver.finish")
    timed(reports.ReportBatcher, "_take", "  finish: a batch taken")
    timed(saves.SaveLedger, "take", "  finish: ledger.take")
    timed(reports, "_write_reports", "reporter: a batch written")
    timed(reports, "_write_together", "reporter: traces' batches written together")
    timed(save_gather.TakenSaves, "assemble", "  reporter: gather and copy")
    timed(taps.Taps, "fill", "  begin_step: taps.fill")
    timed(step_schedule.StepScheduler, "_schedule_afresh", "  begin_step: batch built afresh")  # a new epoch
    for phase in ("prepare_inputs", "sample", "postprocess_sampled"):  # vLLM's own (V2 runner names)
        timed(type(worker.model_runner), phase, f"vllm: {phase}")
    return os.getpid()


def _graph_steps(worker) -> dict:
    return dict(getattr(worker.model_runner._interlace, "graph_steps", None) or {})


def _reset(worker) -> None:
    probe = worker._stage_probe
    for value in probe.values():
        value.clear()
    probe["graph_steps_before"] = _graph_steps(worker)


def _collect(worker) -> dict:
    from vllm.distributed import parallel_state

    probe = worker._stage_probe
    rank = {"tp": parallel_state.get_tensor_model_parallel_rank(), "pp": parallel_state.get_pp_group().rank_in_group}
    before = probe.get("graph_steps_before", {})
    rank["graph_steps"] = {kind: n - before.get(kind, 0) for kind, n in _graph_steps(worker).items()}
    return {"rank": rank, "totals": dict(probe["totals"]), "counts": dict(probe["counts"]),
            "steps": list(probe["steps"]), "marks": dict(probe["marks"]), "syncs": dict(probe["syncs"])}


# The driver side.

ENGINE: dict[str, list[float]] = {}  # the engine core's loop, in this process: label -> [seconds, calls]


def time_engine_core() -> None:
    """The engine core's loop runs in this process: time its steps and the scheduler's parts (what
    is left of a step is mostly the wait for the ranks' outputs)."""
    import functools

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    def timed(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                entry = ENGINE.setdefault(label, [0.0, 0])
                entry[0] += time.perf_counter() - started
                entry[1] += 1

        setattr(owner, name, wrapper)

    timed(EngineCore, "step_with_batch_queue", "engine core: step (batch queue)")
    timed(EngineCore, "step", "engine core: step")
    timed(Scheduler, "schedule", "  scheduler: schedule")
    timed(Scheduler, "update_from_output", "  scheduler: update_from_output")



def print_rank(report: dict, done_at: float) -> None:
    import numpy as np

    steps = report["steps"]
    rank = f"TP{report['rank']['tp']} PP{report['rank']['pp']}"
    if not steps:
        print(f"  {rank}: no steps")
        return
    starts, ends, cpu = (np.array(column) for column in zip(*steps))
    wall = ends - starts
    between = np.maximum(0.0, starts[1:] - ends[:-1]).sum()
    n = len(steps)
    kinds = report["rank"]["graph_steps"]  # a compiled engine's steps by kind: graph, taps or eager
    print(f"  {rank}: {n} steps{f' {kinds}' if kinds else ''}; in steps {wall.sum():.3f} s wall "
          f"(median {1000 * np.median(wall):.2f} ms), {cpu.sum():.3f} s CPU; between steps {between:.3f} s")
    for label, total in sorted(report["totals"].items(), key=lambda kv: -kv[1]):
        print(f"    {label:38} {total:8.3f} s {1000 * total / n:8.3f} ms/step ({report['counts'][label]} calls)")
    marks = report["marks"]
    tail = [f"{name} {1000 * (done_at - marks[key]):.1f} ms" for name, key in
            (("last step ended", "rank: execute_model"), ("last report written", "reporter: a batch written"))
            if key in marks]
    if tail:
        print(f"    before the driver had the results: {', '.join(tail)}")
    for where, count in sorted(report["syncs"].items(), key=lambda kv: -kv[1])[:10]:
        print(f"    sync x{count}: {where}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--in", dest="inp", type=int, default=128)
    parser.add_argument("--out", type=int, default=128)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--graphs", action="store_true", help="a compiled engine with the ops cases' points as graph taps")
    shapes.add_argument(parser)
    parser.add_argument("--cases", default="none,ops-save4,ops-steer1")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--syncs", action="store_true", help="count synchronising CUDA calls in interlace's phases "
                        "(torch's sync debug mode; adds microseconds per call)")
    args = parser.parse_args()

    import interlace
    from runner_bench import config, graph_taps, host_line, interlace_cases, prompts, run_interlace

    print(host_line(), flush=True)
    cfg = config(args)
    if args.graphs:
        from transformers import AutoConfig

        layers = AutoConfig.from_pretrained(cfg.checkpoint_path()).num_hidden_layers
        cfg = cfg.model_copy(update={"graph_taps": graph_taps(layers)})
    import torch

    if cfg.tensor_parallel_size * cfg.pipeline_parallel_size > 1 and not torch.cuda.is_available():
        # as tests/test_parallel.py's CPU engines; on a GPU vLLM picks "mp" itself, and the config
        # stays runner_bench's, whose compiled graphs this probe then finds in vLLM's cache
        cfg = cfg.model_copy(update={"engine_args": {**cfg.engine_args, "distributed_executor_backend": "mp"}})
    time_engine_core()  # before the engine starts: it keeps its step method bound from then on
    model = interlace.Model(cfg)
    hf = model.engine.llm_engine.model_config.hf_config
    cases = interlace_cases(hf.hidden_size, hf.num_hidden_layers)
    vocab = min(1000, hf.vocab_size)
    print(f"ranks (pids): {model.engine.collective_rpc(_install, args=(args.syncs,))}", flush=True)
    seed = 1
    for name in args.cases.split(","):
        run_interlace(model, prompts(args.n, args.inp, vocab, seed=seed), args.out, cases[name])  # warm-up
        seed += 1
        for round_ in range(args.rounds):
            model.engine.collective_rpc(_reset)
            ENGINE.clear()
            seconds, tokens, saved = run_interlace(model, prompts(args.n, args.inp, vocab, seed=seed), args.out, cases[name])
            done_at = time.time()
            seed += 1
            print(f"\n{name} (round {round_}): {seconds:.3f} s, {tokens / seconds:.0f} tok/s, {saved:.1f} MiB saved; "
                  f"TP={args.tp} PP={args.pp}, {'CUDA graphs' if args.graphs else 'eager'}")
            for label, (total, calls) in sorted(ENGINE.items(), key=lambda kv: kv[0].startswith(" ")):  # steps first
                print(f"  {label:40} {total:8.3f} s ({calls} calls)")
            for report in sorted(model.engine.collective_rpc(_collect), key=lambda r: (r["rank"]["pp"], r["rank"]["tp"])):
                print_rank(report, done_at)
    model.close()


if __name__ == "__main__":
    main()
