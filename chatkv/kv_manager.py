"""KVManager: the one owner of every KV block's lifetime.

Everything that holds KV memory holds it through this manager; nothing outside it
and ``BlockPool`` touches a reference count, a radix lock or the pool tensor.

Owners and what each holds
--------------------------
* the **radix tree** (``RadixCache``; ``NoPrefixCache`` when prefix caching is off):
  one pool reference on every block it caches;
* a **sequence** (a request, waiting or running): ``seq.block_table`` (one pool
  reference per entry) and ``seq.lock_node`` (one lock on the path of the cached
  prefix it attached), both set by ``attach`` and ended by ``release``; while it
  waits it may also carry ``seq.prefix``, a ``RetainedKV`` handed to it;
* a **RetainedKV**: the KV a finished turn leaves for the conversation's next turn:
  ``node`` (one lock on the history's full blocks) and ``tail_block`` (one pool
  reference on the partial last block). Issued by ``release(retain=True)`` or
  ``import_kv``; ended by ``attach`` (which takes it over) or ``drop``;
* a **pin**: one lock on a shared prefix (a system prompt now, documents next),
  counted per token run by ``pin``/``unpin``.

Contracts
---------
* Every method completes, or raises leaving every count as it found it.
* ``check_integrity(sequences, handles)`` proves that the pool's references and the
  tree's locks are exactly the tree's own plus those of the sequences, handles and
  pins given, and that every handle issued and not ended is among ``handles``.
* KV leaves and enters the pool as per-layer tensors ``[tokens, kv_heads, head_dim]``
  (``export_kv``/``import_kv``), independent of the block size.
* ``make_room`` frees blocks by evicting unlocked cached blocks, then asking
  ``on_pressure`` (the session layer spills idle conversations, making their blocks
  evictable), then evicting again.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Hashable, Iterable

import torch

from chatkv.block_pool import BlockPool
from chatkv.errors import OutOfBlocks
from chatkv.radix_cache import NoPrefixCache, Node, RadixCache

if TYPE_CHECKING:
    from chatkv.sequence import Sequence


@dataclass(eq=False)
class RetainedKV:
    """KV a conversation holds between turns: the locked radix ``node`` ending at its last
    full block (None if it had none), and its own partial last block ``tail_block`` holding
    ``tail_len`` tokens. ``kv_len = full blocks * block_size + tail_len`` tokens have KV."""

    node: Node | None
    tail_block: int | None
    tail_len: int
    kv_len: int


class KVManager:
    def __init__(self, pool: BlockPool, namespace: Hashable, prefix_caching: bool = True):
        self.pool = pool
        self.block_size = pool.block_size
        self.cache = RadixCache(pool) if prefix_caching else NoPrefixCache(pool)
        self.namespace = namespace
        self.sharing = prefix_caching
        self.on_pressure: Callable[[int], None] | None = None  # called with the blocks still missing
        self._pins: dict[tuple[int, ...], list] = {}  # token run -> [locked node, pin count]
        self._live: set[RetainedKV] = set()  # handles issued and not yet ended

    # -- lookups ------------------------------------------------------------------

    def cached_len(self, token_ids: list[int]) -> int:
        """Tokens of ``token_ids`` whose KV is in the tree, leaving at least one to compute."""
        return self.cache.match(self.namespace, token_ids, max_tokens=len(token_ids) - 1).num_tokens

    # -- sequences ----------------------------------------------------------------

    def attach(self, seq: "Sequence") -> None:
        """Give ``seq`` the cached prefix of its tokens (locked, referenced) and, when its handed
        ``seq.prefix`` continues exactly where that prefix ends, that handle's own tail block.
        The handle is ended either way. Cannot fail."""
        assert not seq.block_table and seq.lock_node is None, "attach of a sequence that holds KV"
        m = self.cache.match(self.namespace, seq.token_ids, max_tokens=len(seq.token_ids) - 1)
        self.cache.lock(m.node)
        self.pool.incref(m.block_ids)
        seq.lock_node, seq.block_table, seq.num_computed = m.node, list(m.block_ids), m.num_tokens
        p = seq.prefix
        if p is not None and p.tail_block is not None and m.num_tokens == p.kv_len - p.tail_len < p.kv_len < len(seq.token_ids):
            seq.block_table.append(p.tail_block)  # the conversation's own partial block continues its history
            seq.num_computed = p.kv_len
            p.tail_block = None
        self.drop(p)
        seq.prefix = None

    def reserve(self, seq: "Sequence", num_tokens: int) -> bool:
        """Make ``seq.block_table`` cover ``num_computed + num_tokens`` tokens; False if blocks lack.
        Raises only what ``on_pressure`` raises, with ``seq`` unchanged."""
        need = -(-(seq.num_computed + num_tokens) // self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        if not self.make_room(need):
            return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def release(self, seq: "Sequence", retain: bool = False) -> RetainedKV | None:
        """End everything ``seq`` holds: its computed full blocks go into the tree first (so a
        later request hits them), then its references and lock are dropped. With ``retain``
        (and sharing on) returns a RetainedKV of its computed tokens for the next turn."""
        self.drop(seq.prefix)
        seq.prefix = None
        bs = self.block_size
        full = seq.num_computed // bs
        table = seq.block_table
        node = self.cache.insert(self.namespace, seq.token_ids[: full * bs], table[:full]) if full else None
        kept = None
        if retain and self.sharing and seq.num_computed:
            if node is not None:
                self.cache.lock(node)
            tail_len = seq.num_computed - full * bs
            tail = table[full] if tail_len else None
            kept = RetainedKV(node, tail, tail_len, seq.num_computed)
            self._live.add(kept)
            if tail is not None:
                table = table[:full] + table[full + 1 :]
        if seq.lock_node is not None:
            self.cache.unlock(seq.lock_node)
            seq.lock_node = None
        self.pool.decref(table)
        seq.block_table = []
        seq.num_computed = 0
        return kept

    # -- retained KV ----------------------------------------------------------------

    def drop(self, kept: RetainedKV | None) -> None:
        """End a RetainedKV: unlock its path and drop its tail block (None: nothing to do)."""
        if kept is None:
            return
        if kept.node is not None:
            self.cache.unlock(kept.node)
            kept.node = None
        if kept.tail_block is not None:
            self.pool.decref([kept.tail_block])
            kept.tail_block = None
        self._live.discard(kept)

    def export_kv(self, kept: RetainedKV, start: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer keys and values ``[kv_len - start, kv_heads, head_dim]`` of the tokens
        ``start:kv_len`` of a RetainedKV (copies; only the blocks holding them are read)."""
        assert 0 <= start <= kept.kv_len, f"export from token {start} of {kept.kv_len}"
        blocks = self._path_blocks(kept.node)
        assert len(blocks) * self.block_size == kept.kv_len - kept.tail_len, "retained path and length disagree"
        if kept.tail_block is not None:
            blocks.append(kept.tail_block)
        first = start // self.block_size
        kv = self.pool.read(blocks[first:], kept.kv_len - first * self.block_size)[:, :, start - first * self.block_size :]
        return [kv[i, 0] for i in range(kv.shape[0])], [kv[i, 1] for i in range(kv.shape[0])]

    def import_kv(self, token_ids: list[int], num_tokens: int, k: list[torch.Tensor], v: list[torch.Tensor]) -> RetainedKV:
        """Put the KV of ``token_ids[:num_tokens]`` (per-layer tensors, at least that long) into
        blocks, reusing whatever of it the tree already has; return it as a RetainedKV.
        Raises OutOfBlocks (changing nothing) when there is no room even after ``make_room``."""
        assert self.sharing, "import_kv needs prefix caching: imported blocks live in the tree"
        bs = self.block_size
        m = self.cache.match(self.namespace, token_ids, max_tokens=num_tokens)
        start = m.num_tokens
        need = -(-num_tokens // bs) - start // bs
        self.cache.lock(m.node)  # the part already in memory must stay while we add the rest
        try:
            if not self.make_room(need):
                raise OutOfBlocks(f"no room for {need} KV blocks to restore {num_tokens} tokens")
            new = self.pool.allocate(need)
        finally:
            self.cache.unlock(m.node)
        try:
            self.pool.write(new, 0, [x[start:num_tokens] for x in k], [x[start:num_tokens] for x in v])
        except BaseException:
            self.pool.decref(new)
            raise
        full = num_tokens // bs
        n_new_full = full - start // bs
        node = None
        if full:
            node = self.cache.insert(self.namespace, token_ids[: full * bs], m.block_ids + new[:n_new_full])
            self.cache.lock(node)
        self.pool.decref(new[:n_new_full])  # the tree holds those now
        tail_len = num_tokens - full * bs
        kept = RetainedKV(node, new[-1] if tail_len else None, tail_len, num_tokens)
        self._live.add(kept)
        return kept

    # -- pins ---------------------------------------------------------------------

    def pin(self, token_ids: list[int]) -> tuple[int, ...] | None:
        """Keep the block-aligned part of ``token_ids`` (a shared prefix) from eviction while
        pinned. Returns the pin's key for ``unpin``, or None if none of it is cached in full."""
        n = len(token_ids) // self.block_size * self.block_size
        if n == 0 or not self.sharing:
            return None
        key = tuple(token_ids[:n])
        if key not in self._pins:
            m = self.cache.match(self.namespace, key)
            if m.num_tokens < n:
                return None
            self.cache.lock(m.node)
            self._pins[key] = [m.node, 0]
        self._pins[key][1] += 1
        return key

    def unpin(self, key: tuple[int, ...] | None) -> None:
        if key is None:
            return
        entry = self._pins[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.cache.unlock(entry[0])
            del self._pins[key]

    # -- memory ---------------------------------------------------------------------

    def make_room(self, need: int) -> bool:
        """Free blocks until ``need`` are free: evict cached blocks, then ask ``on_pressure``,
        then evict again. True on success."""
        if self.pool.num_free < need:
            self.cache.evict(need - self.pool.num_free)
        if self.pool.num_free < need and self.on_pressure is not None:
            self.on_pressure(need - self.pool.num_free)
            self.cache.evict(need - self.pool.num_free)
        return self.pool.num_free >= need

    def clear(self) -> None:
        """Release every unlocked cached block (shutdown)."""
        self.cache.clear()

    def stats(self) -> dict[str, int]:
        """Block and tree counts, for status lines and metrics."""
        return {
            "blocks_total": self.pool.num_blocks,
            "blocks_free": self.pool.num_free,
            "blocks_cached": self.cache.cached_blocks,
            "blocks_evictable": self.cache.evictable_blocks,
            "tree_nodes": len(self.cache.nodes()),
            "pins": len(self._pins),
            "retained": len(self._live),
        }

    # -- integrity ------------------------------------------------------------------

    def check_integrity(self, sequences: Iterable["Sequence"], handles: Iterable[RetainedKV | None]) -> None:
        """Assert the pool and tree invariants, and that the references and locks held are
        exactly those of the tree, ``sequences``, ``handles`` and the pins (call when idle)."""
        self.pool.check_integrity()
        self.cache.check_integrity()
        handles = [h for h in handles if h is not None]
        owned = {id(h) for h in handles}
        assert len(owned) == len(handles), "one RetainedKV held twice"
        orphans = [h for h in self._live if id(h) not in owned]
        assert not orphans, f"{len(orphans)} retained KV handle(s) held by no live session or request"
        unknown = [h for h in handles if h not in self._live]
        assert not unknown, "a retained KV handle was ended but is still held"
        nodes = self.cache.nodes(with_roots=True)
        refs: Counter[int] = Counter(b for n in nodes for b in n.block_ids)
        locks: Counter[int] = Counter()
        for s in sequences:
            refs.update(s.block_table)
            if s.lock_node is not None:
                locks[id(s.lock_node)] += 1
        for h in handles:
            if h.tail_block is not None:
                refs[h.tail_block] += 1
            if h.node is not None:
                locks[id(h.node)] += 1
        for node, _ in self._pins.values():
            locks[id(node)] += 1
        for b in range(self.pool.num_blocks):
            assert self.pool.ref_counts[b] == refs[b], (
                f"block {b} has {self.pool.ref_counts[b]} references, its owners account for {refs[b]}"
            )
        subtree: Counter[int] = Counter()
        for node in reversed(nodes):  # children before parents
            subtree[id(node)] += locks[id(node)]
            assert node.lock_ref == subtree[id(node)], (
                f"a radix node has {node.lock_ref} locks, its owners account for {subtree[id(node)]}"
            )
            if node.parent is not None:
                subtree[id(node.parent)] += subtree[id(node)]

    def _path_blocks(self, node: Node | None) -> list[int]:
        parts: list[list[int]] = []
        while node is not None and not node.is_root:
            parts.append(node.block_ids)
            node = node.parent
        return [b for part in reversed(parts) for b in part]
