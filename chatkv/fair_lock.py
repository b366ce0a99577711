"""A reentrant lock that waiters get in the order they asked for it.

The engine's state lock (``EngineLoop.lock``) is taken by whoever runs a round. Without a
started loop thread, every caller waiting for its request runs rounds itself, back to back:
with ``threading.RLock`` such a thread releases the lock and takes it again before a waiting
thread wakes, round after round, so a command (``engine.on_loop``), a ``call`` with a
timeout, or ``close()`` could wait behind a whole generation (measured: 35-240 ms and up to
160 tokens of another request's generation behind one ``on_loop``; CI once saw all 3,000).
Here a release hands the lock straight to the first waiter, so one waits at most for the
rounds of those that asked before it.
"""

from __future__ import annotations

import threading
from collections import deque


class FairRLock:
    """``threading.RLock``'s ``acquire(blocking, timeout)``, ``release()`` and ``with``, first
    come first served. The uncontended path is one plain lock taken and released."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()  # guards the fields below; never held while waiting
        self._owner: int | None = None
        self._depth = 0
        self._waiters: deque[tuple[int, threading.Event]] = deque()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        with self._mutex:
            if self._owner == me:
                self._depth += 1
                return True
            if self._owner is None and not self._waiters:
                self._owner, self._depth = me, 1
                return True
            if not blocking:
                return False
            entry = (me, threading.Event())
            self._waiters.append(entry)
        entry[1].wait(None if timeout is None or timeout < 0 else timeout)
        with self._mutex:
            if self._owner == me:  # handed over (perhaps just as the wait timed out)
                return True
            self._waiters.remove(entry)
            return False

    def release(self) -> None:
        with self._mutex:
            if self._owner != threading.get_ident():
                raise RuntimeError("cannot release a lock this thread does not hold")
            self._depth -= 1
            if self._depth:
                return
            if self._waiters:
                self._owner, ready = self._waiters.popleft()
                self._depth = 1
                ready.set()
            else:
                self._owner = None

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
