"""The engine loop: the one driver of the engine's steps, and the streams of its requests.

(Past ~400 lines on purpose: the loop's rounds, its thread, its stop and the streams' waits
share one lock and one queue; split, the order in which they are taken could no longer be
read in one place. That lock's own class, ``FairRLock``, is here too: it exists for the loop
alone, and why it must hand over in order is a fact about the rounds.)

The loop's body is ``round()``: the queued commands, then one step of the batch, then each
request's new text pushed to its ``RequestStream``. It holds ``lock`` (the engine's state)
while it runs, so one round runs at a time, and only a round touches the scheduler, the KV
manager, the block pool or the snapshots. After ``engine.start()`` one background thread
runs the rounds, sleeping on a condition variable while there is nothing to do (an idle
engine costs no CPU); without it, whoever waits for the loop runs the same rounds inline on
its own thread. Which of the two it is, is decided here alone (``_queue``, ``until``):

- ``call(fn)`` runs ``fn`` in a round and returns its result (or raises its exception):
  queued for the loop thread, or in a round run here; inside a round it just calls ``fn``;
- every request has a ``RequestStream`` (``seq.stream``): iterate it from a thread or
  ``async for`` it from asyncio; ``cancel()`` aborts the request in the next round.
  Finished requests call the engine's finish listeners (metrics) in the round;
- a waiter (a stream's reader, ``close()``'s grace period) sleeps until the loop thread
  wakes it, never on a timer; when the thread ends it wakes every one of them, and they
  run the rounds themselves from then on;
- ``stop()`` runs the commands still queued and joins the thread once no request is left
  (``Engine.close`` first lets the requests in flight finish or ends them); once the engine
  is closed (``closed``) every round, call and start raises ``EngineClosed``.

``start()`` first releases the OpenMP worker threads of the thread that calls it (see
``release_openmp_pool``): the steps then run alone on the machine's cores at full speed.
A step that raises (a bug, not a request's own error: those end that request alone) raises
to a caller running the round, every sequence left as it was (it ends its own request); on
the loop thread, which has no caller to tell, it fails every request in the batch and the
loop goes on.
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

from chatkv.errors import EngineClosed, check_timeout

if TYPE_CHECKING:
    from chatkv.engine.sequence import Sequence

log = logging.getLogger("chatkv.engine.core")

_OMP_PAUSE_HARD = 2  # omp_pause_resource_t


class FairRLock:
    """A reentrant lock that waiters get in the order they asked for it: ``threading.RLock``'s
    ``acquire(blocking, timeout)``, ``release()`` and ``with``, first come first served. The
    uncontended path is one plain lock taken and released.

    The engine's state lock (``EngineLoop.lock``) is taken by whoever runs a round. Without a
    started loop thread, every caller waiting for its request runs rounds itself, back to back:
    with ``threading.RLock`` such a thread releases the lock and takes it again before a waiting
    thread wakes, round after round, so a command (``engine.on_loop``), a ``call`` with a
    timeout, or ``close()`` could wait behind a whole generation of another request.
    Here a release hands the lock straight to the first waiter, so one waits at most for the
    rounds of those that asked before it.
    """

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
    """The output of one request: text pieces as they settle, then the result. Every request
    has one (``seq.stream``), however the loop runs."""

    def __init__(self, loop: "EngineLoop", seq: "Sequence"):
        self._loop = loop
        self.seq = seq
        self.request_id = seq.seq_id
        self._cv = threading.Condition()
        self._items: deque[str] = deque()
        self._done = False
        self._wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    # -- the loop's side ----------------------------------------------------------------

    def push(self, piece: str, done: bool) -> None:
        """The loop's side (``EngineLoop.publish``): a settled text ``piece``; ``done``: the request ended."""
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

    def _ready(self) -> bool:
        return bool(self._items) or self._done

    def _block(self, ready: Callable[[], bool], timeout: float | None) -> None:
        """Sleep until the loop thread pushes (or ends: it wakes every stream as it does)."""
        with self._cv:
            self._cv.wait_for(lambda: ready() or not self._loop.running, timeout)

    def _until(self, ready: Callable[[], bool], timeout: float | None = None) -> bool:
        try:
            return self._loop.until(ready, self._block, timeout)
        except EngineClosed:
            if ready():  # (close() publishes every request's end before it is closed)
                return True
            raise EngineClosed(
                "the engine was closed before this request finished; what it produced is kept", reply=self.seq.result()
            ) from None

    def cancel(self) -> None:
        """Stop the request; its blocks are freed on the next round. What it produced stays."""
        if not self._done:
            try:
                self._loop.post(lambda: self._loop.engine.abort(self.seq))
            except EngineClosed:  # close() already ended every request
                pass

    def __iter__(self):
        try:
            while True:
                self._until(self._ready)
                with self._cv:
                    if not self._items:
                        break  # done
                    piece = self._items.popleft()
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
                    await self._loop.until_async(self._ready, ev, lambda: self._until(self._ready))
        finally:
            with self._cv:
                self._wakers.remove(waker)
            if not self._done:
                self.cancel()
        if self.seq.error is not None:
            raise self.seq.error

    def token_logprobs(self, start: int = 0):
        """The logprobs (``chatkv.outputs.TokenLogprob``) of the tokens generated so far, from
        ``start`` on (None unless the request's ``SamplingParams.logprobs`` asked for them)."""
        return self.seq.token_logprobs(start)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the request finished; False if ``timeout`` seconds passed first."""
        return self._until(lambda: self._done, timeout)

    def result(self):
        """Wait for the request to finish; its GenerationResult (raises the request's own error)."""
        for _ in self:
            pass
        return self.seq.result()

    async def aresult(self):
        async for _ in self:
            pass
        return self.seq.result()

    def wake(self) -> None:
        """The loop thread ended: whoever waits looks again (and runs the loop itself)."""
        self.push("", False)


class Steps(Protocol):
    """What the loop needs of the engine it drives (``chatkv.engine.core.Engine`` is one); the loop
    names this, never the Engine class, so the two modules do not import each other."""

    def has_work(self) -> bool: ...

    def run_batch(self) -> list[Sequence]: ...

    def abort(self, seq: Sequence) -> None: ...

    def fail_all(self, error: Exception) -> None: ...


class EngineLoop:
    def __init__(self, engine: Steps):
        self.engine = engine
        self._cv = threading.Condition()  # the command queue; the loop thread sleeps on it
        self._idle = threading.Condition()  # notified as the loop thread runs out of work (close()'s grace)
        self._commands: deque[tuple[Callable[[], Any], Future, bool]] = deque()
        self._streams: dict["Sequence", RequestStream] = {}
        self._stopping = False
        self._exited = False  # set (under _cv) by the loop thread as it decides to end
        self._thread: threading.Thread | None = None
        self.closed = False  # the engine is closed: nothing runs here any more
        self.lock = FairRLock()  # the engine's state: held by whoever runs a round, first come first served
        self._here = threading.local()  # .depth: this thread is inside a round (it owns the state)
        self.listeners: list[Callable] = []  # fn(result, seq) when a request finishes (in a round)

    @property
    def running(self) -> bool:
        """A started thread runs the rounds (else whoever waits runs them)."""
        t = self._thread
        return t is not None and not self._exited and t.is_alive()

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def owns_state(self) -> bool:
        """Whether this thread may touch the engine's state now: it is inside a round."""
        return getattr(self._here, "depth", 0) > 0

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

    # -- the loop's one body --------------------------------------------------------------

    def round(
        self,
        command: Callable[[], Any] | None = None,
        done: Callable[[], bool] | None = None,
        lock_timeout: float | None = None,
    ) -> Any:
        """One pass of the loop, on whichever thread runs it (the loop thread, or a caller when
        none is started): the queued commands, then ``command`` if given (its result is
        returned), else one step of the batch unless ``done()`` already holds (the finished
        sequences are returned); then each stream gets its new text. A step that raises
        raises here, every sequence left as it was (the loop thread then fails the batch)."""
        if not self.lock.acquire(timeout=-1 if lock_timeout is None else max(lock_timeout, 0)):
            raise TimeoutError("the engine's state stayed busy")
        try:
            if self.closed:
                raise EngineClosed()
            self._here.depth = getattr(self._here, "depth", 0) + 1
            try:
                with self._cv:
                    commands = list(self._commands)
                    self._commands.clear()
                for fn, fut, posted in commands:
                    self._run_command(fn, fut, posted)
                if command is not None:
                    return command()
                if (done is None or not done()) and self.engine.has_work():
                    return self.engine.run_batch()
                return []
            finally:
                try:
                    self.publish()
                finally:
                    self._here.depth -= 1
        finally:
            self.lock.release()

    @staticmethod
    def _run_command(fn: Callable[[], Any], fut: Future, posted: bool) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            out = fn()
        except BaseException as e:  # noqa: BLE001 - it belongs to whoever asked
            if posted:
                log.warning("engine loop: a posted command failed (%s: %s)", type(e).__name__, e)
            fut.set_exception(e)
        else:
            fut.set_result(out)

    def fail(self, error: Exception) -> None:
        """End every request with ``error`` (a round whose step raised with no caller to raise it to)."""
        with self.lock:
            self._here.depth = getattr(self._here, "depth", 0) + 1
            try:
                self.engine.fail_all(error)
                self.publish()
            finally:
                self._here.depth -= 1

    # -- from any thread ---------------------------------------------------------------

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run ``fn`` in a round and return its result (or raise): the loop thread's next one,
        or without a started thread one run here. Inside a round it just calls ``fn``.
        ``timeout``: TimeoutError if no round ran it by then (a queued one may still run later).
        EngineClosed once the engine is closed."""
        if not callable(fn):
            raise TypeError(f"the engine loop runs functions, got {type(fn).__name__}")
        timeout = check_timeout(timeout)
        if self.owns_state():
            return fn()
        fut = self._queue(fn, False)
        if fut is None:
            return self.round(fn, lock_timeout=timeout)
        return fut.result(timeout)

    def post(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` in a round soon, without waiting for the loop thread (errors are logged)."""
        if self.owns_state():
            fn()
        elif self._queue(fn, True) is None:
            try:
                self.round(fn)
            except EngineClosed:
                raise
            except Exception as e:  # noqa: BLE001 - as the loop thread would
                log.warning("engine loop: a posted command failed (%s: %s)", type(e).__name__, e)

    def _queue(self, fn: Callable[[], Any], posted: bool) -> Future | None:
        """Hand ``fn`` to the loop thread's next round; None when no thread will run it (never
        started, or it ended: a command queued after the loop decided to end would never run)."""
        with self._cv:
            if self.running:
                fut: Future = Future()
                self._commands.append((fn, fut, posted))
                self._cv.notify()
                return fut
        return None

    def until(
        self,
        done: Callable[[], bool],
        block: Callable[[Callable[[], bool], float | None], None],
        timeout: float | None = None,
    ) -> bool:
        """Return once ``done()`` holds: while the loop thread runs, ``block(done, seconds)``
        sleeps until it signals; without one this thread runs the rounds. False if ``timeout``
        seconds passed first (``timeout`` as ``check_timeout`` takes it: every wait comes here)."""
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            if self.running:
                block(done, left)
            else:
                try:
                    self.round(done=done, lock_timeout=left)
                except TimeoutError:
                    return done()
        return True

    async def until_async(self, done: Callable[[], bool], ev: asyncio.Event, here: Callable[[], Any]) -> None:
        """``until`` for asyncio: await ``ev`` (set by the pushes) while the loop thread runs;
        without one, the rounds run in an executor thread (``here``), off the event loop."""
        if self.running:
            await ev.wait()
        elif not done():
            await asyncio.get_running_loop().run_in_executor(None, here)

    def until_idle(self, timeout: float | None) -> bool:
        """Until no request is left to step (or ``timeout``); True if none is."""
        eng = self.engine
        return self.until(lambda: not eng.has_work(), self._block_idle, timeout)

    def _block_idle(self, done: Callable[[], bool], timeout: float | None) -> None:
        with self._idle:
            self._idle.wait_for(lambda: done() or not self.running, timeout)

    def track(self, seq: "Sequence") -> RequestStream:
        """The stream that carries ``seq``'s output (made once, in a round)."""
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

    # -- the loop thread -------------------------------------------------------------------

    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                with self._cv:
                    while not self._commands and not eng.has_work() and not self._stopping:
                        with self._idle:
                            self._idle.notify_all()
                        self._cv.wait()  # woken by a command or stop(): an idle engine costs no CPU
                    if self._stopping and not self._commands and not eng.has_work():
                        self._exited = True  # from here a call runs on its caller's thread, never queued
                        return
                try:
                    self.round()
                except EngineClosed:  # closed under a loop that outlived stop(): nothing more runs here
                    return
                except Exception as e:  # noqa: BLE001 - a bug in the step: its requests fail, the loop goes on
                    log.exception("engine step failed; failing its requests")
                    self.fail(e)
        finally:
            with self._cv:
                self._exited = True
                left, self._commands = list(self._commands), deque()
            for _, fut, _ in left:  # only if it ended on an error of its own
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(RuntimeError("the engine loop thread ended before running this"))
            for stream in list(self._streams.values()):
                stream.wake()
            with self._idle:
                self._idle.notify_all()

    def publish(self) -> None:
        for seq, stream in list(self._streams.items()):
            piece = seq.out.take()
            if seq.finished:
                piece += seq.out.take()
                del self._streams[seq]
                stream.push(piece, True)
                result = seq.result()
                for fn in self.listeners:
                    try:
                        fn(result, seq)
                    except Exception as e:  # noqa: BLE001 - a listener never breaks the loop
                        log.warning("finish listener failed (%s: %s)", type(e).__name__, e)
            elif piece:
                stream.push(piece, False)
