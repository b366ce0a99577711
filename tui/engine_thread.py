"""The one thread that calls the engine (the SDK is synchronous and single-threaded)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor


class EngineThread:
    """The one thread that calls the engine: every call is serialised through it."""

    def __init__(self):
        self._ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chatkv-engine")

    def submit(self, fn, *args, **kw) -> Future:
        return self._ex.submit(fn, *args, **kw)

    async def call(self, fn, *args, **kw):
        return await asyncio.wrap_future(self._ex.submit(fn, *args, **kw))

    closed = False

    def shutdown(self) -> None:
        self.closed = True
        self._ex.shutdown(wait=True)
