"""Serve benchmark: what the HTTP endpoint costs against the cluster handle, in one run.

Workload: C concurrent clients, each sending T traces one after the other; a trace is one invoke
of IN prompt tokens (new ids every round, the same for both sides), OUT generated tokens, greedy,
with the client's own steering vector (``ops.add`` at the middle layer, every step) and a save of
the last token's residual at the last layer (``ops.save``, every step). Llama-3.2-1B shape with
random bf16 weights (``--shape 1b|8b|70b``, bench/shapes.py), or ``--shape tiny``: the bundled tiny Llama (CPU).

Both sides are up at the same time on the same device, in one local Ray, started as interlace
starts engines by default (compiled with CUDA graphs and the default graph taps on a GPU, eager on
a CPU): a one-replica
``interlace.Cluster`` and the Serve application (one engine replica behind the HTTP ingress),
called through ``interlace.connect(url, token=...)``. On a GPU each engine takes 0.4 of it
(``gpu_memory_utilization`` 0.35); on CPU both engines are bound to core 0. Two phases, each paired
like bench/cluster_bench.py (new prompts per pair; which side runs first alternates by round; a
figure is the median of the pairs' ratios, endpoint / cluster):

    plain    the endpoint's blocking trace API (``with remote.trace()``): requests per second,
             time to result.
    stream   ``Remote.stream``: requests per second, and time to first token (the first
             ``tokens`` event). The cluster handle does not stream: its column is its time to
             result, which is what a cluster user waits for the first token.

    vllm     the endpoint's blocking trace API against plain vLLM (an ``AsyncLLM`` with the same
             settings, no interlace, in this process, driven by the same client threads, each
             request without interventions): what the whole path costs a user against vLLM
             as they run it. On a GPU the three engines then take 0.28 of it each.

Target on a GPU at 64 clients: the endpoint's requests per second within 10 % of the cluster's.

Before the timed pairs: one warm-up round per phase and side at full concurrency
(``--warmup-traces`` traces per client), then a check that both sides compute the same tokens and
saves for the first ``--check-clients`` clients (one request at a time on each side, so that both
run it alone in the batch).

Progress: every phase, side and round prints a start and an end line (``[elapsed s] ...``, flushed),
and a round prints how many requests completed every ``--progress-s``. A request running longer than
``--request-timeout-s`` stops the bench: it prints which side, client and trace, for how long, where
the client thread waits (its stack) and the side's own state (the cluster's status; the endpoint's
``/metrics``), then what was measured so far, and exits 3. Past ``--budget-s`` (counted from the
start, engine starts included) it prints what it has and exits 0; a SIGTERM (a command's time limit)
does the same and exits 143; the shutdown after either is cut off at 60 s. (Until 2026-11-25 the
bench printed nothing between the engine starts and the check's result: four warm-up rounds of the
full size, then the check on every client, 2 x 64 requests of 128 tokens one at a time: at the
rates of bench/results/2026-11-25-h100-serve-bench.log about 65 s and 200 s, against the 318 s the
run cut off at 570 s had left after its engine starts; nothing says where that run was.)

Usage: python bench/serve_bench.py [--clients 64] [--traces 4] [--in 128] [--out 128] [--repeats 3]
       [--shape 1b] [--phases plain,stream,vllm] [--warmup-traces 1] [--check-clients 4]
       [--request-timeout-s 120] [--budget-s SECONDS] [--progress-s 10]
GPU machines: bash bench/gpu_session.sh python3 bench/serve_bench.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import secrets
import signal
import socket
import statistics
import sys
import threading
import time
import traceback

import shapes
from runner_bench import config, plain_engine_args, prompts

TOKEN_ENV = "INTERLACE_API_TOKENS"
CLEANUP_S = 60.0  # the shutdown after a stop (a stuck request, the budget) is cut off past this


class Clock:
    """Seconds since the bench started, and what is left of its budget."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.budget_s: float | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def left(self) -> float:
        return math.inf if self.budget_s is None else self.budget_s - self.elapsed()


CLOCK = Clock()


