"""The ``interlace`` command (also ``python -m interlace``).

    interlace sweep SWEEP.yaml              # run a sweep, or resume it: finished shards are kept
    interlace sweep SWEEP.yaml --address auto   # on a running Ray cluster (ray job submit sets RAY_ADDRESS)
    interlace serve SERVE.yaml              # the HTTP endpoint (Ray Serve) until Ctrl-C
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from interlace.cluster.config import ServeConfig, SweepConfig
from interlace.cluster.sweep.runner import SweepStopped, run_sweep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="interlace", description="Intervention programs inside vLLM.")
    commands = parser.add_subparsers(dest="command", required=True)
    sweep = commands.add_parser("sweep", help="run one intervention over a dataset of prompts, to a folder of shards")
    sweep.add_argument("config", help="the sweep YAML (schema: interlace.cluster.config.SweepConfig)")
    sweep.add_argument("--address", default=None, help="Ray cluster to join ('auto', 'ray://host:10001'); "
                       "default: RAY_ADDRESS, else a local Ray")
    serve = commands.add_parser("serve", help="serve the model over HTTP (a Ray Serve application)")
    serve.add_argument("config", help="the serve YAML (schema: interlace.cluster.config.ServeConfig)")
    serve.add_argument("--address", default=None, help="Ray cluster to join; default: RAY_ADDRESS, else a local Ray")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(Path(args.config), args.address)
    return _sweep(Path(args.config), args.address)


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
    except ValueError as exc:  # no API tokens, a bad tokens document
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
    except ValueError as exc:  # a config the run refuses (another sweep in the folder, a bad program path)
        print(f"interlace sweep: {exc}", file=sys.stderr)
        return 2
    print(f"output: {cfg.output}")
    return 0
