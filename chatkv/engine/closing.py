"""``Engine.close(timeout)``: the engine's admission gate and its shutdown contract.

- ``close()`` first stops admitting: from then on every call that would start something
  (``generate``, ``stream``, ``submit``, ``agenerate``, ``start``, ``session``, ``resume``,
  a session's ``send``/``stream``/``asend``/``astream``...) raises ``EngineClosed``.
- The **grace period** (``timeout`` seconds): the requests and session turns already in
  flight go on. ``close`` waits for the engine loop to run out of them: with the loop thread
  started it steps them; without, ``close`` runs the loop's rounds on its own thread too (their
  callers may be running rounds as well: a round holds the loop's ``lock``), so a request whose
  caller stopped reading still ends.
- When it is over, every request left is **cut**: aborted (what it produced stays, its KV
  is kept like any finished turn's) and given an ``EngineClosed`` error, which its caller
  receives; a session turn stores its partial reply first, marked ``interrupted``, and the
  ``EngineClosed`` it raises carries that ``Reply``. A turn still before its request (a
  restore from disk) is refused at admission: nothing of it is stored.
- Then the turns' ends: ``close`` waits (at most ``DRAIN_S``) for the turns whose code is
  running to store their replies; a turn whose caller holds it suspended (a stream not
  read to its end) has its reply stored by ``close`` itself. Then the loop thread stops and
  the sessions are spilled, the snapshots written, the database and knowledge bases closed.
- Afterwards every call raises ``EngineClosed`` and nothing starts a thread again.

Every wait here is bounded: a ``close`` that cannot get something done logs it and goes on.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterator

from chatkv.errors import EngineClosed

if TYPE_CHECKING:
    from chatkv.engine.loop import EngineLoop
    from chatkv.engine.scheduler import Scheduler
    from chatkv.kvcache.manager import KVManager
    from chatkv.sessions.manager import SessionManager

log = logging.getLogger("chatkv.engine.core")

DRAIN_S = 10.0  # after the grace period: how long close() waits for each step of the shutdown


class Gate:
    """What an engine admits: ``state`` goes open -> closing (``close`` began) -> closed."""

    def __init__(self):
        self._cv = threading.Condition()
        self.state = "open"
        self.cut = False  # the grace period is over: every request was ended, none is admitted
        self.turns = 0  # session turns whose code runs now (not those suspended at a yield)
        self.closer: threading.Thread | None = None
        self.done = threading.Event()

    def check(self, what: str) -> None:
        """EngineClosed unless the engine is open."""
        if self.state != "open":
            raise EngineClosed(f"the engine is {'closing' if self.state == 'closing' else 'closed'}; {what} refused")

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """A session turn in flight (EngineClosed once close() began)."""
        with self._cv:
            self.check("a new turn")
            self.turns += 1
        try:
            yield
        finally:
            with self._cv:
                self.turns -= 1
                self._cv.notify_all()

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Around a turn's ``yield``: while its caller holds the piece, the turn is not running."""
        with self._cv:
            self.turns -= 1
            self._cv.notify_all()
        try:
            yield
        finally:
            with self._cv:
                self.turns += 1

    def begin_close(self) -> bool:
        """open -> closing, with this thread as the closer; False if it was not open (closed,
        or another thread is closing it)."""
        with self._cv:
            first = self.state == "open"
            if first:
                self.state, self.closer = "closing", threading.current_thread()
        return first

    def finish(self) -> None:
        """closing -> closed: every ``close()`` waiting for the closer returns."""
        self.state = "closed"
        self.done.set()

    def wait_turns(self, until: float | None) -> bool:
        """Until no turn's code is running, or the monotonic time ``until`` (None: no limit); True if none is."""
        with self._cv:
            return self._cv.wait_for(
                lambda: self.turns <= 0, None if until is None else max(0.0, until - time.monotonic())
            )