def log(message: str) -> None:
    print(f"[{CLOCK.elapsed():7.1f}s] {message}", flush=True)


class Stop(Exception):
    """The bench stops early: ``why`` is "stuck" (a request past its deadline), "budget" or "signal"."""

    def __init__(self, why: str, message: str):
        super().__init__(message)
        self.why = why


class Watchdog:
    """Ends the process (``os._exit``) if it is still running past a deadline: the budget plus the
    shutdown's time, or a shutdown that hangs. Prints every thread's stack first."""

    def __init__(self) -> None:
        self.deadline, self.code, self.why = math.inf, 0, ""
        threading.Thread(target=self._watch, name="serve-bench-watchdog", daemon=True).start()

    def arm(self, at: float, code: int, why: str) -> None:
        if at < self.deadline:
            self.deadline, self.code, self.why = at, code, why

    def _watch(self) -> None:
        import faulthandler

        while CLOCK.elapsed() < self.deadline:
            time.sleep(1.0)
        log(f"watchdog: {self.why}; every thread's stack follows, then exit {self.code}")
        faulthandler.dump_traceback(all_threads=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.code)


def client_ops(vectors: list, client: int, layers: int) -> list[dict]:
    """Client ``client``'s ops: its steering vector at the middle layer, the last token's residual
    saved at the last layer."""
    from interlace import ops

    return [ops.add(f"layers.{layers // 2}.resid", vectors[client]),
            ops.save(f"layers.{layers - 1}.resid", tokens="last")]


def blocking(target, out: int):
    """One request on ``target`` (a Cluster or a Remote), waiting for the result: (first, done) in
    seconds since the request began; without streaming the first token arrives with the result."""
    def one(prompt: list[int], case: list[dict]):
        started = time.perf_counter()
        with target.trace(max_tokens=out, ignore_eos=True, timeout_s=3600) as tr:
            tr.invoke(prompt, ops=case)
        done = time.perf_counter() - started
        return done, done, tr.result
    return one


def streamed(remote, out: int):
    """One request through ``Remote.stream``: (first ``tokens`` event, result) in seconds."""
    def one(prompt: list[int], case: list[dict]):
        started = time.perf_counter()
        tr = remote.trace(max_tokens=out, ignore_eos=True, timeout_s=3600)
        tr.invoke(prompt, ops=case)
        first = result = None
        for event in remote.stream(tr):
            if event["event"] == "tokens" and first is None:
                first = time.perf_counter() - started
            elif event["event"] == "result":
                result = event["result"]
        done = time.perf_counter() - started
        if first is None:
            raise RuntimeError("the stream ended without a 'tokens' event")
        if result is None:
            raise RuntimeError("the stream ended without a 'result' event")
        return first, done, result
    return one


class PlainVLLM:
    """Plain vLLM for the ``vllm`` phase: an ``AsyncLLM`` with the model's settings and no
    interlace, its event loop on a thread of its own, so the bench's client threads call it as
    they call the other sides."""

    def __init__(self, cfg):
        import asyncio

        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = plain_engine_args(cfg)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="plain-vllm-loop", daemon=True).start()

        async def start():
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), usage_context=UsageContext.LLM_CLASS)

        self.engine = asyncio.run_coroutine_threadsafe(start(), self.loop).result()
        self.ids = itertools.count()

    def one(self, out: int):
        """One request (its ops are not vLLM's: it runs without them): (first token, result) in s."""
        import asyncio

        from vllm import SamplingParams

        params = SamplingParams(max_tokens=out, ignore_eos=True, temperature=0)

        async def generate(prompt: list[int]):
            started, first, last = time.perf_counter(), None, None
            async for output in self.engine.generate({"prompt_token_ids": prompt}, params, f"plain-{next(self.ids)}"):
                if first is None and output.outputs[0].token_ids:
                    first = time.perf_counter() - started
                last = output
            return first, time.perf_counter() - started, [last.outputs[0]]

        def run(prompt: list[int], case: list[dict]):
            return asyncio.run_coroutine_threadsafe(generate(prompt), self.loop).result()
        return run

    def close(self) -> None:
        """Shut the engine down on its own loop (its output task ends there, not as a dead engine)."""
        import asyncio

        async def shutdown():
            self.engine.shutdown()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result()
        self.engine = None
        self.loop.call_soon_threadsafe(self.loop.stop)


