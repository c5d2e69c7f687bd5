"""What building a trace's requests costs the driver, before any engine sees them: the invokes
added, their payloads encoded (programs pickled), vLLM's prompts and sampling parameters built.
No engine is started; a diagnostic of the fixed cost a trace pays on the driver per invoke.

    python bench/trace_setup.py --n 256 --cases ops-steer1,prog-steer1,prog-steer1-each
"""

from __future__ import annotations

import argparse
import time

from runner_bench import interlace_cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--in", dest="inp", type=int, default=128)
    parser.add_argument("--cases", default="ops-steer1,ops-save4,prog-steer1,prog-save4,prog-steer1-each")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    from interlace.cluster.assembly import build_requests
    from interlace.core.trace import encode_payloads
    from interlace.model import Trace

    cases = interlace_cases(2048, 16)  # the 1B shape's hidden size and layers
    settings = dict(max_tokens=128, temperature=0.0, ignore_eos=True)
    for name in args.cases.split(","):
        def once():
            trace = Trace(None, settings, 3600.0, 1 << 30)  # no target: it never runs
            for _ in range(args.n):
                trace.invoke([5] * args.inp, **cases[name])
            payloads = encode_payloads(trace.invokes, "trace", "dir:/tmp/unused", 3600.0, 1 << 30)
            return build_requests([inv.prompt for inv in trace.invokes], payloads, trace.settings, "trace")

        once()
        started = time.perf_counter()
        for _ in range(args.repeats):
            once()
        print(f"{name:18} {(time.perf_counter() - started) / args.repeats * 1000:7.2f} ms for {args.n} invokes")


if __name__ == "__main__":
    main()
