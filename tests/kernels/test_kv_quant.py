"""kernels/kv_quant.py (int8 and fp8_e4m3 rows with their float32 scale) and the torch reference's
attention over quantised caches.

What is held, per row of ``head_dim`` values ``x`` with ``scale = max|x| / QMAX``:
- int8: ``|x - dq| <= (1/2 + 2^-16) * scale`` per element (half a quantisation step, plus the float32
  rounding of ``x / scale`` and of ``q * scale``, at most 2 * 127 * 2^-24 steps);
- fp8 e4m3: ``|x - dq| <= 2^-4 * |x| + 2^-10 * scale`` per element (3 mantissa bits: half an ulp is at most
  2^-4 of the value for normals; subnormals are multiples of 2^-9 * scale);
- a zero row has scale 0, zero bytes, and dequantises to zeros; so does a row whose scale underflows
  float32 (``max|x| < QMAX * 2^-149``, about 1.8e-43 for int8): an error below 1e-42;
- subnormal scales (``max|x|`` below ~1.5e-36) and huge rows (up to float32's max) round-trip within the
  bounds' relative size;
- requantising a dequantised row gives the same bytes (checked on rows from 1e-20 to 1e20);
- a row holding a NaN has a NaN scale and one holding an inf (and no NaN) an inf scale; either dequantises
  to non-finite values only (so attention over it is NaN, as over float KV). Other rows are untouched.

Attention over quantised caches (``paged_attention(..., quant=...)``) equals the float reference over the
whole cache dequantised first, bit for bit (tolerance 0: the same values, gathered then dequantised
instead of dequantised then gathered, into the query dtype), for fp32 and bf16 queries. Against the
original float K/V it is within 0.04 (int8) and 0.2 (fp8) max abs error on these O(1) outputs (N(0, 1)
K/V, head_dim 64, 8 x 150 rows of 64; measured 0.024 and 0.113: about one value step, scale / 2 for int8
and 2^-4 of a value for fp8, since an output is a convex mix of values).
"""

from __future__ import annotations

import math

import pytest
import torch

from chatkv.kernels import kv_quant
from chatkv.kernels.attention import build_metadata, paged_attention, store_kv
from tests.kernels.test_attention_naive import MIXED, make_case

QUANTS = list(kv_quant.FORMATS)


