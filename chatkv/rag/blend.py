"""Blend's selective recompute (CacheBlend, EuroSys '25): the forward that computes a prompt's
tokens over chunk KV placed by chatkv.rag.placement, with fewer tokens from each check layer on.

Every new token computes layer 0 (its KV there depends on no other token). A layer computes the
keys and values of every token that reached it and stores them: fresh KV replaces the reused
copy, never worse. At a check layer only the top share of all placed chunk tokens by that
layer's own deviation from the reused KV (summed squared difference of keys and values), and
every token that is not a chunk's, go on into its attention and MLP. The shares shrink
geometrically to ``rag_recompute_ratio`` at the last check layer (``rag_check_layers``):
CacheBlend's gradual filtering; one check layer is LMCache's ``check_layers=[1]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from chatkv.engine.model_runner import BatchItem
from chatkv.kernels import kv_quant


def checks(ratio: float, check_layers: int, num_layers: int) -> dict[int, float]:
    """Blend's check layers: ``{layer: share of all placed chunk tokens that go on past it}``.
    Layers 1 .. ``check_layers`` each keep a share of the last one's, geometrically down to
    ``ratio`` (``ratio ** (i / n)`` at the i-th of n): CacheBlend's gradual filtering, each
    layer's choice made on that layer's own deviation. One check layer is LMCache's
    ``check_layers=[1]``."""
    n = max(1, min(check_layers, num_layers - 1))
    return {i: ratio ** (i / n) for i in range(1, n + 1)}


@torch.inference_mode()
def forward(
    engine, tokens: list[int], table: list[int], h0: int, end: int, reused: torch.Tensor, shares: dict[int, float]
) -> int:
    """Compute ``tokens[h0:end]`` (a request's, in blocks ``table``) over the placed KV as the
    module says: ``reused[p]``, position p's KV was placed from a chunk; ``shares``, ``checks()``'s.
    Returns how many chunk tokens went through every layer (blend's ``recomputed``)."""
    model, runner, pool = engine.model, engine.runner, engine.runner.pool
    quant = pool.quant
    nh, nkv, d = model.num_heads, model.num_kv_heads, model.head_dim
    at = torch.arange(h0, end)  # the positions this layer computes
    chunk = reused[h0:end].clone()  # which of them are placed chunk tokens
    n_chunk = int(chunk.sum())

    def metas(pos: torch.Tensor):
        p = pos.tolist()
        return runner.build_batch([BatchItem([tokens[i] for i in p], p[0], table, "none", positions=p)])

    batch = metas(at)
    h = F.embedding(batch.input_ids, model.embed).to(model.residual_dtype)
    cos, sin = model.rope(batch.positions)
    for li, layer in enumerate(model.layers):
        kc, vc = pool.kv[li, 0], pool.kv[li, 1]
        meta = batch.metas[layer.window]
        t = at.shape[0]
        qkv = layer.qkv(model.rms(h, layer.input_norm)).view(t, nh + 2 * nkv, d)
        qk = qkv[:, : nh + nkv]
        if layer.qk_norm is not None:
            qk = model.rms(qk, layer.qk_norm)
        qk = model.rotate(qk, cos, sin)
        q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :]
        share = shares.get(li)
        keep = None
        if share is not None and bool(chunk.any()):
            keep = keep_rows(kc, vc, meta.slot_mapping, k, v, chunk, math.ceil(share * n_chunk), quant)
        model.store_kv(kc, vc, meta.slot_mapping, k, v, quant=quant)
        if keep is not None and keep.shape[0] < t:
            at, chunk, h, q, cos, sin = at[keep], chunk[keep], h[keep], q[keep], cos[keep], sin[keep]
            if at.shape[0] == 0:
                return 0
            batch = metas(at)
            meta = batch.metas[layer.window]
        o = model.attention(q, kc, vc, meta, model.scale, quant=quant).reshape(at.shape[0], nh * d)
        h = h + layer.o(o)
        g, u = layer.gate_up(model.rms(h, layer.post_norm)).chunk(2, dim=-1)
        h = h + layer.down(F.silu(g) * u)
    return int(chunk.sum())


def keep_rows(kc, vc, slots, k, v, chunk: torch.Tensor, n: int, quant: str | None) -> torch.Tensor:
    """Rows to go on: every non-chunk row, and the ``n`` chunk rows whose fresh ``k``, ``v``
    deviate most from the rows stored at ``slots`` (the reused KV), in ascending order."""
    kv_heads, row = kc.shape[-2:]
    old_k, old_v = kc.view(-1, kv_heads, row).index_select(0, slots), vc.view(-1, kv_heads, row).index_select(0, slots)
    if quant:
        old_k, old_v = (
            kv_quant.dequantize(old_k, quant, torch.float32),
            kv_quant.dequantize(old_v, quant, torch.float32),
        )
    dev = ((k.float() - old_k.float()) ** 2).sum(dim=(1, 2)) + ((v.float() - old_v.float()) ** 2).sum(dim=(1, 2))
    dev = torch.nan_to_num(dev, nan=3e38, posinf=3e38)  # a non-finite row deviates most: it goes on
    dev = dev.masked_fill(~chunk.to(dev.device), float("inf"))  # the tokens between the chunks always go on
    n = min(int((~chunk).sum()) + n, chunk.shape[0])
    return torch.topk(dev, n).indices.sort().values.cpu()  # indexes the positions (CPU) and the rows
