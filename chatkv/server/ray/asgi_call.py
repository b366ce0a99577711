"""One HTTP request answered by an ASGI app in this process, as a stream of plain objects:
a ``Head`` (status and headers), then the body's bytes as the app sends them.

``chatkv serve --ray`` uses it so each engine replica answers with the very app
``chatkv serve`` runs (``create_app``: same routes, validation, errors, SSE), while Ray
carries the request and the answer between the ingress and the replica. The call is
cancelled (and the app sees the client go away) when the consumer stops reading.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator


@dataclass
class HttpCall:
    """A request as the ingress received it (headers lower-cased, as ASGI has them)."""

    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    client: tuple[str, int] | None = None


@dataclass
class Head:
    status: int
    headers: list[tuple[bytes, bytes]]
    replica: str = ""  # who answered (filled in by the replica)


_END = object()


def _scope(call: HttpCall) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": call.method.upper(),
        "scheme": "http",
        "path": call.path,
        "raw_path": call.path.encode(),
        "root_path": "",
        "query_string": call.query_string,
        "headers": list(call.headers),
        "client": call.client,
        "server": ("chatkv-replica", 0),
        "state": {},
    }


async def call_asgi(app, call: HttpCall) -> AsyncIterator[Head | bytes]:
    """Run ``app`` on ``call``; yield its ``Head`` then non-empty body chunks. Closing the
    iterator early disconnects the client: the app's task is cancelled and awaited."""
    out: asyncio.Queue = asyncio.Queue()
    body_given = False
    gone = asyncio.Event()

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await out.put(message)

    task = asyncio.create_task(app(_scope(call), receive, send))
    task.add_done_callback(lambda _t: out.put_nowait(_END))
    try:
        while True:
            msg = await out.get()
            if msg is _END:
                task.result()  # the app's own error, if it raised
                return
            if msg["type"] == "http.response.start":
                yield Head(msg["status"], [(bytes(k), bytes(v)) for k, v in msg.get("headers", [])])
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield bytes(msg["body"])
                if not msg.get("more_body", False):
                    return
    finally:
        gone.set()
        if not task.done():
            task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            if not task.cancelled():  # our own cancellation, not the app's task
                raise
        except Exception:  # noqa: BLE001 - already answered (or the consumer went away)
            pass
