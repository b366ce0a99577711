"""Conversations' KV on disk: spill, restore, the disk budget, the orphan sweep, and when to spill.

One safetensors snapshot per conversation (``storage.KVStore``) with a database row
(``storage.Store``). Snapshots are a cache, never a reason to fail a turn:

- a write that fails (full disk, read-only directory, database error) logs one
  warning; the KV is then dropped and recomputed on the next turn;
- a snapshot that is missing, damaged or does not match (model, tokens, format,
  dtype, geometry) is logged, removed and recomputed: a slower turn, never a wrong one;
- snapshot files without a database row, and rows without a file, are removed when
  the directory is opened;
- snapshots over the disk budget are deleted least recently used first.

Spilling works on anything with a session's ``id``, ``tokens``, ``kept`` (the
RetainedKV in memory), ``busy`` and ``last_used``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Iterable

from chatkv.errors import OutOfBlocks, SnapshotInvalid
from chatkv.kv_manager import KVManager, RetainedKV
from chatkv.storage.kv_store import KVStore, token_hash
from chatkv.storage.repository import Store

log = logging.getLogger("chatkv.sessions")


class Snapshots:
    def __init__(self, kv: KVManager, store: Store, root: Path, fingerprint: str, kv_dtype: str, tenant: str, budget: int):
        self.kv = kv
        self.store = store
        self.files = KVStore(root)  # never raises for the directory; a later save does
        self.fingerprint = fingerprint
        self.kv_dtype = kv_dtype
        self.budget = budget
        self._salt = hashlib.sha256(tenant.encode()).hexdigest()[:8]
        self._sweep_orphans()

    def key(self, conv_id: str) -> str:
        """Snapshot key: the conversation id salted with the tenant, so tenants never read each other's KV."""
        return f"{conv_id}-{self._salt}"

    def path(self, conv_id: str) -> Path:
        return self.files.path(self.key(conv_id))

    def _sweep_orphans(self) -> None:
        rows = self.store.snapshots_lru()
        names = {s.file for s in rows}
        try:
            keys = self.files.keys()
        except OSError as e:  # an unreadable directory: the sweep waits for the next open
            log.warning("snapshot directory %s cannot be listed (%s); orphans not swept", self.files.root, e)
            return
        for key in keys:
            if self.files.path(key).name not in names and key.endswith(self._salt):
                log.warning("snapshot file %s has no database row; removed", key)
                self._unlink(key)
        for snap in rows:
            if not (self.files.root / snap.file).exists():
                log.warning("snapshot row of %s has no file; removed", snap.conversation_id)
                self.store.delete_snapshot(snap.conversation_id)

    def _unlink(self, key: str) -> None:
        try:
            self.files.delete(key)
        except OSError as e:
            log.warning("cannot remove snapshot %s (%s)", key, e)

    def delete(self, conv_id: str) -> None:
        self._unlink(self.key(conv_id))
        try:
            self.store.delete_snapshot(conv_id)
        except Exception as e:  # a cache: a row left without its file is swept at the next open
            log.warning("snapshot row of %s not removed (%s: %s)", conv_id, type(e).__name__, e)

    # -- spill ---------------------------------------------------------------------

    def save(self, conv_id: str, tokens: list[int], kept: RetainedKV) -> bool:
        """Write ``kept`` (the KV of ``tokens[:kept.kv_len]``) unless the snapshot already holds
        exactly it. Never raises for the disk or the database: logs and returns False."""
        n = kept.kv_len
        if n == 0:
            return False
        try:
            snap = self.store.get_snapshot(conv_id)
            if snap is not None and snap.token_count == n and snap.token_hash == token_hash(tokens[:n]) and self.path(conv_id).exists():
                return True
            k, v = self.kv.export_kv(kept)
            meta = self.files.save(self.key(conv_id), tokens[:n], k, v, model_fingerprint=self.fingerprint, kv_dtype=self.kv_dtype)
            self.store.put_snapshot(conv_id, Path(meta.file).name, self.fingerprint, self.kv_dtype, n, meta.token_hash, meta.nbytes)
            self._enforce_budget(keep=conv_id)
            return True
        except Exception as e:  # a cache: any failure to write it costs a recompute later, never the turn
            log.warning("KV of conversation %s not saved to disk (%s: %s); it will be recomputed", conv_id, type(e).__name__, e)
            return False

    def spill(self, s) -> bool:
        """Snapshot the session's KV in memory, then release it. True if it had KV in memory."""
        kept = s.kept
        if kept is None:
            return False
        try:
            self.save(s.id, s.tokens, kept)
        finally:
            s.kept = None
            self.kv.drop(kept)
        return True

    def spill_idle(self, sessions: Iterable, idle_s: float, now: float | None = None, keep=None) -> int:
        """Spill every session idle for ``idle_s`` or longer; returns how many."""
        now = time.monotonic() if now is None else now
        done = 0
        for s in list(sessions):
            if s is not keep and not s.busy and s.kept is not None and now - s.last_used >= idle_s:
                done += self.spill(s)
        return done

    def relieve(self, sessions: Iterable, missing_blocks: int) -> None:
        """Blocks ran short: spill idle sessions, least recently used first, until enough could be evicted."""
        for s in sorted(sessions, key=lambda x: x.last_used):
            if self.kv.cache.evictable_blocks >= missing_blocks:
                break
            if not s.busy and s.kept is not None:
                self.spill(s)

    def _enforce_budget(self, keep: str) -> None:
        total = self.store.total_snapshot_bytes()
        for snap in self.store.snapshots_lru():
            if total <= self.budget:
                break
            if snap.conversation_id == keep:
                continue
            self._unlink(Path(snap.file).stem)
            self.store.delete_snapshot(snap.conversation_id)
            total -= snap.nbytes
            log.info("snapshot of %s deleted: over the disk budget", snap.conversation_id)

    # -- restore -------------------------------------------------------------------

    def restore(self, conv_id: str, prompt: list[int]) -> tuple[RetainedKV | None, int]:
        """Bring the conversation's snapshot back into blocks. Returns the KV (None if nothing
        came back) and how many tokens of it came from disk rather than memory."""
        if not self.kv.sharing:
            return None, 0
        snap = self.store.get_snapshot(conv_id)
        if snap is None:
            return None, 0
        in_memory = self.kv.cached_len(prompt)
        if in_memory >= snap.token_count:
            return None, 0
        pool = self.kv.pool
        try:
            k, v, n = self.files.load(
                self.key(conv_id),
                token_ids=prompt,
                model_fingerprint=self.fingerprint,
                kv_dtype=self.kv_dtype,
                num_layers=pool.num_layers,
                num_kv_heads=pool.num_kv_heads,
                head_dim=pool.head_dim,
            )
        except (SnapshotInvalid, ValueError) as err:  # ValueError: a layout this engine cannot use (e.g. extra tensors)
            log.warning("snapshot of %s unusable (%s); recomputing", conv_id, err)
            self.delete(conv_id)
            return None, 0
        except OSError as err:  # an unreadable disk: keep the file, recompute this time
            log.warning("snapshot of %s cannot be read (%s); recomputing", conv_id, err)
            return None, 0
        n = min(n, len(prompt) - 1)  # leave at least one token to compute, for the logits
        try:
            kept = self.kv.import_kv(prompt, n, k, v)
        except OutOfBlocks:
            log.warning("no room to restore %d tokens of %s; recomputing", n, conv_id)
            return None, 0
        try:
            self.store.touch_snapshot(conv_id)
        except Exception as e:  # only the LRU order of the budget is lost
            log.warning("snapshot of %s: last use not recorded (%s)", conv_id, e)
        return kept, n - in_memory
