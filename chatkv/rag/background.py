"""Chunk KV made off a turn's critical path.

A turn places only chunk KV that is already stored (chatkv.rag.placement); a retrieved chunk
without it is computed in the turn as prefix caching alone computes it, and queued here. Its
canonical KV is then made at the lowest priority: one daemon thread per engine (started when
something is queued, ended once the queue is empty) waits until the engine has been idle for
``QUIET_S`` seconds (``Engine.idle``: open, no session turn running, no request to step), then
computes one chunk in one round of the engine loop, checking idleness again inside the round.
A turn that arrives meanwhile waits for at most that one chunk's forward.

Why a thread of its own rather than a hook in the loop thread: the loop thread runs only after
``Engine.start()``; without it (the SDK's default) whoever waits for a request runs the rounds,
so nothing would ever run them while the engine is idle. The thread calls ``Engine.on_loop``,
which works either way.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from chatkv.errors import EngineClosed

log = logging.getLogger("chatkv.rag.chunk_kv")

QUIET_S = 0.3  # how long the engine must have been idle before a chunk is computed
POLL_S = 0.05  # how often an idle check is made while work is queued


class Filler:
    """The queue of chunks whose canonical KV is to be made when the engine is idle."""

    def __init__(self, engine, store, make: Callable[[str, list[int]], object]):
        """``make(text, ids)``: compute a chunk's canonical KV into ``store`` unless it is there
        (chatkv.rag.placement's, in a round of the engine loop)."""
        self.engine, self.store, self.make = engine, store, make
        self._cv = threading.Condition()
        self._todo: dict[str, list[int]] = {}  # text -> its token ids, in the order queued
        self._busy = False  # a chunk is being computed
        self._thread: threading.Thread | None = None
        self.made = 0  # chunks whose KV this filler computed

    def add(self, texts: Sequence[str], ids: Sequence[list[int]]) -> None:
        """Queue chunks (as a prompt quotes them, with their token ids); already queued ones once."""
        with self._cv:
            for t, c in zip(texts, ids):
                self._todo.setdefault(t, list(c))
            if self._todo and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._run, name="chatkv-chunk-kv", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    @property
    def pending(self) -> int:
        with self._cv:
            return len(self._todo) + self._busy

    def wait(self, timeout: float | None = None) -> bool:
        """Until every queued chunk is made (or dropped on an error); False if ``timeout`` passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._todo and not self._busy, timeout)

    def _run(self) -> None:
        quiet_since = None
        while True:
            with self._cv:
                if not self._todo:
                    self._thread = None
                    self._cv.notify_all()
                    return
            if not self.engine.open:
                self._drop_all()
                return
            if not self.engine.idle:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= QUIET_S:
                try:
                    if self.engine.on_loop(self._one):
                        continue  # the next chunk right away while it stays idle
                except EngineClosed:
                    self._drop_all()
                    return
                quiet_since = None
            time.sleep(POLL_S)

    def _one(self) -> bool:
        """In a round: make the first queued chunk's KV unless the engine is busy. True if one was."""
        if not self.engine.idle:
            return False
        with self._cv:
            if not self._todo:
                return False
            text = next(iter(self._todo))
            ids = self._todo.pop(text)
            self._busy = True
        try:
            threads = getattr(self.engine, "threads", None)
            if threads is not None:
                threads.adjust()
            before = self.store.computed
            self.make(text, ids)
            self.made += self.store.computed - before
        except Exception as e:  # noqa: BLE001 - a chunk left without KV is computed by its turns, as with off
            log.warning("computing a chunk's KV in the background failed (%s: %s)", type(e).__name__, e)
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()
        return True

    def _drop_all(self) -> None:
        with self._cv:
            self._todo.clear()
            self._thread = None
            self._cv.notify_all()


def settle(engine, timeout: float | None = None) -> bool:
    """Wait until the chunk KV queued by earlier turns is made (the engine idle meanwhile);
    True if nothing is left. For a caller that wants the next turn to place it (tests, benchmarks)."""
    store = getattr(engine.kv, "chunks", None)
    if store is None or store.filler is None:
        return True
    return store.filler.wait(timeout)
