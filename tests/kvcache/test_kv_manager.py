"""KVManager: every KV block's lifetime - attach, reserve, release (retain), drop, pins,
export/import, make_room, caching off - and check_integrity catching each kind of leak.

No model: sequences are built directly and "computed" by writing a KV value per token that
depends on the whole prefix up to it, so a block shared with the wrong tokens shows up.
Ends with a hypothesis state machine over the whole API with random token sequences that
share prefixes, checking ownership after every step.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from chatkv.engine.sequence import Sequence
from chatkv.errors import OutOfBlocks
from chatkv.kvcache.block_pool import BlockPool
from chatkv.kvcache.manager import KVManager, RetainedKV
from tests.support.fakes import make_seq

BS = 4
NS = ("model", "float32", None)


def manager(num_blocks=16, layout=(1, 1, 1), prefix_caching=True) -> KVManager:
    pool = BlockPool(num_blocks, BS, *layout)
    return KVManager(pool, NS, prefix_caching)


def kv_value(tokens, p: int) -> float:
    """The 'KV' of token p: a function of the whole prefix tokens[:p+1], exact in float32."""
    return float(hash(tuple(tokens[: p + 1])) % (1 << 20))


def expected(tokens, n: int, layout=(1, 1, 1)):
    L, H, D = layout
    vals = torch.tensor([kv_value(tokens, p) for p in range(n)], dtype=torch.float32)
    k = [vals[:, None, None].expand(n, H, D) + layer for layer in range(L)]
    v = [x + 0.5 for x in k]
    return k, v


def compute(kv: KVManager, seq: Sequence, n: int | None = None) -> bool:
    """What a step does for ``seq``: reserve ``n`` more tokens (all the rest by default), write
    their KV and count them computed. False (nothing changed) if blocks lack."""
    n = len(seq.token_ids) - seq.num_computed if n is None else n
    if not kv.reserve(seq.kv, n):
        return False
    start, end = seq.num_computed, seq.num_computed + n
    if kv.pool.num_layers:
        k, v = expected(seq.token_ids, end, (kv.pool.num_layers, kv.pool.num_kv_heads, kv.pool.head_dim))
        kv.pool.write(seq.block_table, start, [x[start:] for x in k], [x[start:] for x in v])
    seq.num_computed = end
    return True


def assert_holds_its_kv(kv: KVManager, tokens, blocks, n: int) -> None:
    if not kv.pool.num_layers or n == 0:
        return
    got = kv.pool.read(blocks, n)
    k, v = expected(tokens, n, (kv.pool.num_layers, kv.pool.num_kv_heads, kv.pool.head_dim))
    for i in range(kv.pool.num_layers):
        torch.testing.assert_close(got[i, 0], k[i], rtol=0, atol=0)
        torch.testing.assert_close(got[i, 1], v[i], rtol=0, atol=0)


def run_to_end(kv: KVManager, tokens, retain=False):
    """A request that computes all its tokens and finishes."""
    seq = make_seq(tokens, retain=retain)
    kv.attach(seq)
    assert compute(kv, seq)
    return seq, kv.release(seq, retain=retain)


def counts(kv: KVManager):
    """Everything a failed call must leave as it found it."""
    return (
        list(kv.pool.ref_counts),
        sorted(kv.pool._free),
        [(id(n), n.lock_ref, tuple(n.block_ids)) for n in kv.cache.nodes()],
        kv.cache.cached_blocks,
        kv.cache.evictable_blocks,
        set(kv._live),
        {k: c for k, (_, c) in kv._pins.items()},
    )


A = list(range(100, 112))  # 3 blocks
B = list(range(200, 210))  # 2 blocks + 2


# -- attach ---------------------------------------------------------------------------


def test_attach_of_a_cached_prefix_locks_and_references_it():
    kv = manager()
    run_to_end(kv, A)
    assert kv.cache.cached_blocks == 3
    seq = make_seq(A + [1, 2])
    kv.attach(seq)
    path = kv.cache.match(NS, A).block_ids
    assert seq.block_table == path and seq.num_computed == 12
    assert seq.lock_node is not None and seq.lock_node.lock_ref == 1
    assert all(kv.pool.ref_counts[b] == 2 for b in path)  # the tree's and the sequence's
    assert kv.cache.evictable_blocks == 0
    assert_holds_its_kv(kv, seq.token_ids, seq.block_table, 12)
    kv.check_integrity([seq], [])
    assert kv.cache.evict(100) == 0  # locked: nothing goes
    kv.release(seq)
    assert kv.cache.evictable_blocks == 3
    kv.check_integrity([], [])


def test_attach_leaves_at_least_one_token_to_compute():
    kv = manager()
    run_to_end(kv, A)
    seq = make_seq(A)  # everything cached: the last block is recomputed for the logits
    kv.attach(seq)
    assert seq.num_computed == 8 and len(seq.block_table) == 2
    assert kv.cached_len(A) == 8 and kv.cached_len(A + [0]) == 12
    kv.check_integrity([seq], [])
    assert compute(kv, seq)
    kv.release(seq)
    kv.check_integrity([], [])


def test_attach_of_a_miss_holds_nothing_but_a_root_lock():
    kv = manager()
    seq = make_seq(B)
    kv.attach(seq)
    assert seq.block_table == [] and seq.num_computed == 0 and seq.lock_node.is_root
    assert kv.pool.num_free == 16
    kv.check_integrity([seq], [])
    kv.release(seq)
    kv.check_integrity([], [])


def retained_b(kv: KVManager) -> RetainedKV:
    """B's 10 tokens computed and retained: 2 full blocks locked in the tree + a 2-token tail."""
    seq, kept = run_to_end(kv, B, retain=True)
    assert kept is not None
    return kept


