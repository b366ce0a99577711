"""Triton kernels for paged KV: ``store_kv`` and ``paged_attention`` with the torch reference's signatures.

This file is over 400 lines because the kernels share their jit helpers (tile load, dequantisation,
online softmax), which Triton cannot import from another module any more cheaply.

The contract is kernels/attention.py's (cache layout ``[num_blocks, block_size, kv_heads, head_dim]``,
``AttentionMetadata`` from ``build_metadata``) and, for quantised KV (``quant="int8"`` or ``"fp8_e4m3"``),
kernels/kv_quant.py's: uint8 rows of ``head_dim + 4``, the quantised elements then the row's float32
scale. The torch reference is the oracle these kernels are tested against (tests/support/triton_kernel_cases.py,
under ``TRITON_INTERPRET=1`` on CPU).

- ``store_kv``: one program per new token writes its K and V rows into its slot; with ``quant`` it
  quantises them on the way (absmax per row, the scale, round or cast) and writes the bytes and the
  scale, bit for bit what ``kv_quant.quantize`` writes.
- decode (one query per sequence), flash-decoding style: grid (rows, kv heads, splits). A program
  reads one split of a row's keys ``[lo, hi)`` through its block table once for all the query heads
  of its KV head (GQA), and writes an unnormalised partial output with its running max and sum; a
  second kernel merges the splits of each (row, head).
- prefill (new tokens over a cached prefix, variable lengths, one launch for every prefill of the step):
  grid (prefills, query tiles, heads); the queries are the last ``q_len`` of ``kv_len`` positions, so a
  prefix may end anywhere inside a block; causal, with the sliding window as a lower key bound.

Numerics: loads are upcast to fp32, softmax and accumulation are fp32 (Triton's interpreter computes
bf16 wrongly). The two matmuls take fp32 operands ("ieee", no TF32) when the cache is fp32 or when
interpreting; on a GPU with a 16-bit cache they take 16-bit operands (exact products, fp32
accumulation); the probabilities are then rounded to 16 bits before P.V, as flash attention does.
Quantised tiles are dequantised in registers (element x its row's scale, in fp32; on a GPU with 16-bit
queries then rounded to the query dtype, as the reference's dequantise-to-``q.dtype`` does), so a
decode step reads ``head_dim + 4`` bytes per row instead of ``2 * head_dim``.
fp8 e4m3 is encoded and decoded with integer ops on the uint8 bytes, not Triton's float8 type: the
interpreter's float8e4nv cast rounds wrongly at mantissa carries (checked with triton 3.9) and native
float8e4nv needs sm89+, while the integer form is exact everywhere (round to nearest even, as torch's
cast; subnormals; 0x7f/0xff are NaN). int8 rounding is integer RNE too (no libdevice in the interpreter).

Per step, the metadata is packed into int32 device tensors once and kept in ``meta.scratch`` for
every layer. Nothing here synchronises with the device: every launch size comes from host ints.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from chatkv.kernels import attention as reference
from chatkv.kernels import kv_quant
from chatkv.kernels.attention import AttentionMetadata

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# keys per decode split; None = chosen from the batch so that rows x kv heads x splits fills the device.
# Tests set it to force one split or many.
DECODE_SPLIT_TOKENS: int | None = None
NEG_BIG = tl.constexpr(-1.0e30)  # the running max starts here, finite, so a tile with every key masked adds 0 (not NaN)
QUANT_CODES = {None: 0, "int8": 1, "fp8_e4m3": 2}  # the kernels' QUANT constexpr


@triton.jit
def _rne_shr(m, shift):
    """``m >> shift`` rounded to nearest, ties to even (int32, ``m >= 0``, ``1 <= shift <= 30``)."""
    return (m + (1 << (shift - 1)) - 1 + ((m >> shift) & 1)) >> shift


@triton.jit
def _int8_rne(y):
    """fp32 ``y`` (finite, ``|y| <= 127``) rounded to the nearest integer, ties to even, as int8 (torch's round)."""
    u = tl.abs(y).to(tl.int32, bitcast=True)
    e = u >> 23
    m = (u & 0x7FFFFF) | 0x800000  # |y| = m * 2^(e - 150)
    r = tl.where(e < 126, 0, _rne_shr(m, tl.minimum(tl.maximum(150 - e, 1), 30)))  # |y| < 0.5 -> 0
    return tl.where(y < 0, -r, r).to(tl.int8)


@triton.jit
def _fp8_e4m3_bits(y):
    """fp32 ``y`` (``|y| <= 448``) as float8_e4m3fn bits (uint8), rounded to nearest even like torch's cast."""
    bits = y.to(tl.int32, bitcast=True)
    u = bits & 0x7FFFFFFF
    e = u >> 23
    # normal e4m3 (|y| >= 2^-6): keep 3 mantissa bits (a carry moves into the exponent), rebias 127 -> 7
    normal = _rne_shr(u, 20) - (120 << 3)
    # subnormal e4m3: multiples of 2^-9, i.e. round(|y| * 2^9); m * 2^(e - 150 + 9); 8 is the smallest normal
    m = (u & 0x7FFFFF) | 0x800000
    sub = _rne_shr(m, tl.minimum(tl.maximum(141 - e, 1), 30))
    mag = tl.where(e >= 121, normal, sub)
    return (tl.where(bits < 0, mag | 0x80, mag)).to(tl.uint8)


@triton.jit
def _fp8_e4m3_value(b):
    """float8_e4m3fn bits (uint8) -> fp32: sign, 4-bit exponent with bias 7, 3-bit mantissa; 0x7f/0xff are NaN."""
    x = b.to(tl.int32)
    mag = x & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    sub = mag.to(tl.float32) * 0.001953125  # exponent field 0: mantissa x 2^-9
    v = tl.where(mag < 8, sub, normal)
    v = tl.where(mag == 0x7F, float("nan"), v)
    return tl.where(x >= 128, -v, v)


@triton.jit
def _store_rows(
    x, cache_ptr, scale_ptr, row, d, mask, row_ok, D: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr
):
    """Write rows ``x`` [heads, D_PAD] at element offsets ``row`` [heads, 1]: as they are (QUANT 0, cast to the
    cache's dtype), or quantised as kv_quant.quantize does: scale = amax / QMAX (NaN when a row holds a NaN),
    q = round/cast(clamp(x / scale)) (zeros when scale is 0 or NaN), both divisions correctly rounded, and the
    scale at float index (row + D) / 4 of the cache's fp32 view."""
    if QUANT == 0:
        tl.store(cache_ptr + row + d, x.to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        x = x.to(tl.float32)
        amax = tl.max(tl.abs(x), 1)
        has_nan = tl.max((x != x).to(tl.int32), 1) > 0  # tl.max drops NaN on a GPU; torch's amax keeps it
        scale = tl.where(has_nan, float("nan"), tl.math.div_rn(amax, QMAX))
        ok = (scale > 0)[:, None]
        y = tl.where(ok, tl.math.div_rn(x, tl.where(ok, scale[:, None], 1.0)), 0.0)  # a zero or NaN-scaled row: zeros
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        if QUANT == 1:
            tl.store(cache_ptr + row + d, _int8_rne(y), mask=mask)
        else:
            tl.store(cache_ptr + row + d, _fp8_e4m3_bits(y), mask=mask)
        tl.store(scale_ptr + (row + D) // 4, scale[:, None], mask=row_ok)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    block_size,
    KV_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    h_ok = h < KV_HEADS
    mask = h_ok & (d < D)
    row = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + h * stride_ch
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    _store_rows(k, k_cache_ptr, k_scale_ptr, row, d, mask, h_ok, D, QUANT, QMAX)
    _store_rows(v, v_cache_ptr, v_scale_ptr, row, d, mask, h_ok, D, QUANT, QMAX)


def _views(cache: torch.Tensor, quant: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements, scales) views a kernel takes of a cache: int8 elements or fp8 bits (uint8) and the float32
    view whose index (row offset + head_dim) / 4 is a row's scale; an unquantised cache is both."""
    if quant is None:
        return cache, cache
    assert cache.dtype == kv_quant.STORAGE, f"a {quant} cache holds {kv_quant.STORAGE}, not {cache.dtype}"
    elem = cache.view(torch.int8) if quant == "int8" else cache  # fp8: decoded from its bytes in the kernel
    return elem, cache.view(torch.float32)  # the view checks that every stride is a multiple of 4 bytes


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    quant: str | None = None,
) -> None:
    """Write new keys/values ``[tokens, kv_heads, head_dim]`` into their slots (as the reference does); with
    ``quant`` the caches hold kv_quant rows and the new ones are quantised in the kernel."""
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    row = kv_quant.row_width(quant, head_dim)
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(), "k and v caches differ in layout"
    assert k_cache.shape[-2:] == (kv_heads, row) and v.shape == k.shape, (k_cache.shape, k.shape, v.shape)
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1, "head_dim must be contiguous"
    assert slot_mapping.shape == (tokens,), (slot_mapping.shape, tokens)
    (kc, ks), (vc, vs) = _views(k_cache, quant), _views(v_cache, quant)
    _store_kv_kernel[(tokens,)](
        k,
        v,
        kc,
        vc,
        ks,
        vs,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[1],
        KV_HEADS=kv_heads,
        H_PAD=triton.next_power_of_2(kv_heads),
        D=head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
        QUANT=QUANT_CODES[quant],
        QMAX=kv_quant.FORMATS[quant][1] if quant else 0.0,
    )


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    """a @ b with fp32 accumulation: fp32 operands (no TF32) or the 16-bit storage type of the cache."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _load_rows(cache_ptr, scale_ptr, off, valid, d, D: tl.constexpr, QUANT: tl.constexpr):
    """Rows at element offsets ``off`` (``valid`` ones; zeros elsewhere): as stored, or dequantised to fp32."""
    x = tl.load(cache_ptr + off[:, None] + d[None, :], mask=valid[:, None] & (d[None, :] < D), other=0)
    if QUANT != 0:
        if QUANT == 1:
            x = x.to(tl.float32)
        else:
            x = _fp8_e4m3_value(x)
        x = x * tl.load(scale_ptr + (off + D) // 4, mask=valid, other=0.0)[:, None]
    return x


@triton.jit
def _kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    table,
    pos,
    valid,
    block_size,
    stride_cb,
    stride_cs,
    kvh,
    stride_ch,
    d,
    D: tl.constexpr,
    QUANT: tl.constexpr,
):
    """The keys and values of context positions ``pos`` (``valid`` ones; zeros elsewhere) through the block table."""
    blk = tl.load(table + pos // block_size, mask=valid, other=0).to(tl.int64)
    off = blk * stride_cb + (pos % block_size).to(tl.int64) * stride_cs + kvh * stride_ch
    k = _load_rows(k_cache_ptr, k_scale_ptr, off, valid, d, D, QUANT)
    v = _load_rows(v_cache_ptr, v_scale_ptr, off, valid, d, D, QUANT)
    return k, v


@triton.jit
def _operands(q, k_cache_ptr, QUANT: tl.constexpr, DOT_F32: tl.constexpr):
    """The queries in the matmuls' operand dtype: fp32, the 16-bit cache's dtype, or (quantised) their own."""
    if DOT_F32:
        q = q.to(tl.float32)
    elif QUANT == 0:
        q = q.to(k_cache_ptr.dtype.element_ty)
    return q


@triton.jit
def _online_softmax(scores, v, m_i, l_i, acc, DOT_F32: tl.constexpr):
    """One tile of the running softmax: the new max, normaliser and weighted sum of values."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_F32:
        acc = acc * alpha[:, None] + _dot(p, v, DOT_F32)
    else:
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_F32)
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    rows_ptr,
    tables_ptr,
    bounds_ptr,
    part_o_ptr,
    part_ml_ptr,
    scale,
    split_len,
    num_splits,
    table_stride,
    block_size,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
    QUANT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    lo = tl.load(bounds_ptr + 2 * b)
    hi = tl.load(bounds_ptr + 2 * b + 1)
    start = lo + s * split_len
    end = tl.minimum(start + split_len, hi)
    row = tl.load(rows_ptr + b).to(tl.int64)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    head = kvh * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < D)
    q = tl.load(q_ptr + row * stride_qt + head[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    q = _operands(q, k_cache_ptr, QUANT, DOT_F32)

    m_i = tl.full([G_PAD], NEG_BIG, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    table = tables_ptr + b.to(tl.int64) * table_stride
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        k, v = _kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            table,
            pos,
            valid,
            block_size,
            stride_cb,
            stride_cs,
            kvh,
            stride_ch,
            d,
            D,
            QUANT,
        )
        k, v = k.to(q.dtype), v.to(q.dtype)  # no-op unless dequantised tiles meet 16-bit queries on a GPU
        scores = _dot(q, tl.trans(k), DOT_F32) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_i, l_i, acc = _online_softmax(scores, v, m_i, l_i, acc, DOT_F32)

    # partials laid out [rows, heads, splits, ...]
    part = (b.to(tl.int64) * HEADS + head) * num_splits + s
    g_ok = g < GROUP
    tl.store(part_o_ptr + part[:, None] * D_PAD + d[None, :], acc, mask=g_ok[:, None])
    tl.store(part_ml_ptr + part * 2, m_i, mask=g_ok)
    tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_ok)


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    rows_ptr,
    part_o_ptr,
    part_ml_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    HEADS: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = s < num_splits
    part = (b.to(tl.int64) * HEADS + h) * num_splits + s
    m = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=NEG_BIG)
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)
    o = tl.load(part_o_ptr + part[:, None] * D_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp(m - m_max)  # an empty split has m = NEG_BIG, l = 0: weight 0
    total = tl.sum(l * w, 0)
    o = tl.sum(o * w[:, None], 0) / total
    row = tl.load(rows_ptr + b).to(tl.int64)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    starts_ptr,
    qlens_ptr,
    kvlens_ptr,
    tables_ptr,
    scale,
    window,
    table_stride,
    block_size,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_F32: tl.constexpr,
    QUANT: tl.constexpr,
):
    p_id = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(starts_ptr + p_id)
    q_len = tl.load(qlens_ptr + p_id)
    kv_len = tl.load(kvlens_ptr + p_id)

    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    q_ok = i < q_len
    q_pos = kv_len - q_len + i  # the queries are the last q_len positions of the context
    rows = (q_start + i).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :], mask=q_ok[:, None] & (d[None, :] < D), other=0.0
    )
    q = _operands(q, k_cache_ptr, QUANT, DOT_F32)

    # keys this tile can see: [lo, hi); a tile past q_len gets an empty range
    first = kv_len - q_len + tile * BLOCK_M
    hi = tl.minimum(first + BLOCK_M, kv_len)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first - window + 1, 0)
    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = tables_ptr + p_id.to(tl.int64) * table_stride
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < hi
        k, v = _kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            table,
            pos,
            valid,
            block_size,
            stride_cb,
            stride_cs,
            kvh,
            stride_ch,
            d,
            D,
            QUANT,
        )
        k, v = k.to(q.dtype), v.to(q.dtype)  # no-op unless dequantised tiles meet 16-bit queries on a GPU
        scores = _dot(q, tl.trans(k), DOT_F32) * scale
        allowed = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(allowed, scores, float("-inf"))
        m_i, l_i, acc = _online_softmax(scores, v, m_i, l_i, acc, DOT_F32)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=q_ok[:, None] & (d[None, :] < D),
    )


