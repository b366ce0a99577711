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

from chatkv.block_pool import BlockPool
from chatkv.radix_cache import RadixCache
from chatkv.sequence import Sequence, Status


class Scheduler:
    def __init__(self, pool: BlockPool, cache: RadixCache, max_batch_tokens: int, max_running: int):
        self.pool = pool
        self.cache = cache
        self.block_size = pool.block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

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
        if self.pool.num_free < need:
            self.cache.evict(need - self.pool.num_free)
        if self.pool.num_free < need:
            return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def release(self, seq: Sequence, cache_it: bool = True) -> None:
        """Drop the sequence's blocks, first offering its computed full blocks to the radix tree."""
        full = seq.num_computed // self.block_size
        node = None
        if cache_it and full:
            node = self.cache.insert(seq.namespace, seq.token_ids[: full * self.block_size], seq.block_table[:full])
            if seq.retain:
                self.cache.lock(node)
        if seq.lock_node is not None:
            self.cache.unlock(seq.lock_node)
        seq.lock_node = node if (seq.retain and node is not None) else None
        self.pool.decref(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        retain, seq.retain = seq.retain, False
        self.release(seq)
        seq.retain = retain
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
        chunk = min(len(seq.token_ids) - seq.num_computed, budget)
        if not self._reserve(seq, chunk):
            self.cache.unlock(m.node)
            self.pool.decref(seq.block_table)
            seq.lock_node, seq.block_table, seq.num_computed = None, [], 0
            return 0
        if seq.num_cached < 0:
            seq.num_cached = m.num_tokens
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
        self.release(seq)
        seq.status = Status.FINISHED