def test_attach_takes_over_the_retained_tail_when_it_continues_the_prefix():
    kv = manager()
    kept = retained_b(kv)
    tail = kept.tail_block
    seq = make_seq(B + [7, 8, 9], prefix=kept)
    kv.check_integrity([seq], [seq.prefix])
    kv.attach(seq)
    assert seq.prefix is None
    assert seq.num_computed == 10 and seq.block_table[-1] == tail and len(seq.block_table) == 3
    assert kv.pool.ref_counts[tail] == 1  # moved, not copied: the sequence's reference now
    assert kept.node is None and kept.tail_block is None  # the handle is ended
    assert kv.stats()["retained"] == 0
    assert_holds_its_kv(kv, seq.token_ids, seq.block_table, 10)
    kv.check_integrity([seq], [])
    assert compute(kv, seq)
    assert_holds_its_kv(kv, seq.token_ids, seq.block_table, 13)
    kv.release(seq)
    kv.check_integrity([], [])


def test_attach_takes_over_a_tail_with_no_full_block():
    kv = manager()
    _, kept = run_to_end(kv, [5, 6, 7], retain=True)
    assert kept.node is None and kept.tail_len == 3 and kept.kv_len == 3
    tail = kept.tail_block
    nxt = make_seq([5, 6, 7, 8, 9], prefix=kept)
    kv.attach(nxt)
    assert nxt.num_computed == 3 and nxt.block_table == [tail]
    assert_holds_its_kv(kv, nxt.token_ids, nxt.block_table, 3)
    kv.check_integrity([nxt], [])
    kv.release(nxt)
    kv.check_integrity([], [])


@pytest.mark.parametrize(
    "tokens",
    [
        pytest.param(B[:6] + [0] * 7, id="diverges-inside-the-full-blocks"),
        pytest.param(B, id="nothing-left-to-compute"),
        pytest.param(B[:8], id="shorter-than-the-history"),
    ],
)
def test_attach_drops_a_retained_tail_that_does_not_continue_the_prefix(tokens):
    kv = manager()
    kept = retained_b(kv)
    free = kv.pool.num_free
    seq = make_seq(tokens, prefix=kept)
    kv.attach(seq)
    assert kept.tail_block is None and kept.node is None and seq.prefix is None
    assert kv.pool.num_free == free + 1  # the tail went back to the pool
    assert seq.num_computed == kv.cached_len(tokens) and seq.num_computed % BS == 0
    assert_holds_its_kv(kv, seq.token_ids, seq.block_table, seq.num_computed)
    kv.check_integrity([seq], [])
    kv.release(seq)
    kv.check_integrity([], [])


