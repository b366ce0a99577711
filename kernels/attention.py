"""Attention over paged KV: the torch reference (CPU, and the oracle for Triton).

Layout (owned by chatkv.kvcache.block_pool, restated here as the kernel contract):
``k_cache`` and ``v_cache`` of one layer are ``[num_blocks, block_size, kv_heads, head_dim]``
(quantised KV: uint8 rows of ``head_dim + 4``, the values then their scale; kernels/kv_quant.py);
token ``t`` of a sequence lives in slot ``block_table[t // block_size] * block_size + t % block_size``.

One step flattens a batch of sequences: sequence ``i`` brings ``query_lens[i]`` new tokens
(a prefill chunk, or 1 for a decode) that sit at the end of its ``context_lens[i]`` tokens
(cached prefix + new tokens). Its queries attend causally to its own context only.
``AttentionMetadata`` is built once per step and shared by every layer.

How the reference computes it (chosen by measurement on CPU, torch 2.13): K/V are
gathered a whole block at a time (``index_select`` over block ids, not token slots), and
grouped-query attention is plain attention with the query heads that share a KV head
stacked into one ``[kv_heads, group * q_len, head_dim]`` problem.
``scaled_dot_product_attention(..., enable_gqa=True)`` gives the same numbers but is much
slower on CPU for decode shapes (bf16, 9 query / 3 KV heads of 64, one query over 100 /
1000 keys: 101 / 993 us vs 26 / 149 us; 8 such rows over 160 keys: 1208 vs 211 us; fp32
about even); for prefill chunks the grouped form is as fast or faster (20 queries over
1050 keys: 1.3 vs 1.9 ms). Two matmuls and a softmax in fp32 were slower than the grouped form.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from chatkv.kernels import kv_quant


@dataclass
class Prefill:
    """One sequence's prefill chunk: queries ``[start, start + q_len)`` of the step attend to
    the sequence's first ``kv_len`` tokens, found in ``blocks`` (its first ``ceil(kv_len / block_size)`` block ids)."""

    start: int
    q_len: int
    blocks: torch.Tensor  # [num blocks] long
    kv_len: int
    # [q_len, kv_len] bool, True = attend (causal, and the sliding window if any); None: every key
    # (an exact decode row, below)
    mask: torch.Tensor | None
    # the queries sit at given positions, not at the last q_len (``build_metadata(positions=)``):
    # only ``mask`` says which keys each sees, so only the reference computes it
    scattered: bool = False


@dataclass
class AttentionMetadata:
    """Per-step description of the flattened batch. Build it with ``build_metadata``."""

    query_lens: list[int]
    context_lens: list[int]
    slot_mapping: torch.Tensor  # [total new tokens] slot of every new token, where its K/V is stored
    prefills: list[Prefill]  # computed one sequence at a time
    # decodes, one query each, gathered into one padded call:
    decode_rows: torch.Tensor | None  # [B] their rows in the step's queries
    decode_blocks: torch.Tensor | None  # [B * n] long: n block ids per row (the blocks the row attends to, padded)
    decode_kv_len: int  # keys gathered per row: the longest row's span, <= n * block_size
    decode_mask: torch.Tensor | None  # [B, 1, 1, decode_kv_len] bool (True = attend), None when every key is valid
    # the same masks as bounds, for kernels that compute them (kernels/triton_attention.py):
    sliding_window: int | None = None  # a query at position p sees keys (p - window, p]
    decode_bounds: list[tuple[int, int]] | None = None  # per decode row: its keys are [lo, hi) of its gathered blocks
    scratch: dict = field(
        default_factory=dict, repr=False, compare=False
    )  # a backend's per-step packing, shared by layers


