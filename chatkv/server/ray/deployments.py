"""``chatkv serve --ray``: engine replicas on Ray Serve behind one OpenAI-compatible endpoint,
routed by session and by cached prefix. The optional extra ``chatkv[ray]``; the only modules
of chatkv that import ray are this one and ``request_routers.py``.

Shape of the application (one Ray Serve app, default name ``chatkv``):

    HTTP ─► Ray Serve proxy ─► Ingress (1 replica, no CPU) ─► handle ─► EngineReplica x N
                                 reads the body once,          AffinityRouter (request_routers.py)
                                 computes RouteKeys,           picks the replica:
                                 learns who answered           session > prefix > least loaded

- ``EngineReplica`` holds one ``Engine`` and answers with the very app ``chatkv serve`` runs
  (``create_app``, called in-process through ``asgi_call.py``), so endpoints, validation,
  errors, sessions and server-sent events are those of the single server, byte for byte. The
  replica names itself in the answer's head; the ingress adds it as ``X-ChatKV-Replica``.
- Replicas share one ``--db-url`` (PostgreSQL across machines; one SQLite file on one
  machine) and one ``--data-dir`` (the KV snapshots, written behind every turn). A
  conversation's lease keeps it in one replica at a time (409 ``session_busy`` otherwise,
  as in the single server); any replica restores a conversation's KV from the snapshots.
- How the router learns what each replica holds, and how stale it may be: ``affinity.py``.
- ``/metrics`` on the ingress is every replica's exposition with a ``replica`` label, plus
  ``chatkv:router_decisions_total{reason}`` (how requests were routed). ``/health`` is a
  replica's.
- A replica that dies (``ray.kill``, a crash, its machine) is replaced by Ray Serve; the
  router forgets it at once and its sessions go to the least-loaded replica, which restores
  their KV from disk (the dead process's leases are broken at once on the same machine,
  after 30 s from another). A request in flight on it fails: 503 ``replica_unavailable``
  before the first byte, or an error event ending a stream. Its reply so far is not
  stored; the user message is, and the next turn closes it as interrupted. The replacement
  joins the routing when Ray Serve reports it running.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from chatkv.server.chat_shapes import sse
from chatkv.server.errors import APIError
from chatkv.server.guards import read_body
from chatkv.server.ray.affinity import RouteKeys, route_keys, table_for
from chatkv.server.ray.asgi_call import Head, HttpCall, call_asgi
from chatkv.server.ray.prom_merge import merge
from chatkv.server.ray.request_routers import AffinityRouter, RoundRobinRouter

log = logging.getLogger("chatkv.server.ray")
APP = "chatkv"
ENGINE = "EngineReplica"
ROUTERS = {"affinity": AffinityRouter, "round_robin": RoundRobinRouter, "pow2": None}  # None: Ray's default
QUIET = {"log_level": "WARNING", "enable_access_log": False}
REPORT_PREFIXES = 4096  # canonical-history keys a replica reports (the most recent)


@dataclass
class ReplicaOptions:
    """What each engine replica is built from (sent to the replicas: plain data only)."""

    model: str
    served_model_name: str | None = None
    engine: dict = field(default_factory=dict)  # Engine.from_pretrained options (data_dir, db_url, dtype...)
    api_key: str | None = None
    max_concurrency: int = 64
    max_request_bytes: int = 4 * 2**20
    threads: int = 1  # torch threads per replica
    aliases: list = field(default_factory=list)  # more --served-model-name values
    strict_model_names: bool = False


@dataclass
class ServeOptions:
    replica: ReplicaOptions
    replicas: int = 2
    routing: str = "affinity"  # affinity | round_robin | pow2
    imbalance: int = 8  # affinity yields past this many more requests in flight than the least loaded
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    stats_period_s: float = 2.0  # how often replicas report what they hold
    route_prefix: str = "/"
    app_name: str = APP
    ingress_replicas: int = 1  # each keeps its own table (answers it relayed + every replica's reports)


class EngineReplica:
    """One engine and the single server's app; answers ``HttpCall``s as a stream."""

    def __init__(self, opts: ReplicaOptions):
        import torch

        from chatkv import Engine
        from chatkv.server.app import create_app

        torch.set_num_threads(max(1, opts.threads))
        self.engine = Engine.from_pretrained(opts.model, **opts.engine)
        self.app = create_app(
            self.engine,
            model_name=opts.served_model_name,
            aliases=opts.aliases,
            strict_model_names=opts.strict_model_names,
            api_key=opts.api_key,
            max_concurrency=opts.max_concurrency,
            max_request_bytes=opts.max_request_bytes,
            owns_engine=True,
        )
        self.state = self.app.state.chatkv
        self.engine.start()
        self.engine.sessions_in_memory()  # the store is opened now, not on the first turn
        self.replica = serve.get_replica_context().replica_id.unique_id

    async def call(self, call: HttpCall, keys: RouteKeys):
        """The answer: a ``Head`` (naming this replica), then body chunks. ``keys`` is for the router."""
        async for item in call_asgi(self.app, call):
            if isinstance(item, Head):
                item.replica = self.replica
            yield item

    def record_routing_stats(self) -> dict:
        """What this replica holds, for the router (see ``affinity.py``)."""
        from chatkv.server.ray.affinity import KEY_BYTES

        return {
            "at": time.time(),
            "sessions": self.engine.sessions_in_memory(),
            "prefixes": [k.hex()[:KEY_BYTES] for k in self.state.history.recent_keys(REPORT_PREFIXES)],
            "in_flight": self.state.limit.running,
        }

    def check_health(self) -> None:
        if self.state.stopping or not self.engine.started:
            raise RuntimeError("the engine is not running")

    def __del__(self):  # Ray Serve's graceful shutdown: requests drained, then this
        state = getattr(self, "state", None)
        if state is not None and not state.stopping:
            state.stopping = True
            self.engine.close()  # spills the open sessions to the shared snapshots


