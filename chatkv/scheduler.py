"""Continuous batching: which sequences compute how many tokens in the next step.

Each step: every running sequence gets its share first (1 token for a decode,
a chunk for an unfinished prefill), then waiting sequences are admitted,
longest cached prefix first, while the token budget and free blocks allow.
When blocks run out the newest running sequence is preempted: its computed
full blocks go into the radix tree (so its re-admission hits them), its own
references are dropped and it goes back to the front of the queue.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from chatkv.block_pool import BlockPool
from chatkv.radix_cache import RadixCache
from chatkv.sequence import Retained, Sequence, Status


class Scheduler:
    def __init__(self, pool: BlockPool, cache: RadixCache, max_batch_tokens: int, max_running: int):
        self.pool = pool
        self.cache = cache
        self.block_size = pool.block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.on_pressure: Callable[[int], None] | None = None  # called with the blocks still missing

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- blocks -------------------------------------------------------------

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make ``seq.block_table`` cover ``num_computed + num_tokens`` tokens; False if blocks lack."""
        need = -(-(seq.num_computed + num_tokens) // self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        if not self.make_room(need):
            return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def make_room(self, need: int) -> bool:
        """Free blocks until ``need`` are free: evict cached blocks, then ask ``on_pressure``. True on success."""
        if self.pool.num_free < need:
            self.cache.evict(need - self.pool.num_free)
        if self.pool.num_free < need and self.on_pressure is not None:
            self.on_pressure(need - self.pool.num_free)  # e.g. spill idle sessions, making their blocks evictable
            self.cache.evict(need - self.pool.num_free)
        return self.pool.num_free >= need

    def release(self, seq: Sequence, retain: bool = False) -> None:
        """Drop the sequence's blocks, first offering its computed full blocks to the radix tree.

        With ``retain`` the inserted path stays locked and the partial last block stays
        referenced, both recorded in ``seq.retained`` for the session's next turn.
        """
        self.drop_prefix(seq)
        bs = self.block_size
        full = seq.num_computed // bs
        node = self.cache.insert(seq.namespace, seq.token_ids[: full * bs], seq.block_table[:full]) if full else None
        table = seq.block_table
        if retain:
            if node is not None:
                self.cache.lock(node)
            tail_len = seq.num_computed - full * bs
            tail = table[full] if tail_len else None
            seq.retained = Retained(node, tail, tail_len, seq.num_computed)
            if tail is not None:
                table = table[:full] + table[full + 1 :]
        if seq.lock_node is not None:
            self.cache.unlock(seq.lock_node)
            seq.lock_node = None
        self.pool.decref(table)
        seq.block_table = []
        seq.num_computed = 0

    def drop_prefix(self, seq: Sequence) -> None:
        """Release the previous turn's retained KV still attached to ``seq`` (if admission did not take it)."""
        release_retained(self.cache, self.pool, seq.prefix)
        seq.prefix = None

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    # -- admission ----------------------------------------------------------

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Attach the cached prefix and reserve blocks for a first chunk; 0 if it cannot start now."""
        m = self.cache.match(seq.namespace, seq.token_ids, max_tokens=len(seq.token_ids) - 1)
        self.cache.lock(m.node)
        self.pool.incref(m.block_ids)
        seq.lock_node, seq.block_table, seq.num_computed = m.node, list(m.block_ids), m.num_tokens
        p = seq.prefix
        if p is not None and p.tail_block is not None and m.num_tokens == p.kv_len - p.tail_len < p.kv_len < len(seq.token_ids):
            # the session's own partial block continues its history: take it over
            seq.block_table.append(p.tail_block)
            seq.num_computed = p.kv_len
            p.tail_block = None
        self.drop_prefix(seq)
        chunk = min(len(seq.token_ids) - seq.num_computed, budget)
        if not self._reserve(seq, chunk):
            self.release(seq)  # its tail block (if it took one) goes into the tree or back to the pool
            return 0
        if seq.num_cached < 0:
            seq.num_cached = seq.num_computed
        return chunk

    # -- the step -----------------------------------------------------------

    def schedule(self) -> list[tuple[Sequence, int]]:
        """Return ``(sequence, tokens to compute)`` pairs for the next step, in batch order."""
        plan: list[tuple[Sequence, int]] = []
        budget = self.max_batch_tokens
        for seq in list(self.running):
            if seq not in self.running:  # preempted below on behalf of an older sequence
                continue
            want = min(len(seq.token_ids) - seq.num_computed, max(budget, 1))
            while not self._reserve(seq, want):
                victim = self.running[-1]
                self.preempt(victim)
                plan = [(s, n) for s, n in plan if s is not victim]
                if victim is seq:
                    break
            else:
                plan.append((seq, want))
                budget -= want
        if self.waiting and budget > 0 and len(self.running) < self.max_running:
            # longest cached prefix first: those cost the least to start
            ranked = sorted(
                self.waiting,
                key=lambda s: -self.cache.match(s.namespace, s.token_ids, max_tokens=len(s.token_ids) - 1).num_tokens,
            )
            for seq in ranked:
                if budget <= 0 or len(self.running) >= self.max_running:
                    break
                chunk = self._admit(seq, budget)
                if chunk == 0:
                    break
                self.waiting.remove(seq)
                seq.status = Status.RUNNING
                self.running.append(seq)
                plan.append((seq, chunk))
                budget -= chunk
        return plan

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq, retain=seq.retain)
        seq.status = Status.FINISHED


def release_retained(cache: RadixCache, pool: BlockPool, kept: Retained | None) -> None:
    """Give back what a session held between turns: unlock its path, drop its tail block."""
    if kept is None:
        return
    if kept.node is not None:
        cache.unlock(kept.node)
        kept.node = None
    if kept.tail_block is not None:
        pool.decref([kept.tail_block])
        kept.tail_block = None