def test_attach_prefers_a_longer_cached_match_over_the_retained_tail():
    kv = manager()
    kept = retained_b(kv)
    run_to_end(kv, B + [1, 2, 3])  # another request cached B's third block in full
    seq = make_seq(B + [1, 2, 3, 4], prefix=kept)
    kv.attach(seq)
    assert seq.num_computed == 12 and kept.tail_block is None
    assert seq.block_table == kv.cache.match(NS, seq.token_ids, 12).block_ids
    assert_holds_its_kv(kv, seq.token_ids, seq.block_table, 12)
    kv.check_integrity([seq], [])
    kv.release(seq)
    kv.check_integrity([], [])


# -- reserve / release -----------------------------------------------------------------


def test_reserve_allocates_only_what_is_missing():
    kv = manager(num_blocks=4)
    seq = make_seq(list(range(13)))
    kv.attach(seq)
    assert kv.reserve(seq.kv, 3) and len(seq.block_table) == 1
    assert kv.reserve(seq.kv, 4) and len(seq.block_table) == 1  # still fits in the first block
    assert kv.reserve(seq.kv, 13) and len(seq.block_table) == 4
    assert not kv.reserve(seq.kv, 17) and len(seq.block_table) == 4  # no room: unchanged
    kv.check_integrity([seq], [])
    kv.release(seq)
    assert kv.pool.num_free == 4


def test_release_puts_computed_full_blocks_into_the_tree():
    kv = manager()
    seq = make_seq(B + [1, 2, 3, 4, 5])
    kv.attach(seq)
    assert kv.reserve(seq.kv, 15) and len(seq.block_table) == 4
    table = list(seq.block_table)
    assert compute(kv, seq, 10)  # 2 full blocks + 2 tokens computed; the 4th block reserved, unused
    kv.release(seq)
    assert seq.block_table == [] and seq.num_computed == 0 and seq.lock_node is None
    m = kv.cache.match(NS, seq.token_ids)
    assert m.num_tokens == 8 and m.block_ids == table[:2]
    assert kv.cache.cached_blocks == 2 and kv.pool.num_free == 16 - 2
    assert_holds_its_kv(kv, seq.token_ids, m.block_ids, 8)
    kv.check_integrity([], [])


def test_release_of_duplicate_blocks_keeps_the_trees():
    kv = manager()
    seq = make_seq(A + [9])  # admitted before the first request below finished: a miss
    kv.attach(seq)
    run_to_end(kv, A)
    tree_blocks = kv.cache.match(NS, A).block_ids
    assert compute(kv, seq)  # the same tokens, in blocks of its own
    own = list(seq.block_table)
    kv.release(seq)
    assert kv.cache.match(NS, A).block_ids == tree_blocks
    assert all(kv.pool.ref_counts[b] == 0 for b in own[:3])  # its duplicates went back to the pool
    assert kv.pool.num_free == 16 - 3
    kv.check_integrity([], [])


def test_release_retain_returns_the_locked_node_and_its_own_tail():
    kv = manager()
    seq = make_seq(B, retain=True)
    kv.attach(seq)
    assert compute(kv, seq)
    table = list(seq.block_table)
    kept = kv.release(seq, retain=True)
    assert (kept.kv_len, kept.tail_len, kept.tail_block) == (10, 2, table[2])
    assert kept.node is not None and kept.node.lock_ref == 1
    assert kv._path_blocks(kept.node) == table[:2]
    assert kv.pool.ref_counts[table[2]] == 1 and table[2] not in {b for n in kv.cache.nodes() for b in n.block_ids}
    assert kv.cache.evictable_blocks == 0 and kv.cache.evict(100) == 0
    assert kv.stats()["retained"] == 1
    assert seq.block_table == [] and seq.lock_node is None
    kv.check_integrity([], [kept])
    with pytest.raises(AssertionError, match="held by no live"):
        kv.check_integrity([], [])
    kv.drop(kept)
    kv.check_integrity([], [])
    assert kv.pool.ref_counts[table[2]] == 0 and kv.cache.evictable_blocks == 2
    assert kv.cache.evict(100) == 2 and kv.pool.num_free == 16


def test_release_retain_of_whole_blocks_has_no_tail():
    kv = manager()
    _, kept = run_to_end(kv, A, retain=True)
    assert kept.tail_block is None and kept.tail_len == 0 and kept.kv_len == 12
    assert kv.pool.num_free == 16 - 3
    kv.check_integrity([], [kept])
    kv.drop(kept)
    kv.drop(kept)  # ending twice is harmless
    kv.drop(None)
    kv.check_integrity([], [])