def _replica_died(e: BaseException) -> APIError:
    return APIError(
        503,
        f"the replica answering this request is unavailable ({type(e).__name__}); retry: another "
        "replica takes the conversation over from the shared store",
        "replica_unavailable",
    )


class Ingress:
    """The HTTP face: routes each request to an engine replica and relays its answer."""

    def __init__(self, engine, opts: ServeOptions):
        self.handle = engine.options(stream=True)
        self.table = table_for(f"{opts.app_name}/{ENGINE}")
        self.max_request_bytes = opts.replica.max_request_bytes
        self.prefix = opts.route_prefix.rstrip("/")

    def _path(self, request: Request) -> str:
        path = request.scope["path"]
        root = request.scope.get("root_path") or ""
        for p in (root, self.prefix):
            if p and p != "/" and path.startswith(p):
                path = path[len(p) :] or "/"
        return path

    async def __call__(self, request: Request) -> Response:
        path = self._path(request)
        try:
            if path == "/metrics" and request.method == "GET":
                return await self._metrics()
            body = await read_body(request, self.max_request_bytes)
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers.raw}
            keys = route_keys(path, headers, body)
            call = HttpCall(
                request.method,
                path,
                request.scope.get("query_string", b""),
                list(request.headers.raw),
                body,
                tuple(request.client) if request.client else None,
            )
            stream = self.handle.call.remote(call, keys)
            try:
                head = await stream.__anext__()
            except StopAsyncIteration:
                raise APIError(500, "the replica ended the answer before its head", "internal_error") from None
            except Exception as e:  # noqa: BLE001 - the replica died or was unreachable
                log.warning("request to %s failed before its answer: %r", path, e)
                raise _replica_died(e) from e
        except APIError as e:
            return e.response()
        raw = dict(head.headers)
        if head.status < 400:  # the replica that answered holds the request's session and these prefixes
            session = raw.get(b"x-session-id")
            self.table.learn(keys, head.replica, session.decode() if session else None)
        headers = [*head.headers, (b"x-chatkv-replica", head.replica.encode())]
        if not raw.get(b"content-type", b"").startswith(b"text/event-stream"):
            # not streamed: the body is on its way with the head; answered whole (a cut is a 503)
            try:
                body = b"".join([chunk async for chunk in stream])
            except Exception as e:  # noqa: BLE001
                return _replica_died(e).response()
            response = Response(body, status_code=head.status)
        else:
            response = StreamingResponse(self._relay(stream), status_code=head.status)
        response.raw_headers = headers
        return response

    @staticmethod
    async def _relay(stream):
        """Server-sent events as the replica sends them; if it dies mid-answer (the status is
        sent already), an error event and ``[DONE]`` end the stream, as any other error does."""
        try:
            async for chunk in stream:
                yield chunk
        except Exception as e:  # noqa: BLE001
            log.warning("answer cut by its replica: %r", e)
            yield sse(_replica_died(e).body())
            yield sse("[DONE]")
        finally:
            stream.cancel()

    async def _answer(self, call: HttpCall, keys: RouteKeys) -> tuple[Head, bytes]:
        stream = self.handle.call.remote(call, keys)
        head, chunks = None, []
        async for item in stream:
            if isinstance(item, Head):
                head = item
            else:
                chunks.append(item)
        return head, b"".join(chunks)

    async def _metrics(self) -> Response:
        texts = {}
        # one replica at a time: calls made at once from one request share Ray's internal request
        # id, and Ray's router then fulfils only one of them (the others wait forever)
        for r in sorted(self.table.replicas) or [None]:
            try:
                head, body = await asyncio.wait_for(self._answer(HttpCall("GET", "/metrics"), RouteKeys(pin=r)), 30)
            except Exception as e:  # noqa: BLE001 - a replica gone meanwhile: the others are still worth showing
                log.warning("/metrics of replica %s: %r", r, e)
                continue
            if head is not None and head.status == 200:
                texts.setdefault(head.replica, body.decode())
        lines = [
            "# HELP chatkv:router_decisions_total Requests routed, by kind and reason (affinity.choose)",
            "# TYPE chatkv:router_decisions_total counter",
        ]
        for reason, n in sorted(self.table.decisions.items()):
            lines.append(f'chatkv:router_decisions_total{{reason="{reason}"}} {float(n)}')
        lines += [
            "# HELP chatkv:router_replicas Engine replicas the router routes to now (1 each)",
            "# TYPE chatkv:router_replicas gauge",
        ]
        lines += [f'chatkv:router_replicas{{replica="{r}"}} 1.0' for r in sorted(self.table.replicas)]
        return Response(merge(texts, "\n".join(lines) + "\n"), media_type="text/plain; version=0.0.4; charset=utf-8")


