"""`serve --engine aiohttp|ray` and the Ray engine's flags, without importing Ray (it is optional)."""

from __future__ import annotations

import argparse

ENGINES = ("aiohttp", "ray")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (docs/DEPLOY.md, section Ray Serve)")
    group.add_argument("--engine", choices=ENGINES, default="aiohttp",
                       help="aiohttp: one process, one model (default); ray: Ray Serve, several model replicas "
                       "behind one endpoint (pip install '.[ray]' in the pack's folder: the minimax-h3-split[ray] "
                       "distribution)")
    scale = group.add_mutually_exclusive_group()
    scale.add_argument("--replicas", type=int, help="--engine ray: encoder replicas, one model each (default 1)")
    scale.add_argument("--autoscale", metavar="MIN:MAX", help="--engine ray: scale the encoder replicas with load")
    group.add_argument("--gpus-per-replica", type=float,
                       help="--engine ray: GPUs per encoder replica (default 0: CPU); above 1, the text encoder's "
                       "layers are spread over the replica's GPUs")
    group.add_argument("--address", help="--engine ray: an existing Ray cluster (e.g. ray://head:10001 or auto); "
                       "default: start Ray on this machine")


def main(args) -> int:
    if getattr(args, "engine", "aiohttp") == "ray":
        try:
            from .ray_run import main as ray_main
        except ImportError as error:
            import sys

            print(f"error: --engine ray needs Ray Serve ({error}); in the pack's folder: pip install '.[ray]' "
                  "(or pip install 'ray[serve]>=2.60')", file=sys.stderr)
            return 2
        return ray_main(args)
    for flag in ("replicas", "autoscale", "gpus_per_replica", "address"):
        if getattr(args, flag, None) is not None:
            import sys

            print(f"error: --{flag.replace('_', '-')} needs --engine ray", file=sys.stderr)
            return 2
    from .aiohttp_server import main as serve_main

    return serve_main(args)
