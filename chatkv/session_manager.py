"""SessionManager: runs session turns and moves their KV between memory and disk.

It owns the conversation database (storage.repository.Store) and the snapshot
directory (storage.kv_store.KVStore) of one data directory, and talks to the
engine's pool and radix cache. Contracts:

- a turn's user message (and the history's tokens) are committed before
  generation; the reply before the turn reports done; an interrupted reply
  keeps what was produced, marked ``interrupted``;
- a snapshot that is missing, damaged or does not match (model, tokens,
  format, dtype, geometry) is logged, removed and recomputed: a slower turn,
  never a wrong one;
- snapshot files without a database row, and rows without a file, are removed
  when the manager opens;
- snapshots over the disk budget are deleted least recently used first.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch

from chatkv.errors import OutOfBlocks, SessionError, SnapshotInvalid
from chatkv.scheduler import release_retained
from chatkv.sequence import Retained
from chatkv.session import Reply, Session, Usage
from chatkv.storage.kv_store import KVStore, token_hash
from chatkv.storage.repository import Store
from chatkv.turns import TurnRenderer

if TYPE_CHECKING:
    from chatkv.engine import Engine

log = logging.getLogger("chatkv.sessions")
DEFAULT_TITLE = "New chat"


class SessionManager:
    def __init__(self, engine: "Engine", data_dir: Path, db_url: str | None, idle_spill_s: float, snapshot_budget: int):
        self.engine = engine
        self.store = Store.open(db_url, data_dir)
        self.kv = KVStore(data_dir / "kv")
        self.renderer = TurnRenderer(engine.tokenizer)
        self.idle_spill_s = idle_spill_s
        self.snapshot_budget = snapshot_budget
        self.tenant = engine.config.tenant
        self._salt = hashlib.sha256(self.tenant.encode()).hexdigest()[:8]
        self.live: dict[str, Session] = {}
        self._pins: dict[tuple[int, ...], list] = {}  # system-prompt tokens -> [node, sessions using it]
        engine.scheduler.on_pressure = self._on_pressure
        self._sweep_orphans()

    # -- naming -------------------------------------------------------------

    def key(self, conv_id: str) -> str:
        """Snapshot key: the conversation id salted with the tenant, so tenants never read each other's KV."""
        return f"{conv_id}-{self._salt}"

    def _sweep_orphans(self) -> None:
        rows = {s.file for s in self.store.snapshots_lru()}
        for key in self.kv.keys():
            if self.kv.path(key).name not in rows and key.endswith(self._salt):
                log.warning("snapshot file %s has no database row; removed", key)
                self.kv.delete(key)
        for snap in self.store.snapshots_lru():
            if not (self.kv.root / snap.file).exists():
                log.warning("snapshot row of %s has no file; removed", snap.conversation_id)
                self.store.delete_snapshot(snap.conversation_id)

    # -- sessions -----------------------------------------------------------

    def create(self, system: str | None, title: str | None, params: dict | None) -> Session:
        info = self.store.create_conversation(
            title=title or DEFAULT_TITLE,
            model=self.engine.model_dir.name,
            system_prompt=system or "",
            params=params or {},
            tenant=self.tenant,
        )
        s = Session(self, info.id, info.title, system, info.params, [])
        self.live[s.id] = s
        return s

    def resume(self, conv_id: str) -> Session:
        if conv_id in self.live:
            return self.live[conv_id]
        info = self.store.get_conversation(conv_id, tenant=self.tenant)
        s = Session(self, info.id, info.title, info.system_prompt or None, info.params, list(info.token_ids or []))
        msgs = self.store.messages(s.id)
        if msgs and msgs[-1].role == "user" and s.tokens:
            # the process died while replying: close the turn as an interrupted, empty reply
            s.tokens = s.tokens + self.renderer.close_reply([])
            self.store.add_message(s.id, "assistant", "", status="interrupted", token_ids=s.tokens)
        self.live[s.id] = s
        return s

    def close_session(self, s: Session) -> None:
        if s.busy:
            raise SessionError(f"session '{s.id}' is generating; finish or interrupt the reply first")
        self.spill(s)
        self._unpin(s)
        s.closed = True
        self.live.pop(s.id, None)

    def delete(self, s: Session) -> None:
        release_retained(self.engine.cache, self.engine.pool, s.kept)
        s.kept = None
        self._unpin(s)
        if self.store.delete_conversation(s.id) is not None:
            self.kv.delete(self.key(s.id))
        s.closed = True
        self.live.pop(s.id, None)

    def close(self) -> None:
        for s in list(self.live.values()):
            if not s.busy:
                self.close_session(s)
        self.store.close()

    # -- a turn -------------------------------------------------------------

    def turn(self, s: Session, text: str, params) -> Iterator[str | Reply]:
        from chatkv.engine import result_of

        arrival = time.perf_counter()  # TTFT counts the restore from disk too
        self.spill_idle(now=time.monotonic(), keep=s)
        if s.tokens:
            prompt = s.tokens + self.renderer.user_turn(text)
        else:
            messages = ([{"role": "system", "content": s.system}] if s.system else []) + [{"role": "user", "content": text}]
            prompt = self.renderer.first(messages)
        restored = self.restore(s, prompt) if s.kept is None else 0
        seq = self.engine.add_request(prompt, params, retain=True, prefix=s.kept)  # validates before anything is saved
        s.kept = None  # handed to the request, which releases it once admitted
        seq.num_restored = restored
        seq.arrival = arrival
        try:
            self.store.add_message(s.id, "user", text, token_ids=prompt)  # committed before generation
        except BaseException:
            self.engine.abort(seq)
            raise
        if not s.tokens and s.title == DEFAULT_TITLE:  # name a new chat after its first message
            s.title = " ".join(text.split())[:48]
            self.store.rename(s.id, s.title)
        s.tokens = prompt
        s.busy = True
        try:
            yield from self.engine.drive(seq)
        finally:
            self.engine.abort(seq)  # no-op when it finished
            s.busy = False
            s.kept = seq.retained
            s.tokens = seq.token_ids + self.renderer.close_reply(seq.generated_ids)
            s.last_used = time.monotonic()
            r = result_of(seq)
            usage = Usage(
                prompt_tokens=r.prompt_tokens,
                cached_tokens=r.cached_tokens - min(restored, r.cached_tokens),  # restored KV is counted apart
                restored_tokens=restored,
                computed_tokens=r.computed_tokens,
                generated_tokens=r.generated_tokens,
                ttft_s=r.ttft_s,
                tokens_per_s=r.decode_tokens_per_s,
            )
            msg = self.store.add_message(
                s.id,
                "assistant",
                r.text,
                status="complete" if r.finish_reason != "aborted" else "interrupted",
                token_ids=s.tokens,
                **usage.message_stats(),
            )
            self._pin(s)
        yield Reply(text=r.text, usage=usage, finish_reason=r.finish_reason, message_id=msg.id)

    # -- pinning the shared system prompt ------------------------------------

    def _pin(self, s: Session) -> None:
        if s.pinned is not None or not s.system:
            return
        sys_tokens = self.renderer.system_prefix(s.system)
        n = len(sys_tokens) // self.engine.pool.block_size * self.engine.pool.block_size
        if n == 0 or s.tokens[:n] != sys_tokens[:n]:
            return
        key = tuple(sys_tokens[:n])
        if key not in self._pins:
            m = self.engine.cache.match(self.engine.namespace, sys_tokens[:n])
            if m.num_tokens < n:
                return
            self.engine.cache.lock(m.node)
            self._pins[key] = [m.node, 0]
        self._pins[key][1] += 1
        s.pinned = key

    def _unpin(self, s: Session) -> None:
        if s.pinned is None:
            return
        entry = self._pins[s.pinned]
        entry[1] -= 1
        if entry[1] == 0:
            self.engine.cache.unlock(entry[0])
            del self._pins[s.pinned]
        s.pinned = None

    # -- disk ---------------------------------------------------------------

    def spill(self, s: Session) -> bool:
        """Snapshot the session's resident KV (unless the file already holds exactly it), then release it."""
        kept = s.kept
        if kept is None:
            return False
        try:
            n = kept.kv_len
            snap = self.store.get_snapshot(s.id)
            fresh = snap is not None and snap.token_count == n and snap.token_hash == token_hash(s.tokens[:n])
            if n > 0 and not (fresh and self.kv.path(self.key(s.id)).exists()):
                self._write(s, kept)
        finally:
            release_retained(self.engine.cache, self.engine.pool, kept)
            s.kept = None
        return True

    def _write(self, s: Session, kept: Retained) -> None:
        e = self.engine
        bs, n = e.pool.block_size, kept.kv_len
        full = n // bs
        blocks = e.cache.match(e.namespace, s.tokens[: full * bs]).block_ids if full else []
        assert len(blocks) == full, "a session's locked history must be in the radix tree"
        if kept.tail_block is not None:
            blocks = blocks + [kept.tail_block]
        kv = e.pool.kv[:, :, blocks].flatten(2, 3)[:, :, :n]  # [layers, 2, tokens, kv_heads, head_dim]
        meta = self.kv.save(
            self.key(s.id),
            s.tokens[:n],
            [kv[i, 0] for i in range(kv.shape[0])],
            [kv[i, 1] for i in range(kv.shape[0])],
            model_fingerprint=e.fingerprint,
            kv_dtype=e.kv_dtype,
        )
        self.store.put_snapshot(s.id, Path(meta.file).name, e.fingerprint, e.kv_dtype, n, meta.token_hash, meta.nbytes)
        self._enforce_budget(keep=s.id)

    def _enforce_budget(self, keep: str) -> None:
        total = self.store.total_snapshot_bytes()
        for snap in self.store.snapshots_lru():
            if total <= self.snapshot_budget:
                break
            if snap.conversation_id == keep:
                continue
            self.kv.delete(Path(snap.file).stem)
            self.store.delete_snapshot(snap.conversation_id)
            total -= snap.nbytes
            log.info("snapshot of %s deleted: over the disk budget", snap.conversation_id)

    def restore(self, s: Session, prompt: list[int]) -> int:
        """Bring the session's snapshot back into blocks; return how many tokens came from disk."""
        e = self.engine
        snap = self.store.get_snapshot(s.id)
        if snap is None:
            return 0
        in_memory = e.cache.match(e.namespace, prompt, max_tokens=len(prompt) - 1)
        if in_memory.num_tokens >= snap.token_count:
            return 0
        try:
            k, v, n = self.kv.load(
                self.key(s.id),
                token_ids=prompt,
                model_fingerprint=e.fingerprint,
                kv_dtype=e.kv_dtype,
                num_layers=e.model.num_layers,
                num_kv_heads=e.model.num_kv_heads,
                head_dim=e.model.head_dim,
            )
        except (SnapshotInvalid, ValueError) as err:  # ValueError: a layout this engine cannot use (e.g. extra tensors)
            log.warning("snapshot of %s unusable (%s); recomputing", s.id, err)
            self.kv.delete(self.key(s.id))
            self.store.delete_snapshot(s.id)
            return 0
        n = min(n, len(prompt) - 1)  # leave at least one token to compute, for the logits
        try:
            s.kept = self._into_blocks(prompt, n, k, v)
        except OutOfBlocks:
            log.warning("no room to restore %d tokens of %s; recomputing", n, s.id)
            return 0
        self.store.touch_snapshot(s.id)
        return n - in_memory.num_tokens

    def _into_blocks(self, tokens: list[int], n: int, k: list[torch.Tensor], v: list[torch.Tensor]) -> Retained:
        e = self.engine
        bs = e.pool.block_size
        m = e.cache.match(e.namespace, tokens, max_tokens=n)
        e.cache.lock(m.node)  # the part already in memory must stay while we add the rest
        try:
            start = m.num_tokens
            need = -(-n // bs) - start // bs
            e.scheduler.make_room(need)
            new = e.pool.allocate(need)  # raises OutOfBlocks if there is still no room
        finally:
            e.cache.unlock(m.node)
        # copy each layer straight from the loaded tensors into the new blocks' slots
        slots = (torch.tensor(new)[:, None] * bs + torch.arange(bs)).flatten()[: n - start].to(e.pool.kv.device)
        flat = e.pool.kv.flatten(2, 3)  # [layers, 2, slots, kv_heads, head_dim], a view
        for i in range(len(k)):
            flat[i, 0].index_copy_(0, slots, k[i][start:n].to(flat.dtype))
            flat[i, 1].index_copy_(0, slots, v[i][start:n].to(flat.dtype))
        full = n // bs
        node = None
        if full:
            node = e.cache.insert(e.namespace, tokens[: full * bs], m.block_ids + new[: full - start // bs])
            e.cache.lock(node)
        tail_len = n - full * bs
        e.pool.decref(new[: full - start // bs])  # the tree holds those now
        return Retained(node, new[-1] if tail_len else None, tail_len, n)

    # -- when to spill --------------------------------------------------------

    def spill_idle(self, now: float | None = None, keep: Session | None = None) -> int:
        """Spill every session idle for longer than ``idle_spill_s``; returns how many."""
        now = time.monotonic() if now is None else now
        done = 0
        for s in list(self.live.values()):
            if s is not keep and not s.busy and s.kept is not None and now - s.last_used >= self.idle_spill_s:
                done += self.spill(s)
        return done

    def _on_pressure(self, missing_blocks: int) -> None:
        """Blocks ran short: spill idle sessions, least recently used first, until enough could be evicted."""
        for s in sorted(self.live.values(), key=lambda x: x.last_used):
            if self.engine.cache.evictable_blocks >= missing_blocks:
                break
            if not s.busy and s.kept is not None:
                self.spill(s)
