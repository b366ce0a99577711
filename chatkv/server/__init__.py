"""``chatkv serve``: an OpenAI-compatible HTTP server over one engine.

    chatkv serve [--host 127.0.0.1] [--port 8000] [--model DIR] [--api-key KEY ...] [--api-keys FILE]
    from chatkv.server import create_app; app = create_app(engine)   # any ASGI server

Built on Starlette with uvicorn: a mature, small ASGI stack (Starlette is what FastAPI itself
is made of), whose ``StreamingResponse`` gives server-sent events with the client's
disconnect cancelling the generator, and whose server gives graceful shutdown (requests in
flight finish, then the app's lifespan closes the engine and spills its sessions). FastAPI
would add pydantic models and their 422 errors; the OpenAI API needs its own error shape
and codes (400 ``invalid_value`` with ``param``, 404 ``model_not_found``...), so bodies are
validated by hand in ``schemas.py`` and FastAPI would bring nothing we use.

Modules: ``app`` (the app, its state and lifespan), ``routes`` (the handlers), ``schemas``
(request validation), ``generation`` (stateless requests and session turns), ``history``
(canonical tokens for clients that re-send their history), ``responses`` (OpenAI's shapes,
SSE), ``resp_routes``, ``resp_request`` and ``resp_shapes`` (the Responses API: its routes, its
bodies and ids, its objects and stream events), ``guards`` (API keys and the users they are, body
size, concurrency), ``limits`` (bounds on a request's work: JSON depth, message counts, text size),
``tokens`` (``/tokenize``, ``/detokenize``), ``errors`` (OpenAI's error JSON), ``cli`` (the options,
the engine, uvicorn).
Metrics live in ``chatkv.engine.metrics``. ``chatkv serve --ray`` (replicas on Ray Serve) is the
subpackage ``chatkv.server.ray``; nothing here imports it but ``cli``, through ``ray.options``. Only the public SDK is
used (``tests/test_faces_public_api.py``).
"""

from chatkv.server.app import create_app

__all__ = ["create_app"]
