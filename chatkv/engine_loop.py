"""The engine loop: one background thread owns the engine's state and runs its steps.

(Past ~400 lines on purpose: the loop's admission, its stop and the close() gate share one
lock and one queue; split, the order in which they are taken could no longer be read in one
place. Issue 21's single engine driver is where it shrinks.)

After ``engine.start()`` every request, session turn and KV operation reaches the engine
through this loop, from any thread or from asyncio:

- ``call(fn)`` runs ``fn`` on the loop thread between two steps and returns its result
  (or raises its exception) to the caller; on the loop thread itself, or before the loop
  is started, it just calls ``fn``. Everything that touches the scheduler, the KV manager,
  the block pool or the snapshots goes through it, so nothing else ever races the step;
- ``submit(...)`` queues a request (validated on the loop thread; a bad one raises to the
  caller) and returns a ``RequestStream``: iterate it from a thread or ``async for`` it from
  asyncio; ``cancel()`` aborts the request on the next step, freeing its blocks;
- each step's settled text is pushed to the streams of the requests that produced it;
  finished requests call the engine's finish listeners (metrics) on the loop thread;
- ``stop()`` runs the commands still queued and joins the thread once no request is left
  (``Engine.close`` first lets the requests in flight finish or ends them); once the engine
  is closed (``closed``) every call, post, submit and start raises ``EngineClosed``;
- work done off the loop thread (no loop started, or after it stopped) holds ``lock``, so
  ``close()`` on another thread never races a step or a session's KV work.

The loop sleeps on a condition variable while there is no work: an idle engine costs no CPU.
``start()`` first releases the OpenMP worker threads of the thread that calls it (see
``release_openmp_pool``): the steps then run alone on the machine's cores at full speed.
A step that raises (a bug, not a request's own error: those end that request alone) fails
every request in it with that error and the loop goes on.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Protocol

from chatkv.errors import EngineClosed

if TYPE_CHECKING:
    from chatkv.sequence import Sequence

log = logging.getLogger("chatkv.engine")

_OMP_PAUSE_HARD = 2  # omp_pause_resource_t


@functools.lru_cache(maxsize=1)
def _libgomp():
    """The GNU OpenMP runtime torch computes with, if it is already loaded; else None."""
    if not sys.platform.startswith("linux") or "torch" not in sys.modules:
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if "libgomp" in line and "/" in line}
    except (OSError, IndexError):
        return None
    torch_lib = os.path.join(os.path.dirname(sys.modules["torch"].__file__), "lib") + os.sep
    ours = sorted(p for p in paths if p.startswith(torch_lib)) or sorted(paths)
    if len(ours) != 1:  # none, or several runtimes and none of them torch's own: leave them be
        return None
    try:
        lib = ctypes.CDLL(ours[0])  # already loaded: the same library, not a second copy
        fn = lib.omp_pause_resource_all
    except (OSError, AttributeError):  # an OpenMP older than 5.0
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def release_openmp_pool() -> bool:
    """End the OpenMP worker threads this thread's multithreaded torch ops started (they start
    again if it runs such ops again). True if there was a GNU OpenMP runtime to ask.

    Why: GNU OpenMP (torch's intra-op threads on Linux) keeps one pool of workers per thread
    that ever ran a parallel op, and once the threads it manages outnumber the CPUs it stops
    spinning between parallel regions and puts them to sleep after each: every small op of a
    decode step then waits for a futex wake-up. An engine loaded on the main thread, then
    stepped by the loop thread, holds two pools, which on 2 cores doubled the time of a
    decode step. Called on the thread that calls ``start()`` (where the engine was loaded),
    before the loop thread's first step."""
    fn = _libgomp()
    if fn is None:
        return False
    return fn(_OMP_PAUSE_HARD) == 0


class RequestStream:
    """The output of one submitted request: text pieces as they settle, then the result."""

    def __init__(self, loop: "EngineLoop", seq: "Sequence"):
        self._loop = loop
        self.seq = seq
        self.request_id = seq.seq_id
        self._cv = threading.Condition()
        self._items: deque[str] = deque()
        self._done = False
        self._wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    # -- the loop thread's side ---------------------------------------------------------

    def _push(self, piece: str, done: bool) -> None:
        with self._cv:
            if piece:
                self._items.append(piece)
            self._done = self._done or done
            self._cv.notify_all()
            wakers = list(self._wakers)
        for loop, ev in wakers:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # that event loop is closed: its consumer is gone
                pass

    # -- the consumer's side -------------------------------------------------------------

    @property
    def finished(self) -> bool:
        with self._cv:
            return self._done and not self._items

    def cancel(self) -> None:
        """Stop the request; its blocks are freed on the next step. What it produced stays."""
        if not self._done:
            try:
                self._loop.post(lambda: self._loop.engine.abort(self.seq))
            except EngineClosed:  # close() already ended every request
                pass

    def __iter__(self):
        try:
            while True:
                with self._cv:
                    if self._items:
                        piece = self._items.popleft()
                    elif self._done:
                        break
                    elif self._loop.running:
                        self._cv.wait(1.0)  # woken by the push; the timeout only re-checks the loop
                        continue
                    else:
                        piece = None
                if piece is None:  # no loop thread: this one steps
                    self._step_here()
                    continue
                yield piece
        finally:
            if not self._done:  # the consumer stopped early
                self.cancel()
        if self.seq.error is not None:
            raise self.seq.error

    async def __aiter__(self):
        ev = asyncio.Event()
        waker = (asyncio.get_running_loop(), ev)
        with self._cv:
            self._wakers.append(waker)
        try:
            while True:
                with self._cv:
                    piece = self._items.popleft() if self._items else None
                    done = self._done
                    if piece is None and not done:
                        ev.clear()  # set again by the next push, even one racing this line
                if piece is not None:
                    yield piece
                elif done:
                    break
                else:
                    await ev.wait()
        finally:
            with self._cv:
                self._wakers.remove(waker)
            if not self._done:
                self.cancel()
        if self.seq.error is not None:
            raise self.seq.error

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the request finished (stepping here if the loop is not started)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            while not self._loop.running and not self._done:
                self._step_here()
            with self._cv:
                left = None if deadline is None else deadline - time.monotonic()
                if self._done or (left is not None and left <= 0):
                    return self._done
                # woken by the push; the timeout only re-checks that the loop still runs
                self._cv.wait(1.0 if left is None else min(1.0, left))

    def _step_here(self) -> None:
        try:
            self._loop.step_here()
        except EngineClosed:
            with self._cv:
                if not self._done:  # (close() publishes every request's end before it is closed)
                    raise

    def result(self):
        """Wait for the request to finish; its GenerationResult (raises the request's own error)."""
        for _ in self:
            pass
        return self.seq.result()

    async def aresult(self):
        async for _ in self:
            pass
        return self.seq.result()


class Steps(Protocol):
    """What the loop needs of the engine it drives (``chatkv.engine.Engine`` is one); the loop
    names this, never the Engine class, so the two modules do not import each other."""

    def has_work(self) -> bool: ...

    def step(self) -> list[Sequence]: ...

    def abort(self, seq: Sequence) -> None: ...

    def fail_all(self, error: Exception) -> None: ...


class EngineLoop:
    def __init__(self, engine: Steps):
        self.engine = engine
        self._cv = threading.Condition()
        self._commands: deque[tuple[Callable[[], Any], Future | None]] = deque()
        self._streams: dict["Sequence", RequestStream] = {}
        self._stopping = False
        self._exited = False  # set (under _cv) by the loop thread as it decides to end
        self._thread: threading.Thread | None = None
        self.closed = False  # the engine is closed: nothing runs here any more
        self.lock = threading.RLock()  # the engine's state, for work done off the loop thread
        self._here = threading.local()  # .depth: this thread runs ``here`` (it owns the state now)
        self.listeners: list[Callable] = []  # fn(result, seq) when a request finishes (loop thread)

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._exited and self._thread.is_alive()

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def owns_state(self) -> bool:
        """Whether this thread may touch the engine's state now: the loop thread, or one running ``here``."""
        return self.on_loop_thread() or getattr(self._here, "depth", 0) > 0

    def start(self) -> None:
        if self.closed:
            raise EngineClosed("the engine is closed; its loop does not start again")
        if self.running:
            return
        self._stopping = False
        self._exited = False
        release_openmp_pool()
        self._thread = threading.Thread(target=self._run, name="chatkv-engine", daemon=True)
        self._thread.start()

    # -- from any thread ---------------------------------------------------------------

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run ``fn`` on the loop thread between steps and return its result (or raise);
        without a loop thread, here (holding ``lock``). ``timeout``: TimeoutError if the loop
        has not run it by then (it may still run later). EngineClosed once the engine is closed."""
        if self.on_loop_thread():
            return fn()
        fut = self._queue(fn, Future())
        if fut is None:
            return self.here(fn)
        return fut.result(timeout)

    def post(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the loop thread soon, without waiting (errors are logged)."""
        if self.on_loop_thread():
            fn()
        elif self._queue(fn, None) is None:
            self.here(fn)

    def _queue(self, fn: Callable[[], Any], fut: Future | None):
        """Hand ``fn`` to the loop thread: ``fut`` (True for a post) once queued; None when there
        is no loop thread to run it (never started, or it ended: a command queued after the
        loop decided to end would never run)."""
        with self._cv:
            if self._thread is not None and not self._exited and self._thread.is_alive():
                self._commands.append((fn, fut))
                self._cv.notify()
                return fut if fut is not None else True
        return None

    def here(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on this thread, as the engine's state's owner for now (no loop thread)."""
        with self.lock:
            if self.closed:
                raise EngineClosed()
            self._here.depth = getattr(self._here, "depth", 0) + 1
            try:
                return fn()
            finally:
                self._here.depth -= 1

    def submit(self, make_seq: Callable[[], "Sequence"]) -> RequestStream:
        """Queue the request ``make_seq()`` builds (on the loop thread) and stream its output."""

        stream = self.call(lambda: self.track(make_seq()))
        with self._cv:
            self._cv.notify()
        return stream

    def track(self, seq: "Sequence") -> RequestStream:
        """The stream that carries ``seq``'s output (made once; loop thread or no loop)."""
        stream = seq.stream
        if stream is None:
            stream = seq.stream = RequestStream(self, seq)
            self._streams[seq] = stream
        return stream

    def stop(self, timeout: float | None = 30.0) -> bool:
        """Run the queued commands and the requests left, then join the thread (at most
        ``timeout`` seconds: False if it is still running then). ``Engine.close`` ends every
        request first."""
        thread = self._thread
        if thread is None:
            return True
        if self.on_loop_thread():
            raise RuntimeError("the engine loop cannot stop itself; call close() from another thread")
        with self._cv:
            self._stopping = True
            self._cv.notify()
        thread.join(timeout)
        if thread.is_alive():
            log.warning("the engine loop did not stop within %s s; left running (a daemon thread)", timeout)
            return False
        self._thread = None
        return True

    def step_here(self) -> None:
        """One step on the caller's thread (the loop is not started)."""
        with self.lock:
            if self.closed:
                raise EngineClosed()
            if self.engine.has_work():
                self.engine.step()
            self._publish()

    # -- the loop thread -------------------------------------------------------------------

    def _run(self) -> None:
        eng = self.engine
        while True:
            with self._cv:
                while not self._commands and not eng.has_work() and not self._stopping:
                    self._cv.wait()
                commands = list(self._commands)
                self._commands.clear()
                if self._stopping and not commands and not eng.has_work():
                    self._exited = True  # from here a call runs on its caller's thread, never queued
                    return
            for fn, fut in commands:
                if fut is not None and not fut.set_running_or_notify_cancel():
                    continue
                try:
                    out = fn()
                except BaseException as e:  # noqa: BLE001 - it belongs to whoever asked
                    if fut is not None:
                        fut.set_exception(e)
                    else:
                        log.warning("engine loop: a posted command failed (%s: %s)", type(e).__name__, e)
                else:
                    if fut is not None:
                        fut.set_result(out)
            if eng.has_work():  # (a finished turn's KV is its session's at once: nothing to wait for)
                try:
                    eng.step()
                except Exception as e:  # noqa: BLE001 - a bug in the step: its requests fail, the loop goes on
                    log.exception("engine step failed; failing its requests")
                    eng.fail_all(e)
            self._publish()

    def _publish(self) -> None:
        for seq, stream in list(self._streams.items()):
            piece = seq.out.take()
            if seq.finished:
                piece += seq.out.take()
                del self._streams[seq]
                stream._push(piece, True)
                result = seq.result()
                for fn in self.listeners:
                    try:
                        fn(result, seq)
                    except Exception as e:  # noqa: BLE001 - a listener never breaks the loop
                        log.warning("finish listener failed (%s: %s)", type(e).__name__, e)
            elif piece:
                stream._push(piece, False)