def rows(n=2000, d=64, seed=0):
    """Rows of N(0, 1) values, row magnitudes from 1e-20 to 1e20, a few outliers per row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.logspace(-20, 20, n)[:, None]
    x[::7, 3] *= 50  # an outlier channel: the rest of the row gets coarser steps
    return x


@pytest.mark.parametrize("quant", QUANTS)
def test_layout_round_trip_bounds_and_requantise(quant):
    x = rows()
    r = kv_quant.quantize(x, quant)
    assert r.dtype == torch.uint8 and r.shape == (*x.shape[:-1], kv_quant.row_width(quant, 64))
    s = kv_quant.scales(r)
    assert torch.equal(s, x.abs().amax(-1) / kv_quant.FORMATS[quant][1])
    assert torch.equal(r[..., 64:].contiguous().view(torch.float32)[..., 0], s)  # the scale's 4 bytes, native order
    dq = kv_quant.dequantize(r, quant, torch.float32)
    err = (x - dq).abs()
    if quant == "int8":
        assert (err <= (0.5 + 2**-16) * s[:, None]).all()
        assert torch.equal(
            r[..., :64].view(torch.int8).abs().amax(-1), torch.full((x.shape[0],), 127, dtype=torch.int8)
        )
    else:
        assert (err <= 2**-4 * x.abs() + 2**-10 * s[:, None]).all()
    assert torch.equal(kv_quant.quantize(dq, quant), r)  # requantising loses nothing more
    # other dtypes in and out: fp16/bf16 inputs are quantised from their exact fp32 value; dequantise rounds once
    h = x[900:1100].half()
    assert torch.equal(kv_quant.quantize(h, quant), kv_quant.quantize(h.float(), quant))
    rh = kv_quant.quantize(h, quant)
    for dt in (torch.float16, torch.bfloat16):
        assert torch.equal(kv_quant.dequantize(rh, quant, dt), kv_quant.dequantize(rh, quant, torch.float32).to(dt))


@pytest.mark.parametrize("quant", QUANTS)
def test_zero_tiny_and_huge_rows(quant):
    qmax = kv_quant.FORMATS[quant][1]
    x = torch.zeros(5, 16)
    x[0] = -0.0  # zero rows: scale 0, zero bytes (no sign bits), zeros out
    g = torch.Generator().manual_seed(1)
    for i, amax in ((2, 1e-40), (3, 3.0e38), (4, 1e-44)):  # subnormal scale, near float32's max, scale underflows
        y = torch.randn(16, generator=g)
        x[i] = y / y.abs().max() * amax
    r = kv_quant.quantize(x, quant)
    dq = kv_quant.dequantize(r, quant, torch.float32)
    s = kv_quant.scales(r)
    for i in (0, 1, 4):
        assert s[i] == 0 and not r[i].any() and not dq[i].any(), i
    assert dq.isfinite().all()
    assert 1e-44 < qmax * 2.0**-149  # row 4's scale underflowed: that is why it is zeros
    step = 0.5 if quant == "int8" else 0.0625 * qmax  # error bound in units of the scale, at the row's max
    for i in (2, 3):
        assert (x[i] - dq[i]).abs().max() <= 1.01 * step * x[i].abs().max() / qmax, i


@pytest.mark.parametrize("quant", QUANTS)
def test_nan_and_inf_rows(quant):
    x = rows(6, 8)
    x[1, 2] = float("nan")
    x[3, 0] = float("inf")
    x[4, 1] = -float("inf")
    x[4, 5] = float("nan")
    r = kv_quant.quantize(x, quant)
    s = kv_quant.scales(r)
    assert s[1].isnan() and s[3].isinf() and s[4].isnan()
    dq = kv_quant.dequantize(r, quant, torch.float32)
    bad = torch.tensor([False, True, False, True, True, False])
    assert not dq[bad].isfinite().any() and dq[~bad].isfinite().all()
    assert torch.equal(r[~bad], kv_quant.quantize(x[~bad], quant))  # rows are independent


def test_bad_format_and_head_dim():
    with pytest.raises(ValueError, match="int4"):
        kv_quant.quantize(torch.zeros(2, 8), "int4")
    with pytest.raises(AssertionError, match="head_dim"):
        kv_quant.row_width("int8", 6)
    assert kv_quant.row_width(None, 6) == 6 and kv_quant.row_width("fp8_e4m3", 64) == 68


def quantised_step(quant, block_size, heads=8, kv_heads=2, d=64, window=None, seed=0):
    q, kc, vc, tables, qlens, ctxs, new_k, new_v, _, _ = make_case(
        seed + block_size, block_size, MIXED, heads, kv_heads, d
    )
    meta = build_metadata(tables, qlens, ctxs, block_size, sliding_window=window)
    float_k, float_v = kc.clone(), vc.clone()
    store_kv(float_k, float_v, meta.slot_mapping, new_k, new_v)
    kc, vc = kv_quant.quantize(kc, quant), kv_quant.quantize(vc, quant)  # unwritten slots: garbage, quantised
    store_kv(kc, vc, meta.slot_mapping, new_k, new_v, quant=quant)
    return q, kc, vc, meta, float_k, float_v


@pytest.mark.parametrize("quant", QUANTS)
def test_store_kv_writes_quantised_rows(quant):
    q, kc, vc, meta, float_k, float_v = quantised_step(quant, 5)
    for cache, floats in ((kc, float_k), (vc, float_v)):
        got = cache.view(-1, 2, 68)[meta.slot_mapping]
        assert torch.equal(got, kv_quant.quantize(floats.view(-1, 2, 64)[meta.slot_mapping], quant))


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("quant", QUANTS)
def test_attention_equals_dequantise_then_reference(quant, block_size, window):
    """The reference with ``quant`` (prefills dequantise the gathered rows; decodes apply the scales to
    scores and probabilities) against dequantising the whole cache and running the float reference:
    within 1e-5 in fp32 (the same values, the products in another order) and 2e-2 in bf16 queries (a
    few bf16 roundings of O(1) outputs apart); and against the unquantised K/V, the quantisation error
    itself: 0.04 (int8), 0.2 (fp8)."""
    q, kc, vc, meta, float_k, float_v = quantised_step(quant, block_size, window=window)
    scale = 1 / math.sqrt(64)
    got = paged_attention(q, kc, vc, meta, scale, quant=quant)
    dk, dv = kv_quant.dequantize(kc, quant, torch.float32), kv_quant.dequantize(vc, quant, torch.float32)
    torch.testing.assert_close(got, paged_attention(q, dk, dv, meta, scale), rtol=0, atol=1e-5)
    qb = q.bfloat16()
    want_b = paged_attention(qb, dk.bfloat16(), dv.bfloat16(), meta, scale)
    torch.testing.assert_close(paged_attention(qb, kc, vc, meta, scale, quant=quant), want_b, rtol=0, atol=2e-2)
    err = (got - paged_attention(q, float_k, float_v, meta, scale)).abs().max().item()
    assert err <= {"int8": 0.04, "fp8_e4m3": 0.2}[quant], err