def test_release_retain_of_nothing_computed_is_none():
    kv = manager()
    seq = make_seq(A, retain=True)
    kv.attach(seq)  # nothing cached, nothing computed
    assert kv.release(seq, retain=True) is None
    kv.check_integrity([], [])


def test_release_drops_a_prefix_that_was_never_attached():
    kv = manager()
    kept = retained_b(kv)
    seq = make_seq(B + [1], prefix=kept)  # e.g. aborted while waiting
    kv.release(seq)
    assert seq.prefix is None and kept.tail_block is None and kv.stats()["retained"] == 0
    kv.check_integrity([], [])


# -- pins -----------------------------------------------------------------------------


def test_pin_is_counted_and_survives_evict_all():
    kv = manager()
    run_to_end(kv, A)
    run_to_end(kv, B)
    k1 = kv.pin(A[:9])  # the block-aligned part: 2 blocks
    k2 = kv.pin(A[:8])
    assert k1 == k2 == tuple(A[:8]) and kv.stats()["pins"] == 1
    kv.check_integrity([], [])
    kv.cache.evict(10**6)  # all that is evictable: B and A's third block
    assert kv.cache.match(NS, A).num_tokens == 8 and kv.cache.match(NS, B).num_tokens == 0
    kv.check_integrity([], [])
    kv.unpin(k1)
    kv.cache.evict(10**6)
    assert kv.cache.match(NS, A).num_tokens == 8  # one pin left
    kv.check_integrity([], [])
    kv.unpin(k2)
    assert kv.stats()["pins"] == 0
    kv.cache.evict(10**6)
    assert kv.cache.match(NS, A).num_tokens == 0 and kv.pool.num_free == 16
    kv.check_integrity([], [])
    with pytest.raises(KeyError):
        kv.unpin(k1)  # more unpins than pins is a bug of the caller


def test_pin_of_what_is_not_cached_in_full_is_none():
    kv = manager()
    run_to_end(kv, A[:5])  # one block cached
    assert kv.pin(A) is None
    assert kv.pin(A[:3]) is None  # less than a block
    assert kv.pin(A[:4]) == tuple(A[:4])
    kv.unpin(None)
    kv.unpin(tuple(A[:4]))
    kv.check_integrity([], [])


# -- export / import --------------------------------------------------------------------

LAYOUT = (2, 2, 3)


def real_manager(num_blocks=16, prefix_caching=True) -> KVManager:
    return manager(num_blocks, LAYOUT, prefix_caching)


@pytest.mark.parametrize("n", [3, 8, 10, 12])
def test_export_then_import_round_trips_the_kv(n):
    kv = real_manager()
    tokens = (A + B)[:n]
    _, kept = run_to_end(kv, tokens, retain=True)
    k, v = kv.export_kv(kept)
    want_k, want_v = expected(tokens, n, LAYOUT)
    assert len(k) == len(v) == LAYOUT[0] and k[0].shape == (n, 2, 3)
    for i in range(LAYOUT[0]):
        torch.testing.assert_close(k[i], want_k[i], rtol=0, atol=0)
        torch.testing.assert_close(v[i], want_v[i], rtol=0, atol=0)
    # into an empty pool of another manager (a restart)
    other = real_manager()
    got = other.import_kv(tokens + [1, 2], n, k, v)
    assert (got.kv_len, got.tail_len) == (n, n % BS)
    k2, v2 = other.export_kv(got)
    for i in range(LAYOUT[0]):
        torch.testing.assert_close(k2[i], want_k[i], rtol=0, atol=0)
        torch.testing.assert_close(v2[i], want_v[i], rtol=0, atol=0)
    other.check_integrity([], [got])
    # the imported handle is attached like a retained one
    seq = make_seq(tokens + [1, 2], prefix=got)
    other.attach(seq)
    assert seq.num_computed == n
    assert_holds_its_kv(other, seq.token_ids, seq.block_table, n)
    other.check_integrity([seq], [])
    other.release(seq)
    other.check_integrity([], [])
    # the export is a copy: the pool can change under it
    kv.drop(kept)
    kv.clear()
    kv.pool.kv.zero_()
    torch.testing.assert_close(k[0], want_k[0], rtol=0, atol=0)