class Side:
    """One side's request function, its name, and what it can tell about itself when stuck."""

    def __init__(self, name: str, one, diagnose):
        self.name, self.one, self.diagnose = name, one, diagnose


def run_round(side: Side, data: list[list[list[int]]], cases: list[list[dict]], label: str, args,
              keep: bool = False, quiet: bool = False) -> dict:
    """Every client (a thread) sends its traces in turn; all clients at once. ``data[c]``: client
    c's prompts. Prints start, progress and end; raises :class:`Stop` when a request runs past
    ``args.request_timeout_s`` or the budget is spent, and the first client error at once."""
    total = sum(len(d) for d in data)
    lock = threading.Lock()
    timed: list[tuple[float, float, int]] = []
    results: dict[tuple[int, int], object] = {}
    current: dict[int, tuple[int, float]] = {}  # client -> (its trace index, when that request began)
    errors: list[tuple[int, int, BaseException, str]] = []
    left = [len(data)]
    all_done = threading.Event()

    def client(c: int) -> None:
        k = -1
        try:
            for k, prompt in enumerate(data[c]):
                with lock:
                    current[c] = (k, time.perf_counter())
                first, done, result = side.one(prompt, cases[c])
                with lock:
                    timed.append((first, done, len(result[0].token_ids)))
                    if keep:
                        results[c, k] = result
                    del current[c]
        except BaseException as exc:  # noqa: BLE001 - reported by the round, with the client's place
            with lock:
                errors.append((c, k, exc, traceback.format_exc()))
                current.pop(c, None)
        finally:
            with lock:
                left[0] -= 1
                if not left[0]:
                    all_done.set()

    if CLOCK.left() <= 0:
        raise Stop("budget", f"budget of {args.budget_s:.0f}s spent before {label}")
    threads = {c: threading.Thread(target=client, args=(c,), name=f"client-{c}", daemon=True) for c in range(len(data))}
    if not quiet:
        log(f"{label}: start, {len(data)} clients x {total // max(1, len(data))} traces")
    started = time.perf_counter()
    for t in threads.values():
        t.start()
    next_progress = started + args.progress_s
    while not all_done.wait(0.5):
        now = time.perf_counter()
        with lock:
            snapshot, done_count, failed = dict(current), len(timed), list(errors)
        if failed:
            break
        late = sorted(((now - t0, c, k) for c, (k, t0) in snapshot.items()), reverse=True)
        if late and late[0][0] > args.request_timeout_s:
            raise Stop("stuck", _stuck_report(side, label, late, done_count, total, now - started, threads, args))
        if CLOCK.left() <= 0:
            raise Stop("budget", f"budget of {args.budget_s:.0f}s spent during {label}: {done_count}/{total} "
                       f"requests done in {now - started:.1f}s, {len(snapshot)} in flight"
                       + (f", the oldest {late[0][0]:.1f}s (client {late[0][1]}, trace {late[0][2]})" if late else ""))
        if now >= next_progress:
            next_progress = now + args.progress_s
            oldest = f", oldest {late[0][0]:.1f}s (client {late[0][1]}, trace {late[0][2]})" if late else ""
            log(f"{label}: {done_count}/{total} done after {now - started:.1f}s, {len(snapshot)} in flight{oldest}")
    seconds = time.perf_counter() - started
    if errors:
        c, k, exc, where = errors[0]
        print(where, file=sys.stderr, flush=True)
        raise RuntimeError(f"{label}: client {c}, trace {k} failed after {seconds:.1f}s into the round "
                           f"({len(errors)} client(s) failed): {type(exc).__name__}: {exc}") from exc
    if not quiet:
        log(f"{label}: end, {len(timed)}/{total} done in {seconds:.2f}s ({len(timed) / seconds:.2f} req/s, "
            f"result p50 {statistics.median(t[1] for t in timed):.3f}s, max {max(t[1] for t in timed):.3f}s)")
    return {"req_s": len(timed) / seconds, "tok_s": sum(t[2] for t in timed) / seconds, "seconds": seconds,
            "first": [t[0] for t in timed], "done": [t[1] for t in timed], "results": results}


