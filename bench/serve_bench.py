"""Serve benchmark: what the HTTP endpoint costs against the cluster handle, in one run.

Workload: C concurrent clients, each sending T traces one after the other; a trace is one invoke
of IN prompt tokens (new ids every round, the same for both sides), OUT generated tokens, greedy,
with the client's own steering vector (``ops.add`` at the middle layer, every step) and a save of
the last token's residual at the last layer (``ops.save``, every step). Llama-3.2-1B shape with
random bf16 weights (bench/runner_bench.py), or ``--tiny``: the bundled tiny Llama (CPU).

Both sides are up at the same time on the same device, in one local Ray: a one-replica
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

Target on a GPU at 64 clients: the endpoint's requests per second within 10 % of the cluster's.

Usage: python bench/serve_bench.py [--clients 64] [--traces 4] [--in 128] [--out 128] [--repeats 3]
       [--tiny] [--phases plain,stream]
GPU machines: bash bench/gpu_session.sh python3 bench/serve_bench.py
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import os
import secrets
import socket
import statistics
import time

from runner_bench import MODEL_DIR, config, make_model_dir, prompts

TOKEN_ENV = "INTERLACE_API_TOKENS"


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
        return first, done, result
    return one


def run_round(one, data: list[list[list[int]]], cases: list[list[dict]]) -> dict:
    """Every client (a thread) sends its traces in turn; all clients at once. ``data[c]``: client
    c's prompts."""
    def client(c: int) -> list[tuple[float, float, int]]:
        timed = []
        for prompt in data[c]:
            first, done, result = one(prompt, cases[c])
            timed.append((first, done, len(result[0].token_ids)))
        return timed

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(data)) as pool:
        timed = [t for per_client in pool.map(client, range(len(data))) for t in per_client]
    seconds = time.perf_counter() - started
    return {"req_s": len(timed) / seconds, "tok_s": sum(t[2] for t in timed) / seconds,
            "first": [t[0] for t in timed], "done": [t[1] for t in timed]}