def test_import_reuses_blocks_already_in_the_tree():
    kv = real_manager()
    tokens = A + B  # 22 tokens
    run_to_end(kv, tokens[:8])  # the first 2 blocks are cached
    tree = kv.cache.match(NS, tokens).block_ids
    assert len(tree) == 2
    free = kv.pool.num_free
    want_k, want_v = expected(tokens, 14, LAYOUT)
    # import different values for the whole range: the cached part must not be overwritten
    k = [x + 1000 for x in want_k]
    v = [x + 1000 for x in want_v]
    kept = kv.import_kv(tokens, 14, k, v)
    assert kv.pool.num_free == free - 2  # ceil(14/4) - 2 cached = 2 new blocks
    assert kv._path_blocks(kept.node)[:2] == tree
    got_k, _ = kv.export_kv(kept)
    for i in range(LAYOUT[0]):
        torch.testing.assert_close(got_k[i][:8], want_k[i][:8], rtol=0, atol=0)  # the tree's own
        torch.testing.assert_close(got_k[i][8:], k[i][8:14], rtol=0, atol=0)  # the imported rest
    kv.check_integrity([], [kept])
    kv.drop(kept)
    kv.check_integrity([], [])


@pytest.mark.parametrize("n", [8, 6])
def test_import_of_what_the_tree_already_holds_allocates_nothing_new_for_it(n):
    kv = real_manager()
    run_to_end(kv, A)
    free = kv.pool.num_free
    k, v = expected(A, n, LAYOUT)
    kept = kv.import_kv(A, n, k, v)
    assert kv.pool.num_free == free - (n % BS > 0)  # only a partial tail needs a block of its own
    assert kept.kv_len == n and kept.tail_len == n % BS
    kv.check_integrity([], [kept])
    got_k, got_v = kv.export_kv(kept)
    for i in range(LAYOUT[0]):
        torch.testing.assert_close(got_k[i], k[i], rtol=0, atol=0)
    kv.drop(kept)
    kv.check_integrity([], [])


def test_import_with_no_room_raises_out_of_blocks_and_changes_nothing():
    kv = real_manager(num_blocks=6)
    tokens = A + B
    run_to_end(kv, tokens[:4])  # one cached block: matched, locked and unlocked by the import
    hog = make_seq(list(range(500, 520)))
    kv.attach(hog)
    assert kv.reserve(hog.kv, 20)  # the other 5 blocks
    calls = []
    kv.on_pressure = calls.append  # relieves nothing
    before = counts(kv)
    k, v = expected(tokens, 14, LAYOUT)
    with pytest.raises(OutOfBlocks):
        kv.import_kv(tokens, 14, k, v)
    assert calls == [3]
    assert counts(kv) == before
    kv.check_integrity([hog], [])
    kv.release(hog)
    kv.check_integrity([], [])


def test_import_when_on_pressure_raises_changes_nothing():
    kv = real_manager(num_blocks=4)
    tokens = A + B
    run_to_end(kv, tokens[:4])
    hog = make_seq(list(range(500, 512)))
    kv.attach(hog)
    assert kv.reserve(hog.kv, 12)

    def boom(missing):
        raise OSError(28, "No space left on device")

    kv.on_pressure = boom
    before = counts(kv)
    k, v = expected(tokens, 10, LAYOUT)
    with pytest.raises(OSError):
        kv.import_kv(tokens, 10, k, v)
    assert counts(kv) == before
    kv.check_integrity([hog], [])


def test_import_needs_prefix_caching():
    kv = real_manager(prefix_caching=False)
    k, v = expected(A, 8, LAYOUT)
    with pytest.raises(AssertionError):
        kv.import_kv(A, 8, k, v)


# -- make_room --------------------------------------------------------------------------


