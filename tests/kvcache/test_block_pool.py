"""BlockPool: id accounting (allocate/incref/decref, the free list), its integrity check,
and moving KV in and out with ``read``/``write`` independently of the tensor layout."""

from __future__ import annotations

import random

import pytest
import torch

from chatkv.errors import OutOfBlocks
from chatkv.kvcache.block_pool import BlockPool

L, H, D = 2, 2, 3  # a small real layout: layers, kv heads, head dim


def state(pool: BlockPool):
    return list(pool.ref_counts), list(pool._free), pool.num_free


# -- accounting -------------------------------------------------------------------


def test_fresh_pool_is_all_free():
    pool = BlockPool(6, 4)
    assert pool.num_free == 6 and pool.num_blocks == 6 and pool.block_size == 4
    assert pool.ref_counts == [0] * 6
    pool.check_integrity()


def test_allocate_gives_distinct_blocks_with_one_reference():
    pool = BlockPool(6, 4)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert len(a) == 2 and len(b) == 3 and not set(a) & set(b)
    assert all(pool.ref_counts[x] == 1 for x in a + b)
    assert pool.num_free == 1
    pool.check_integrity()
    assert pool.allocate(0) == [] and pool.num_free == 1


def test_incref_decref_and_the_free_list():
    pool = BlockPool(4, 2)
    a = pool.allocate(2)
    pool.incref(a)
    pool.incref(a[:1])
    assert [pool.ref_counts[x] for x in a] == [3, 2]
    assert pool.decref(a) == 0  # 2, 1: none freed
    assert pool.decref(a) == 1  # 1, 0: the second is free again
    assert pool.num_free == 3 and pool.ref_counts[a[1]] == 0
    pool.check_integrity()
    assert pool.decref(a[:1]) == 1
    assert pool.num_free == 4
    pool.check_integrity()
    # freed blocks are reusable
    again = pool.allocate(4)
    assert sorted(again) == [0, 1, 2, 3]
    pool.check_integrity()


def test_incref_or_decref_of_a_free_block_is_refused():
    pool = BlockPool(3, 2)
    with pytest.raises(AssertionError):
        pool.incref([1])
    with pytest.raises(AssertionError):
        pool.decref([1])
    pool.check_integrity()


def test_out_of_blocks_changes_nothing():
    pool = BlockPool(5, 4)
    held = pool.allocate(3)
    pool.incref(held[:1])
    before = state(pool)
    with pytest.raises(OutOfBlocks) as e:
        pool.allocate(3)
    assert "3" in str(e.value) and "2 free" in str(e.value)
    assert isinstance(e.value, MemoryError)
    assert state(pool) == before
    pool.check_integrity()
    assert len(pool.allocate(2)) == 2  # what is free is still usable
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)


# -- check_integrity catches corruption ----------------------------------------------


def test_integrity_catches_a_block_on_the_free_list_twice():
    pool = BlockPool(4, 2)
    pool._free.append(pool._free[0])
    with pytest.raises(AssertionError, match="twice"):
        pool.check_integrity()


def test_integrity_catches_a_block_both_free_and_referenced():
    pool = BlockPool(4, 2)
    a = pool.allocate(1)
    pool._free.append(a[0])  # a double free that bypassed decref
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_catches_a_lost_block():
    pool = BlockPool(4, 2)
    a = pool.allocate(1)
    pool.ref_counts[a[0]] = 0  # dropped without going back to the free list
    with pytest.raises(AssertionError, match="!= total"):
        pool.check_integrity()


def test_integrity_catches_a_negative_count():
    pool = BlockPool(4, 2)
    pool.ref_counts[pool._free.pop()] = -1
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_catches_a_referenced_block_left_on_the_free_list():
    pool = BlockPool(4, 2)
    pool.ref_counts[pool._free[0]] = 1  # counted, but still handed out by allocate
    with pytest.raises(AssertionError, match="both free and referenced"):
        pool.check_integrity()


# -- layout ------------------------------------------------------------------------


def test_layout_properties():
    pool = BlockPool(8, 4, num_layers=L, num_kv_heads=H, head_dim=D, dtype=torch.bfloat16)
    assert (pool.num_layers, pool.num_kv_heads, pool.head_dim) == (L, H, D)
    assert pool.kv.dtype == torch.bfloat16
    ids_only = BlockPool(8, 4)
    assert (ids_only.num_layers, ids_only.num_kv_heads, ids_only.head_dim) == (0, 0, 0)
    assert ids_only.kv.numel() == 0


def rand_kv(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(n, H, D, generator=g) for _ in range(L)]
    v = [torch.randn(n, H, D, generator=g) for _ in range(L)]
    return k, v


def as_layers(kv: torch.Tensor):
    """[layers, 2, tokens, heads, dim] -> per-layer k and v lists."""
    return [kv[i, 0] for i in range(kv.shape[0])], [kv[i, 1] for i in range(kv.shape[0])]


def assert_kv_equal(got: torch.Tensor, k, v):
    gk, gv = as_layers(got)
    for i in range(len(k)):
        torch.testing.assert_close(gk[i], k[i].to(got.dtype), rtol=0, atol=0)
        torch.testing.assert_close(gv[i], v[i].to(got.dtype), rtol=0, atol=0)


