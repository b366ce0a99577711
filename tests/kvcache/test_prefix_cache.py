"""The PrefixCache contract (chatkv/kvcache/prefix_cache.py), run against every implementation:
NoPrefixCache, RadixCache and HiRadixCache (a real HostPool on CPU). Real pools throughout.

What the contract promises whatever the implementation: the cache's references are its
own (``cached_blocks`` of them) and the caller's stay the caller's; a caller that caps a
match at ``len - 1`` always has a token left to compute; eviction never frees a locked
node; namespaces never share; ``evict`` returns what became free.
"""

from __future__ import annotations

import pytest

from chatkv.kvcache.block_pool import BlockPool
from chatkv.kvcache.hiradix import HiRadixCache
from chatkv.kvcache.host_pool import HostPool
from chatkv.kvcache.prefix_cache import NoPrefixCache, PrefixCache
from chatkv.kvcache.radix import RadixCache

BS = 4
LAYOUT = (2, 2, 3)  # layers, kv heads, head dim: the host tier copies real KV
A = list(range(100, 112))  # 3 blocks
B = list(range(200, 208))  # 2 blocks


def _none(pool):
    return NoPrefixCache(pool)


def _radix(pool):
    return RadixCache(pool)


def _hiradix(pool):
    return HiRadixCache(pool, HostPool(8, BS, *LAYOUT, dtype=pool.kv.dtype))


KINDS = {"none": _none, "radix": _radix, "hiradix": _hiradix}


@pytest.fixture(params=sorted(KINDS))
def made(request):
    pool = BlockPool(12, BS, *LAYOUT)
    return request.param, pool, KINDS[request.param](pool)


def put(pool: BlockPool, cache: PrefixCache, tokens, ns="m"):
    """What a finished request does: its own blocks, insert, drop its own references."""
    ids = pool.allocate(len(tokens) // BS)
    node = cache.insert(ns, tokens, ids)
    pool.decref(ids)
    return node, ids


def referenced(pool: BlockPool) -> int:
    return sum(1 for c in pool.ref_counts if c)


def check(pool: BlockPool, cache: PrefixCache) -> None:
    pool.check_integrity()
    cache.check_integrity()
    assert referenced(pool) == cache.cached_blocks, "a block referenced by nobody but the cache is not counted"


def test_every_implementation_is_a_prefix_cache(made):
    _, _, cache = made
    assert isinstance(cache, PrefixCache)
    assert cache.block_size == BS


def test_a_match_capped_at_len_minus_one_leaves_a_token_to_compute(made):
    kind, pool, cache = made
    put(pool, cache, A)
    for n in range(1, len(A) + 1):
        m = cache.match("m", A[:n], max_tokens=n - 1)
        got = m.num_tokens + m.host_tokens
        assert got <= n - 1 and got % BS == 0 and m.num_tokens == len(m.block_ids) * BS
    full = cache.match("m", A)
    assert full.num_tokens == (0 if kind == "none" else len(A))
    check(pool, cache)


def test_the_cache_holds_its_own_references_and_the_caller_keeps_its_own(made):
    kind, pool, cache = made
    ids = pool.allocate(3)
    node = cache.insert("m", A + [7], ids)  # the trailing partial block is ignored
    adopted = 0 if kind == "none" else 3
    assert cache.cached_blocks == adopted
    assert [pool.ref_counts[b] for b in ids] == [1 + (adopted > 0)] * 3  # the caller's, plus the cache's
    assert node.is_root == (kind == "none")
    pool.decref(ids)  # the caller lets go: what the cache did not adopt goes back to the pool
    assert pool.num_free == pool.num_blocks - adopted
    check(pool, cache)
    dup = pool.allocate(3)  # the same tokens again, in other blocks: not adopted
    cache.insert("m", A, dup)
    pool.decref(dup)
    assert cache.cached_blocks == adopted and pool.num_free == pool.num_blocks - adopted
    check(pool, cache)


def test_an_empty_insert_returns_a_root(made):
    _, pool, cache = made
    assert cache.insert("m", A, []).is_root
    check(pool, cache)


def test_eviction_never_frees_a_locked_node(made):
    kind, pool, cache = made
    put(pool, cache, A)
    put(pool, cache, B)
    m = cache.match("m", A)
    cache.lock(m.node)
    free = pool.num_free
    freed = cache.evict(pool.num_blocks)
    assert freed == pool.num_free - free  # evict says what became free
    again = cache.match("m", A)
    assert again.num_tokens == m.num_tokens and again.block_ids == m.block_ids
    assert all(pool.ref_counts[b] for b in m.block_ids)
    assert cache.cached_blocks == len(m.block_ids) and cache.evictable_blocks == 0
    check(pool, cache)
    cache.unlock(m.node)
    assert cache.evictable_blocks == cache.cached_blocks
    cache.evict(pool.num_blocks)
    assert pool.num_free == pool.num_blocks and cache.cached_blocks == 0
    check(pool, cache)


def test_locks_count_and_an_extra_unlock_is_an_error(made):
    kind, pool, cache = made
    node, _ = put(pool, cache, A)
    cache.lock(node)
    cache.lock(node)
    cache.unlock(node)
    cache.evict(pool.num_blocks)
    assert cache.match("m", A).num_tokens == (0 if kind == "none" else len(A))  # one lock left
    cache.unlock(node)
    if kind != "none":  # the no-sharing cache ignores locks: it holds nothing to protect
        with pytest.raises(AssertionError, match="not locked"):
            cache.unlock(node)
    check(pool, cache)


def test_namespaces_never_share(made):
    kind, pool, cache = made
    put(pool, cache, A, ns="one")
    assert cache.match("two", A).num_tokens == 0
    _, ids = put(pool, cache, A, ns="two")
    assert cache.cached_blocks == (0 if kind == "none" else 6)
    freed = cache.drop_namespace("one")
    assert freed == (0 if kind == "none" else 3)
    assert cache.match("one", A).num_tokens == 0 and cache.match("two", A).num_tokens == (0 if kind == "none" else 12)
    check(pool, cache)


def test_drop_namespace_and_clear_keep_locked_paths(made):
    kind, pool, cache = made
    node, _ = put(pool, cache, A)
    put(pool, cache, B)
    cache.lock(node)
    cache.drop_namespace("m")
    assert cache.match("m", B).num_tokens == 0
    cache.clear()
    assert cache.match("m", A).num_tokens == (0 if kind == "none" else 12)
    cache.unlock(node)
    cache.clear()
    assert pool.num_free == pool.num_blocks and cache.cached_blocks == 0 and cache.host_blocks == 0
    assert cache.nodes() == []
    check(pool, cache)


def test_the_host_tier_only_where_there_is_one(made):
    kind, pool, cache = made
    node, _ = put(pool, cache, A)
    free = pool.num_free
    freed = cache.offload(node)
    assert freed == pool.num_free - free
    m = cache.match("m", A)
    if cache.host is None:
        assert freed == 0 and m.host_tokens == 0 and cache.host_blocks == 0 and cache.tier_stats() == {}
        assert cache.load(m, []) is m
    else:  # device -> host, then back into fresh device blocks
        assert freed == 3 and m.num_tokens == 0 and m.host_tokens == 12 and cache.host_blocks == 3
        check(pool, cache)
        m = cache.load(m, pool.allocate(3))
        assert m.num_tokens == 12 and m.host_tokens == 0 and cache.host_blocks == 0
        assert cache.tier_stats() == {"evicted_to_host": 3, "host_hits": 3, "host_evicted": 0}
    check(pool, cache)
