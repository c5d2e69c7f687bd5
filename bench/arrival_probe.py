"""Arrival probe: the engine's rate when one-invoke traces arrive one by one, as a server's do (a
diagnostic, not a figure).

runner_bench sends one trace of N invokes that start and end together. An endpoint's clients
each send one-invoke traces, one after the other: every few steps an invoke comes or goes, so
the batch the workers plan for changes nearly every step. This probe drives vLLM's engine by
hand, in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), with C closed-loop clients: each
keeps one request in flight and sends its next as soon as the last one finished, T in all. The
same loop runs on plain vLLM (requests without interventions) and on an interlace engine with
each case, in pairs (new prompts every pair, which side first alternates); the figure is output
tokens per second, interlace / plain.

    wave      the same requests, C at a time, each wave starting together (runner_bench's regime)
    closed    C closed-loop clients (the endpoint's regime)

Cases: ``none`` (plain requests on the interlace engine), ``serve`` (serve_bench's: the client's own steering vector at
the middle layer and the last token's residual saved at the last layer, every step), ``save1``
(that save only), ``steer1`` (that add only).

``--phases`` times interlace's calls inside the engine (step_probe.py's probes) for the
interlace side's closed-loop runs; ``--profile N`` prints the N functions with the most own time
in the interlace side's runs (cProfile: it slows Python-heavy code, so ratios with it are not
figures).

Usage: python bench/arrival_probe.py [--shape 1b] [--graphs] [--clients 64] [--traces 4]
       [--in 128] [--out 128] [--cases none,serve] [--modes wave,closed] [--repeats 2] [--taps] [--phases]
       [--profile 25]
GPU machines: bash bench/gpu_session.sh python3 bench/arrival_probe.py --graphs
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import os
import statistics
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import shapes  # noqa: E402 - bench/, this script's folder
from runner_bench import config, host_line, plain_engine, prompts  # noqa: E402


def case_ops(case: str, vector, layers: int) -> list[dict]:
    from interlace import ops

    add = ops.add(f"layers.{layers // 2}.resid", vector)
    save = ops.save(f"layers.{layers - 1}.resid", tokens="last")
    return {"none": [],
            "serve": [add, save], "save1": [save], "steer1": [add]}[case]


class Requests:
    """Builds each side's requests: plain ones, or one-invoke traces with a case's ops."""

    def __init__(self, model, case: str | None, vectors: list, layers: int, out: int):
        self.model, self.case, self.vectors, self.layers, self.out = model, case, vectors, layers, out
        self.ids = itertools.count()

    def make(self, client: int, prompt: list[int]):
        from vllm import SamplingParams

        from interlace.cluster.assembly import build_requests
        from interlace.core.trace import Invoke, encode_payloads, new_trace_id

        settings = dict(max_tokens=self.out, temperature=0.0, ignore_eos=True)
        if self.case is None:
            return f"plain-{next(self.ids)}", {"prompt_token_ids": prompt}, SamplingParams(**settings)
        trace = new_trace_id()
        invoke = Invoke(prompt, ops=case_ops(self.case, self.vectors[client], self.layers))
        payloads = encode_payloads([invoke], trace, f"dir:{self.model._sink_root}", 600.0, 2**34)
        [request], [params] = build_requests([prompt], payloads, settings, trace)
        return f"{trace}-0", request, params


def drive(engine, requests: Requests, data: list[list[list[int]]], mode: str) -> tuple[float, int]:
    """Run every client's prompts (``data[client][k]``) through ``engine`` (a vLLM LLMEngine);
    seconds and output tokens."""
    clients, traces = len(data), len(data[0])
    sent = [0] * clients
    owner: dict[str, int] = {}
    tokens = 0
    started = time.perf_counter()

    def send(client: int) -> None:
        rid, prompt, params = requests.make(client, data[client][sent[client]])  # built while the engine waits, as a replica does
        sent[client] += 1
        owner[rid] = client
        engine.add_request(rid, prompt, params)

    if mode == "closed":
        for client in range(clients):
            send(client)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)
                    client = owner.pop(out.request_id)
                    if sent[client] < traces:
                        send(client)
    else:
        for _wave in range(traces):
            for client in range(clients):
                send(client)
            while engine.has_unfinished_requests():
                tokens += sum(len(out.outputs[0].token_ids) for out in engine.step() if out.finished)
    engine.step()  # workers learn which requests finished (and report them) in a step
    return time.perf_counter() - started, tokens


def burden(seconds: float) -> None:
    """Every reporter job (workers/reporter.py) runs ``seconds`` of pure Python after its own work."""
    from interlace.workers.reporter import Reporter

    submit = Reporter.submit

    def burdened_submit(self, job):
        def burdened():
            job()
            until = time.perf_counter() + seconds
            while time.perf_counter() < until:
                pass

        submit(self, burdened)

    Reporter.submit = burdened_submit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--traces", type=int, default=4, help="requests per client")
    parser.add_argument("--in", dest="inp", type=int, default=128)
    parser.add_argument("--out", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="pairs per case and mode")
    parser.add_argument("--cases", default="none,serve")
    parser.add_argument("--modes", default="wave,closed")
    parser.add_argument("--graphs", action="store_true", help="both engines compiled with CUDA graphs")
    parser.add_argument("--taps", action="store_true", help="every layer's resid a graph tap on an eager engine "
                        "(a CPU run of the path compiled engines take: ops in the taps)")
    parser.add_argument("--phases", action="store_true", help="time interlace's calls (closed-loop runs)")
    parser.add_argument("--profile", type=int, default=0, help="cProfile's top N (closed-loop runs)")
    parser.add_argument("--reporter-burden-ms", type=float, default=0.0, help="add this much pure Python (the GIL "
                        "held) to each reporter job: what the reporter's own Python costs the engine")
    shapes.add_argument(parser)
    args = parser.parse_args()

    import torch

    import interlace

    print(host_line(), flush=True)
    if args.reporter_burden_ms:
        burden(args.reporter_burden_ms / 1e3)
    if args.phases:
        import step_probe

        step_probe.install_probes()
    cfg = config(args)
    plain = plain_engine(cfg)
    hf = plain.llm_engine.model_config.hf_config
    model = interlace.Model(cfg.model_copy(update={"graph_taps": "resid"}) if args.taps else cfg)
    generator = torch.Generator().manual_seed(0)
    vectors = [torch.randn(hf.hidden_size, generator=generator) * 0.01 for _ in range(args.clients)]
    vocab = min(1000, hf.vocab_size)
    seeds = itertools.count(1)

    def fresh():
        return [prompts(args.traces, args.inp, vocab, seed=next(seeds)) for _ in range(args.clients)]

    for side, engine in (("plain", plain), ("interlace", model)):  # compile, capture, warm both
        requests = Requests(model, None if side == "plain" else "serve", vectors, hf.num_hidden_layers, args.out)
        drive(engine.llm_engine if side == "plain" else model.engine.llm_engine, requests, fresh(), "closed")
    print(f"{args.clients} clients x {args.traces} one-invoke traces, {args.inp} in / {args.out} out; "
          f"{shapes.describe(args) if hasattr(shapes, 'describe') else args.shape}, graphs={args.graphs}", flush=True)
    summary = []
    for case, mode in itertools.product(args.cases.split(","), args.modes.split(",")):
        ratios, rates = [], []
        for pair in range(args.repeats):
            data = fresh()
            plain_req = Requests(model, None, vectors, hf.num_hidden_layers, args.out)
            ours_req = Requests(model, case, vectors, hf.num_hidden_layers, args.out)
            profile = cProfile.Profile() if args.profile else None
            measured = {}
            for side in (("plain", "interlace") if pair % 2 == 0 else ("interlace", "plain")):
                if side == "plain":
                    measured[side] = drive(plain.llm_engine, plain_req, data, mode)
                    continue
                if args.phases:
                    step_probe.TOTALS.clear(), step_probe.COUNTS.clear(), step_probe.CPU_TOTALS.clear()
                if profile is not None:
                    profile.enable()
                measured[side] = drive(model.engine.llm_engine, ours_req, data, mode)
                if profile is not None:
                    profile.disable()
            (ps, pt), (s, t) = measured["plain"], measured["interlace"]
            ratios.append((t / s) / (pt / ps))
            rates.append((pt / ps, t / s))
            print(f"{case:7} {mode:6} pair {pair}: plain {pt / ps:9.0f} tok/s ({ps:.2f} s), interlace {t / s:9.0f} tok/s "
                  f"({s:.2f} s), ratio {ratios[-1]:.3f}", flush=True)
            if args.phases and mode == "closed" and pair == args.repeats - 1:
                steps = max(1, step_probe.COUNTS.get("interleaver.begin_step", 1))
                print(f"  interlace's calls, closed loop ({steps} steps):")
                for label, total in sorted(step_probe.TOTALS.items(), key=lambda kv: -kv[1])[:30]:
                    count = step_probe.COUNTS.get(label, 0)
                    print(f"    {total:8.3f} s {count:8d}x {1e6 * total / max(count, 1):9.1f} us/call  {label}")
            if profile is not None and pair == args.repeats - 1:
                import pstats

                print(f"  cProfile of the interlace side, {mode}, top {args.profile} by own time:")
                stats = pstats.Stats(profile)
                rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:args.profile]
                ours = sorted(((k, v) for k, v in stats.stats.items() if "/workers/" in k[0]), key=lambda kv: -kv[1][3])
                for heading, listed in (("", rows), (f"  interlace's worker code by cumulative time, top {args.profile}:\n", ours[:args.profile])):
                    print(heading, end="")
                    for (file, line, name), (calls, _, own, cumulative, _) in listed:
                        print(f"    {own:8.3f} own {cumulative:8.3f} cum s {calls:9d} calls  {'/'.join(file.split('/')[-3:])}:{line}({name})")
        summary.append((case, mode, statistics.median(ratios), min(ratios), max(ratios), len(ratios)))
    print("case    mode    ratio (median, min-max, pairs)")
    for case, mode, median, low, high, n in summary:
        print(f"{case:7} {mode:7} {median:.3f} ({low:.3f}-{high:.3f}, {n})")
    counts = model.step_counts()[0]
    print(f"interlace engine steps (rank 0): {counts.get('graph_steps')}; taps: {counts.get('taps')}")
    time.sleep(2.0)  # the last reports are written on the reporter thread
    model.close()


if __name__ == "__main__":
    main()