def _stuck_report(side: Side, label: str, late, done_count: int, total: int, seconds: float, threads, args) -> str:
    stuck = [x for x in late if x[0] > args.request_timeout_s]
    lines = [f"STUCK: {label}: {len(stuck)} request(s) past --request-timeout-s {args.request_timeout_s:g}s "
             f"on the {side.name} side; {done_count}/{total} done in {seconds:.1f}s, {len(late)} in flight"]
    lines += [f"  {side.name} client {c}, trace {k}: running {age:.1f}s" for age, c, k in stuck[:10]]
    if len(stuck) > 10:
        lines.append(f"  ... and {len(stuck) - 10} more; the youngest in flight {late[-1][0]:.1f}s")
    age, c, k = stuck[0]
    frame = sys._current_frames().get(threads[c].ident)
    if frame is not None:
        lines.append(f"  where {side.name} client {c} waits:")
        lines += ["    " + line for chunk in traceback.format_stack(frame)[-14:] for line in chunk.rstrip().splitlines()]
    lines.append(f"  {side.name} side's state:")
    lines += ["    " + line for line in _with_timeout(side.diagnose, 20.0).splitlines()]
    return "\n".join(lines)


def _with_timeout(fn, seconds: float) -> str:
    """``fn()``'s text, or why there is none, within ``seconds`` (a stuck side may not answer)."""
    out: list[str] = []

    def call() -> None:
        try:
            out.append(fn())
        except Exception as exc:  # noqa: BLE001 - a diagnosis that failed says so
            out.append(f"(failed: {type(exc).__name__}: {exc})")

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    return out[0] if out else f"(no answer within {seconds:.0f}s)"


def cluster_diagnosis(cluster) -> str:
    import ray

    infos = ray.get([s.actor.info.remote() for s in cluster._replicas], timeout=15)
    keep = ("index", "pid", "in_flight", "max_in_flight_seen", "shards_served")
    return "\n".join([f"status: {json.dumps(cluster.status())}"]
                     + [f"replica: {json.dumps({k: i[k] for k in keep})}" for i in infos])


def endpoint_diagnosis(url: str, token: str) -> str:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=15).text
    wanted = ("in_flight", "waiting", "kv_cache", "requests_total", "traces_total")
    lines = [line for line in text.splitlines() if not line.startswith("#") and "interlace" in line
             and any(w in line for w in wanted)]
    return "\n".join(lines[:40]) or text[:2000]


class Collected:
    """The timed pairs so far, by phase: a summary works on what there is (a bench cut short)."""

    def __init__(self, phases: list[str], repeats: int):
        self.phases, self.repeats = phases, repeats
        self.rounds: dict[str, dict[str, list[dict]]] = {p: {} for p in phases}  # phase -> side -> rounds
        self.base = {p: "vllm" if p == "vllm" else "cluster" for p in phases}  # the ratio's denominator
        self.ratios: dict[str, list[float]] = {p: [] for p in phases}

    def summary(self, phase: str) -> dict | None:
        ratios, rounds = self.ratios[phase], self.rounds[phase]
        if not ratios:
            return None
        out = {"phase": phase, "base": self.base[phase], "pairs": len(ratios), "ratio": statistics.median(ratios),
               "min": min(ratios), "max": max(ratios)}
        for side, timed in rounds.items():
            side = "base" if side == self.base[phase] else side
            out[f"{side}_req_s"] = statistics.median(t["req_s"] for t in timed)
            out[f"{side}_tok_s"] = statistics.median(t["tok_s"] for t in timed)
            for key in ("first", "done"):
                values = sorted(x for t in timed for x in t[key])
                out[f"{side}_{key}_p50"] = statistics.median(values)
                out[f"{side}_{key}_p90"] = values[min(len(values) - 1, int(0.9 * len(values)))]
        return out


