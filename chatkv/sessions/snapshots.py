"""Conversations' KV on disk: write-behind after every turn, spill, restore, the disk budget.

Past 400 lines: the write-behind queue, the writer's reports, restore and the disk budget
share the per-conversation tracks; split, each half would reach into the other's state.

Each conversation's KV is stored as append-only segments plus a manifest
(``storage.kv_segments``), written by one background thread (``storage.kv_writer``):

- **write-behind**: after each turn ``write_behind`` copies only the tokens the disk lacks
  out of the pool (``KVManager.export_kv(kept, start)``) and queues them; the reply is
  not delayed by any file I/O. A clean interpreter exit, ``close`` and an explicit
  ``spill`` wait for what is queued. If the stored tokens are no longer a prefix of the
  conversation's, the write keeps the segments of any branch on disk that hold the
  history's own leading tokens (a regenerated reply, an edited message, a branch switched
  back to: the other branch stays on disk beside it, sharing those files) and appends
  after them. Sharing no whole segment (compaction merged the common prefix's segments),
  a branch is written whole from token 0 and the other still kept; a history that changed
  along its branch (truncated, a moved attention-sink window) starts a new epoch: the
  whole KV as one base segment, older files removed after.
- **spill** releases a session's KV; the snapshot is usually current already, so it
  writes nothing (an idle spill and ``relieve`` never wait for the disk).
- **restore** reads the branch on disk sharing the longest prefix with the prompt, verifies
  every segment (fingerprint, dtype, geometry, tokens, checksum) and uses the valid ones
  before the first bad one; the rest is recomputed and the manifest repaired (a branch
  not listing the bad file keeps all of its own). Missing, damaged or mismatched: a
  slower turn, never a wrong one.
- the **manifest is the authority** for what is on disk; the database row (LRU order)
  is bookkeeping that may lag: written when a spill, flush or close waits for the writer,
  on restore, and at least every ``ROW_SYNC_S`` (not on every turn: a transaction per turn
  would cost the engine thread more than the copy of the KV), and reconciled when the
  directory is opened (``chatkv.sessions.manifest_rows``).
- the **database** is touched only from the caller's (engine) thread: the writer reports
  through a queue that every call here drains.
- snapshots are a cache: a full or read-only disk logs one warning and never fails a turn;
  over the disk budget (this tenant's snapshots, sizes from their manifests) the least
  recently used are deleted.

It never sees a Session: ``spill`` takes what ``write_behind`` takes (a conversation id, its
tokens, the KV kept in memory), and ``relieve`` takes ``Resident`` records, each telling its
owner (the session manager, the only writer of a session) when its KV was released.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from chatkv.errors import OutOfBlocks, SnapshotInvalid
from chatkv.kvcache.manager import KVManager, RetainedKV
from chatkv.sessions import manifest_rows as rows
from chatkv.storage.kv_segments import Manifest, SegmentStore, new_epoch
from chatkv.storage.kv_store import token_hash
from chatkv.storage.kv_writer import AppendJob, SegmentWriter, Written
from chatkv.storage.repository import Store

log = logging.getLogger("chatkv.sessions")

ROW_SYNC_S = 30.0  # the writer's reports reach the database rows at least this often (and at spill, flush, close)


@dataclass
class _Track:
    """What a conversation's snapshot holds once every write queued for it is done."""

    epoch: str
    end: int
    tokens: list[int] | None  # tokens[:end] when known, else only their hash
    hash: str | None
    seq: int = 0  # the last write queued for it
    fence: int = 0  # the id of the last stored message of that history (SegmentStore's fence)


@dataclass(frozen=True)
class Resident:
    """A conversation whose KV is in memory and may be spilled under memory pressure."""

    conv_id: str
    tokens: Sequence[int]
    kept: RetainedKV
    last_used: float
    released: Callable[[], None]  # its owner forgets the KV (called once it is released)