def _window_mask(q_len: int, kv_len: int, window: int | None, q_pos: torch.Tensor | None = None) -> torch.Tensor:
    """Causal mask for queries that are the last ``q_len`` of ``kv_len`` positions, or that sit
    at positions ``q_pos`` (True = attend)."""
    q_pos = (torch.arange(kv_len - q_len, kv_len) if q_pos is None else q_pos)[:, None]
    k_pos = torch.arange(kv_len)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def build_metadata(
    block_tables: list[list[int]],
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    sliding_window: int | None = None,
    device: str | torch.device = "cpu",
    exact: list[bool] | None = None,
    positions: list[list[int] | None] | None = None,
) -> AttentionMetadata:
    """Describe one flattened step. ``context_lens[i]`` counts sequence i's new tokens too.

    ``positions[i]`` (ascending), when given: sequence i's new tokens sit at those positions,
    not at the last ``query_lens[i]`` of its context, whose end is past the last of them. Each
    sees the keys at or before its own position, the other new tokens' included (stored in the
    same layer before the attention): chatkv.rag.placement recomputes a chosen set of a prompt's
    tokens over KV placed around them in one such item. The torch reference computes these;
    the Triton kernels hand a step that holds one to it.

    ``exact[i]``: sequence i's single query is computed over exactly its own keys, as a lone
    decode is, not padded to the longest decode row of the step with a mask: a padded row's
    rounding differs from a lone one's (bf16: up to 2e-3), so speculative decoding's
    verification rows, which must give what plain decoding gives, are exact (without a
    sliding window; a window's rows are always padded)."""
    assert len(block_tables) == len(query_lens) == len(context_lens)
    exact = exact or [False] * len(query_lens)
    positions = positions or [None] * len(query_lens)
    slots: list[int] = []
    prefills: list[Prefill] = []
    decodes: list[tuple[int, list[int], int, int]] = []  # (row, block ids, first valid key, end of keys)
    start = 0
    for table, q_len, ctx, alone, at in zip(block_tables, query_lens, context_lens, exact, positions):
        assert 0 < q_len <= ctx <= len(table) * block_size, (q_len, ctx, len(table), block_size)
        n_blocks = -(-ctx // block_size)
        if at is not None:
            assert len(at) == q_len and at[-1] < ctx and all(a < b for a, b in zip(at, at[1:])), (
                "positions: ascending, in the context"
            )
            slots.extend(table[t // block_size] * block_size + t % block_size for t in at)
            blocks = torch.tensor(table[:n_blocks], dtype=torch.long, device=device)
            mask = _window_mask(q_len, ctx, sliding_window, torch.tensor(at)).to(device)
            prefills.append(Prefill(start, q_len, blocks, ctx, mask, scattered=True))
            start += q_len
            continue
        slots.extend(table[t // block_size] * block_size + t % block_size for t in range(ctx - q_len, ctx))
        if q_len == 1 and alone and sliding_window is None:  # its own call over its own keys, unmasked
            prefills.append(
                Prefill(start, 1, torch.tensor(table[:n_blocks], dtype=torch.long, device=device), ctx, None)
            )
        elif q_len == 1:
            # only the blocks inside the window: the first one may hold a few keys before it
            first = 0 if sliding_window is None else max(0, ctx - sliding_window) // block_size
            lo = 0 if sliding_window is None else max(0, ctx - sliding_window) - first * block_size
            decodes.append((start, table[first:n_blocks], lo, ctx - first * block_size))
        else:
            blocks = torch.tensor(table[:n_blocks], dtype=torch.long, device=device)
            mask = _window_mask(q_len, ctx, sliding_window).to(device)
            prefills.append(Prefill(start, q_len, blocks, ctx, mask))
        start += q_len
    decode_rows = decode_blocks = decode_mask = None
    decode_kv_len = 0
    if decodes:
        n = max(len(b) for _, b, _, _ in decodes)
        decode_kv_len = max(hi for _, _, _, hi in decodes)
        decode_rows = torch.tensor([r for r, _, _, _ in decodes], dtype=torch.long, device=device)
        # pad short rows with their own last block: any valid block id, masked out below
        decode_blocks = torch.tensor([b + b[-1:] * (n - len(b)) for _, b, _, _ in decodes], dtype=torch.long).view(-1)
        decode_blocks = decode_blocks.to(device)
        if any(lo > 0 or hi < decode_kv_len for _, _, lo, hi in decodes):
            pos = torch.arange(decode_kv_len)[None, :]
            lo = torch.tensor([lo for _, _, lo, _ in decodes])[:, None]
            hi = torch.tensor([hi for _, _, _, hi in decodes])[:, None]
            decode_mask = ((pos >= lo) & (pos < hi))[:, None, None, :].to(device)
    return AttentionMetadata(
        query_lens=list(query_lens),
        context_lens=list(context_lens),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        prefills=prefills,
        decode_rows=decode_rows,
        decode_blocks=decode_blocks,
        decode_kv_len=decode_kv_len,
        decode_mask=decode_mask,
        sliding_window=sliding_window,
        decode_bounds=[(lo, hi) for _, _, lo, hi in decodes] or None,
    )


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    quant: str | None = None,
) -> None:
    """Write new keys/values ``[tokens, kv_heads, head_dim]`` into their slots; with ``quant``
    (``int8``, ``fp8_e4m3``) the caches hold quantised rows and the new ones are quantised here
    (chatkv.kernels.kv_quant)."""
    kv_heads, row = k_cache.shape[-2:]
    if quant is not None:
        k, v = kv_quant.quantize(k, quant), kv_quant.quantize(v, quant)
    k_cache.view(-1, kv_heads, row).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, row).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(
    cache: torch.Tensor, blocks: torch.Tensor, rows: int, kv_len: int, dtype: torch.dtype, quant: str | None = None
) -> torch.Tensor:
    """Keys (or values) of ``blocks`` as ``[rows, kv_heads, kv_len, head_dim]`` in ``dtype`` (one
    gather copy; quantised rows are dequantised after the gather, so only what is read is)."""
    num_blocks, block_size, kv_heads, row = cache.shape
    x = cache.index_select(0, blocks).view(rows, -1, kv_heads, row)[:, :kv_len]
    if quant is not None:
        return kv_quant.dequantize(x, quant, dtype).transpose(1, 2)
    return x.transpose(1, 2).to(dtype)


def _quantised_decode(qs, k_cache, v_cache, meta: AttentionMetadata, scale: float, quant: str) -> torch.Tensor:
    """Decode rows ``qs [b, kv_heads, group, head_dim]`` over quantised K/V with the scales applied
    where they are cheap: ``q . (s_k k) = s_k (q . k)`` scales a key's score, ``sum p s_v v``
    scales its probability, so the gathered values are only converted (exact), never
    multiplied. Measured on CPU (8 rows x 8,192 int8 keys, 3 KV heads of 64, bf16): 12.5 ms,
    against 62 ms for dequantise-then-SDPA (bf16 SDPA over bf16 K/V: 7 ms)."""
    b, rows, kv_len = qs.shape[0], meta.decode_blocks, meta.decode_kv_len
    kv_heads, row = k_cache.shape[-2:]
    k, sk = kv_quant.split(k_cache.index_select(0, rows).view(b, -1, kv_heads, row)[:, :kv_len], quant, qs.dtype)
    v, sv = kv_quant.split(v_cache.index_select(0, rows).view(b, -1, kv_heads, row)[:, :kv_len], quant, qs.dtype)
    scores = torch.matmul(qs, k.permute(0, 2, 3, 1)).float()  # [b, kv_heads, group, kv_len]
    scores.mul_(sk.transpose(1, 2)[:, :, None, :] * scale)
    if meta.decode_mask is not None:
        scores.masked_fill_(~meta.decode_mask, float("-inf"))
    p = torch.softmax(scores, dim=-1).mul_(sv.transpose(1, 2)[:, :, None, :])
    return torch.matmul(p.to(qs.dtype), v.transpose(1, 2))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    quant: str | None = None,
) -> torch.Tensor:
    """Attention of the step's queries ``[tokens, heads, head_dim]`` over their paged contexts.

    The new tokens' K/V must already be stored (``store_kv``, with the same ``quant``).
    Returns ``[tokens, heads, head_dim]``.
    """
    tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[-2]
    group = heads // kv_heads
    if not meta.prefills and meta.decode_rows is not None and meta.decode_rows.shape[0] == tokens:
        out = None  # decode-only step: every row is written below
    else:
        out = torch.empty_like(q)
    for p in meta.prefills:
        # [kv_heads, group * q_len, head_dim]: the query heads of one KV head stacked
        qs = q[p.start : p.start + p.q_len].view(p.q_len, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        qs = qs.reshape(kv_heads, group * p.q_len, head_dim)
        ks = _gather(k_cache, p.blocks, 1, p.kv_len, q.dtype, quant)[0]
        vs = _gather(v_cache, p.blocks, 1, p.kv_len, q.dtype, quant)[0]
        # 4-D inputs: with 3-D ones CPU SDPA takes its slow generic path (~3x slower for long prefixes)
        mask = None if p.mask is None else p.mask.repeat(group, 1)
        o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=mask, scale=scale)[0]
        out[p.start : p.start + p.q_len] = (
            o.view(kv_heads, group, p.q_len, head_dim).permute(2, 0, 1, 3).reshape(p.q_len, heads, head_dim)
        )
    if meta.decode_rows is not None:
        b = meta.decode_rows.shape[0]
        qs = q if out is None else q.index_select(0, meta.decode_rows)
        qs = qs.view(b, kv_heads, group, head_dim)
        if quant is not None:
            o = _quantised_decode(qs, k_cache, v_cache, meta, scale, quant).view(b, heads, head_dim)
        else:
            ks = _gather(k_cache, meta.decode_blocks, b, meta.decode_kv_len, q.dtype)
            vs = _gather(v_cache, meta.decode_blocks, b, meta.decode_kv_len, q.dtype)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=meta.decode_mask, scale=scale).view(
                b, heads, head_dim
            )
        if out is None:
            return o
        out.index_copy_(0, meta.decode_rows, o)
    return out
