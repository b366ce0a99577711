"""kernels/attention.py's paged reference against a naive attention written from the definition.

The naive side reads each sequence's K/V token by token through its block table
(slot = table[t // block_size] * block_size + t % block_size) and computes, for every
query, a plain softmax(q . k / sqrt(d)) over the tokens it may see: the causal prefix,
cut to the last ``window`` positions when there is a sliding window. GQA: query head h
reads KV head h // (heads / kv_heads).
"""

from __future__ import annotations

import math

import pytest
import torch

from chatkv.kernels.attention import build_metadata, paged_attention, store_kv

GARBAGE = 1e4  # unwritten slots hold large finite values: any leak through a mask shows


def naive_attention(q, k_cache, v_cache, block_tables, query_lens, context_lens, block_size, window, positions=None):
    """q [tokens, heads, d] -> [tokens, heads, d], one query and one key at a time; ``positions[i]``:
    sequence i's queries sit there, not at the end of its context."""
    tokens, heads, d = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    k_flat = k_cache.reshape(-1, kv_heads, d)
    v_flat = v_cache.reshape(-1, kv_heads, d)
    out = torch.zeros_like(q)
    row = 0
    positions = positions or [None] * len(query_lens)
    for table, q_len, ctx, at in zip(block_tables, query_lens, context_lens, positions):
        for j in range(q_len):
            pos = ctx - q_len + j if at is None else at[j]
            visible = [t for t in range(pos + 1) if window is None or t > pos - window]
            slots = [table[t // block_size] * block_size + t % block_size for t in visible]
            for h in range(heads):
                kh = h // group
                scores = [float(q[row, h] @ k_flat[s, kh]) / math.sqrt(d) for s in slots]
                m = max(scores)
                w = [math.exp(x - m) for x in scores]
                total = sum(w)
                acc = torch.zeros(d, dtype=q.dtype)
                for wi, s in zip(w, slots):
                    acc += (wi / total) * v_flat[s, kh]
                out[row, h] = acc
            row += 1
    return out


def make_case(seed, block_size, specs, heads=4, kv_heads=2, d=8, share=False, extra_blocks=2):
    """specs: (cached prefix length, new tokens) per sequence. Returns everything a step needs.

    Block ids are a shuffled permutation of the pool; with ``share`` the second sequence
    reuses the first one's leading full blocks (a prefix-cache hit), K/V included.
    """
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-(c + n) // block_size) + extra_blocks for c, n in specs) + 3
    ids = torch.randperm(need, generator=g).tolist()
    k_cache = torch.full((need, block_size, kv_heads, d), GARBAGE)
    v_cache = torch.full((need, block_size, kv_heads, d), -GARBAGE)
    tables, truth_k, truth_v = [], [], []
    for i, (c, n) in enumerate(specs):
        ctx = c + n
        nb = -(-ctx // block_size) + (i % (extra_blocks + 1))  # some tables longer than needed
        table = [ids.pop() for _ in range(nb)]
        k = torch.randn(ctx, kv_heads, d, generator=g)
        v = torch.randn(ctx, kv_heads, d, generator=g)
        if share and i == 1:
            shared = min(specs[0][0], c) // block_size
            table[:shared] = tables[0][:shared]
            k[: shared * block_size] = truth_k[0][: shared * block_size]
            v[: shared * block_size] = truth_v[0][: shared * block_size]
        tables.append(table)
        truth_k.append(k)
        truth_v.append(v)
        for t in range(c):  # the cached prefix is already in the pool
            k_cache[table[t // block_size], t % block_size] = k[t]
            v_cache[table[t // block_size], t % block_size] = v[t]
    query_lens = [n for _, n in specs]
    context_lens = [c + n for c, n in specs]
    new_k = torch.cat([truth_k[i][c:] for i, (c, _) in enumerate(specs)])
    new_v = torch.cat([truth_v[i][c:] for i, (c, _) in enumerate(specs)])
    q = torch.randn(sum(query_lens), heads, d, generator=g)
    return q, k_cache, v_cache, tables, query_lens, context_lens, new_k, new_v, truth_k, truth_v


# (cached prefix, new tokens): prefill chunks starting mid-block over a cached prefix, whole
# fresh prompts, a first token alone, and decodes, in one batch
MIXED = [(7, 9), (0, 12), (13, 1), (0, 1), (22, 1), (3, 4), (40, 1), (1, 17)]
DECODES = [(5, 1), (0, 1), (30, 1), (17, 1), (2, 1)]
PREFILLS = [(11, 6), (0, 19), (4, 2)]


@pytest.mark.parametrize("window", [None, 3, 8], ids=["full", "window3", "window8"])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("batch", [MIXED, DECODES, PREFILLS], ids=["mixed", "decodes", "prefills"])
def test_paged_reference_equals_naive_attention(batch, block_size, window):
    heads, kv_heads, d = 4, 2, 8
    q, k_cache, v_cache, tables, qlens, ctxs, new_k, new_v, truth_k, truth_v = make_case(
        block_size * 100 + len(batch), block_size, batch, heads, kv_heads, d
    )
    meta = build_metadata(tables, qlens, ctxs, block_size, sliding_window=window)
    store_kv(k_cache, v_cache, meta.slot_mapping, new_k, new_v)
    # every token of every sequence is now where its block table says
    for table, ctx, k, v in zip(tables, ctxs, truth_k, truth_v):
        slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(ctx)])
        assert torch.equal(k_cache.reshape(-1, kv_heads, d)[slots], k)
        assert torch.equal(v_cache.reshape(-1, kv_heads, d)[slots], v)
    got = paged_attention(q, k_cache, v_cache, meta, scale=1 / math.sqrt(d))
    want = naive_attention(q, k_cache, v_cache, tables, qlens, ctxs, block_size, window)
    assert got.shape == q.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (6, 2), (8, 1)], ids=["mha", "group3", "mqa"])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_gqa_groups_and_shared_prefix_blocks(heads, kv_heads, block_size):
    """Other head groupings, and two sequences that share their leading blocks (a prefix-cache hit)."""
    d = 16
    batch = [(20, 1), (18, 5), (0, 3), (9, 1)]
    q, k_cache, v_cache, tables, qlens, ctxs, new_k, new_v, _, _ = make_case(
        7 + block_size, block_size, batch, heads, kv_heads, d, share=True
    )
    assert tables[1][: 18 // block_size] == tables[0][: 18 // block_size]
    for window in (None, 4):
        kc, vc = k_cache.clone(), v_cache.clone()
        meta = build_metadata(tables, qlens, ctxs, block_size, sliding_window=window)
        store_kv(kc, vc, meta.slot_mapping, new_k, new_v)
        got = paged_attention(q, kc, vc, meta, scale=1 / math.sqrt(d))
        want = naive_attention(q, kc, vc, tables, qlens, ctxs, block_size, window)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_window_wider_than_context_is_full_attention():
    batch = [(6, 3), (10, 1), (0, 4)]
    q, k_cache, v_cache, tables, qlens, ctxs, new_k, new_v, _, _ = make_case(3, 5, batch)
    outs = []
    for window in (None, 64):
        kc, vc = k_cache.clone(), v_cache.clone()
        meta = build_metadata(tables, qlens, ctxs, 5, sliding_window=window)
        store_kv(kc, vc, meta.slot_mapping, new_k, new_v)
        outs.append(paged_attention(q, kc, vc, meta, scale=1 / math.sqrt(8)))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("first, other", [(150, 700), (2001, 2100), (60, 64)])
def test_exact_decode_rows_equal_lone_decodes_bit_for_bit(dtype, first, other):
    """Speculative decoding verifies k proposals as k+1 decode rows of one step, each at its own
    length. Padded to the longest row with a mask, a row's bf16 rounding differs from the lone
    decode plain decoding computes (up to 2e-3 measured), so accepted tokens could differ from
    plain greedy output; an ``exact`` row equals its lone decode bit for bit, at the product's
    shapes (SmolLM2-135M: 9 query / 3 KV heads of 64, blocks of 16, a ~2k-token history)."""
    torch.manual_seed(0)
    heads, kv_heads, d, bs = 9, 3, 64, 16
    lens = [first + i for i in range(6)] + [37, other]  # one sequence's verification rows, then two others
    nblocks = sum(-(-n // bs) for n in lens) + 4
    k_cache = torch.randn(nblocks, bs, kv_heads, d).to(dtype)
    v_cache = torch.randn(nblocks, bs, kv_heads, d).to(dtype)
    shared = list(range(-(-lens[5] // bs)))  # the six rows share one block table
    nxt = len(shared)
    tables = [shared] * 6
    for n in lens[6:]:
        tables.append(list(range(nxt, nxt + -(-n // bs))))
        nxt += len(tables[-1])
    q = torch.randn(len(lens), heads, d).to(dtype)
    exact = [True] * 6 + [False, False]
    meta = build_metadata(tables, [1] * len(lens), lens, bs, exact=exact)
    out = paged_attention(q, k_cache, v_cache, meta, 1 / math.sqrt(d))
    for i in range(6):
        alone = paged_attention(
            q[i : i + 1], k_cache, v_cache, build_metadata([tables[i]], [1], [lens[i]], bs), 1 / math.sqrt(d)
        )
        assert torch.equal(out[i], alone[0]), i
    padded = paged_attention(q, k_cache, v_cache, build_metadata(tables, [1] * len(lens), lens, bs), 1 / math.sqrt(d))
    torch.testing.assert_close(out, padded, atol=5e-3, rtol=0)  # the same attention, up to rounding


@pytest.mark.parametrize("window", [None, 6], ids=["full", "window6"])
@pytest.mark.parametrize("block_size", [1, 5])
def test_queries_at_given_positions_see_what_a_causal_prefill_there_would(block_size, window):
    """``build_metadata(positions=)``: a sequence recomputes tokens scattered through its context
    (chatkv.rag.placement), the rest of whose keys are already stored; each query sees the keys at
    or before its position, the others' new keys included, never a later one. In one step with
    an ordinary prefill chunk and a decode."""
    heads, kv_heads, d = 4, 2, 8
    specs = [(30, 0), (11, 6), (20, 1)]  # the first: 30 tokens, all stored, 6 of them recomputed
    q, k_cache, v_cache, tables, _, _, _, _, truth_k, truth_v = make_case(
        7 + block_size, block_size, specs, heads, kv_heads, d
    )
    at = [2, 3, 9, 17, 18, 25]  # its context ends after 25: keys 26-29 are never read
    for t in at:  # the stored rows there are stale: the step writes them again
        k_cache[tables[0][t // block_size], t % block_size] = GARBAGE
    qlens, ctxs = [len(at), 6, 1], [at[-1] + 1, 17, 21]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(qlens), heads, d, generator=g)
    new_k = torch.cat([truth_k[0][at], truth_k[1][11:], truth_k[2][20:]])
    new_v = torch.cat([truth_v[0][at], truth_v[1][11:], truth_v[2][20:]])
    meta = build_metadata(tables, qlens, ctxs, block_size, sliding_window=window, positions=[at, None, None])
    store_kv(k_cache, v_cache, meta.slot_mapping, new_k, new_v)
    got = paged_attention(q, k_cache, v_cache, meta, scale=1 / math.sqrt(d))
    want = naive_attention(q, k_cache, v_cache, tables, qlens, ctxs, block_size, window, positions=[at, None, None])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(AssertionError, match="ascending"):
        build_metadata(tables[:1], [2], [26], block_size, positions=[[9, 3]])
