"""The host-memory tier between the device KV pool and disk, and per-sequence radix namespaces.

Real parts throughout: a HostPool (on CPU: a second tensor, the same code as CUDA's minus
the stream), the radix tree, the KV manager, and engines on a seeded tiny Llama whose
logits and greedy tokens are checked against transformers' own forward.

- HostPool: sizing from bytes, exact save/load round trips, integrity;
- the KV manager: eviction moves blocks device -> host instead of away, a hit copies them
  back (exact values), offload, partial loads when the device is short, namespaces;
- engines: a host-tier hit gives logits identical to the device hit (torch.equal) and to
  transformers within tolerance; under memory pressure sessions go device -> host -> disk;
  host_cache_bytes=0 has no tier;
- a seeded random stress of the KV manager with tiny pools, integrity after every step.
"""

from __future__ import annotations

import random

import pytest
import torch

from chatkv import InvalidRequest
from chatkv.config import EngineConfig
from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams
from chatkv.errors import OutOfBlocks
from chatkv.kvcache.block_pool import BlockPool
from chatkv.kvcache.host_pool import HostPool
from chatkv.kvcache.manager import KVManager
from chatkv.outputs import Usage
from tests.kvcache.test_kv_manager import assert_holds_its_kv, compute, expected, make_seq
from tests.support.tiny import VOCAB, make_model

BS = 4
NS = ("model", "float32", None)
LAYOUT = (2, 2, 3)  # layers, kv heads, head dim
A = list(range(100, 112))  # 3 blocks
B = list(range(200, 210))  # 2 blocks + 2


def tiered(num_blocks=8, host_blocks=8, layout=LAYOUT) -> KVManager:
    pool = BlockPool(num_blocks, BS, *layout)
    host = HostPool(host_blocks, BS, *layout, dtype=pool.kv.dtype)
    return KVManager(pool, NS, host=host)


def run_to_end(kv: KVManager, tokens, retain=False, namespace=None):
    seq = make_seq(tokens, retain=retain)
    seq.namespace = namespace
    kv.attach(seq)
    assert compute(kv, seq)
    return seq, kv.release(seq, retain=retain)


def admit(kv: KVManager, tokens, prefix=None, namespace=None):
    seq = make_seq(tokens, prefix=prefix)
    seq.namespace = namespace
    kv.attach(seq)
    seq.num_cached = seq.num_computed  # what the scheduler records at the first admission
    return seq


# -- HostPool ---------------------------------------------------------------------------


