"""``chatkv serve``: parse the options, load the engine, run uvicorn until SIGINT/SIGTERM.

Shutdown (SIGINT or SIGTERM) is uvicorn's graceful one (no new connections; requests in flight
get up to ``--graceful-timeout`` seconds), then the app's lifespan closes the engine: open
sessions are spilled to disk and the engine thread is joined; the exit status is 0. A second
Ctrl+C skips the wait for requests in flight. Shortly before ``--graceful-timeout`` runs out,
the requests still generating are stopped, their replies so far stored as interrupted, and
answered with a 503 ``shutting_down`` (an error event in a stream already under way), rather
than cancelled by uvicorn mid-send.

Users: ``--api-key KEY`` (repeatable) and ``--api-keys FILE`` (``name:key`` lines, mode 0600,
re-read on SIGHUP); see ``guards.py``.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys

from chatkv.config import HEADS, KV_DTYPES, WEIGHTS
from chatkv.server.ray import options as ray_options


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="chatkv serve",
        description="Serve a model over an OpenAI-compatible HTTP API "
        "(/v1/chat/completions, /v1/completions, /v1/responses, /v1/embeddings, /v1/models, /tokenize, "
        "/detokenize, /health, /metrics; each /v1 route also without /v1).",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port, 0-65535 (0: any free one; default 8000)")
    p.add_argument(
        "--model",
        default=None,
        help="a local Hugging Face model directory or a GGUF file, prepared once into the data directory "
        "(default: the packaged SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        metavar="NAME",
        help="the model's id in replies and /v1/models (default: the model directory's name); repeat it for "
        "aliases, each listed by /v1/models",
    )
    p.add_argument(
        "--strict-model-names",
        action="store_true",
        help="answer only requests naming one of the model's names (404 for another); by default any "
        "model name reaches the served model, as llama-server does",
    )
    p.add_argument(
        "--data-dir", metavar="DIR", default=None, help="conversations and KV snapshots (default: $CHATKV_HOME)"
    )
    p.add_argument(
        "--db-url",
        metavar="URL",
        default=os.environ.get("CHATKV_DB_URL"),
        help="the conversation database, any SQLAlchemy URL (postgresql+psycopg://user@host/chatkv): replicas "
        "on one database and one --data-dir share conversations (default: $CHATKV_DB_URL, else SQLite "
        "in the data dir)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1 routes; repeat it for several users, each key its "
        "own (default: $CHATKV_API_KEY; none: open, one user)",
    )
    p.add_argument(
        "--api-keys",
        metavar="FILE",
        default=None,
        help="users and their keys, one 'name:key' a line (the file must be private: chmod 600); "
        "re-read on SIGHUP. Each user sees only their own conversations and cache",
    )
    p.add_argument(
        "--max-concurrency", type=int, default=64, help="requests running at once; more get 429 (default 64)"
    )
    p.add_argument(
        "--max-request-bytes", type=int, default=4 * 2**20, help="largest request body; larger get 413 (default 4 MiB)"
    )
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument(
        "--context-window", type=int, default=None, metavar="N", help="tokens one request or conversation may hold"
    )
    p.add_argument(
        "--weights",
        choices=WEIGHTS,
        default="auto",
        help="auto (a GGUF's own int4, else the float model), bf16, fp32, int4, int8",
    )
    p.add_argument("--head-weights", choices=HEADS, default="auto", help="the output matrix: auto, float, int8, int4")
    p.add_argument(
        "--no-deterministic",
        dest="deterministic",
        action="store_false",
        help="compute with oneDNN's batched kernels: faster prefill of long prompts, but a reply may change "
        "with the load, the batch and the thread count (default: deterministic, the same reply whatever the load)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default="auto",
        help="the KV cache: auto (the model's dtype), bf16, fp16, fp32, int8 or fp8 (about half the memory)",
    )
    p.add_argument("--graceful-timeout", type=float, default=30.0, help="seconds requests in flight get at shutdown")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    ray_options.add_arguments(p)
    return p


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, ending the requests in flight itself just before the graceful
        timeout would have them cancelled (``ServerState.cut``)."""

        async def shutdown(self, sockets=None):
            import asyncio

            grace = self.config.timeout_graceful_shutdown
            if grace is not None:
                state = self.config.app.state.chatkv
                margin = min(1.0, grace / 4)  # time to stop generating, store the partial reply and answer
                asyncio.get_running_loop().call_later(max(0.0, grace - margin), state.cut_requests)
            await super().shutdown(sockets)

    return Server


