"""The ``--ray`` options of ``chatkv serve`` and their checks; ray is imported only once they
pass (``deployments.py``), so ``chatkv serve`` works without the ``chatkv[ray]`` extra.

    chatkv serve --ray [--replicas N] [--ray-address ADDR] [--ray-routing affinity|round_robin|pow2]
                 [--replica-cpus C] [--replica-gpus G] --db-url URL --data-dir DIR ...
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

MAX_REPLICAS = 1024
INSTALL = "pip install 'chatkv[ray]'"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas on Ray Serve (the chatkv[ray] extra)")
    g.add_argument(
        "--ray",
        action="store_true",
        help="serve N engine replicas on Ray Serve, routed by session and "
        "cached prefix (a local Ray instance, or --ray-address)",
    )
    g.add_argument("--replicas", type=int, default=None, metavar="N", help="engine replicas with --ray (default 2)")
    g.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="join this Ray cluster ('auto', or host:port of its head) instead of starting one",
    )
    g.add_argument(
        "--ray-routing",
        choices=["affinity", "round_robin", "pow2"],
        default="affinity",
        help="affinity (default: session, then longest cached prefix, then least loaded), round_robin, "
        "or pow2 (Ray's power of two choices)",
    )
    g.add_argument(
        "--replica-cpus", type=float, default=1.0, metavar="C", help="CPUs each replica reserves (default 1)"
    )
    g.add_argument(
        "--replica-gpus",
        type=float,
        default=0.0,
        metavar="G",
        help="GPUs each replica reserves (default 0); > 0 runs the engines on CUDA",
    )


def check(args) -> str | None:
    """Why these options cannot run, or None."""
    ray_only = [
        name
        for name, default in (
            ("replicas", None),
            ("ray_address", None),
            ("ray_routing", "affinity"),
            ("replica_cpus", 1.0),
            ("replica_gpus", 0.0),
        )
        if getattr(args, name) != default
    ]
    if not args.ray:
        return f"--{ray_only[0].replace('_', '-')} needs --ray" if ray_only else None
    if args.replicas is None:
        args.replicas = 2
    if not 1 <= args.replicas <= MAX_REPLICAS:
        return f"--replicas must be between 1 and {MAX_REPLICAS}, got {args.replicas}"
    if args.replica_cpus < 0 or args.replica_gpus < 0 or args.replica_cpus + args.replica_gpus == 0:
        return "--replica-cpus and --replica-gpus must be >= 0, and one of them > 0"
    if args.model is not None and not (Path(args.model).is_dir() or Path(args.model).is_file()):
        return f"model path '{args.model}' is not a directory or a GGUF file (chatkv never downloads weights)"
    if not _installed("ray") or not _installed("ray.serve"):
        return f"--ray needs Ray Serve, which is not installed: {INSTALL}"
    return None


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent missing, or the import blocked (sys.modules[name] = None)
        return False


def run(args, engine_config: dict) -> int:
    """Deploy the replicas and serve until SIGINT/SIGTERM (``deployments.run``)."""
    from chatkv import ChatKVError

    try:
        return _run(args, engine_config)
    except ChatKVError as e:
        print(f"chatkv serve: {e}", file=sys.stderr)
        return 1


def _run(args, engine_config: dict) -> int:
    from chatkv.config import EngineConfig

    if args.replica_gpus > 0:  # the GPU Ray gives each replica is its CUDA device 0
        engine_config = dict(engine_config, device="cuda")
    EngineConfig.from_kwargs(**engine_config)  # a bad option fails here, not N times in the replicas
    if engine_config.get("data_dir") is None:  # every replica on one resolved directory
        from chatkv import data_dir

        engine_config = dict(engine_config, data_dir=str(data_dir(None)))
    model = args.model
    if model is None:  # converted once, here, not by N replicas at once into one data dir
        from chatkv import ensure_default_model

        model = str(ensure_default_model(Path(engine_config["data_dir"])))
    elif Path(model).is_file():  # a GGUF file: prepared once, here, for every replica
        from chatkv import ensure_gguf_model

        model = str(ensure_gguf_model(model, Path(engine_config["data_dir"])))
    try:
        from chatkv.server.ray import deployments
    except ImportError as e:
        print(f"chatkv serve: --ray needs Ray Serve ({e}): {INSTALL}", file=sys.stderr)
        return 1
    opts = deployments.ServeOptions(
        deployments.ReplicaOptions(
            str(Path(model).resolve()),
            args.served_model_name,
            engine_config,
            args.api_key,
            args.max_concurrency,
            args.max_request_bytes,
            threads=max(1, int(args.replica_cpus)),
            aliases=list(getattr(args, "aliases", [])),
            strict_model_names=bool(getattr(args, "strict_model_names", False)),
        ),
        replicas=args.replicas,
        routing=args.ray_routing,
        replica_cpus=args.replica_cpus,
        replica_gpus=args.replica_gpus,
    )
    return deployments.run(opts, args.host, args.port, args.ray_address)