class Closer:
    """Closes one engine: ``Engine.close`` and a round's step that finds the grace period over
    call it. It works on the engine's collaborators, handed over when the engine is made: the
    admission gate, the loop, the scheduler and the KV manager; the session manager and the
    knowledge bases, which the engine opens lazily, through the engine's own callables."""

    def __init__(
        self,
        gate: Gate,
        loop: EngineLoop,
        scheduler: Scheduler,
        kv: KVManager,
        sessions: Callable[[], SessionManager | None],
        take_sessions: Callable[[], SessionManager | None],
        close_kbs: Callable[[], None],
    ):
        self.gate, self.loop, self.scheduler, self.kv = gate, loop, scheduler, kv
        self.sessions = sessions  # the session manager if it is open (None: not opened)
        self.take_sessions = take_sessions  # the same, detached from the engine (nothing opens it again)
        self.close_kbs = close_kbs  # close and forget every open knowledge base

    def close(self, timeout: float | None) -> None:
        gate = self.gate
        if not gate.begin_close():  # closed already, or another thread is closing it: wait for that one
            if gate.closer is not threading.current_thread():
                gate.done.wait()
            return
        try:
            if not self._grace(timeout):
                log.info("close(): requests still running after the %s s grace period are interrupted", timeout)
            self._cut()
            if not gate.wait_turns(time.monotonic() + DRAIN_S):
                log.warning("close(): %d turn(s) still running after %s s; closing without them", gate.turns, DRAIN_S)
            sm = self.sessions()
            if sm is not None:
                sm.end_turns()  # turns whose callers hold them suspended: their replies are stored here
        finally:
            try:
                self._teardown()
            finally:
                gate.finish()

    def _busy(self) -> bool:
        return self.scheduler.has_work() or self.gate.turns > 0

    def _grace(self, timeout: float | None) -> bool:
        """Let what is in flight finish: the requests (the engine loop runs out of them, on its thread
        or here) and the turns (each ends its own); True if they did within ``timeout``."""
        loop, gate = self.loop, self.gate
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while self._busy():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            if not self.scheduler.has_work():
                gate.wait_turns(deadline)  # a turn's own request is stepped by the loop meanwhile
                continue
            try:
                loop.until_idle(left)
            except EngineClosed:
                return True
            except Exception as e:  # noqa: BLE001 - a failed step ends its requests, as on the loop thread
                log.exception("engine step failed during close(); failing its requests")
                loop.fail(e)
        return True

    def end_requests(self) -> None:
        """End every request in the scheduler, each with an EngineClosed its caller receives (in a
        round of the engine loop). Also run by a round's step that finds the grace period over
        (``Engine.run_batch``): a caller running the rounds ends them itself instead of waiting
        for close() to get the lock."""
        for seq in self.scheduler.sequences():
            self.scheduler.abort(seq)
            seq.error = EngineClosed(
                "the engine was closed before this request finished; what it produced is kept", reply=seq.result()
            )
        self.loop.publish()

    def _cut(self) -> None:
        """End every request left, in a round of the loop; from now on none is admitted."""
        self.gate.cut = True
        try:
            self.loop.call(self.end_requests, timeout=DRAIN_S)
        except TimeoutError:
            log.warning("close(): the engine loop did not end the requests in flight within %s s", DRAIN_S)
        except EngineClosed:  # closed meanwhile (by a thread that gave up waiting for this one): nothing left
            pass

    def _teardown(self) -> None:
        """Stop the loop thread; spill and close the sessions, the store, the knowledge bases."""
        loop = self.loop
        stopped = loop.stop(DRAIN_S)  # (its rounds take the lock: joined before it is taken here)
        got = loop.lock.acquire(timeout=DRAIN_S)  # late rounds elsewhere wait, then see it closed
        try:
            sm = self.take_sessions()
            try:
                if sm is not None:
                    if stopped:
                        sm.close()
                    else:  # the KV belongs to a loop thread that is still running: only the files are closed
                        sm.close_files()
            finally:
                self.close_kbs()
                if stopped:
                    self.kv.clear()
                loop.closed = True
        finally:
            if got:
                loop.lock.release()