def build(opts: ServeOptions):
    """The bound application (``serve.run`` it)."""
    router = ROUTERS[opts.routing]
    router_config = RequestRouterConfig(
        **({"request_router_class": router} if router is not None else {}),
        request_router_kwargs={"deployment": f"{opts.app_name}/{ENGINE}", "imbalance": opts.imbalance}
        if router is not None
        else {},
        request_routing_stats_period_s=opts.stats_period_s,
        request_routing_stats_timeout_s=max(5.0, opts.stats_period_s),
    )
    engine = serve.deployment(EngineReplica).options(
        name=ENGINE,
        num_replicas=opts.replicas,
        max_ongoing_requests=opts.replica.max_concurrency,
        ray_actor_options={"num_cpus": opts.replica_cpus, "num_gpus": opts.replica_gpus},
        request_router_config=router_config,
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=30.0,
        logging_config=QUIET,
    )
    ingress = serve.deployment(Ingress).options(
        name="Ingress",
        num_replicas=opts.ingress_replicas,
        max_ongoing_requests=100_000,
        ray_actor_options={"num_cpus": 0},
        logging_config=QUIET,
    )
    return ingress.bind(engine.bind(opts.replica), opts)


def options_from_args(args: dict) -> ServeOptions:
    """``ServeOptions`` from flat ``key=value`` arguments (see ``app_builder``)."""
    args = dict(args)
    if "model" not in args:
        raise ValueError("chatkv's Ray app needs model=DIR (a local Hugging Face model directory)")

    def take(cls, skip: str) -> dict:
        out = {}
        for f in fields(cls):
            if f.name in args and f.name != skip:
                v, default = args.pop(f.name), f.default
                out[f.name] = type(default)(v) if isinstance(v, str) and type(default) in (int, float) else v
        return out

    replica = take(ReplicaOptions, "engine")
    return ServeOptions(ReplicaOptions(**replica, engine=args), **take(ServeOptions, "replica"))


def app_builder(args: dict):
    """For Ray Serve's own tools: ``serve run chatkv.server.ray.deployments:app_builder model=DIR replicas=2
    db_url=... data_dir=...``, or a config file's ``import_path`` with ``args``. Keys: the fields of
    ``ReplicaOptions`` and ``ServeOptions``; any other key is an engine option (``dtype``,
    ``data_dir``, ``db_url``, ``weights``...). Strings become the fields' types."""
    return build(options_from_args(args))


def deploy(opts: ServeOptions):
    """Deploy (or update) the app on the Ray instance this process is connected to; returns
    when every replica is running."""
    return serve.run(build(opts), name=opts.app_name, route_prefix=opts.route_prefix, blocking=False)


def check_resources(opts: ServeOptions) -> str | None:
    """Why the cluster cannot hold the replicas, or None."""
    have = ray.cluster_resources()
    for res, each in (("CPU", opts.replica_cpus), ("GPU", opts.replica_gpus)):
        need = each * opts.replicas
        if need > have.get(res, 0.0) + 1e-9:
            return (
                f"{opts.replicas} replicas x {each:g} {res} need {need:g} {res}, and the Ray cluster has "
                f"{have.get(res, 0.0):g} (fewer --replicas, or a smaller --replica-{res.lower()}s)"
            )
    return None


def run(opts: ServeOptions, host: str, port: int, ray_address: str | None) -> int:
    """Start or join Ray, deploy, serve until SIGINT/SIGTERM, then take the app down."""
    started_ray = ray_address is None
    if started_ray:
        ray.init(
            include_dashboard=False,
            object_store_memory=256 * 2**20,
            logging_level=logging.WARNING,
            runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
        )
    else:
        ray.init(address=ray_address, logging_level=logging.WARNING)
    try:
        why = check_resources(opts)
        if why:
            print(f"chatkv serve: {why}", flush=True, file=sys.stderr)
            return 2
        serve.start(http_options={"host": host, "port": port}, logging_config=QUIET)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        deploy(opts)
        name = opts.replica.served_model_name or Path(opts.replica.model).name
        print(
            f"chatkv serve: model {name!r} on {opts.replicas} Ray Serve replicas ({opts.routing} routing) at "
            f"http://{host}:{port}/v1",
            flush=True,
            file=sys.stderr,
        )
        stop.wait()
        serve.delete(opts.app_name)  # replicas drain their requests, then spill their sessions
        return 0
    finally:
        if started_ray:
            serve.shutdown()
            ray.shutdown()