@pytest.mark.parametrize("n", [1, 3, 4, 5, 11, 12])
def test_write_read_round_trip_across_block_boundaries(n):
    pool = BlockPool(8, 4, num_layers=L, num_kv_heads=H, head_dim=D)
    blocks = pool.allocate(-(-n // 4))
    k, v = rand_kv(n, n)
    pool.write(blocks, 0, k, v)
    got = pool.read(blocks, n)
    assert got.shape == (L, 2, n, H, D)
    assert_kv_equal(got, k, v)


def test_write_from_mid_block_into_shuffled_blocks():
    bs = 4
    pool = BlockPool(8, bs, num_layers=L, num_kv_heads=H, head_dim=D)
    rng = random.Random(3)
    blocks = pool.allocate(8)
    rng.shuffle(blocks)
    blocks = blocks[:5]  # non-contiguous, out of order
    assert blocks != sorted(blocks)
    first_k, first_v = rand_kv(3, 1)
    pool.write(blocks, 0, first_k, first_v)  # tokens 0..2
    rest_k, rest_v = rand_kv(14, 2)
    pool.write(blocks, 3, rest_k, rest_v)  # tokens 3..16: starts mid block 0, crosses four boundaries
    got = pool.read(blocks, 17)
    assert_kv_equal(
        got, [torch.cat([a, b]) for a, b in zip(first_k, rest_k)], [torch.cat([a, b]) for a, b in zip(first_v, rest_v)]
    )
    # each token sits at block * bs + offset of the raw tensor: the layout read() promises to hide
    for t in range(17):
        b, off = blocks[t // bs], t % bs
        for layer in range(L):
            want_k = first_k[layer][t] if t < 3 else rest_k[layer][t - 3]
            torch.testing.assert_close(pool.kv[layer, 0, b, off], want_k, rtol=0, atol=0)
    # a read of a middle range via a sub-list of blocks
    mid = pool.read(blocks[1:3], 8)
    assert_kv_equal(mid, [x[4:12] for x in as_layers(got)[0]], [x[4:12] for x in as_layers(got)[1]])


def test_write_touches_nothing_outside_its_slots():
    pool = BlockPool(6, 4, num_layers=L, num_kv_heads=H, head_dim=D)
    pool.kv.fill_(7.0)
    blocks = [4, 1]
    k, v = rand_kv(3, 9)
    pool.write(blocks, 2, k, v)  # slots 4*4+2, 4*4+3, 1*4+0
    written = {(4, 2), (4, 3), (1, 0)}
    for b in range(6):
        for off in range(4):
            if (b, off) not in written:
                assert torch.all(pool.kv[:, :, b, off] == 7.0), (b, off)


def test_write_converts_dtype():
    pool = BlockPool(4, 4, num_layers=L, num_kv_heads=H, head_dim=D, dtype=torch.bfloat16)
    blocks = pool.allocate(2)
    k, v = rand_kv(6, 5)  # float32 in
    pool.write(blocks, 1, k, v)
    got = pool.read(blocks, 7)[:, :, 1:]
    assert got.dtype == torch.bfloat16
    assert_kv_equal(got, k, v)  # equal to the inputs rounded to bfloat16
    f64 = BlockPool(2, 4, num_layers=L, num_kv_heads=H, head_dim=D, dtype=torch.float64)
    f64.write([1], 0, [x[:2].half() for x in k], [x[:2].half() for x in v])
    got = f64.read([1], 2)
    assert got.dtype == torch.float64
    assert_kv_equal(got, [x[:2].half() for x in k], [x[:2].half() for x in v])


def test_read_is_a_copy():
    pool = BlockPool(4, 2, num_layers=L, num_kv_heads=H, head_dim=D)
    blocks = pool.allocate(2)
    k, v = rand_kv(4, 4)
    pool.write(blocks, 0, k, v)
    got = pool.read(blocks, 4)
    got.zero_()
    assert_kv_equal(pool.read(blocks, 4), k, v)


def test_empty_write_and_read():
    """Nothing to write (e.g. restoring KV the tree already holds in whole blocks) is a no-op."""
    pool = BlockPool(4, 2, num_layers=L, num_kv_heads=H, head_dim=D)
    pool.write([], 0, [torch.zeros(0, H, D)] * L, [torch.zeros(0, H, D)] * L)
    assert torch.all(pool.kv == 0)
    assert pool.read([], 0).shape == (L, 2, 0, H, D)


def test_write_or_read_past_the_blocks_is_refused():
    pool = BlockPool(4, 2, num_layers=L, num_kv_heads=H, head_dim=D)
    k, v = rand_kv(3, 0)
    with pytest.raises(AssertionError):
        pool.write([0], 0, k, v)
    with pytest.raises(AssertionError):
        pool.write([0, 1], 2, k, v)
    with pytest.raises(AssertionError):
        pool.read([0], 3)
    with pytest.raises(AssertionError):
        pool.write([0, 1], 0, k[:1], v[:1])  # one tensor per layer


def test_ids_only_pool_accepts_layerless_writes():
    pool = BlockPool(4, 2)
    pool.write([0, 1], 1, [], [])
    assert pool.read([0, 1], 3).shape == (0, 2, 3, 0, 0)
