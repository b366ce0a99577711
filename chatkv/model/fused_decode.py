"""The decode step of the quantised modes through the fused CPU ops (chatkv.kernels.cpu_decode).

``LlamaModel.forward`` calls ``forward`` here first; it computes the step when every row is a
one-token query (decodes, and speculative decoding's verification rows) over full-attention,
bfloat16 KV, in a mode whose residual stream is float32 (int4/int8 weights), and returns None
otherwise, so that the model's torch ops compute it. Same inputs and outputs as the model's
forward; per layer: ``add_rms`` (residual + RMSNorm), ``decode_attention`` (RoPE, KV store,
attention), ``silu_mul``, and the 4 projections, instead of ~160 torch ops
(tests/model/test_cpu_decode.py: both paths on the default model, and each op against its formula).

Every row attends over exactly its own keys, so a row's logits do not depend on what else is in
the step: a verified proposal's logits are its plain decode's, bit for bit, as speculative
decoding needs (chatkv.engine.model_runner).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chatkv.kernels import cpu_decode


def kernels_available() -> bool:
    """Whether the fused ops are built (once, into chatkv's cache directory) and loaded here."""
    done = cpu_decode.loaded()
    if done is not None:  # asked once per prefill step and projection (chatkv.model.prefill)
        return done
    from chatkv.storage.paths import cache_dir

    return cpu_decode.load(cache_dir() / "kernels")


def supported(model) -> bool:
    """Whether ``model``'s decode steps can take the fused ops at all (checked once, at load)."""
    return (
        model.residual_dtype == torch.float32
        and model.dtype == torch.bfloat16
        and model.device.type == "cpu"
        and model.windows == [None]
        and model.min_rows == 1
        and all(layer.qk_norm is None for layer in model.layers)
        and cpu_decode.heads_supported(model.num_heads, model.num_kv_heads, model.head_dim)
        and kernels_available()
    )


def _rows(meta, t: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(blocks ``[t, n]``, context lengths ``[t]``, the longest) of a step whose every row is a
    one-token query; None when some row is part of a longer chunk."""
    if meta.decode_rows is not None and not meta.prefills and meta.decode_rows.shape[0] == t:
        # decode-only (rows in item order, 0..t-1): the padded block table of the decode call
        his = [hi for _, hi in meta.decode_bounds]
        return meta.decode_blocks.view(t, -1), torch.tensor(his, dtype=torch.long), max(his)
    if any(p.q_len != 1 for p in meta.prefills):
        return None
    tables: list[list[int] | None] = [None] * t
    ctx = [0] * t
    for p in meta.prefills:  # exact one-token rows: their own blocks, unmasked
        tables[p.start], ctx[p.start] = p.blocks.tolist(), p.kv_len
    if meta.decode_rows is not None:
        n = meta.decode_blocks.shape[0] // meta.decode_rows.shape[0]
        blocks = meta.decode_blocks.view(-1, n).tolist()
        for i, row in enumerate(meta.decode_rows.tolist()):
            tables[row], ctx[row] = blocks[i], meta.decode_bounds[i][1]
    if any(tb is None for tb in tables):
        return None
    width = max(len(tb) for tb in tables)
    padded = [tb + tb[-1:] * (width - len(tb)) for tb in tables]
    return torch.tensor(padded, dtype=torch.long), torch.tensor(ctx, dtype=torch.long), max(ctx)


def forward(
    model,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv: torch.Tensor,
    metas: dict,
    logits_rows: torch.Tensor,
    quant: str | None,
) -> torch.Tensor | None:
    """``LlamaModel.forward`` of this step through the fused ops, or None (see the module doc)."""
    if quant is not None or kv.dtype != torch.bfloat16 or not model.fused_decode:
        return None
    t = input_ids.shape[0]
    meta = metas[None]
    if model.invariant:
        return _invariant(model, input_ids, positions, kv, meta, logits_rows)
    got = _rows(meta, t)
    if got is None:
        return None
    blocks, ctx, max_ctx = got
    return _step(model, input_ids, positions, kv, meta.slot_mapping, blocks, ctx, max_ctx, logits_rows)


def _invariant(model, input_ids, positions, kv, meta, logits_rows) -> torch.Tensor:
    """A deterministic model's step, whatever its rows: prefill chunks too, each token a one-token
    query over its own keys (``meta.scratch["rows"]``: chatkv.engine.model_runner.build_batch). A
    step of up to ``INT4_MM_ROWS`` rows is a decode step's fused ops; a wider one computes the same
    numbers with its projections over all rows at once (``int4_mm_many``: each weight tile decoded
    once) and its attention ``rows_attention``'s 16 rows a call after ``rope_store`` (the two parts
    of ``decode_attention``). A row's numbers are its own either way."""
    blocks, ctx = meta.scratch["rows"]
    if input_ids.shape[0] <= cpu_decode.INT4_MM_ROWS:
        return _step(model, input_ids, positions, kv, meta.slot_mapping, blocks, ctx, int(ctx.max()), logits_rows)
    from chatkv.kernels import cpu_invariant

    weights = model.fused_norm_weights()
    h = F.embedding(input_ids, model.embed).to(torch.float32)
    table = model.rope_table(positions)
    slots = meta.slot_mapping.contiguous()
    nh, nkv, d = model.num_heads, model.num_kv_heads, model.head_dim
    # the step's norms and silu_mul; its own attention (and that attention's scratch) is not used
    step = cpu_decode.DecodeStep(
        h, table, positions.contiguous(), slots, blocks, ctx, 1, kv, nh, nkv, d,
        model.layers[0].gate_up.out_features // 2, model.scale, model.eps,
    )  # fmt: skip
    normed = step.norm(None, weights[0])
    for i, layer in enumerate(model.layers):
        k_cache, v_cache = kv[i, 0], kv[i, 1]
        q = cpu_invariant.rope_store(layer.qkv(normed), table, positions, k_cache, v_cache, slots, nh, nkv)
        o = cpu_invariant.rows_attention(q, k_cache, v_cache, blocks, None, ctx, model.scale).view(-1, nh * d)
        normed = step.norm(layer.o(o), weights[2 * i + 1])
        normed = step.norm(layer.down(step.silu_mul(layer.gate_up(normed))), weights[2 * i + 2])
    return model.lm_head(normed.index_select(0, logits_rows)).float()


def _step(model, input_ids, positions, kv, slots, blocks, ctx, max_ctx, logits_rows):
    """The fused ops over one step's rows (each a one-token query); the logits of ``logits_rows``."""
    weights = model.fused_norm_weights()
    h = F.embedding(input_ids, model.embed).to(torch.float32)
    table = model.rope_table(positions)  # grown to this step's positions
    step = cpu_decode.DecodeStep(
        h,
        table,
        positions.contiguous(),
        slots.contiguous(),
        blocks.contiguous(),
        ctx,
        max_ctx,
        kv,
        model.num_heads,
        model.num_kv_heads,
        model.head_dim,
        model.layers[0].gate_up.out_features // 2,
        model.scale,
        model.eps,
    )
    normed = step.norm(None, weights[0])
    for i, layer in enumerate(model.layers):
        o = step.attention(layer.qkv(normed), i)
        normed = step.norm(layer.o(o), weights[2 * i + 1])
        normed = step.norm(layer.down(step.silu_mul(layer.gate_up(normed))), weights[2 * i + 2])
    return model.lm_head(normed.index_select(0, logits_rows)).float()
