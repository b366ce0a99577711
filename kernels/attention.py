"""Attention over paged KV: the torch reference (CPU, and the oracle for Triton).

Layout (owned by chatkv.block_pool, restated here as the kernel contract):
``k_cache`` and ``v_cache`` of one layer are ``[num_blocks, block_size, kv_heads, head_dim]``;
token ``t`` of a sequence lives in slot ``block_table[t // block_size] * block_size + t % block_size``.

One step flattens a batch of sequences: sequence ``i`` brings ``query_lens[i]`` new tokens
(a prefill chunk, or 1 for a decode) that sit at the end of its ``context_lens[i]`` tokens
(cached prefix + new tokens). Its queries attend causally to its own context only.
``AttentionMetadata`` is built once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step description of the flattened batch. Build it with ``build_metadata``."""

    query_lens: list[int]
    context_lens: list[int]
    slot_mapping: torch.Tensor  # [total new tokens] slot of every new token, where its K/V is stored
    # sequences computed one at a time (prefill chunks): (query start, query len, kv slots, mask or None)
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]
    # decodes gathered into one padded call: query rows, kv slots [B, Lmax], mask [B, 1, 1, Lmax] or None
    decode_rows: torch.Tensor | None
    decode_slots: torch.Tensor | None
    decode_mask: torch.Tensor | None


def _context_slots(block_table: list[int], n: int, block_size: int) -> torch.Tensor:
    blocks = torch.tensor(block_table[: (n + block_size - 1) // block_size], dtype=torch.long)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)
    return slots[:n]


def _window_mask(q_len: int, kv_len: int, window: int | None) -> torch.Tensor | None:
    """Causal mask for queries that are the last ``q_len`` of ``kv_len`` positions (True = attend)."""
    if q_len == 1 and (window is None or kv_len <= window):
        return None
    q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
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
) -> AttentionMetadata:
    """Describe one flattened step. ``context_lens[i]`` counts sequence i's new tokens too."""
    assert len(block_tables) == len(query_lens) == len(context_lens)
    slot_parts, prefills, decodes = [], [], []
    start = 0
    for table, q_len, ctx in zip(block_tables, query_lens, context_lens):
        assert 0 < q_len <= ctx <= len(table) * block_size, (q_len, ctx, len(table), block_size)
        ctx_slots = _context_slots(table, ctx, block_size)
        slot_parts.append(ctx_slots[ctx - q_len :])
        if q_len == 1:
            decodes.append((start, ctx_slots))
        else:
            prefills.append((start, q_len, ctx_slots.to(device), _mask_to(device, _window_mask(q_len, ctx, sliding_window))))
        start += q_len
    decode_rows = decode_slots = decode_mask = None
    if decodes:
        lens = [len(s) for _, s in decodes]
        lmax = max(lens)
        decode_rows = torch.tensor([r for r, _ in decodes], dtype=torch.long, device=device)
        decode_slots = torch.zeros(len(decodes), lmax, dtype=torch.long)
        for i, (_, s) in enumerate(decodes):
            decode_slots[i, : len(s)] = s
        valid = torch.arange(lmax)[None, :] < torch.tensor(lens)[:, None]
        if sliding_window is not None:
            valid &= torch.arange(lmax)[None, :] > torch.tensor(lens)[:, None] - 1 - sliding_window
        if not bool(valid.all()):
            decode_mask = valid[:, None, None, :].to(device)
        decode_slots = decode_slots.to(device)
    return AttentionMetadata(
        query_lens=list(query_lens),
        context_lens=list(context_lens),
        slot_mapping=torch.cat(slot_parts).to(device),
        prefills=prefills,
        decode_rows=decode_rows,
        decode_slots=decode_slots,
        decode_mask=decode_mask,
    )


def _mask_to(device, mask):
    return None if mask is None else mask.to(device)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write new keys/values ``[tokens, kv_heads, head_dim]`` into their slots."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of the step's queries ``[tokens, heads, head_dim]`` over their paged contexts.

    The new tokens' K/V must already be stored (``store_kv``). Returns ``[tokens, heads, head_dim]``.
    """
    kv_heads, head_dim = k_cache.shape[-2:]
    k_flat = k_cache.view(-1, kv_heads, head_dim)
    v_flat = v_cache.view(-1, kv_heads, head_dim)
    out = torch.empty_like(q)
    for start, q_len, slots, mask in meta.prefills:
        qs = q[start : start + q_len].transpose(0, 1)  # [H, L, D]
        ks = k_flat.index_select(0, slots).transpose(0, 1).to(q.dtype)
        vs = v_flat.index_select(0, slots).transpose(0, 1).to(q.dtype)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + q_len] = o.transpose(0, 1)
    if meta.decode_rows is not None:
        b, lmax = meta.decode_slots.shape
        qs = q.index_select(0, meta.decode_rows)[:, :, None, :]  # [B, H, 1, D]
        flat = meta.decode_slots.reshape(-1)
        ks = k_flat.index_select(0, flat).view(b, lmax, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        vs = v_flat.index_select(0, flat).view(b, lmax, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
        out.index_copy_(0, meta.decode_rows, o[:, :, 0, :])
    return out
