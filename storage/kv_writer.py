"""The one background thread that writes write-behind KV snapshots (``storage.kv_segments``).

Contracts:

- ``submit(job)`` is called from the engine thread only; it returns at once (it blocks only
  while ``max_queued`` jobs are already waiting: back-pressure, never unbounded memory).
  Jobs run in submission order, one at a time.
- The thread touches files only, never the database. Every job puts exactly one
  :class:`Written` on ``done`` (a thread-safe queue the engine thread drains), saying whether
  it was written and, when known, what manifest is on disk now.
- A write that fails (full disk, read-only medium, EIO) logs one warning, and further
  failures log at debug level until a write succeeds again; it never raises to anyone.
- The thread is a daemon; ``atexit`` closes every live writer (runs what is queued, then
  joins), so a clean interpreter exit still writes what is pending. ``close`` does the same.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from chatkv.storage.kv_segments import Diverged, Manifest, SegmentStore

__all__ = ["AppendJob", "Written", "SegmentWriter"]

log = logging.getLogger("chatkv.storage")

EXIT_TIMEOUT_S = 120.0  # how long an exiting interpreter waits for pending snapshot writes


@dataclass
class AppendJob:
    """Store the KV ``k``/``v`` of ``tokens[start:]`` for conversation ``conv_id`` (file key ``key``)."""

    conv_id: str
    key: str
    seq: int  # increases per job; lets the engine tell the latest write of a conversation
    tokens: list[int]  # the conversation's tokens[:end]
    start: int  # where k/v begin; a branch on disk may hold more of ``tokens`` already (kept, not rewritten)
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    epoch: str
    base: bool  # the first segment of a new epoch (start == 0): older files are replaced
    model_fingerprint: str
    kv_dtype: str
    fence: int = 0  # the id of the history's last stored message (see kv_segments)


@dataclass(frozen=True)
class Written:
    """The outcome of one job."""

    conv_id: str
    seq: int
    ok: bool
    manifest: Manifest | None  # on disk now (when ``known``); None: no snapshot
    known: bool  # False: the state on disk could not be read back after a failure
    nbytes: int = 0  # bytes of the segment written (a merged one included)
    merged: bool = False  # older segments were merged into it (compaction)
    seconds: float = 0.0
    error: str = ""
    io_error: bool = False


_LIVE: "weakref.WeakSet[SegmentWriter]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for w in list(_LIVE):
        w.close(EXIT_TIMEOUT_S)


class SegmentWriter:
    def __init__(self, store: SegmentStore, max_queued: int = 64):
        self.store = store
        self.done: queue.SimpleQueue[Written] = queue.SimpleQueue()
        self._jobs: queue.Queue = queue.Queue(maxsize=max_queued)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._warned = False

    def submit(self, job: AppendJob) -> bool:
        """Queue ``job``; False (nothing queued) once closed."""
        with self._lock:
            if self._closed:
                return False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="chatkv-snapshot-writer", daemon=True)
                self._thread.start()
                _LIVE.add(self)
        self._jobs.put(job)
        return True

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout: float | None = None) -> None:
        """Run every queued job, then stop the thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        _LIVE.discard(self)
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout)
            if thread.is_alive():
                log.warning("snapshot writer still busy after %.0f s; some KV may be recomputed later", timeout)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                out = self._write(job)
            except BaseException as e:  # never lose the completion: the engine waits for it
                out = Written(job.conv_id, job.seq, False, None, False, error=f"{type(e).__name__}: {e}")
            self.done.put(out)
            del job

    def _write(self, job: AppendJob) -> Written:
        t0 = time.perf_counter()
        try:
            man, nbytes = self.store.append(
                job.key,
                job.tokens,
                job.start,
                job.k,
                job.v,
                epoch=job.epoch,
                base=job.base,
                model_fingerprint=job.model_fingerprint,
                kv_dtype=job.kv_dtype,
                fence=job.fence,
            )
        except Diverged as e:  # an earlier write failed, or the disk holds another epoch: the engine restarts
            log.debug("%s", e)
            return Written(job.conv_id, job.seq, False, e.on_disk, True, seconds=time.perf_counter() - t0, error=str(e))
        except Exception as e:  # OSError: full or read-only disk, EIO; anything else: still never the turn
            if not self._warned:
                log.warning(
                    "KV of conversation %s not saved to disk (%s: %s); it will be recomputed",
                    job.conv_id,
                    type(e).__name__,
                    e,
                )
                self._warned = True
            else:
                log.debug("KV of conversation %s not saved to disk (%s: %s)", job.conv_id, type(e).__name__, e)
            try:
                on_disk, known = self.store.read_manifest(job.key), True
            except Exception:
                on_disk, known = None, False
            return Written(
                job.conv_id,
                job.seq,
                False,
                on_disk,
                known,
                seconds=time.perf_counter() - t0,
                error=f"{type(e).__name__}: {e}",
                io_error=True,
            )
        self._warned = False
        merged = nbytes > 0 and man.segments[-1].start < job.start  # nothing written: a branch on disk held it all
        return Written(
            job.conv_id, job.seq, True, man, True, nbytes=nbytes, merged=merged, seconds=time.perf_counter() - t0
        )
