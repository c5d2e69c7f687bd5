"""Runner benchmark: interlace against plain vLLM, in one process and one run, paired.

A Llama-3 shape with random bf16 weights (``--shape 1b|8b|70b``, bench/shapes.py; no download), N prompts x IN tokens, OUT
generated tokens each, greedy, eager mode, or with ``--graphs`` both engines compiled with CUDA graphs
(interlace with its default graph taps, every layer's resid: ops run inside the graphs and
programs between their pieces, workers/taps.py and workers/graphs.py). Cases:

    none             the interlace engine, requests without interventions
    ops-save4        declarative: save the last token's residual at 4 layers, every step
    ops-steer1       declarative: add a steering vector at 1 layer, every step
    prog-save4       the same as a batched Python program
    prog-steer1      the same as a batched Python program
    prog-steer1-each the steering program unbatched: one program call per invoke per step
    ops-save4-unheld ops-save4 with gang admission off (its requests enter vLLM's scheduler as they
                     come): what holding a trace a step's budget at a time costs (diagnostic)

Both engines stay up side by side (a plain ``vllm.LLM`` and an interlace model with the same
settings); every timed interlace run is paired with a plain run right before or after it (the
order alternates by round, and rounds go over every case) on the same new prompts, and a case's
figure is the median of its paired ratios (interlace tok/s / plain tok/s). With ``--graphs
--eager-too`` an eager interlace engine (the default) runs each case too, right after the compiled
one on the same prompts, against the same plain run: the two figures then come from one run. Pairing cancels the
machine's drift, which between separate runs was larger than the effects measured. Every pair
runs new prompts: prompts seen before would be served from plain vLLM's prefix cache, which an
intervened request bypasses (its hooks must see every token).

Usage: python bench/runner_bench.py [--n 256[,1024...]] [--in 128] [--out 128] [--tp 1] [--pp 1]
       [--cases a,b] [--repeats 3] [--graphs [--eager-too]] [--shape 1b]     (--shape tiny: the bundled tiny Llama, e.g. on CPU)
       [--kv-gib G]
``--kv-gib`` squeezes both engines' KV cache to G GiB per rank, so vLLM preempts and recomputes
requests: plain vLLM recomputes, interlace replays ops and programs' logged writes on the
recomputed rows (workers/write_log.py). Each pair's line then counts the chunks interlace
replayed (``replays``); e.g. ``--shape 1b --n 256 --in 128 --out 128 --kv-gib 0.5 --cases
none,ops-steer1,prog-steer1,prog-steer1-each``.
       python bench/runner_bench.py --kv-clear [--n 256] [--in 128] [--out 128] [--shape 1b]
Prints one JSON line per pair, then a table. ``--kv-clear`` times only what clearing intervened
requests' KV-cache blocks adds (workers/kv_blocks.py; the steering cases above pay it): the
per-step look at new blocks over N decoding requests, and clearing N finished requests' blocks
in KV-cache tensors of the model's shape, on this machine's device.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import statistics
import threading
import time
from typing import Callable

import shapes  # bench/, this script's folder
from pool_pairs import median_interval

def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def config(args):
    engine_args = {}
    if getattr(args, "eager_too", False) and args.shape != "tiny":
        engine_args["gpu_memory_utilization"] = 0.28  # three engines share the GPU
    # --graphs: vLLM as users run it, compiled with CUDA graphs (both engines; interlace's default
    # on a GPU); otherwise both eager
    engine_args["enforce_eager"] = not getattr(args, "graphs", False)
    update = {"tensor_parallel_size": getattr(args, "tp", 1), "pipeline_parallel_size": getattr(args, "pp", 1)}
    if getattr(args, "kv_gib", None):  # a squeezed KV cache: vLLM preempts (both engines alike)
        update["kv_cache_bytes"] = int(args.kv_gib * 2**30)
    return shapes.model_config(args, **engine_args).model_copy(update=update)


def plain_engine_args(cfg) -> dict:
    """vLLM's keyword arguments for ``cfg`` with no interlace at all (no worker extension, vLLM's
    own scheduler and compilation settings), the process environment prepared as for interlace."""
    from interlace.cluster.engine import engine_args, prepare_environment

    prepare_environment(cfg)
    kwargs = engine_args(cfg.model_copy(update={"graph_taps": []}))
    kwargs.pop("worker_extension_cls")
    kwargs.pop("scheduler_cls")
    return kwargs


def plain_engine(cfg):
    """vLLM with the same settings and no interlace at all."""
    from vllm import LLM

    return LLM(**plain_engine_args(cfg))


def case_layers(layers: int) -> tuple[list[int], int]:
    """The layers the cases save (3, 7, 11, 15 on 16 layers) and the one they steer."""
    return [layers * (i + 1) // 4 - 1 for i in range(4)], layers // 2


def graph_taps(layers: int) -> list[str]:
    """The points the ops cases use (the probes declare only these as graph taps; this bench
    takes the default, every layer's resid)."""
    save_layers, steer_layer = case_layers(layers)
    return [f"layers.{layer}.resid" for layer in sorted({*save_layers, steer_layer})]


def interlace_cases(hidden: int, layers: int):
    import torch

    import interlace
    from interlace import ops

    save_layers, steer_layer = case_layers(layers)
    vector = torch.randn(hidden, dtype=torch.bfloat16) * 0.01

    @interlace.batched
    def save4(m):
        for layer in save_layers:
            m.save(f"l{layer}", m.last(m.layers[layer].resid))

    @interlace.batched
    def steer1(m):
        m.layers[steer_layer].resid += vector

    def steer1_each(m):
        m.layers[steer_layer].resid += vector

    def read1_each(m):  # diagnostics: what a program per invoke costs without its write (step_probe)
        m.layers[steer_layer].resid

    def noop_each(m):  # and without reaching any point
        pass

    return {
        "none": {},
        "ops-save4": {"ops": [ops.save(f"layers.{layer}.resid", tokens="last") for layer in save_layers]},
        "ops-steer1": {"ops": [ops.add(f"layers.{steer_layer}.resid", vector)]},
        "prog-save4": {"program": save4},
        "prog-steer1": {"program": steer1},
        "prog-steer1-each": {"program": steer1_each},
        "prog-read1-each": {"program": read1_each},
        "prog-noop-each": {"program": noop_each},
        "ops-save4-unheld": {"ops": [ops.save(f"layers.{layer}.resid", tokens="last") for layer in save_layers],
                             UNHELD: True},
    }


def run_plain(llm, data, out: int) -> tuple[float, int]:
    from vllm import SamplingParams

    for phases in PLAIN_PHASES:
        phases.clear()
    _reset_runner_times(llm)
    params = SamplingParams(max_tokens=out, ignore_eos=True, temperature=0)
    started = time.perf_counter()
    result = llm.generate([{"prompt_token_ids": p} for p in data], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    _read_runner_times(llm)
    return seconds, sum(len(o.outputs[0].token_ids) for o in result)


def paired(round_: int, plain: Callable[[], tuple], others: list[Callable[[], tuple]]) -> tuple[tuple, list[tuple]]:
    """One timed pair (or more): plain vLLM first in even rounds and last in odd ones, so the
    machine's drift falls on both sides alike. Returns plain's result and the others'."""
    first = plain() if round_ % 2 == 0 else None
    results = [run() for run in others]
    return (first if first is not None else plain()), results


UNHELD = "unheld"  # a case's key: its requests skip gang admission (see ungang)


PHASES: dict[str, float] | None = None  # --phases: where the last interlace trace's time went


def run_interlace(model, data, out: int, case: dict) -> tuple[float, int, float]:
    case = dict(case)
    unheld = case.pop(UNHELD, False)
    if PHASES is not None:
        PHASES.clear()
    if STEP_TIMERS:
        _reset_runner_times(model.engine)
    started = time.perf_counter()
    with ungang(unheld), model.trace(max_tokens=out, ignore_eos=True, timeout_s=3600) as tr:
        for p in data:
            tr.invoke(p, **case)
    seconds = time.perf_counter() - started
    if PHASES is not None:
        PHASES["total"] = seconds
    if STEP_TIMERS:
        _read_runner_times(model.engine)
    saved = sum(v.numel() * v.element_size() for r in tr.result for v in r.saves.values())
    return seconds, sum(len(r.token_ids) for r in tr.result), saved / 2**20


def time_phases(model, plain) -> None:
    """--phases (diagnostic): where each trace's time went on the driver, by wrapping the parts
    that run it. Interlace's own: generate (vLLM's ``LLM.generate``: requests in, every token
    out) and collect (waiting for and reading the workers' reports). Inside generate, on both
    engines, vLLM's front end: add (adding the requests, first start to last end), wait (blocked
    on the engine core's outputs; with the engine core in its own process this is its stepping
    as the front end sees it), process (turning outputs into results), and first (from the last
    request added to the first outputs)."""
    global PHASES
    PHASES = {}
    for name in ("_generate", "_collect"):
        _wrap(model, name, name.strip("_"), PHASES)
    plain_phases: dict[str, float] = {}
    PLAIN_PHASES.append(plain_phases)
    for llm, phases in ((model.engine, PHASES), (plain, plain_phases)):
        engine = llm.llm_engine
        _wrap(engine, "add_request", "add", phases, span=True)
        _wrap(engine.engine_core, "get_output", "wait", phases)
        _wrap(engine.output_processor, "process_outputs", "process", phases)
        [cores, *_] = llm.collective_rpc(_time_runner)
        print(f"{'interlace' if llm is model.engine else 'plain'}: the model runner's process may run on cores {cores}")
        STEP_TIMERS.append((llm, phases))


STEP_TIMERS: list = []  # --phases: (engine, its phases), whose runner steps are timed in the worker


def _time_runner(worker) -> list[int]:
    """In the worker (sent by collective_rpc): time the model runner's calls. ``runner``: the time
    inside execute_model and sample_tokens (interlace's work included); ``between``: the engine
    core's time between them (its scheduler, outputs and anything else on its thread, and its
    waits). ``runner_cpu``: the thread's CPU time inside them; where it falls short of ``runner`` the
    thread waited (for the GPU, the GIL, or a core). ``threads``: each thread's CPU seconds in the
    process since the last take, by name, and ``yields``: the runner thread's involuntary context
    switches (the kernel took its core)."""
    runner = worker.model_runner
    state = runner.__dict__.setdefault("_bench_steps", {"runner": 0.0, "runner_cpu": 0.0, "between": 0.0,
                                                        "calls": 0, "last": None})
    state["_threads"] = _thread_cpu()
    for name in ("execute_model", "sample_tokens"):
        method = getattr(runner, name)

        def timed(*args, _method=method, **kwargs):
            begun, begun_cpu = time.perf_counter(), time.thread_time()
            if state["last"] is not None:
                state["between"] += begun - state["last"]
            try:
                return _method(*args, **kwargs)
            finally:
                state["last"] = time.perf_counter()
                state["runner"] += state["last"] - begun
                state["runner_cpu"] += time.thread_time() - begun_cpu
                state["calls"] += 1
                state["_tid"] = threading.get_native_id()
        setattr(runner, name, timed)
    return sorted(os.sched_getaffinity(0))


def _thread_cpu() -> dict[int, tuple[str, float, int]]:
    """This process's threads: native id -> (name, CPU seconds, involuntary context switches)."""
    ticks = os.sysconf("SC_CLK_TCK")
    threads = {}
    for task in os.listdir("/proc/self/task"):
        try:
            stat = open(f"/proc/self/task/{task}/stat").read()
            status = open(f"/proc/self/task/{task}/status").read()
        except OSError:  # ended meanwhile
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        switches = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        threads[int(task)] = (name, (int(fields[11]) + int(fields[12])) / ticks, switches)
    return threads


def _take_runner_times(worker) -> dict:
    state = worker.model_runner._bench_steps
    taken = {k: state[k] for k in ("runner", "runner_cpu", "between", "calls")}
    now, before = _thread_cpu(), state["_threads"]
    busy: dict[str, float] = {}
    for tid, (name, cpu, _) in now.items():
        spent = cpu - before.get(tid, (name, 0.0, 0))[1]
        if spent >= 0.01:
            busy[name] = round(busy.get(name, 0.0) + spent, 2)
    taken["threads"] = busy
    if "_tid" in state and state["_tid"] in now:
        taken["yields"] = now[state["_tid"]][2] - before.get(state["_tid"], ("", 0.0, 0))[2]
    state.update(runner=0.0, runner_cpu=0.0, between=0.0, calls=0, last=None, _threads=now)
    return taken


def _reset_runner_times(engine) -> None:
    for llm, _phases in STEP_TIMERS:
        if llm is engine:
            llm.collective_rpc(_take_runner_times)


def _read_runner_times(engine) -> None:
    for llm, phases in STEP_TIMERS:
        if llm is engine:
            [rank0, *_] = llm.collective_rpc(_take_runner_times)
            phases.update(rank0)


PLAIN_PHASES: list[dict[str, float]] = []  # --phases: plain vLLM's, the same parts


def _wrap(owner, name: str, label: str, phases: dict, span: bool = False) -> None:
    """Time ``owner.name`` into ``phases[label]`` (summed over calls; ``span``: from the first
    call's start to the last one's end), and ``phases["first"]``: the wait for the first outputs."""
    method = getattr(owner, name)

    def timed(*args, **kwargs):
        begun = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            ended = time.perf_counter()
            if span:
                phases.setdefault("_add_start", begun)
                phases["_add_end"] = ended
                phases[label] = ended - phases["_add_start"]
            else:
                phases[label] = phases.get(label, 0.0) + ended - begun
            if label == "wait" and "first" not in phases and "_add_end" in phases:
                phases["first"] = ended - phases["_add_end"]
    setattr(owner, name, timed)


def _shown(phases: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in phases.items() if not k.startswith("_")}


@contextlib.contextmanager
def ungang(on: bool):
    """While on, the driver's requests carry a gang of one, which vLLM's scheduler passes straight
    through (workers/scheduler.py): a diagnostic of what holding a trace costs, not a setting."""
    if not on:
        yield
        return
    from interlace import model as driver_model
    from interlace.workers.scheduler import GANG_KEY

    build = driver_model.build_requests

    def one_gang(*args, **kwargs):
        prompts, params = build(*args, **kwargs)
        for param in params:
            if param.extra_args and GANG_KEY in param.extra_args:
                trace, invoke, _size = param.extra_args[GANG_KEY]
                param.extra_args[GANG_KEY] = [trace, invoke, 1]
        return prompts, params

    driver_model.build_requests = one_gang
    try:
        yield
    finally:
        driver_model.build_requests = build


def kv_clear_cost(args) -> None:
    """Time KVBlocks.update (every step) and KVBlocks.release (once per finished batch)."""
    from types import SimpleNamespace

    import torch

    from interlace.workers.kv_blocks import KVBlocks

    layers, kv_heads, head_dim, block = shapes.kv_cache_shape(args.shape)
    blocks_each = -(-(args.inp + args.out) // block)
    num_blocks = args.n * blocks_each + 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    caches = [torch.zeros(2, num_blocks, block, kv_heads, head_dim, dtype=torch.bfloat16, device=device)
              for _ in range(layers)]
    runner = SimpleNamespace(kv_caches=caches, kv_cache_config=SimpleNamespace(num_blocks=num_blocks))
    req_ids = [f"{i}-r" for i in range(args.n)]
    step = SimpleNamespace(req_ids=req_ids, resumed_req_ids=set(),  # a decode step: one request in 16 grows
                           new_block_ids=[([num_blocks - 1],) if i % 16 == 0 else None for i in range(args.n)])
    timings = {"update per step (ms)": [], "release per finished batch (ms)": []}
    for _ in range(20):
        kv = KVBlocks(runner)
        for i, req_id in enumerate(req_ids):
            kv.hold(req_id, (list(range(1 + i * blocks_each, 1 + (i + 1) * blocks_each)),))
        started = time.perf_counter()
        kv.update(step)
        timings["update per step (ms)"].append((time.perf_counter() - started) * 1e3)
        started = time.perf_counter()
        kv.release(set(req_ids))
        if device == "cuda":
            torch.cuda.synchronize()
        timings["release per finished batch (ms)"].append((time.perf_counter() - started) * 1e3)
    print(f"{args.n} requests x {blocks_each} blocks, {layers} KV-cache tensors on {device}:")
    for name, values in timings.items():
        print(f"  {name:34} median {statistics.median(values):.3f}  max {max(values):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", default="256", help="prompts per trace; several sizes (256,1024) run on the same engines")
    parser.add_argument("--in", dest="inp", type=int, default=128)
    parser.add_argument("--out", type=int, default=128)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="timed pairs per case")
    shapes.add_argument(parser)
    parser.add_argument("--cases", default="none,ops-save4,ops-steer1,prog-save4,prog-steer1,prog-steer1-each")
    parser.add_argument("--kv-gib", type=float, default=None, help="KV cache per rank in GiB, both engines "
                        "(small enough and vLLM preempts: interlace replays ops and programs' writes)")
    parser.add_argument("--kv-clear", action="store_true", help="time clearing intervened requests' KV blocks only")
    parser.add_argument("--graphs", action="store_true", help="both engines compiled with CUDA graphs (enforce_eager=False; "
                        "interlace declares the ops cases' points as graph taps, and runs steps with programs eager)")
    parser.add_argument("--case-taps", action="store_true", help="with --graphs: interlace declares only the cases' "
                        "points as graph taps (5 layers' resid) instead of every layer's: what each tap costs a step "
                        "whose programs run between graph pieces (a cut and a Python break per tap)")
    parser.add_argument("--phases", action="store_true", help="diagnostic: print where each interlace trace's time "
                        "went on the driver (building requests, vLLM's generate, collecting reports)")
    parser.add_argument("--eager-too", action="store_true", help="with --graphs: a third engine, interlace eager (the "
                        "default), runs every case on the same prompts right after the compiled one, against the same plain run")
    args = parser.parse_args()
    args.sizes = [int(n) for n in str(args.n).split(",")]
    args.n = args.sizes[0]  # --kv-clear's
    if args.case_taps and not args.graphs:
        parser.error("--case-taps declares graph taps: give --graphs")
    if args.eager_too and not args.graphs:
        parser.error("--eager-too compares an eager interlace engine with a compiled one: give --graphs")
    if args.kv_clear:
        return kv_clear_cost(args)

    import interlace

    print(host_line(), flush=True)
    if args.phases:  # before the engines start: collective_rpc of the bench's own functions (time_phases)
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    cfg = config(args)
    plain = plain_engine(cfg)
    hf = plain.llm_engine.model_config.hf_config
    # Compiled: the default graph taps (every layer's resid), where ops run inside the CUDA graphs
    # and programs between their pieces (taps.py, graphs.py)
    model = interlace.Model(cfg.model_copy(update={"graph_taps": graph_taps(hf.num_hidden_layers)})
                            if args.case_taps else cfg)
    eager = interlace.Model(config(argparse.Namespace(**{**vars(args), "graphs": False}))) if args.eager_too else None
    cases = interlace_cases(hf.hidden_size, hf.num_hidden_layers)
    if args.phases:
        time_phases(model, plain)
    seeds = itertools.count(1)  # one stream for every size: no pair sees another's prompts (prefix cache)
    for n in args.sizes:
        run_size(args, n, plain, model, eager, cases, min(1000, hf.vocab_size), cfg, seeds)
    graph_steps = model.step_counts()[0]["graph_steps"]
    if graph_steps is not None:
        print(f"interlace engine steps (rank 0): {graph_steps}")
    model.close()
    if eager is not None:
        eager.close()
    plain.llm_engine.engine_core.shutdown()


def host_line() -> str:
    """The machine a run's figures come from. The ratios move between lent hosts of one GPU kind
    (ops-save4 0.85-1.00 on two H100 hosts on 2026-11-27) while each step's host work sets the
    rate, so the CPU is named beside them."""
    import torch

    cpu, mhz = "?", []
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                cpu = value.strip()
            elif key.strip() == "cpu MHz":
                mhz.append(float(value))
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    clock = f", {statistics.median(mhz):.0f} MHz median now" if mhz else ""
    return f"host: {gpu}; {cpu}, {os.cpu_count()} cores{clock}"


def run_size(args, n: int, plain, model, eager, cases: dict, vocab: int, cfg, seeds) -> None:
    """Every case at ``n`` prompts, paired with plain vLLM round by round; prints a table."""
    data = prompts(n, args.inp, vocab)
    run_plain(plain, data, args.out)  # warm-ups at full size: kernels compile per batch shape
    run_interlace(model, data, args.out, cases["ops-steer1"])
    if eager is not None:
        run_interlace(eager, data, args.out, cases["ops-steer1"])

    names = args.cases.split(",")
    ratios: dict[str, list[float]] = {name: [] for name in names}
    eager_ratios: dict[str, list[float]] = {name: [] for name in names}  # --eager-too
    plain_rates: dict[str, list[float]] = {name: [] for name in names}
    best: dict[str, list[float]] = {name: [0.0, 0.0] for name in names}  # fastest plain and interlace tok/s
    # Round by round over the cases (see paired): the machine's drift falls on every case alike.
    for round_ in range(args.repeats):
        for name in names:
            # New prompts for every pair, the same for both engines: prompts seen before would be
            # served from plain vLLM's prefix cache (an intervened request's prompt never is: its
            # hooks must see every token), which is not the workload of N new prompts.
            fresh = prompts(n, args.inp, vocab, seed=next(seeds))
            others = [lambda: run_interlace(model, fresh, args.out, cases[name])]
            replays = sum(model.engine.collective_rpc("interlace_replays"))
            if eager is not None:
                others.append(lambda: run_interlace(eager, fresh, args.out, cases[name]))
            (p_seconds, p_tokens), [(i_seconds, i_tokens, saved_mib), *rest] = paired(
                round_, lambda: run_plain(plain, fresh, args.out), others)
            extra = {}
            if rest:
                [(e_seconds, e_tokens, _)] = rest
            plain_rates[name].append(p_tokens / p_seconds)
            ratios[name].append((i_tokens / i_seconds) / plain_rates[name][-1])
            best[name] = [max(best[name][0], plain_rates[name][-1]), max(best[name][1], i_tokens / i_seconds)]
            if eager is not None:
                eager_ratios[name].append((e_tokens / e_seconds) / plain_rates[name][-1])
                extra = {"eager_interlace_s": round(e_seconds, 3), "eager_ratio": round(eager_ratios[name][-1], 3)}
            print(json.dumps({"n": n, "case": name, "round": round_, "plain_s": round(p_seconds, 3),
                              "interlace_s": round(i_seconds, 3), "tokens": i_tokens,
                              "ratio": round(ratios[name][-1], 3), "saved_mib": round(saved_mib, 1),
                              "replays": sum(model.engine.collective_rpc("interlace_replays")) - replays, **extra,
                              **({"phases": _shown(PHASES), "plain_phases": _shown(PLAIN_PHASES[0])} if PHASES is not None else {})}),
                  flush=True)
    table = [(name, statistics.median(plain_rates[name]), *median_interval(ratios[name]), min(ratios[name]),
              max(ratios[name]), best[name][1] / best[name][0]) for name in names]

    where = f"TP={args.tp} PP={args.pp}, {'CUDA graphs' if args.graphs else 'eager'}, {cfg.dtype}, {cfg.name}"
    print(f"\n{n} prompts x {args.inp} in / {args.out} out, {where}; {args.repeats} pairs per case")
    # "fastest": each side's fastest trace against the other's; the lent GPU hosts slow single
    # traces by up to a third at random, which moves a median of a few pairs more than the effects
    # measured here, and a side's fastest trace least.
    # "95%": a bootstrap interval for the median (bench/pool_pairs.py pools several processes' pairs).
    print(f"{'case':18} {'plain tok/s':>12} {'x plain (median)':>17} {'95%':>10} {'min':>6} {'max':>6} {'fastest':>8}"
          + (f" {'eager interlace x plain':>24} {'min':>6} {'max':>6}" if eager is not None else ""))
    for name, rate, median, median_low, median_high, low, high, fastest in table:
        row = f"{name:18} {rate:12.0f} {median:17.2f} {median_low:5.2f}-{median_high:.2f} {low:6.2f} {high:6.2f} {fastest:8.2f}"
        if eager is not None:
            row += f" {statistics.median(eager_ratios[name]):24.2f} {min(eager_ratios[name]):6.2f} {max(eager_ratios[name]):6.2f}"
        print(row)


if __name__ == "__main__":
    main()
