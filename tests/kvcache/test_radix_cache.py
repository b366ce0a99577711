"""RadixCache: unit tests, then a stateful property test against a naive reference."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from chatkv.kvcache.block_pool import BlockPool
from chatkv.kvcache.radix import RadixCache

BS = 4


def make(num_blocks: int = 16) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(num_blocks, BS)
    return pool, RadixCache(pool)


def put(pool: BlockPool, cache: RadixCache, tokens, ns="m"):
    """What a finished request does: its own blocks, insert, drop its own references."""
    ids = pool.allocate(len(tokens) // BS)
    node = cache.insert(ns, tokens, ids)
    pool.decref(ids)
    return node, ids


def check(pool: BlockPool, cache: RadixCache) -> None:
    pool.check_integrity()
    cache.check_integrity()


A = list(range(100, 112))  # 3 blocks
B = list(range(200, 208))  # 2 blocks
C = list(range(300, 308))  # 2 blocks


def test_match_miss():
    pool, cache = make()
    res = cache.match("m", A)
    assert res.node.is_root and res.block_ids == [] and res.num_tokens == 0
    put(pool, cache, A)
    res = cache.match("m", [1] + A)
    assert res.node.is_root and res.block_ids == [] and res.num_tokens == 0
    check(pool, cache)


def test_match_hit_on_node_boundary():
    pool, cache = make()
    node, ids = put(pool, cache, A)
    res = cache.match("m", A + [7, 8, 9])  # trailing partial block is never cached
    assert res.node is node and res.block_ids == ids and res.num_tokens == 12
    assert node.parent.is_root  # no split
    check(pool, cache)


def test_match_ending_mid_node_splits():
    pool, cache = make()
    leaf, ids = put(pool, cache, A)
    res = cache.match("m", A[:8] + [0, 0, 0, 0])
    assert res.num_tokens == 8 and res.block_ids == ids[:2]
    assert res.node.tokens == tuple(A[:8]) and leaf.parent is res.node and leaf.tokens == tuple(A[8:])
    check(pool, cache)
    # diverging inside a block: only the whole blocks before it count
    res = cache.match("m", A[:6] + [0, 0])
    assert res.num_tokens == 4 and res.block_ids == ids[:1]
    check(pool, cache)
    assert cache.match("m", A).block_ids == ids
    assert cache.cached_blocks == 3


def test_max_tokens_cap():
    pool, cache = make()
    _, ids = put(pool, cache, A)
    assert cache.match("m", A, max_tokens=len(A) - 1).block_ids == ids[:2]  # rounded down to a block
    assert cache.match("m", A, max_tokens=4).num_tokens == 4
    assert cache.match("m", A, max_tokens=3).node.is_root
    assert cache.match("m", A, max_tokens=0).num_tokens == 0
    assert cache.match("m", A, max_tokens=100).num_tokens == 12
    check(pool, cache)


def test_insert_ignores_trailing_tokens_and_empty_insert_returns_root():
    pool, cache = make()
    ids = pool.allocate(2)
    node = cache.insert("m", A[:10], ids)
    pool.decref(ids)
    assert node.tokens == tuple(A[:8]) and cache.cached_blocks == 2
    assert cache.insert("m", A, []).is_root
    with pytest.raises(AssertionError):
        cache.insert("m", A[:7], pool.allocate(2))


def test_insert_dedups_and_caller_duplicates_return_to_pool():
    pool, cache = make()
    _, first = put(pool, cache, A)
    mine = pool.allocate(4)  # recomputed A and one more block
    node = cache.insert("m", A + [5, 6, 7, 8], mine)
    assert [pool.ref_counts[b] for b in mine] == [1, 1, 1, 2]  # only the new block is adopted
    pool.decref(mine)
    assert all(pool.ref_counts[b] == 0 for b in mine[:3])
    assert cache.match("m", A + [5, 6, 7, 8]).block_ids == first + mine[3:]
    assert node.block_ids == mine[3:] and node.parent.block_ids == first
    assert pool.num_free == 16 - 4 == 16 - cache.cached_blocks
    check(pool, cache)


def test_namespaces_are_isolated():
    pool, cache = make()
    _, a_ids = put(pool, cache, A, ns=("llama", "bf16"))
    assert cache.match(("llama", "fp8"), A).num_tokens == 0
    _, b_ids = put(pool, cache, A, ns=("llama", "fp8"))
    assert set(a_ids).isdisjoint(b_ids) and cache.cached_blocks == 6
    assert cache.match(("llama", "bf16"), A).block_ids == a_ids
    assert cache.match(("llama", "fp8"), A).block_ids == b_ids
    check(pool, cache)
    assert cache.evict(100) == 6 and pool.num_free == 16  # evict spans namespaces
    check(pool, cache)


def test_lock_prevents_eviction():
    pool, cache = make()
    put(pool, cache, A)
    put(pool, cache, B)
    res = cache.match("m", A)
    cache.lock(res.node)
    assert cache.evictable_blocks == 2
    assert cache.evict(100) == 2  # only B
    assert cache.match("m", A).block_ids == res.block_ids and cache.match("m", B).num_tokens == 0
    assert cache.evictable_blocks == 0
    check(pool, cache)
    cache.unlock(res.node)
    assert cache.evictable_blocks == 3
    assert cache.evict(1) == 3 and pool.num_free == 16
    check(pool, cache)


def test_lock_of_a_child_pins_its_ancestors():
    pool, cache = make()
    put(pool, cache, A[:8])
    child, _ = put(pool, cache, A)
    assert child.parent.tokens == tuple(A[:8])
    cache.lock(child)
    assert cache.evict(100) == 0 and cache.cached_blocks == 3
    # a split under a lock keeps the counts right
    cache.match("m", A[:4])
    check(pool, cache)
    cache.unlock(child)
    assert cache.evict(100) == 3
    check(pool, cache)


def test_evict_lru_order_whole_nodes():
    pool, cache = make()
    put(pool, cache, A)
    put(pool, cache, B)
    put(pool, cache, C)
    cache.match("m", A)  # A is now the most recently used
    assert cache.evict(1) == 2  # B, the whole node
    assert cache.match("m", B).num_tokens == 0 and cache.match("m", C).num_tokens == 8
    # that match touched C: A is now the oldest
    assert cache.evict(1) == 3 and cache.match("m", A).num_tokens == 0
    assert cache.match("m", C).num_tokens == 8
    check(pool, cache)


def test_evict_leaf_then_parent():
    pool, cache = make()
    put(pool, cache, A[:8])
    put(pool, cache, A)
    put(pool, cache, B)  # newest
    assert cache.evict(3) == 3  # leaf A[8:], then its parent A[:8] became an unlocked leaf
    assert cache.match("m", A).num_tokens == 0 and cache.match("m", B).num_tokens == 8
    assert cache.evict(0) == 0
    check(pool, cache)


def test_evict_counts_only_blocks_that_became_free():
    pool, cache = make()
    _, ids = put(pool, cache, A)
    pool.incref(ids[:1])  # someone else still reads the first block
    assert cache.evict(100) == 2 and cache.cached_blocks == 0
    assert pool.ref_counts[ids[0]] == 1
    pool.decref(ids[:1])
    check(pool, cache)


def test_unlock_underflow_and_lock_of_evicted_node_assert():
    pool, cache = make()
    node, _ = put(pool, cache, A)
    with pytest.raises(AssertionError):
        cache.unlock(node)
    cache.lock(node)
    cache.unlock(node)
    with pytest.raises(AssertionError):
        cache.unlock(node)
    cache.evict(100)
    with pytest.raises(AssertionError):
        cache.lock(node)
    check(pool, cache)


def test_clear_keeps_locked_paths():
    pool, cache = make()
    put(pool, cache, A)
    node, _ = put(pool, cache, B, ns="other")
    cache.lock(node)
    cache.clear()
    assert cache.cached_blocks == 2 and pool.num_free == 14
    check(pool, cache)
    cache.unlock(node)
    cache.clear()
    assert cache.cached_blocks == 0 and pool.num_free == 16
    check(pool, cache)


def test_check_integrity_catches_a_bad_count():
    pool, cache = make()
    put(pool, cache, A)
    cache._cached += 1
    with pytest.raises(AssertionError):
        cache.check_integrity()


# ---------------------------------------------------------------------------------------
# Stateful property test. The reference is naive: a dict from each cached block-aligned
# prefix (namespace, tokens) to the block id holding it, plus the logical time each prefix
# was last touched and the prefixes callers have locked.

P_BS = 2
P_BLOCKS = 16
NAMESPACES = st.sampled_from(["a", "b"])
TOKENS = st.lists(st.integers(0, 1), max_size=12)  # two symbols, so prefixes collide


class RadixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(P_BLOCKS, P_BS)
        self.cache = RadixCache(self.pool)
        self.ref: dict[tuple, int] = {}  # (ns, prefix) -> block id holding its last block
        self.time: dict[tuple, int] = {}  # (ns, prefix) -> last match/insert that touched it
        self.content: dict[int, tuple] = {}  # block id -> (ns, prefix) it was filled with
        self.locks: list[tuple[tuple, object]] = []  # ((ns, prefix), node)
        self.clock = 0

    # -- helpers
    def _keys(self, ns, tokens, n_blocks):
        return [(ns, tuple(tokens[: (i + 1) * P_BS])) for i in range(n_blocks)]

    def _covered(self, key) -> bool:
        ns, p = key
        return any(lns == ns and lp[: len(p)] == p for (lns, lp), _ in self.locks)

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _match(self, ns, tokens, max_tokens):
        res = self.cache.match(ns, tokens, max_tokens)
        limit = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
        k = 0
        while (k + 1) * P_BS <= limit and (ns, tuple(tokens[: (k + 1) * P_BS])) in self.ref:
            k += 1
        keys = self._keys(ns, tokens, k)
        assert res.num_tokens == k * P_BS
        assert res.block_ids == [self.ref[key] for key in keys]
        assert [self.content[b] for b in res.block_ids] == keys
        t = self._tick()
        for key in keys:
            self.time[key] = t
        return res, k

    def _evict(self, n):
        before = dict(self.ref)
        free_before = self.pool.num_free
        freed = self.cache.evict(n)
        assert self.pool.num_free - free_before == freed
        survivors = {k: b for k, b in before.items() if self.pool.ref_counts[b] > 0}
        evicted = before.keys() - survivors.keys()
        assert len(evicted) == freed
        for ns, p in survivors:  # still prefix-closed
            assert len(p) == P_BS or (ns, p[:-P_BS]) in survivors
        for (ns, p), _ in self.locks:  # locked paths survive whole
            assert all(key in survivors for key in self._keys(ns, p, len(p) // P_BS))
        parents = {(ns, p[:-P_BS]) for ns, p in survivors}
        unlocked_leaves = [k for k in survivors if k not in parents and not self._covered(k)]
        if evicted and unlocked_leaves:  # LRU: nothing evicted is newer than a surviving leaf
            assert max(self.time[e] for e in evicted) <= min(self.time[s] for s in unlocked_leaves)
        if evicted:  # no over-eviction: before the last (newest) node went, fewer than n were free
            newest = max(self.time[e] for e in evicted)
            assert freed - sum(self.time[e] == newest for e in evicted) < n
        if freed < n:  # stopped early only because nothing unlocked was left
            assert all(self._covered(key) for key in survivors)
        self.ref = survivors
        for e in evicted:
            del self.time[e]

    # -- rules
    @rule(ns=NAMESPACES, tokens=TOKENS, max_tokens=st.none() | st.integers(0, 13))
    def match(self, ns, tokens, max_tokens):
        self._match(ns, tokens, max_tokens)

    @rule(ns=NAMESPACES, tokens=TOKENS, reuse=st.booleans())
    def insert(self, ns, tokens, reuse):
        """A request finishing: with ``reuse`` it matched first and holds the tree's blocks
        (locked, plus its own reference), otherwise it recomputed everything."""
        n = len(tokens) // P_BS
        own, lock = [], None
        if reuse:
            res, k = self._match(ns, tokens, None)
            self.cache.lock(res.node)
            lock = ((ns, tuple(tokens[: k * P_BS])), res.node)
            self.locks.append(lock)
            self.pool.incref(res.block_ids)
            own = list(res.block_ids)
        need = n - len(own)
        if need > self.pool.num_free:
            self._evict(need - self.pool.num_free)
        if need <= self.pool.num_free:
            new = self.pool.allocate(need)
            for i, b in enumerate(new):
                self.content[b] = (ns, tuple(tokens[: (len(own) + i + 1) * P_BS]))
            blocks = own + new
            node = self.cache.insert(ns, tokens, blocks)
            t = self._tick()
            keys = self._keys(ns, tokens, n)
            for key, b in zip(keys, blocks):
                self.ref.setdefault(key, b)
                self.time[key] = t
            assert self._path_blocks(node) == [self.ref[key] for key in keys]
            self.pool.decref(new)
        if lock is not None:
            self.locks.remove(lock)
            self.cache.unlock(lock[1])
        self.pool.decref(own)

    @rule(ns=NAMESPACES, tokens=TOKENS, max_tokens=st.none() | st.integers(0, 13))
    def lock(self, ns, tokens, max_tokens):
        res, k = self._match(ns, tokens, max_tokens)
        self.cache.lock(res.node)
        self.locks.append(((ns, tuple(tokens[: k * P_BS])), res.node))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 99))
    def unlock(self, i):
        _, node = self.locks.pop(i % len(self.locks))
        self.cache.unlock(node)

    @rule(n=st.integers(0, P_BLOCKS + 2))
    def evict(self, n):
        self._evict(n)

    @rule()
    def clear(self):
        self.cache.clear()
        self.ref = {k: b for k, b in self.ref.items() if self._covered(k)}
        self.time = {k: self.time[k] for k in self.ref}

    # -- invariants, after every step (callers hold no references between steps)
    @staticmethod
    def _path_blocks(node):
        blocks = []
        while node is not None:
            blocks[:0] = node.block_ids
            node = node.parent
        return blocks

    @invariant()
    def consistent(self):
        self.pool.check_integrity()
        self.cache.check_integrity()
        assert self.cache.cached_blocks == len(self.ref)
        assert self.pool.num_free == P_BLOCKS - len(self.ref)
        assert all(self.pool.ref_counts[b] == 1 for b in self.ref.values())
        assert self.cache.evictable_blocks == sum(not self._covered(k) for k in self.ref)
        for (ns, p), node in self.locks:
            assert self._path_blocks(node) == [self.ref[key] for key in self._keys(ns, p, len(p) // P_BS)]


RadixMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestRadixMachine = RadixMachine.TestCase