def test_make_room_asks_on_pressure_only_after_eviction_falls_short():
    kv = manager(num_blocks=8)
    run_to_end(kv, A)  # 3 evictable blocks
    kept = retained_b(kv)  # 3 blocks held by a conversation
    hog = make_seq(list(range(500, 504)))
    kv.attach(hog)
    assert kv.reserve(hog.kv, 4)  # 1 block; 1 left free
    assert kv.pool.num_free == 1
    seen = []

    def on_pressure(missing):
        seen.append((missing, kv.pool.num_free, kv.cache.evictable_blocks))
        kv.drop(kept)  # the session layer spills the idle conversation: its blocks become evictable

    kv.on_pressure = on_pressure
    assert kv.make_room(1) and kv.make_room(0) and seen == []  # already free
    assert kv.make_room(3) and seen == []  # eviction alone suffices
    assert kv.pool.num_free >= 3
    kv.check_integrity([hog], [kept])
    assert kv.make_room(7)
    assert seen == [(3, 4, 0)]  # called once, after every evictable block went, with what was missing
    assert kv.pool.num_free == 7
    kv.check_integrity([hog], [])
    seen.clear()
    assert not kv.make_room(8)  # the hog's block: nobody can free it
    assert seen == [(1, 7, 0)]
    kv.check_integrity([hog], [])


def test_reserve_raises_what_on_pressure_raises_with_the_sequence_unchanged():
    kv = manager(num_blocks=2)
    seq = make_seq(list(range(12)))
    kv.attach(seq)
    assert kv.reserve(seq.kv, 8)

    def boom(missing):
        raise RuntimeError("spill failed")

    kv.on_pressure = boom
    with pytest.raises(RuntimeError):
        kv.reserve(seq.kv, 12)
    assert len(seq.block_table) == 2
    kv.check_integrity([seq], [])


# -- prefix caching off -------------------------------------------------------------------


def test_no_prefix_cache_never_caches_and_returns_every_block():
    kv = manager(num_blocks=8, prefix_caching=False)
    for _ in range(50):
        seq = make_seq(A + [1], retain=True)
        kv.attach(seq)
        assert seq.num_computed == 0 and seq.block_table == []  # never a hit, however often seen
        assert compute(kv, seq)
        kv.check_integrity([seq], [])
        assert kv.release(seq, retain=True) is None
        assert kv.pool.num_free == 8
        kv.check_integrity([], [])
    assert kv.cached_len(A + [1]) == 0
    assert kv.cache.nodes() == [] and kv.cache.cached_blocks == 0
    assert kv.pin(A) is None
    assert kv.stats() == {
        "blocks_total": 8,
        "blocks_free": 8,
        "blocks_cached": 0,
        "blocks_evictable": 0,
        "tree_nodes": 0,
        "pins": 0,
        "retained": 0,
    }


def test_no_prefix_cache_preempted_sequence_returns_its_blocks():
    kv = manager(num_blocks=4, prefix_caching=False)
    seq = make_seq(list(range(14)))
    kv.attach(seq)
    assert compute(kv, seq, 9)
    assert kv.pool.num_free == 1
    kv.release(seq)
    assert kv.pool.num_free == 4
    kv.attach(seq)
    assert seq.num_computed == 0  # recomputed from scratch
    kv.release(seq)
    kv.check_integrity([], [])


# -- check_integrity finds every kind of leak ----------------------------------------------


def leaky_setup():
    kv = manager()
    run_to_end(kv, A)
    kept = retained_b(kv)
    seq = make_seq(A + [1, 2])
    kv.attach(seq)
    assert compute(kv, seq)
    kv.check_integrity([seq], [kept])
    return kv, seq, kept


def test_integrity_catches_a_lock_with_no_owner():
    kv, seq, kept = leaky_setup()
    kv.cache.lock(kv.cache.match(NS, A).node)
    with pytest.raises(AssertionError, match="locks"):
        kv.check_integrity([seq], [kept])


def test_integrity_catches_a_lock_owner_forgotten():
    kv, seq, kept = leaky_setup()
    seq.kv.lock_node = None  # its block table forgot its lock without unlocking
    with pytest.raises(AssertionError, match="locks"):
        kv.check_integrity([seq], [kept])


def test_integrity_catches_a_pin_leaked_lock():
    kv, seq, kept = leaky_setup()
    key = kv.pin(A)
    kv.check_integrity([seq], [kept])
    del kv._pins[key]  # the pin forgotten, its lock kept
    with pytest.raises(AssertionError, match="locks"):
        kv.check_integrity([seq], [kept])


def test_integrity_catches_a_leaked_lock_on_a_namespace_root():
    kv = manager()
    seq = make_seq(list(range(300, 306)))
    kv.attach(seq)  # a miss: its lock is on the namespace root
    assert seq.lock_node.is_root
    seq.kv.lock_node = None  # dropped without release: the root keeps a lock nobody owns
    with pytest.raises(AssertionError):
        kv.check_integrity([seq], [])