def test_host_pool_sizing_round_trip_and_integrity():
    pool = BlockPool(6, BS, *LAYOUT)
    per_block = 2 * LAYOUT[0] * BS * LAYOUT[1] * LAYOUT[2] * 4  # k and v, fp32
    host = HostPool.for_pool(pool, 5 * per_block + per_block // 2)
    assert host.num_blocks == 5 and host.kv.shape == (2, 2, 5, BS, 2, 3) and host.kv.dtype == pool.kv.dtype
    assert HostPool.for_pool(pool, per_block - 1) is None  # not one block: the tier is off
    assert HostPool.for_pool(BlockPool(4, BS), 1 << 20) is None  # an id-only pool has nothing to copy
    pool.kv.copy_(torch.randn_like(pool.kv))
    want = pool.kv[:, :, [4, 1, 2]].clone()
    ids = host.allocate(3)
    host.save(pool, [4, 1, 2], ids)
    pool.kv.zero_()
    host.load(pool, ids, [0, 3, 5])
    assert torch.equal(pool.kv[:, :, [0, 3, 5]], want)
    assert host.num_used == 3 and host.num_free == 2
    host.check_integrity()
    with pytest.raises(OutOfBlocks):
        host.allocate(3)
    host.free(ids)
    with pytest.raises(AssertionError):
        host.free(ids[:1])
    host.check_integrity()


# -- the KV manager with a host tier ---------------------------------------------------------


def test_eviction_moves_to_host_and_a_hit_copies_it_back_exactly():
    kv = tiered()
    run_to_end(kv, A)
    assert kv.cache.cached_blocks == 3
    assert kv.cache.evict(3) == 3  # the device blocks are free ...
    assert kv.pool.num_free == 8 and kv.cache.cached_blocks == 0
    m = kv.cache.match(NS, A)  # ... and the prefix is still in the tree, on host
    assert (m.num_tokens, m.host_tokens) == (0, 12) and m.host_node.on_host
    assert kv.cached_len(A + [1]) == 12
    st = kv.stats()
    assert (st["evicted_to_host"], st["host_blocks_used"], st["host_hits"]) == (3, 3, 0)
    kv.pool.kv.zero_()  # nothing of the old device copy survives
    seq = admit(kv, A + [1, 2])
    assert seq.num_computed == 12 and seq.num_host == 12 and len(seq.block_table) == 3
    assert_holds_its_kv(kv, seq.token_ids, seq.block_table, 12)
    st = kv.stats()
    assert (st["host_hits"], st["host_blocks_used"], st["blocks_cached"]) == (3, 0, 3)
    kv.check_integrity([seq], [])
    assert compute(kv, seq)
    kv.release(seq)
    kv.check_integrity([], [])


def test_a_match_ending_inside_a_host_node_splits_it_and_loads_only_that_part():
    kv = tiered()
    run_to_end(kv, A)
    kv.cache.evict(3)
    seq = admit(kv, A[:8] + [7])  # 2 of the 3 host blocks
    assert seq.num_computed == 8 and seq.num_host == 8
    m = kv.cache.match(NS, A)
    assert (m.num_tokens, m.host_tokens) == (8, 4)  # the third block stays on host
    kv.check_integrity([seq], [])
    kv.release(seq)
    kv.check_integrity([], [])


def test_host_full_drops_lru_host_leaves():
    kv = tiered(num_blocks=8, host_blocks=4)
    run_to_end(kv, A)  # 3 blocks
    run_to_end(kv, B)  # 2 blocks, newer
    kv.cache.evict(3)  # A goes to host (3 of 4 host blocks)
    assert kv.cache.match(NS, A).host_tokens == 12
    kv.cache.evict(2)  # B needs 2 host blocks: A, the LRU host leaf, is dropped
    st = kv.stats()
    assert (st["evicted_to_host"], st["host_evicted"], st["host_blocks_used"]) == (5, 3, 2)
    assert kv.cached_len(A + [0]) == 0 and kv.cache.match(NS, B).host_tokens == 8
    kv.check_integrity([], [])


def test_a_node_larger_than_the_host_tier_is_dropped_not_moved():
    kv = tiered(num_blocks=8, host_blocks=2)
    run_to_end(kv, A)
    assert kv.cache.evict(1) == 3
    assert kv.cached_len(A + [0]) == 0 and kv.stats()["evicted_to_host"] == 0
    kv.check_integrity([], [])


def test_a_hit_with_too_few_free_device_blocks_loads_what_fits():
    kv = tiered(num_blocks=4, host_blocks=8)
    run_to_end(kv, A)
    kv.cache.evict(3)
    hog = admit(kv, list(range(500, 508)))
    assert kv.reserve(hog.kv, 8)  # 2 of the 4 device blocks, locked by a running request
    seq = admit(kv, A + [1])
    assert seq.num_computed == 8 and seq.num_host == 8  # 2 blocks fit; the third is recomputed
    assert_holds_its_kv(kv, seq.token_ids, seq.block_table, 8)
    kv.check_integrity([hog, seq], [])
    for s in (seq, hog):
        kv.release(s)
    kv.check_integrity([], [])


def test_insert_over_a_host_node_promotes_it_with_the_callers_blocks():
    kv = tiered()
    run_to_end(kv, A)
    kv.cache.evict(3)
    seq = make_seq(A + [1])
    kv.reserve(seq.kv, 13)  # computed from scratch (as if the host copy could not be loaded)
    assert compute(kv, seq, 13)
    kv.release(seq)
    m = kv.cache.match(NS, A)
    assert (m.num_tokens, m.host_tokens) == (12, 0) and kv.host.num_used == 0
    assert_holds_its_kv(kv, A, m.block_ids, 12)
    kv.check_integrity([], [])


def test_offload_moves_an_idle_conversation_to_host_and_the_next_turn_copies_it_back():
    kv = tiered()
    _, kept = run_to_end(kv, B, retain=True)  # 2 full blocks + a 2-token tail
    assert kv.pool.num_free == 5
    assert kv.offload(kept) == 3  # the full blocks to host, the tail dropped
    assert kept.node is None and kept.tail_block is None and kv.stats()["retained"] == 0
    assert kv.pool.num_free == 8 and kv.host.num_used == 2
    kv.check_integrity([], [])
    seq = admit(kv, B + [1, 2])  # the next turn, its handle gone: a host hit for the full blocks
    assert seq.num_computed == 8 and seq.num_host == 8
    assert_holds_its_kv(kv, seq.token_ids, seq.block_table, 8)
    u = seq.usage()
    assert (u.cached_tokens, u.host_tokens, u.restored_tokens) == (0, 8, 0)
    kv.release(seq)
    kv.check_integrity([], [])


def test_offload_stops_at_a_shared_locked_prefix():
    kv = tiered()
    _, kept = run_to_end(kv, A, retain=True)
    other = admit(kv, A[:4] + [9])  # another request locks the first block
    kv.offload(kept)
    m = kv.cache.match(NS, A)
    assert (m.num_tokens, m.host_tokens) == (4, 8)
    kv.check_integrity([other], [])
    kv.release(other)
    kv.check_integrity([], [])


def test_offload_without_a_host_tier_is_drop():
    kv = KVManager(BlockPool(8, BS, *LAYOUT), NS)
    _, kept = run_to_end(kv, B, retain=True)
    assert kv.offload(kept) == 1  # only the tail
    assert kv.cache.match(NS, B).num_tokens == 8 and kv.stats().keys() == {
        "blocks_total",
        "blocks_free",
        "blocks_cached",
        "blocks_evictable",
        "tree_nodes",
        "pins",
        "retained",
    }
    kv.check_integrity([], [])


def test_import_copies_the_host_part_back_and_counts_it():
    kv = tiered()
    tokens = A + B
    run_to_end(kv, tokens[:8])
    kv.cache.evict(2)
    k, v = expected(tokens, 14, LAYOUT)
    kept = kv.import_kv(tokens, 14, [x + 1000 for x in k], [x + 1000 for x in v])  # disk values differ
    assert kept.host_len == 8
    got_k, _ = kv.export_kv(kept)
    for i in range(LAYOUT[0]):
        torch.testing.assert_close(got_k[i][:8], k[i][:8], rtol=0, atol=0)  # from host, not the import
        torch.testing.assert_close(got_k[i][8:], k[i][8:14] + 1000, rtol=0, atol=0)
    seq = admit(kv, tokens[:14] + [1], prefix=kept)
    assert seq.num_computed == 14 and seq.num_host == 8
    kv.check_integrity([seq], [])
    kv.release(seq)
    kv.check_integrity([], [])


def test_integrity_catches_a_host_block_owned_by_no_node():
    kv = tiered()
    run_to_end(kv, A)
    kv.cache.evict(3)
    kv.check_integrity([], [])
    kv.host.allocate(1)
    with pytest.raises(AssertionError, match="host"):
        kv.check_integrity([], [])


def test_clear_drops_the_host_tier_too():
    kv = tiered()
    run_to_end(kv, A)
    run_to_end(kv, B)
    kv.cache.evict(2)
    kv.clear()
    assert kv.pool.num_free == 8 and kv.host.num_used == 0 and kv.cache.nodes() == []
    kv.check_integrity([], [])


# -- namespaces -------------------------------------------------------------------------------


def test_namespaces_of_sequences_never_share_and_drop_namespace_discards_one():
    kv = tiered(num_blocks=12)
    mine = ("sink", 1)
    run_to_end(kv, A)
    _, kept = run_to_end(kv, A, retain=True, namespace=mine)  # the same tokens in another namespace
    assert kv.cache.cached_blocks == 6
    assert kv.cached_len(A + [1]) == 12 and kv.cached_len(A + [1], mine) == 12
    assert kv.cached_len(B + [1], mine) == 0
    run_to_end(kv, B, namespace=mine)
    kv.cached_len(A + [1])  # the default namespace's A is now the most recently used
    kv.cache.evict(2)  # B of `mine` (the LRU leaf) goes to host
    assert kv.cache.match(mine, B).host_tokens == 8
    # a handle of one namespace never lends its tail to a sequence of another
    k, v = expected(B, 10, LAYOUT)
    other = kv.import_kv(B, 10, k, v, namespace=mine)
    assert other.host_len == 8  # its full blocks were on host in that namespace
    seq = admit(kv, B + [5], prefix=other)  # default namespace: nothing of B there
    assert seq.num_computed == 0 and seq.block_table == []
    kv.release(seq)
    kv.check_integrity([], [kept])
    free = kv.pool.num_free
    assert kv.drop_namespace(mine) == 2  # A of `mine` is locked by `kept`: only B's 2 blocks go
    assert kv.pool.num_free == free + 2 and kv.host.num_used == 0
    assert kv.cached_len(A + [1], mine) == 12 and kv.cached_len(B + [1], mine) == 0
    kv.offload(kept)  # ends the handle; `mine` is garbage now
    kv.drop_namespace(mine)
    assert mine not in kv.cache._roots and kv.host.num_used == 0
    assert kv.cached_len(A + [1]) == 12  # the default namespace is untouched
    assert kv.pool.num_free == 12 - 3
    kv.check_integrity([], [])


def test_drop_namespace_keeps_locked_paths_and_the_root_they_hang_on():
    kv = tiered()
    ns = "private"
    seq = admit(kv, A + [1], namespace=ns)
    assert compute(kv, seq)
    kv.release(seq)
    running = admit(kv, A[:8] + [3], namespace=ns)
    kv.drop_namespace(ns)
    assert kv.cached_len(A + [1], ns) == 8 and ns in kv.cache._roots
    kv.check_integrity([running], [])
    kv.release(running)
    kv.drop_namespace(ns)
    assert ns not in kv.cache._roots and kv.pool.num_free == 8
    kv.check_integrity([], [])


# -- randomized stress ---------------------------------------------------------------------------

STEMS = [list(range(10, 40)), list(range(10, 19)) + list(range(50, 71)), list(range(80, 90))]


def random_tokens(rng: random.Random) -> list[int]:
    stem = rng.choice(STEMS)
    return stem[: rng.randint(0, len(stem))] + [rng.randint(0, 7) for _ in range(rng.randint(1, 6))]


def stress(seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    kv = tiered(num_blocks=10, host_blocks=5, layout=(1, 1, 1))
    seqs, live = [], []  # live: (handle, its tokens, namespace)
    for _ in range(300):
        op = rng.random()
        if (op < 0.25 and len(seqs) < 3) or not seqs:  # few at once: the rest of the pool churns
            ns = rng.choice([None, "other"])
            prefix = None
            if live and rng.random() < 0.5:
                prefix, toks, ns = live.pop(rng.randrange(len(live)))
                tokens = toks + [rng.randint(0, 7) for _ in range(rng.randint(1, 4))]
            else:
                tokens = random_tokens(rng)
            seq = admit(kv, tokens, prefix=prefix, namespace=ns)
            assert_holds_its_kv(kv, seq.token_ids, seq.block_table, seq.num_computed)
            seqs.append(seq)
        elif op < 0.55:
            seq = rng.choice(seqs)
            if seq.num_computed == len(seq.token_ids):
                seq.token_ids.append(rng.randint(0, 7))
            compute(kv, seq, rng.randint(1, len(seq.token_ids) - seq.num_computed))
            assert_holds_its_kv(kv, seq.token_ids, seq.block_table, seq.num_computed)
        elif op < 0.7:
            seq = seqs.pop(rng.randrange(len(seqs)))
            done = seq.token_ids[: seq.num_computed]
            kept = kv.release(seq, retain=rng.random() < 0.6)
            if kept is not None:
                live.append((kept, done, seq.namespace))
        elif op < 0.78 and live:
            kept, _, _ = live.pop(rng.randrange(len(live)))
            (kv.offload if rng.random() < 0.7 else kv.drop)(kept)
        elif op < 0.84:
            tokens = random_tokens(rng)
            n = rng.randint(1, len(tokens))
            k, v = expected(tokens, n, (1, 1, 1))
            ns = rng.choice([None, "other"])
            try:
                kept = kv.import_kv(tokens, n, k, v, namespace=ns)
            except OutOfBlocks:
                pass
            else:
                live.append((kept, tokens[:n], ns))
                got_k, _ = kv.export_kv(kept)
                torch.testing.assert_close(got_k[0], k[0], rtol=0, atol=0)
        elif op < 0.95:
            kv.cache.evict(rng.randint(1, 6))
        else:
            kv.drop_namespace("other")
        kv.check_integrity(seqs, [h for h, _, _ in live])
    st = kv.stats()
    for seq in seqs:
        kv.release(seq)
    for h, _, _ in live:
        kv.drop(h)
    kv.clear()
    kv.check_integrity([], [])
    assert kv.pool.num_free == 10 and kv.host.num_used == 0
    return st


def test_random_stress_keeps_integrity_and_the_kv_of_every_owner():
    """Requests with shared prefixes, retained turns, offloads, imports, evictions and two
    namespaces over a 10-block pool and a 5-block host tier, 8 seeds x 300 steps; after
    every step every block and lock is owned, host blocks are exactly the host nodes', and
    every owner holds the KV of its own tokens (so every host round trip was exact)."""
    totals = {"evicted_to_host": 0, "host_hits": 0, "host_evicted": 0}
    for seed in range(8):
        st = stress(seed)
        for k in totals:
            totals[k] += st[k]
    assert all(totals.values()), totals  # every tier move happened


# -- engines on a tiny model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("host-tier-model")
    return make_model(d, "llama", seed=3, max_position_embeddings=2048), d


def per_block_bytes(e_or_dir, block_size: int) -> int:
    return 2 * 2 * block_size * 2 * 16 * 4  # k and v x 2 layers x block x 2 kv heads x head_dim 16 x fp32


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def first_logits(e: Engine, prompt: list[int], max_tokens: int = 4):
    """Run ``prompt`` greedily; return (the logits its first token was sampled from, the result)."""
    seen = []
    forward = e.runner.forward
    e.runner.forward = lambda batch: seen.append(forward(batch)) or seen[-1]
    try:
        r = e.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    finally:
        e.runner.forward = forward
    return seen[0][-1], r


def test_host_hit_logits_equal_the_device_hit_and_transformers(model):
    ref, d = model
    bs = 8
    e = Engine(d, EngineConfig(num_blocks=12, block_size=bs, host_cache_bytes=32 * per_block_bytes(d, bs)))
    assert e.kv.host is not None and e.kv.host.num_blocks == 32
    prompt = ids(61, 1)  # 7 full blocks + 5
    _, first = first_logits(e, prompt)
    assert first.usage.computed_tokens == 61
    on_device, r_dev = first_logits(e, prompt)  # the device hit
    assert r_dev.usage.cached_tokens == 56 and r_dev.usage.host_tokens == 0
    e.check_integrity()
    first_logits(e, ids(90, 2))  # 12 blocks: the pool cannot hold both, the first prompt goes to host
    st = e.kv_stats()
    assert st["evicted_to_host"] >= 7 and st["host_evicted"] == 0
    assert e.kv.cache.match(e.kv.namespace, prompt).num_tokens < 56
    e.check_integrity()
    on_host, r_host = first_logits(e, prompt)  # the host hit
    assert r_host.usage.host_tokens > 0 and r_host.usage.cached_tokens + r_host.usage.host_tokens == 56
    assert r_host.usage.computed_tokens == 5 and e.kv_stats()["host_hits"] > 0
    assert torch.equal(on_host, on_device)
    assert r_host.token_ids == r_dev.token_ids == first.token_ids
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0, -1].float()
    assert (on_host - want).abs().max().item() <= 1e-4
    hf = ref.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert r_host.token_ids == hf[0, len(prompt) :].tolist()
    e.check_integrity()
    e.close()


def test_host_cache_bytes_zero_is_no_tier(model):
    _, d = model
    e = Engine(d, EngineConfig(num_blocks=12, block_size=8, host_cache_bytes=0))
    assert e.kv.host is None and e.runner.host_pool is None and "host_blocks_total" not in e.kv_stats()
    prompt = ids(61, 1)
    first_logits(e, prompt)
    first_logits(e, ids(90, 2))
    _, r = first_logits(e, prompt)
    assert r.usage.host_tokens == 0 and r.usage.cached_tokens < 56  # evicted means gone
    e.check_integrity()
    off = Engine(d, EngineConfig(num_blocks=12, block_size=8, enable_prefix_caching=False))
    assert off.kv.host is None  # no shared cache, no tier under it
    with pytest.raises(InvalidRequest, match="host_cache_bytes"):
        EngineConfig.from_kwargs(host_cache_bytes=-1)


def test_engine_stress_with_shared_prefixes_keeps_integrity_and_outputs(model):
    """Batches of greedy requests sharing prefixes over a 10-block pool and an 8-block host
    tier: integrity after every step, and the same tokens as an engine without prefix caching."""
    _, d = model
    bs = 8
    e = Engine(
        d, EngineConfig(num_blocks=10, block_size=bs, max_batch_tokens=48, host_cache_bytes=8 * per_block_bytes(d, bs))
    )
    plain = Engine(d, EngineConfig(num_blocks=64, block_size=bs, enable_prefix_caching=False))
    rng = random.Random(0)
    stems = [ids(40, 10 + i) for i in range(3)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for _ in range(5):
        prompts = [
            rng.choice(stems)[: rng.randint(8, 40)] + ids(rng.randint(1, 9), rng.randint(0, 99)) for _ in range(4)
        ]
        seqs = [e.add_request(p, params) for p in prompts]
        while not all(s.finished for s in seqs):
            e.step()
            e.check_integrity()
        want = plain.generate(prompts, params)
        assert [s.result().token_ids for s in seqs] == [w.token_ids for w in want]
    st = e.kv_stats()
    assert st["evicted_to_host"] > 0 and st["host_hits"] > 0
    e.close()


def test_sessions_under_pressure_go_device_then_host_then_disk(model, tmp_path):
    """Five chats of ~8 blocks each on a 20-block pool with a 16-block host tier: the pool's
    pressure spills idle chats (a snapshot on disk), their blocks move to host, and when
    host is full the oldest chat's blocks leave it; its next turn reads its snapshot, while
    a chat still on host is copied back from there."""
    ref, d = model
    bs = 8
    e = Engine(
        d,
        EngineConfig(
            data_dir=str(tmp_path), num_blocks=20, block_size=bs, host_cache_bytes=16 * per_block_bytes(d, bs)
        ),
    )
    greedy = dict(max_tokens=4, temperature=0.0)
    sessions = [e.session(params=greedy) for _ in range(5)]
    words = "the quick brown fox jumps over the lazy dog what is the capital of France Paris is".split()
    steps = []
    for i, s in enumerate(sessions):
        s.send(" ".join(words[i:] + words[:i]) * 2)  # distinct, 57 prompt tokens each
        e.check_integrity()
        steps.append(e.kv_stats())
    # device -> host -> out: all that is on host or left it came from device eviction, and
    # host dropped blocks only when full (less room left than one chat's 7-8 blocks)
    for before, st in zip([{"host_evicted": 0}, *steps], steps):
        assert st["host_blocks_used"] + st["host_hits"] + st["host_evicted"] <= st["evicted_to_host"]
        if st["host_evicted"] > before["host_evicted"]:
            assert st["host_blocks_total"] - st["host_blocks_used"] < 8
    assert steps[-1]["evicted_to_host"] > 0 and steps[-1]["host_evicted"] > 0
    assert sum(s.kept is None for s in sessions) >= 3, "idle chats were spilled (released to the tiers) under pressure"
    # -> disk: the oldest chat's KV left host entirely, it comes back from its snapshot
    r0 = sessions[0].send("Hello, how are you today?")
    assert r0.usage.restored_tokens > 0 and r0.usage.host_tokens == 0
    e.check_integrity()
    # a chat spilled later is still on host: its full blocks are copied back, only the
    # partial last block comes from the snapshot
    r2 = sessions[2].send("What is the capital of France?")
    assert r2.usage.host_tokens >= 7 * bs and r2.usage.restored_tokens < bs
    e.check_integrity()
    for s, r in ((sessions[0], r0), (sessions[2], r2)):
        prompt = s.tokens[: r.usage.prompt_tokens]
        gen = s.tokens[r.usage.prompt_tokens : r.usage.prompt_tokens + r.usage.generated_tokens]
        hf = ref.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, eos_token_id=2, pad_token_id=0)
        assert gen == hf[0, len(prompt) :].tolist()[: len(gen)]
        u = r.usage
        assert u.cached_tokens + u.host_tokens + u.restored_tokens + u.computed_tokens == u.prompt_tokens
    stored = [Usage.from_message(m) for m in sessions[2].messages() if m.role == "assistant"][-1]
    assert stored.host_tokens == r2.usage.host_tokens  # the database keeps the tier split
    e.check_integrity()
    e.close()


def test_usage_summary_names_every_tier():
    u = Usage(prompt_tokens=12, cached_tokens=8, host_tokens=2, restored_tokens=0, computed_tokens=2)
    assert "12 prompt tokens (8 cached, 2 host, 0 restored, 2 computed)" in u.summary()
    assert u.message_columns()["host_tokens"] == 2