def paired(phase: str, sides: dict, data_for, cases, repeats: int) -> dict:
    """Alternate cluster and endpoint over ``repeats`` rounds on fresh prompts; ratios endpoint /
    cluster."""
    rounds: dict[str, list[dict]] = {side: [] for side in sides}
    ratios = []
    for round_ in range(repeats):
        data = data_for()
        order = list(sides.items())[:: 1 if round_ % 2 == 0 else -1]
        timed = {side: run_round(one, data, cases) for side, one in order}
        for side, t in timed.items():
            rounds[side].append(t)
        ratios.append(timed["endpoint"]["req_s"] / timed["cluster"]["req_s"])
        print(json.dumps({"phase": phase, "round": round_, "first": order[0][0],
                          **{f"{side}_req_s": round(t["req_s"], 2) for side, t in timed.items()},
                          **{f"{side}_first_p50_s": round(statistics.median(t["first"]), 4) for side, t in timed.items()},
                          **{f"{side}_done_p50_s": round(statistics.median(t["done"]), 4) for side, t in timed.items()},
                          "ratio": round(ratios[-1], 3)}), flush=True)

    def pooled(side: str, key: str) -> list[float]:
        return sorted(x for t in rounds[side] for x in t[key])

    summary = {"phase": phase, "ratio": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    for side in sides:
        summary[f"{side}_req_s"] = statistics.median(t["req_s"] for t in rounds[side])
        summary[f"{side}_tok_s"] = statistics.median(t["tok_s"] for t in rounds[side])
        for key in ("first", "done"):
            values = pooled(side, key)
            summary[f"{side}_{key}_p50"] = statistics.median(values)
            summary[f"{side}_{key}_p90"] = values[min(len(values) - 1, int(0.9 * len(values)))]
    return summary


def same_results(cluster_one, endpoint_one, data, cases) -> tuple[int, int]:
    """Clients whose first request gives the same tokens and saves on both sides (greedy: it must)."""
    import torch

    equal = 0
    for c in range(len(data)):
        *_, a = cluster_one(data[c][0], cases[c])
        *_, b = endpoint_one(data[c][0], cases[c])
        equal += a[0].token_ids == b[0].token_ids and a[0].saves.keys() == b[0].saves.keys() and all(
            torch.equal(a[0].saves[k], b[0].saves[k]) for k in a[0].saves)
    return equal, len(data)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients")
    parser.add_argument("--traces", type=int, default=4, help="traces each client sends per round, in turn")
    parser.add_argument("--in", dest="inp", type=int, default=128)
    parser.add_argument("--out", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed pairs per phase")
    parser.add_argument("--tiny", action="store_true", help="the bundled tiny Llama instead of the 1B shape")
    parser.add_argument("--phases", default="plain,stream")
    args = parser.parse_args()
    args.tp = args.pp = 1

    import ray
    import torch
    from transformers import AutoConfig

    import interlace
    from interlace.cluster import serve_app
    from interlace.cluster.config import ClusterConfig, LimitsConfig, ResourcesConfig, ServeConfig

    gpus = torch.cuda.device_count()
    if not gpus:
        os.environ["INTERLACE_CPU_CORES"] = "0"  # both engines on one core: the same device for both sides
    if not args.tiny:
        make_model_dir(MODEL_DIR)
    cfg = config(args)
    # Each side takes 0.4 of the GPU; on CPU one core's bundle each (both bound to core 0 above).
    resources = ResourcesConfig(num_cpus=1, num_gpus=0.4) if gpus else ResourcesConfig(num_cpus=1)
    cluster_cfg = ClusterConfig(model=cfg, replicas=1, resources=resources, max_in_flight=args.clients)
    token = secrets.token_urlsafe(24)  # a fresh ops-role token, for this run only
    os.environ[TOKEN_ENV] = json.dumps({"tokens": [{"name": "bench", "token": token, "role": "ops"}]})
    serve_cfg = ServeConfig(cluster=cluster_cfg, port=free_port(),
                            limits=LimitsConfig(max_trace_s=3600, max_in_flight_per_token=args.clients))

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    cluster = remote = None
    try:
        started = time.perf_counter()
        cluster = interlace.Cluster(cluster_cfg)
        url = serve_app.start(serve_cfg)
        remote = interlace.connect(url, token=token, max_parallel=args.clients)
        print(f"both sides up in {time.perf_counter() - started:.0f}s; endpoint {url}", flush=True)

        hf = AutoConfig.from_pretrained(cfg.checkpoint_path())
        dtype = torch.float32 if cfg.dtype in ("auto", "float32") else getattr(torch, cfg.dtype)
        vectors = [(torch.randn(hf.hidden_size, generator=torch.Generator().manual_seed(c)) * 0.01).to(dtype)
                   for c in range(args.clients)]
        cases = [client_ops(vectors, c, hf.num_hidden_layers) for c in range(args.clients)]
        seeds = itertools.count(1)
        vocab = min(1000, hf.vocab_size)

        def fresh() -> list[list[list[int]]]:
            flat = prompts(args.clients * args.traces, args.inp, vocab, seed=next(seeds))
            return [flat[c * args.traces:(c + 1) * args.traces] for c in range(args.clients)]

        sides = {"plain": {"cluster": blocking(cluster, args.out), "endpoint": blocking(remote, args.out)},
                 "stream": {"cluster": blocking(cluster, args.out), "endpoint": streamed(remote, args.out)}}
        phases = args.phases.split(",")
        warm = fresh()  # warm-ups at full size, and a check that both sides compute the same
        for phase in phases:
            for one in sides[phase].values():
                run_round(one, warm, cases)
        equal, checked = same_results(sides["plain"]["cluster"], sides[phases[-1]]["endpoint"], warm, cases)
        print(json.dumps({"same_results": equal, "clients_checked": checked}), flush=True)
        results = [paired(phase, sides[phase], fresh, cases, args.repeats) for phase in phases]
    finally:
        if remote is not None:
            remote.close()
        from ray import serve

        serve.shutdown()
        if cluster is not None:
            cluster.close()
        ray.shutdown()

    device = torch.cuda.get_device_name(0) if gpus else "CPU (both engines on core 0)"
    print(f"\n{args.clients} clients x {args.traces} traces per round, one invoke each: {args.inp} in / "
          f"{args.out} out, own steering vector + last-token save; {cfg.name} ({cfg.dtype}), {device}; "
          f"{args.repeats} pairs per phase; results equal on both sides for {equal}/{checked} clients")
    print(f"{'phase':7} {'cluster req/s':>13} {'endpoint req/s':>14} {'ratio':>6} {'min':>5} {'max':>5} "
          f"{'overhead':>8}  {'cluster result s':>16}  {'endpoint 1st token s':>20}  {'endpoint result s':>17}")
    print(f"{'':7} {'':>13} {'':>14} {'':>6} {'':>5} {'':>5} {'':>8}  {'p50 / p90':>16}  {'p50 / p90':>20}  "
          f"{'p50 / p90':>17}")
    for r in results:
        span = lambda key: f"{r[key + '_p50']:.3f} / {r[key + '_p90']:.3f}"  # noqa: E731
        first = span("endpoint_first") if r["phase"] == "stream" else "not streamed"
        print(f"{r['phase']:7} {r['cluster_req_s']:13.2f} {r['endpoint_req_s']:14.2f} {r['ratio']:6.2f} "
              f"{r['min']:5.2f} {r['max']:5.2f} {1 - r['ratio']:8.1%}  {span('cluster_done'):>16}  {first:>20}  "
              f"{span('endpoint_done'):>17}")
    print("The cluster handle does not stream: its first token arrives with its result (time to result).")


if __name__ == "__main__":
    main()