class Snapshots:
    def __init__(
        self, kv: KVManager, store: Store, root: Path, fingerprint: str, kv_dtype: str, tenant: str, budget: int
    ):
        self.kv = kv
        self.store = store
        self.segments = SegmentStore(root)  # never raises for the directory; a later write does
        self.files = self.segments.files
        self.fingerprint = fingerprint
        self.kv_dtype = kv_dtype
        self.tenant = tenant
        self.budget = budget
        self._salt = hashlib.sha256(tenant.encode()).hexdigest()[:8]
        self._tracks: dict[str, _Track] = {}
        self._pending: Counter[str] = Counter()
        self._seq = 0
        self._sizes: dict[str, int] = {}  # bytes on disk per conversation, from its manifest (shared files once)
        self._known: dict[str, Manifest] = {}  # the last manifest the disk was seen to hold (its branches)
        self._dirty: dict[str, Manifest | None] = {}  # rows to bring up to date (None: delete)
        self._dirty_since: float | None = None
        self._closed = False
        self._writer = SegmentWriter(self.segments)
        self.stats = Counter()  # jobs, bytes, merges, failures, writer_s, engine_s
        self.written: list[Written] = []  # the writer's reports, oldest first (the last 1000)
        for conv, man in rows.reconcile(self.segments, store, tenant, self._salt).items():
            self._sizes[conv] = man.nbytes
            self._known[conv] = man
            if self._mine(man):  # another model's is kept for it; this engine's first write replaces it
                self._tracks[conv] = _Track(man.epoch, man.end, None, man.token_hash, fence=man.fence)

    def key(self, conv_id: str) -> str:
        """Snapshot key: the conversation id salted with the tenant, so tenants never read each other's KV."""
        return f"{conv_id}-{self._salt}"

    def path(self, conv_id: str) -> Path:
        """The conversation's manifest."""
        return self.segments.manifest_path(self.key(conv_id))

    def on_disk(self) -> int:
        """How many conversations have KV on disk."""
        return len(self._sizes)

    def segment_paths(self, conv_id: str) -> list[Path]:
        """The segment files its manifest lists, in token order (none if it has no valid manifest)."""
        try:
            man = self.segments.read_manifest(self.key(conv_id))
        except (SnapshotInvalid, OSError):
            return []
        return [self.segments.root / s.file for s in man.segments] if man else []

    def _note(self, conv_id: str, man: Manifest | None) -> None:
        """The disk now holds ``man`` for the conversation: its row is written at the next sync."""
        if man is None:
            self._sizes.pop(conv_id, None)
            self._known.pop(conv_id, None)
        else:
            self._sizes[conv_id] = man.nbytes
            self._known[conv_id] = man
        self._dirty[conv_id] = man
        if self._dirty_since is None:
            self._dirty_since = time.monotonic()

    def _sync_rows(self) -> None:
        """Write the rows the writer's reports changed (a database transaction each)."""
        dirty, self._dirty, self._dirty_since = self._dirty, {}, None
        for conv_id, man in dirty.items():
            rows.record(self.store, conv_id, man)

    def delete(self, conv_id: str) -> None:
        self._wait(conv_id)
        self._tracks.pop(conv_id, None)
        self._sizes.pop(conv_id, None)
        self._known.pop(conv_id, None)
        self._dirty.pop(conv_id, None)
        rows.remove_files(self.segments, self.key(conv_id))
        rows.forget(self.store, conv_id)

    # -- write-behind ------------------------------------------------------------------

    def write_behind(self, conv_id: str, tokens: Sequence[int], kept: RetainedKV | None, fence: int = 0) -> None:
        """After a turn: queue the KV of ``tokens[:kept.kv_len]`` the disk lacks. Copies only
        those tokens' KV out of the pool; no file I/O, never waits for the disk, never raises.
        ``fence``: the id of the turn's last stored message (a snapshot of a newer history on
        disk is never replaced by this one)."""
        t0 = time.perf_counter()
        try:
            self._drain()
            if kept is not None:
                self._queue(conv_id, tokens, kept, fence)
            if self._dirty_since is not None and time.monotonic() - self._dirty_since > ROW_SYNC_S:
                self._sync_rows()
            self._enforce_budget(keep=conv_id)
        except Exception as e:  # a cache: never the turn
            log.warning("KV of conversation %s not queued for disk (%s: %s)", conv_id, type(e).__name__, e)
        self.stats["engine_s"] += time.perf_counter() - t0

    def _mine(self, man: Manifest) -> bool:
        """Whether ``man`` holds KV this engine computes (model, kv dtype, geometry)."""
        pool = self.kv.pool
        return (man.model_fingerprint, man.kv_dtype, man.geometry()) == (
            self.fingerprint,
            self.kv_dtype,
            (pool.num_layers, pool.num_kv_heads, pool.row_dim),
        )

    def _continues(self, t: _Track, tokens: Sequence[int]) -> bool:
        """Whether the tokens stored (or queued) are a prefix of ``tokens``."""
        if len(tokens) < t.end:
            return False
        if t.tokens is not None:
            return list(tokens[: t.end]) == t.tokens
        if token_hash(tokens[: t.end]) != t.hash:
            return False
        t.tokens = list(tokens[: t.end])
        return True

    def _queue(self, conv_id: str, tokens: Sequence[int], kept: RetainedKV, fence: int = 0) -> bool:
        """Queue what the snapshot lacks of ``kept``. True if it is (or will be) current."""
        n = kept.kv_len
        if n == 0 or self._closed:
            return False
        t = self._tracks.get(conv_id)
        left = t.fence if t is not None else 0  # the last message of the history stored before
        fence = max(fence, left)
        toks = list(tokens[:n])
        if t is not None and t.end and self._continues(t, tokens):
            if t.end >= n:
                return True
            start, base, epoch = t.end, False, t.epoch
        else:
            start = self._shared(conv_id, toks)
            if start >= n:  # a branch on disk holds it all (switched back to): nothing to write
                self._tracks[conv_id] = _Track(new_epoch(), n, toks, None, t.seq if t else 0, fence)
                return True
            base, epoch = start == 0 and not self._other_branch(conv_id, left, fence), new_epoch()
        k, v = self.kv.export_kv(kept, start)
        self._seq += 1
        job = AppendJob(
            conv_id,
            self.key(conv_id),
            self._seq,
            toks,
            start,
            k,
            v,
            epoch,
            base,
            self.fingerprint,
            self.kv_dtype,
            fence,
        )
        if not self._writer.submit(job):
            return False
        self._tracks[conv_id] = _Track(epoch, n, toks, None, self._seq, fence)
        self._pending[conv_id] += 1
        return True

    def _shared(self, conv_id: str, tokens: list[int]) -> int:
        """Where a write of ``tokens`` leaving the tracked branch starts: the end of the longest run
        of whole leading segments of a branch last seen on disk that hold its tokens (0: none, a
        new epoch). Hashes only, no file I/O; the writer checks the disk again under its lock."""
        man = self._known.get(conv_id)
        if man is None or not self._mine(man):
            return 0
        return max(self.segments.matching(view, tokens).end for view in man.views())

    def _other_branch(self, conv_id: str, left: int, leaf: int) -> bool:
        """Whether message ``left`` is on another branch than message ``leaf`` (not its ancestor):
        the history stored before is still the conversation's, so a write sharing no whole segment
        with it keeps it beside (a copy of the common prefix, not a base write replacing it). A
        history that changed along one branch (truncated, a moved sink window) is replaced."""
        if not left or not leaf or left == leaf:
            return False
        try:
            parent = {m.id: m.parent_id for m in self.store.message_tree(conv_id)}
        except Exception as e:  # a cache: a base write then, as before branches
            log.debug("conversation %s: message tree not read (%s)", conv_id, e)
            return False
        node = leaf
        while node is not None and node != left:
            node = parent.get(node)
        return node is None and left in parent

    def _handle(self, w: Written) -> None:
        self._pending[w.conv_id] -= 1
        if self._pending[w.conv_id] <= 0:
            del self._pending[w.conv_id]
        self.written.append(w)
        del self.written[:-1000]
        self.stats["jobs"] += 1
        self.stats["writer_s"] += w.seconds
        self.stats["bytes"] += w.nbytes
        self.stats["merges"] += w.merged
        self.stats["failures"] += not w.ok
        t = self._tracks.get(w.conv_id)
        if not w.ok and t is not None and t.seq == w.seq:  # its latest write failed: believe the disk
            m = w.manifest if w.known else None
            if m is None or not self._mine(m):  # nothing (of this model) to append to: a new epoch next
                del self._tracks[w.conv_id]
            else:
                self._tracks[w.conv_id] = _Track(m.epoch, m.end, None, m.token_hash, w.seq, m.fence)
        if w.known:
            self._note(w.conv_id, w.manifest)

    def _drain(self) -> None:
        while True:
            try:
                w = self._writer.done.get_nowait()
            except queue.Empty:
                return
            self._handle(w)

    def _wait(self, conv_id: str | None = None) -> None:
        """Until the writes queued (for ``conv_id``, or all) are on disk and recorded."""
        self._drain()
        while self._pending[conv_id] > 0 if conv_id is not None else self._pending:
            try:
                w = self._writer.done.get(timeout=1.0)
            except queue.Empty:
                if not self._writer.alive():
                    log.warning("the snapshot writer stopped; %d write(s) lost", sum(self._pending.values()))
                    self._pending.clear()
                    self._tracks.clear()
                    return
                continue
            self._handle(w)

    def flush(self, conv_id: str | None = None) -> None:
        """Wait until what was queued (for ``conv_id``, or for every conversation) is on disk."""
        self._wait(conv_id)
        self._sync_rows()
        self._enforce_budget(keep=conv_id)

    def close(self) -> None:
        """Write what is queued, stop the writer and record the last rows. Never raises."""
        try:
            self._wait()
        except Exception as e:
            log.warning("snapshot writes not all recorded at close (%s: %s)", type(e).__name__, e)
        finally:
            self._closed = True
            self._writer.close()
            try:
                self._drain()
                self._sync_rows()
            except Exception as e:
                log.warning("snapshot rows not all recorded at close (%s: %s)", type(e).__name__, e)

    # -- spill -------------------------------------------------------------------------

    def save(self, conv_id: str, tokens: Sequence[int], kept: RetainedKV) -> bool:
        """Make the snapshot hold ``kept`` (the KV of ``tokens[:kept.kv_len]``) and wait until it
        is on disk. Never raises for the disk or the database: logs and returns False."""
        try:
            self._drain()
            if not self._queue(conv_id, tokens, kept):
                return False
            self._wait(conv_id)
            self._sync_rows()
            self._enforce_budget(keep=conv_id)
            t = self._tracks.get(conv_id)
            return t is not None and t.end >= kept.kv_len
        except Exception as e:  # a cache: any failure to write it costs a recompute later, never the turn
            log.warning(
                "KV of conversation %s not saved to disk (%s: %s); it will be recomputed", conv_id, type(e).__name__, e
            )
            return False

    def drain(self) -> None:
        """Take in the writer's reports (the database rows they change are written later)."""
        self._drain()

    def spill(self, conv_id: str, tokens: Sequence[int], kept: RetainedKV | None, wait: bool = True) -> bool:
        """Make sure ``kept`` (the KV of ``tokens[:kept.kv_len]``) reaches the conversation's
        snapshot (waiting for it with ``wait``), then release it from memory: the caller's handle
        is ended. True if there was KV to release."""
        if kept is None:
            return False
        try:
            if wait:
                self.save(conv_id, tokens, kept)
            else:
                try:
                    self._queue(conv_id, tokens, kept)
                except Exception as e:
                    log.warning(
                        "KV of conversation %s not saved to disk (%s: %s); it will be recomputed",
                        conv_id,
                        type(e).__name__,
                        e,
                    )
        finally:
            self.kv.offload(kept)  # down a tier: host memory (if any), else evictable cache
        return True

    def relieve(self, residents: Iterable[Resident], missing_blocks: int) -> int:
        """Blocks ran short: spill conversations, least recently used first, until enough could be
        evicted. Returns how many were spilled."""
        done = 0
        for r in sorted(residents, key=lambda x: x.last_used):
            if self.kv.cache.evictable_blocks >= missing_blocks:
                break
            try:
                done += self.spill(r.conv_id, r.tokens, r.kept, wait=False)
            finally:
                r.released()
        return done

    def _enforce_budget(self, keep: str | None) -> None:
        """Over the budget (this tenant's snapshots): delete the least recently used ones."""
        if sum(self._sizes.values()) <= self.budget:
            return
        self._sync_rows()
        for snap in self.store.snapshots_lru():
            if sum(self._sizes.values()) <= self.budget:
                break
            if snap.conversation_id == keep or snap.conversation_id not in self._sizes:
                continue
            self.delete(snap.conversation_id)
            log.info("snapshot of %s deleted: over the disk budget", snap.conversation_id)

    # -- restore -----------------------------------------------------------------------

    def restore(self, conv_id: str, prompt: list[int], namespace=None) -> tuple[RetainedKV | None, int]:
        """Bring the conversation's snapshot back into blocks. Returns the KV (None if nothing
        came back) and how many tokens of it came from disk rather than memory."""
        if not self.kv.sharing:
            return None, 0
        self._wait(conv_id)  # its queued writes reach the disk first
        with self.segments.locked():  # no other process changes its files while they are read
            return self._restore(conv_id, prompt, namespace)

    def _restore(self, conv_id: str, prompt: list[int], namespace) -> tuple[RetainedKV | None, int]:
        key = self.key(conv_id)
        try:
            man = self.segments.read_manifest(key)
        except SnapshotInvalid as err:
            log.warning("snapshot of %s unusable (%s); recomputing", conv_id, err)
            self._discard(conv_id)
            return None, 0
        except OSError as err:  # an unreadable disk: keep the files, recompute this time
            log.warning("snapshot of %s cannot be read (%s); recomputing", conv_id, err)
            return None, 0
        if man is None:
            self._tracks.pop(conv_id, None)
            rows.forget(self.store, conv_id)
            return None, 0
        if not self._mine(man):
            pool = self.kv.pool
            log.warning(
                "snapshot of %s unusable (stored for model %r, kv dtype %s, geometry %s; this engine: %r, %s, %s); "
                "recomputing",
                conv_id,
                man.model_fingerprint,
                man.kv_dtype,
                man.geometry(),
                self.fingerprint,
                self.kv_dtype,
                (pool.num_layers, pool.num_kv_heads, pool.row_dim),
            )
            self._discard(conv_id)
            return None, 0
        ns = {} if namespace is None else {"namespace": namespace}
        in_memory = self.kv.cached_len(prompt, **ns)
        ours = self.segments.best(man, prompt)  # the branch sharing most with it; the others stay on disk, unread
        if in_memory >= min(ours.end if ours.segments else 0, len(prompt) - 1):
            return None, 0
        try:
            k, v, good, why = self.segments.load(ours, prompt)
        except OSError as err:  # an unreadable disk: keep the files, recompute this time
            log.warning("snapshot of %s cannot be read (%s); recomputing", conv_id, err)
            return None, 0
        if good is not ours:  # a damaged segment: the manifest keeps those before it
            self._repair(conv_id, man, good, ours.segments[len(good.segments)].file, why)
        if not good.segments:
            return None, 0
        n = min(good.end, len(prompt) - 1)  # leave at least one token to compute, for the logits
        if n <= in_memory:  # what was left after a damaged segment memory holds already
            return None, 0
        try:
            kept = self.kv.import_kv(prompt, n, k, v, **ns)
        except OutOfBlocks:
            log.warning("no room to restore %d tokens of %s; recomputing", n, conv_id)
            return None, 0
        self.stats.update(restores=1, restore_bytes=sum(x[:n].nbytes for x in k + v))
        try:
            self._sync_rows()
            self.store.touch_snapshot(conv_id)
        except Exception as e:  # only the LRU order of the budget is lost
            log.warning("snapshot of %s: last use not recorded (%s)", conv_id, e)
        return kept, n - in_memory

    def _discard(self, conv_id: str) -> None:
        self._tracks.pop(conv_id, None)
        self._sizes.pop(conv_id, None)
        self._known.pop(conv_id, None)
        self._dirty.pop(conv_id, None)
        rows.remove_files(self.segments, self.key(conv_id))
        rows.forget(self.store, conv_id)

    def _repair(self, conv_id: str, man: Manifest, good: Manifest, bad: str, why: str) -> None:
        """Segment file ``bad`` was bad: every branch listing it keeps the valid ones before it,
        the others stay whole; ``good`` (the branch restored, so cut) becomes current."""
        fixed = man.cut(bad, good)
        if fixed is None:
            log.warning("snapshot of %s unusable (%s); recomputing", conv_id, why)
            self._discard(conv_id)
            return
        if good.segments:
            log.warning(
                "snapshot of %s: %s; restoring its first %d tokens, recomputing the rest", conv_id, why, good.end
            )
        else:
            log.warning(
                "snapshot of %s: %s; recomputing this branch (%d other(s) kept)", conv_id, why, len(fixed.branches) + 1
            )
        good = fixed
        self._tracks[conv_id] = _Track(good.epoch, good.end, None, good.token_hash or None, fence=good.fence)
        try:
            self.segments.write_manifest(good)
            self.segments.remove(good.key, keep=good)
        except OSError as e:  # a read-only medium: the bad segment is refused again next time
            log.warning("snapshot of %s: manifest not repaired (%s)", conv_id, e)
            return
        self._note(conv_id, good)