def _packed(meta: AttentionMetadata, device: torch.device) -> dict:
    """The step's metadata as int32 device tensors, built once per step and shared by every layer."""
    packed = meta.scratch.get("triton")
    if packed is not None:
        return packed
    packed = {}
    if meta.prefills:
        n = max(p.blocks.shape[0] for p in meta.prefills)
        tables = torch.zeros(len(meta.prefills), n, dtype=torch.int32, device=device)
        for i, p in enumerate(meta.prefills):
            tables[i, : p.blocks.shape[0]] = p.blocks
        info = torch.tensor([[p.start, p.q_len, p.kv_len] for p in meta.prefills], dtype=torch.int32).T.contiguous()
        packed["prefill"] = (tables, info.to(device), max(p.q_len for p in meta.prefills))
    if meta.decode_rows is not None:
        b = meta.decode_rows.shape[0]
        assert meta.decode_bounds is not None and len(meta.decode_bounds) == b, "metadata lacks decode_bounds"
        bounds = torch.tensor(meta.decode_bounds, dtype=torch.int32).to(device)
        packed["decode"] = (
            meta.decode_rows.to(torch.int32),
            meta.decode_blocks.view(b, -1).to(torch.int32),
            bounds,
            max(hi - lo for lo, hi in meta.decode_bounds),
        )
    meta.scratch["triton"] = packed
    return packed


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _decode_splits(rows: int, kv_heads: int, span: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """(number of splits, keys per split): enough programs for about two waves over the device."""
    tiles = triton.cdiv(span, block_n)
    if DECODE_SPLIT_TOKENS is not None:
        split_len = triton.cdiv(DECODE_SPLIT_TOKENS, block_n) * block_n
    else:
        want = max(1, triton.cdiv(2 * _num_sms(device), rows * kv_heads))
        split_len = triton.cdiv(tiles, min(tiles, want)) * block_n
    return triton.cdiv(span, split_len), split_len


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    quant: str | None = None,
) -> torch.Tensor:
    """Attention of the step's queries ``[tokens, heads, head_dim]`` over their paged contexts (see the reference);
    with ``quant`` the caches hold kv_quant rows, dequantised tile by tile in the kernels."""
    if any(p.scattered for p in meta.prefills):  # queries at given positions: the reference's masks
        return reference.paged_attention(q, k_cache, v_cache, meta, scale, quant)
    tokens, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    row = kv_quant.row_width(quant, head_dim)
    assert group * kv_heads == heads and k_cache.shape[-1] == row, (q.shape, k_cache.shape, quant)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and q.stride(2) == 1
    # fp32 operands: interpreting, an fp32 cache, or quantised KV under fp32 queries
    dot_f32 = INTERPRET or k_cache.dtype == torch.float32 or (quant is not None and q.dtype == torch.float32)
    (kc, ks), (vc, vs) = _views(k_cache, quant), _views(v_cache, quant)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    packed = _packed(meta, q.device)
    out = torch.empty_like(q)
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    if "prefill" in packed:
        tables, info, max_q = packed["prefill"]
        block_m = 16 if INTERPRET else 64
        block_n = 16 if INTERPRET else (64 if d_pad <= 64 else 32)
        window = meta.sliding_window
        grid = (tables.shape[0], triton.cdiv(max_q, block_m), heads)
        _prefill_kernel[grid](
            q,
            kc,
            vc,
            ks,
            vs,
            out,
            info[0],
            info[1],
            info[2],
            tables,
            scale,
            window or 0,
            tables.shape[1],
            block_size,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            *cache_strides,
            GROUP=group,
            D=head_dim,
            D_PAD=d_pad,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            HAS_WINDOW=window is not None,
            DOT_F32=dot_f32,
            QUANT=QUANT_CODES[quant],
        )
    if "decode" in packed:
        rows, tables, bounds, span = packed["decode"]
        b = rows.shape[0]
        block_n = 16 if INTERPRET else 64
        splits, split_len = _decode_splits(b, kv_heads, span, block_n, q.device)
        part_o = torch.empty(b, heads, splits, d_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(b, heads, splits, 2, dtype=torch.float32, device=q.device)
        _decode_split_kernel[(b, kv_heads, splits)](
            q,
            kc,
            vc,
            ks,
            vs,
            rows,
            tables,
            bounds,
            part_o,
            part_ml,
            scale,
            split_len,
            splits,
            tables.shape[1],
            block_size,
            q.stride(0),
            q.stride(1),
            *cache_strides,
            HEADS=heads,
            GROUP=group,
            G_PAD=max(16, triton.next_power_of_2(group)),
            D=head_dim,
            D_PAD=d_pad,
            BLOCK_N=block_n,
            DOT_F32=dot_f32,
            QUANT=QUANT_CODES[quant],
        )
        _decode_reduce_kernel[(b, heads)](
            out,
            rows,
            part_o,
            part_ml,
            out.stride(0),
            out.stride(1),
            splits,
            HEADS=heads,
            D=head_dim,
            D_PAD=d_pad,
            S_PAD=triton.next_power_of_2(splits),
        )
    return out