def _Server(config):
    return _server_class()(config)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class _ProgressLines:
    """A first run's model conversion as log lines on stderr, one each 10% (a server's log has no
    bar to redraw)."""

    def __init__(self) -> None:
        self.said = -1

    def __call__(self, done: int, total: int) -> None:
        tenth = done * 10 // max(total, 1)
        if tenth > self.said:
            self.said = tenth
            print(f"chatkv serve: preparing the model: {tenth * 10}% ({done} of {total} tensors)", file=sys.stderr)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if not 0 <= args.port <= 65535:
        print(f"chatkv serve: --port must be in 0-65535 (0: any free port), got {args.port}", file=sys.stderr)
        return 2
    for name in ("max_concurrency", "max_request_bytes"):
        if getattr(args, name) < 1:
            print(f"chatkv serve: --{name.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    from chatkv.server.guards import KeyFileError, Users

    names = args.served_model_name or []
    if any(not n.strip() for n in names):
        print("chatkv serve: --served-model-name must not be empty", file=sys.stderr)
        return 2
    args.served_model_name, args.aliases = (names[0] if names else None), names[1:]
    keys = args.api_key if args.api_key is not None else [k for k in [os.environ.get("CHATKV_API_KEY")] if k]
    if any(not k.strip() for k in keys):
        print("chatkv serve: --api-key must not be empty", file=sys.stderr)
        return 2
    try:
        users = Users.from_options(keys, args.api_keys)
    except (KeyFileError, ValueError) as e:
        print(f"chatkv serve: {e}", file=sys.stderr)
        return 2
    if args.ray:
        if args.api_keys or len(keys) > 1:
            print(
                "chatkv serve: --ray takes one --api-key (several users need one process: leave out --ray)",
                file=sys.stderr,
            )
            return 2
        args.api_key = keys[0] if keys else None
    why = ray_options.check(args)
    if why:
        print(f"chatkv serve: {why}", file=sys.stderr)
        return 2
    import uvicorn

    from chatkv import ChatKVError, Engine
    from chatkv.server.app import create_app

    config = {
        "dtype": args.dtype,
        "data_dir": args.data_dir,
        "db_url": args.db_url or None,
        "weights": args.weights,
        "head_weights": args.head_weights,
        "kv_dtype": args.kv_dtype,
        "deterministic": args.deterministic,
    }
    if args.context_window is not None:
        config["context_window"] = args.context_window
    if args.ray:
        return ray_options.run(args, config)
    try:
        engine = Engine.from_pretrained(args.model, progress=_ProgressLines(), **config)
    except ChatKVError as e:
        print(f"chatkv serve: {e}", file=sys.stderr)
        return 1
    app = create_app(
        engine,
        model_name=args.served_model_name,
        aliases=args.aliases,
        strict_model_names=args.strict_model_names,
        users=users,
        max_concurrency=args.max_concurrency,
        max_request_bytes=args.max_request_bytes,
        owns_engine=True,
    )
    if not users.required and not _loopback(args.host):
        print(
            f"chatkv serve: warning: listening on {args.host} without --api-key: anyone who can reach it can use it",
            file=sys.stderr,
        )
    name = app.state.chatkv.model_name
    print(f"chatkv serve: model {name!r} at http://{args.host}:{args.port}/v1", file=sys.stderr)
    server = _Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.graceful_timeout,
            lifespan="on",
        )
    )
    if args.api_keys and hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, lambda signum, frame: users.reload())
    # uvicorn re-raises the signal that stopped it once it has shut down; these handlers take
    # it, so a graceful stop ends with status 0 (and no KeyboardInterrupt traceback on Ctrl+C)
    stopped_by: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stopped_by.append(signum))
    try:
        server.run()
    finally:
        if not app.state.chatkv.stopping:  # the lifespan never ran (the port was taken...)
            engine.close()
    return 0 if server.started else 1
