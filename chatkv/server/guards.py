"""What a request must pass before it reaches the engine: the API key, the body's size, and
the number of requests already running.

- ``--api-key``: every ``/v1/...`` route needs ``Authorization: Bearer <key>`` (compared in
  constant time); ``/health`` and ``/metrics`` stay open, as in vLLM, so probes and
  scrapers need no secret. A missing or wrong key is a 401 with code ``invalid_api_key``.
- ``--max-request-bytes``: a ``Content-Length`` over the limit is refused before reading;
  a body without one (chunked) is read only up to the limit. Either way a 413.
- ``--max-concurrency``: generation and embedding requests running at once (a streamed
  response counts until its last chunk is sent or the client goes away). One more is a 429
  at once, not queued: a client retries with backoff, and the server's memory stays bounded.
"""

from __future__ import annotations

import hmac

from starlette.requests import Request

from chatkv.server.errors import APIError


def check_api_key(request: Request, api_key: str | None) -> None:
    if not api_key:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "Incorrect API key provided." if header else
                       "You didn't provide an API key: send 'Authorization: Bearer <key>'.",
                       "invalid_api_key", type="invalid_request_error")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 if it is larger than ``limit`` bytes."""
    length = request.headers.get("content-length")
    too_large = APIError(413, f"the request body is larger than the server's limit of {limit} bytes "
                              "(chatkv serve --max-request-bytes)", "request_too_large")
    if length is not None:
        try:
            if int(length) > limit:
                raise too_large
        except ValueError:
            raise APIError(400, f"bad Content-Length header {length!r}", "invalid_request") from None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


class ConcurrencyLimit:
    """A count of running requests, checked and changed on the event loop's thread only."""

    def __init__(self, limit: int):
        self.limit = limit
        self.running = 0

    def acquire(self) -> "Slot":
        if self.running >= self.limit:
            raise APIError(429, f"the server is already running {self.limit} requests "
                                "(chatkv serve --max-concurrency); retry shortly", "rate_limit_exceeded")
        self.running += 1
        return Slot(self)


class Slot:
    """One running request's place; ``release()`` is idempotent."""

    def __init__(self, limit: ConcurrencyLimit):
        self._limit = limit
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._limit.running -= 1