def paired(phase: str, sides: dict[str, Side], data_for, cases, args, collected: Collected) -> None:
    """Alternate the phase's two sides over ``repeats`` rounds on fresh prompts; ratios endpoint /
    the other side (the cluster, or plain vLLM), kept in ``collected`` as each pair completes."""
    for round_ in range(args.repeats):
        data = data_for()
        order = list(sides.items())[:: 1 if round_ % 2 == 0 else -1]
        timed = {name: run_round(side, data, cases, f"{phase} round {round_} {name}", args) for name, side in order}
        for name, t in timed.items():
            collected.rounds[phase].setdefault(name, []).append(t)
        collected.ratios[phase].append(timed["endpoint"]["req_s"] / timed[collected.base[phase]]["req_s"])
        print(json.dumps({"phase": phase, "round": round_, "first": order[0][0],
                          **{f"{name}_req_s": round(t["req_s"], 2) for name, t in timed.items()},
                          **{f"{name}_first_p50_s": round(statistics.median(t["first"]), 4) for name, t in timed.items()},
                          **{f"{name}_done_p50_s": round(statistics.median(t["done"]), 4) for name, t in timed.items()},
                          "ratio": round(collected.ratios[phase][-1], 3)}), flush=True)


def same_results(cluster_side: Side, endpoint_side: Side, data, cases, args) -> tuple[int, int]:
    """Clients whose first request gives the same tokens and saves on both sides (greedy: it must),
    one request at a time on each side (alone in its batch: the same arithmetic on both sides)."""
    import torch

    equal = 0
    checked = min(args.check_clients, len(data))
    log(f"check: start, the first request of {checked} clients on each side, one at a time")
    for c in range(checked):
        a = run_round(cluster_side, [data[c][:1]], [cases[c]], f"check client {c} cluster", args, True, True)
        b = run_round(endpoint_side, [data[c][:1]], [cases[c]], f"check client {c} endpoint", args, True, True)
        a, b = a["results"][0, 0][0], b["results"][0, 0][0]
        equal += a.token_ids == b.token_ids and a.saves.keys() == b.saves.keys() and all(
            torch.equal(a.saves[k], b.saves[k]) for k in a.saves)
    log(f"check: end, {equal}/{checked} equal")
    return equal, checked


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def print_table(args, cfg, device: str, collected: Collected, check: tuple[int, int] | None) -> None:
    checked = f"{check[0]}/{check[1]} clients checked" if check else "not checked"
    print(f"\n{args.clients} clients x {args.traces} traces per round, one invoke each: {args.inp} in / "
          f"{args.out} out, own steering vector + last-token save; {cfg.name} ({cfg.dtype}), {device}; "
          f"{args.repeats} pairs per phase asked; results equal on both sides: {checked}", flush=True)
    print(f"{'phase':7} {'pairs':>5} {'base':>7} {'base req/s':>10} {'endpoint req/s':>14} {'ratio':>6} {'min':>5} "
          f"{'max':>5} {'overhead':>8}  {'base result s':>16}  {'endpoint 1st token s':>20}  {'endpoint result s':>17}")
    print(f"{'':7} {'':>5} {'':>7} {'':>10} {'':>14} {'':>6} {'':>5} {'':>5} {'':>8}  {'p50 / p90':>16}  {'p50 / p90':>20}  "
          f"{'p50 / p90':>17}")
    for phase in collected.phases:
        r = collected.summary(phase)
        if r is None:
            print(f"{phase:7} {0:5d}  no complete pair")
            continue
        span = lambda key: f"{r[key + '_p50']:.3f} / {r[key + '_p90']:.3f}"  # noqa: E731
        first = span("endpoint_first") if r["phase"] == "stream" else "not streamed"
        print(f"{r['phase']:7} {r['pairs']:5d} {r['base']:>7} {r['base_req_s']:10.2f} {r['endpoint_req_s']:14.2f} "
              f"{r['ratio']:6.2f} {r['min']:5.2f} {r['max']:5.2f} {1 - r['ratio']:8.1%}  {span('base_done'):>16}  "
              f"{first:>20}  {span('endpoint_done'):>17}")
    print("The cluster handle does not stream: its first token arrives with its result (time to result). Plain "
          "vLLM runs the same requests without their ops.", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients")
    parser.add_argument("--traces", type=int, default=4, help="traces each client sends per round, in turn")
    parser.add_argument("--in", dest="inp", type=int, default=128)
    parser.add_argument("--out", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed pairs per phase")
    shapes.add_argument(parser)
    parser.add_argument("--phases", default="plain,stream")
    parser.add_argument("--warmup-traces", type=int, default=1, help="traces per client in each warm-up round")
    parser.add_argument("--check-clients", type=int, default=4, help="clients whose results are compared (0: none)")
    parser.add_argument("--request-timeout-s", type=float, default=120.0,
                        help="a request running longer stops the bench with a report of where it was")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop measuring past this many seconds from the start, print what there is, exit 0")
    parser.add_argument("--ingress-replicas", type=int, default=4,
                        help="replicas of the HTTP ingress deployment (ServeConfig's default)")
    parser.add_argument("--progress-s", type=float, default=10.0, help="progress line interval within a round")
    args = parser.parse_args()
    args.tp = args.pp = 1
    CLOCK.budget_s = args.budget_s
    watchdog = Watchdog()
    if args.budget_s is not None:
        watchdog.arm(args.budget_s + CLEANUP_S, 0, f"the budget of {args.budget_s:.0f}s plus {CLEANUP_S:.0f}s "
                     "for the shutdown ran out")
    log(f"serve_bench: {' '.join(sys.argv[1:])}")

    import ray
    import torch
    from transformers import AutoConfig

    import interlace
    from interlace.cluster.serve import app as serve_app
    from interlace.cluster.config import ClusterConfig, LimitsConfig, ResourcesConfig, ServeConfig

    gpus = torch.cuda.device_count()
    if not gpus:
        os.environ["INTERLACE_CPU_CORES"] = "0"  # both engines on one core: the same device for both sides
    args.graphs = gpus > 0  # interlace's default: compiled with graph taps on a GPU, eager on a CPU
    cfg = config(args)
    phases = args.phases.split(",")
    share = 0.3 if "vllm" in phases else 0.4  # of the GPU, per engine (a third engine: plain vLLM)
    if gpus and "vllm" in phases:
        cfg = cfg.model_copy(update={"engine_args": {**cfg.engine_args, "gpu_memory_utilization": 0.28}})
    # Each side takes its share of the GPU; on CPU one core's bundle each (both bound to core 0 above).
    resources = ResourcesConfig(num_cpus=1, num_gpus=share) if gpus else ResourcesConfig(num_cpus=1)
    cluster_cfg = ClusterConfig(model=cfg, replicas=1, resources=resources, max_in_flight=args.clients)
    token = secrets.token_urlsafe(24)  # a fresh ops-role token, for this run only
    os.environ[TOKEN_ENV] = json.dumps({"tokens": [{"name": "bench", "token": token, "role": "ops"}]})
    serve_cfg = ServeConfig(cluster=cluster_cfg, port=free_port(), ingress_replicas=args.ingress_replicas,
                            limits=LimitsConfig(max_trace_s=3600, max_in_flight_per_token=args.clients))
    device = torch.cuda.get_device_name(0) if gpus else "CPU (both engines on core 0)"
    collected = Collected(phases, args.repeats)
    check = None
    code = 0

    ray.init(address="local", include_dashboard=False, log_to_driver=False)

    def on_signal(signum, _frame):
        raise Stop("signal", f"signal {signum} received")

    signal.signal(signal.SIGTERM, on_signal)  # a command limit's kill: say where it was, then stop
    cluster = remote = plain = None
    try:
        try:
            log("cluster: starting a one-replica interlace.Cluster")
            cluster = interlace.Cluster(cluster_cfg)
            log("cluster: up; endpoint: starting the Serve application")
            url = serve_app.start(serve_cfg)
            remote = interlace.connect(url, token=token, max_parallel=args.clients)
            log(f"both sides up; endpoint {url}")
            if CLOCK.left() <= 0:
                raise Stop("budget", f"budget of {args.budget_s:.0f}s spent starting the engines")

            hf = AutoConfig.from_pretrained(cfg.checkpoint_path())
            dtype = torch.float32 if cfg.dtype in ("auto", "float32") else getattr(torch, cfg.dtype)
            vectors = [(torch.randn(hf.hidden_size, generator=torch.Generator().manual_seed(c)) * 0.01).to(dtype)
                       for c in range(args.clients)]
            cases = [client_ops(vectors, c, hf.num_hidden_layers) for c in range(args.clients)]
            seeds = itertools.count(1)
            vocab = min(1000, hf.vocab_size)

            def fresh(traces: int = args.traces) -> list[list[list[int]]]:
                flat = prompts(args.clients * traces, args.inp, vocab, seed=next(seeds))
                return [flat[c * traces:(c + 1) * traces] for c in range(args.clients)]

            diagnose_cluster = lambda: cluster_diagnosis(cluster)  # noqa: E731
            diagnose_endpoint = lambda: endpoint_diagnosis(url, token)  # noqa: E731
            cluster_side = Side("cluster", blocking(cluster, args.out), diagnose_cluster)
            sides = {"plain": {"cluster": cluster_side,
                               "endpoint": Side("endpoint", blocking(remote, args.out), diagnose_endpoint)},
                     "stream": {"cluster": cluster_side,
                                "endpoint": Side("endpoint", streamed(remote, args.out), diagnose_endpoint)}}
            if "vllm" in phases:
                log("plain vLLM: starting an AsyncLLM with the same settings")
                plain = PlainVLLM(cfg)
                sides["vllm"] = {"vllm": Side("vllm", plain.one(args.out), lambda: "plain vLLM: no state to report"),
                                 "endpoint": sides["plain"]["endpoint"]}
            warm = fresh(max(1, args.warmup_traces))  # warm-ups at full concurrency
            for phase in phases:
                for name, side in sides[phase].items():
                    t = run_round(side, warm, cases, f"warm-up {phase} {name}", args)
                    print(json.dumps({"warmup": phase, "side": name, "req_s": round(t["req_s"], 2),
                                      "done_p50_s": round(statistics.median(t["done"]), 4)}), flush=True)
            if args.check_clients > 0:
                checked_on = [p for p in phases if p != "vllm"] or ["plain"]  # the endpoint's API of the last such phase
                check = same_results(cluster_side, sides[checked_on[-1]]["endpoint"], warm, cases, args)
                print(json.dumps({"same_results": check[0], "clients_checked": check[1]}), flush=True)
            for phase in phases:
                log(f"phase {phase}: start, {args.repeats} pairs")
                paired(phase, sides[phase], fresh, cases, args, collected)
                log(f"phase {phase}: end")
        except Stop as stop:
            code = 0 if stop.why == "budget" else 3 if stop.why == "stuck" else 143
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            log(f"stopped ({stop.why}): {stop}")
            watchdog.arm(CLOCK.elapsed() + CLEANUP_S, code, f"the shutdown took over {CLEANUP_S:.0f}s")
        except BaseException:
            watchdog.arm(CLOCK.elapsed() + CLEANUP_S, 1, f"the shutdown took over {CLEANUP_S:.0f}s")
            print_table(args, cfg, device, collected, check)
            raise
        print_table(args, cfg, device, collected, check)
    finally:
        watchdog.arm(CLOCK.elapsed() + CLEANUP_S, code, f"the shutdown took over {CLEANUP_S:.0f}s")
        log("shutting down")
        if remote is not None:
            remote.close()
        if plain is not None:
            plain.close()
        from ray import serve

        serve.shutdown()
        if cluster is not None:
            cluster.close()
        ray.shutdown()
        log("shut down")
    if code:
        sys.stdout.flush()
        os._exit(code)  # client threads of a stuck round may still be waiting


if __name__ == "__main__":
    main()