def test_integrity_catches_a_reference_with_no_owner():
    kv, seq, kept = leaky_setup()
    kv.pool.incref(seq.block_table[:1])
    with pytest.raises(AssertionError, match="references"):
        kv.check_integrity([seq], [kept])


def test_integrity_catches_an_allocated_block_with_no_owner():
    kv, seq, kept = leaky_setup()
    kv.pool.allocate(1)
    with pytest.raises(AssertionError, match="references"):
        kv.check_integrity([seq], [kept])


def test_integrity_catches_a_handle_not_passed():
    kv, seq, kept = leaky_setup()
    with pytest.raises(AssertionError, match="held by no live"):
        kv.check_integrity([seq], [])


def test_integrity_catches_a_handle_whose_tail_was_forgotten():
    kv, seq, kept = leaky_setup()
    kept.tail_block = None  # its reference stays in the pool
    with pytest.raises(AssertionError, match="references"):
        kv.check_integrity([seq], [kept])


def test_integrity_catches_an_ended_handle_still_held():
    kv, seq, kept = leaky_setup()
    kv.drop(kept)
    with pytest.raises(AssertionError, match="ended"):
        kv.check_integrity([seq], [kept])


def test_integrity_catches_one_handle_held_twice():
    kv, seq, kept = leaky_setup()
    with pytest.raises(AssertionError, match="twice"):
        kv.check_integrity([seq], [kept, kept])


def test_integrity_catches_a_block_table_cleared_without_release():
    kv, seq, kept = leaky_setup()
    seq.kv.blocks = []  # its block table emptied by hand
    with pytest.raises(AssertionError):
        kv.check_integrity([seq], [kept])


def test_integrity_catches_a_sequence_dropped_without_release():
    kv, seq, kept = leaky_setup()
    with pytest.raises(AssertionError):
        kv.check_integrity([], [kept])


def test_integrity_catches_a_reference_counted_twice():
    kv, seq, kept = leaky_setup()
    other = make_seq([1])
    other.kv.blocks = [seq.block_table[-1]]  # claims a block it holds no reference on
    with pytest.raises(AssertionError, match="references"):
        kv.check_integrity([seq, other], [kept])


# -- a state machine over the whole API ---------------------------------------------------

# token sequences drawn from a few shared stems, so prefixes are shared at and off block boundaries
STEMS = [list(range(10, 30)), list(range(10, 17)) + list(range(40, 53)), list(range(60, 66))]
tokens_st = st.builds(
    lambda stem, cut, tail: STEMS[stem][:cut] + tail,
    st.integers(0, len(STEMS) - 1),
    st.integers(0, 20),
    st.lists(st.integers(0, 7), max_size=6),
).filter(lambda t: len(t) >= 1)


class KVMachine(RuleBasedStateMachine):
    """Live owners: sequences (attached, maybe computed), retained handles (with the tokens they
    hold), pins. After every step the pool and tree must be owned exactly by them, and every
    sequence and handle must hold the KV of its own tokens."""

    handles = Bundle("handles")

    def __init__(self):
        super().__init__()
        self.kv = KVManager(BlockPool(10, BS, 1, 1, 1), NS)
        self.seqs: list[Sequence] = []
        self.live: dict[int, tuple[RetainedKV, list[int]]] = {}  # id -> (handle, its tokens)
        self.pins: list[tuple[int, ...]] = []
        self.pressure_calls = 0
        self.kv.on_pressure = self._on_pressure

    def _on_pressure(self, missing):
        self.pressure_calls += 1

    def _attach(self, seq: Sequence) -> None:
        self.kv.attach(seq)
        assert seq.num_computed < len(seq.token_ids)
        assert len(seq.block_table) * BS >= seq.num_computed
        assert_holds_its_kv(self.kv, seq.token_ids, seq.block_table, seq.num_computed)
        self.seqs.append(seq)

    @rule(tokens=tokens_st)
    def new_request(self, tokens):
        self._attach(make_seq(tokens))

    @rule(h=consumes(handles), more=st.lists(st.integers(0, 7), min_size=1, max_size=5))
    def next_turn(self, h, more):
        """A conversation's next turn: its history plus new tokens, handed the retained KV."""
        if h is None:
            return
        kept, tokens = self.live.pop(id(h))
        self._attach(make_seq(tokens + more, prefix=kept))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), n=st.integers(1, 12))
    def step(self, i, n):
        self._step(i, n)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), n=st.integers(1, 12))
    def step_again(self, i, n):  # computing is what an engine does most: a second rule for it
        self._step(i, n)

    def _step(self, i, n):
        seq = self.seqs[i % len(self.seqs)]
        left = len(seq.token_ids) - seq.num_computed
        if left == 0:  # a decode: sample a token first
            seq.token_ids.append(n % 8)
            left = 1
        table, computed = list(seq.block_table), seq.num_computed
        if not compute(self.kv, seq, min(n, left)):  # no room: nothing of the sequence changed
            assert (seq.block_table, seq.num_computed) == (table, computed)
        assert_holds_its_kv(self.kv, seq.token_ids, seq.block_table, seq.num_computed)

    @precondition(lambda self: self.seqs)
    @rule(target=handles, i=st.integers(0, 100), retain=st.booleans())
    def finish(self, i, retain):
        seq = self.seqs.pop(i % len(self.seqs))
        computed = seq.token_ids[: seq.num_computed]
        kept = self.kv.release(seq, retain=retain)
        assert seq.block_table == [] and seq.lock_node is None and seq.num_computed == 0
        if kept is None:
            assert not retain or not computed
            return None
        assert kept.kv_len == len(computed)
        self.live[id(kept)] = (kept, computed)
        return kept

    @rule(h=consumes(handles))
    def drop(self, h):
        if h is not None:
            self.live.pop(id(h))
        self.kv.drop(h)

    @rule(h=handles)
    def export(self, h):
        if h is None:
            return
        kept, tokens = self.live[id(h)]
        k, v = self.kv.export_kv(kept)
        want_k, want_v = expected(tokens, len(tokens))
        torch.testing.assert_close(k[0], want_k[0], rtol=0, atol=0)
        torch.testing.assert_close(v[0], want_v[0], rtol=0, atol=0)

    @rule(target=handles, tokens=tokens_st, n=st.integers(1, 20))
    def restore(self, tokens, n):
        """A snapshot read back from disk: the KV of tokens[:n] imported."""
        n = min(n, len(tokens))
        k, v = expected(tokens, n)
        refs, free, live = list(self.kv.pool.ref_counts), set(self.kv.pool._free), set(self.kv._live)
        try:
            kept = self.kv.import_kv(tokens, n, k, v)
        except OutOfBlocks:
            # nothing allocated, nothing locked, no handle issued; make_room may have evicted
            # unlocked cached blocks on the way (the tree's own references, nobody else's)
            assert set(self.kv.pool._free) >= free and set(self.kv._live) == live
            tree = {b for node in self.kv.cache.nodes() for b in node.block_ids}
            for b, (was, now) in enumerate(zip(refs, self.kv.pool.ref_counts)):
                assert now == was or (now == was - 1 and b not in tree), (b, was, now)
            return None
        self.live[id(kept)] = (kept, list(tokens[:n]))
        return kept

    @rule(tokens=tokens_st)
    def pin(self, tokens):
        key = self.kv.pin(tokens)
        if key is not None:
            self.pins.append(key)

    @precondition(lambda self: self.pins)
    @rule(i=st.integers(0, 100))
    def unpin(self, i):
        self.kv.unpin(self.pins.pop(i % len(self.pins)))

    @rule(n=st.integers(0, 12))
    def evict(self, n):
        self.kv.cache.evict(n)

    @rule()
    def evict_all(self):
        self.kv.cache.evict(10**6)
        for key in set(self.pins):  # pinned prefixes survive
            assert self.kv.cache.match(NS, list(key)).num_tokens == len(key)

    @invariant()
    def owned_exactly(self):
        handles = [kept for kept, _ in self.live.values()]
        self.kv.check_integrity(self.seqs, handles)

    def teardown(self):
        for seq in self.seqs:
            self.kv.release(seq)
        for kept, _ in list(self.live.values()):
            self.kv.drop(kept)
        for key in self.pins:
            self.kv.unpin(key)
        self.kv.check_integrity([], [])
        self.kv.clear()
        assert self.kv.pool.num_free == self.kv.pool.num_blocks


KVMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestKVMachine = KVMachine.TestCase
