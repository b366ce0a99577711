"""The row-invariant kernels of a deterministic engine (chatkv.kernels.cpu_invariant): each row's
numbers are the same alone, among other rows of any number and on 1 or 2 threads, on every path
this machine has (AMX, AVX512-BF16, plain C), and close to float64 at the product's real sizes
(the default model's projections and output matrix, a 1.7B model's MLP)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chatkv.kernels import cpu_decode
from chatkv.model.fused_decode import kernels_available

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C compiler for the CPU kernels here")

# (in, out): the default model's qkv, gate_up, down, output matrix; a 1.7B model's gate_up slice; odd sizes
SHAPES = [(576, 960), (576, 3072), (1536, 576), (576, 49152), (2048, 2048), (64, 40), (576, 1000)]
ROWS = (1, 2, 5, 16, 17, 33, 64, 100)


def _paths():
    from chatkv.kernels import cpu_invariant

    best = cpu_invariant.PATHS.index(cpu_invariant.path())
    return list(range(best + 1))


@pytest.fixture
def path_cap():
    from chatkv.kernels import cpu_invariant

    best = cpu_invariant.path()
    yield cpu_invariant.path
    cpu_invariant.path(cpu_invariant.PATHS.index(best))


@pytest.mark.parametrize("k,n", SHAPES)
def test_rows_are_computed_alone_on_every_path(k, n, path_cap):
    from chatkv.kernels.cpu_invariant import RowInvariantLinear

    g = torch.Generator().manual_seed(k * 7 + n)
    w = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(max(ROWS), k, generator=g).bfloat16()
    exact = F.linear(x.double(), w.double(), b.double())
    threads = torch.get_num_threads()
    for p in _paths():
        name = path_cap(p)
        lin = RowInvariantLinear(w, b)
        lone = torch.cat([lin(x[r : r + 1]) for r in range(x.shape[0])])
        try:
            for t in (1, 2):
                torch.set_num_threads(t)
                for m in ROWS:
                    assert torch.equal(lin(x[:m]), lone[:m]), f"{name}: {m} rows on {t} threads"
        finally:
            torch.set_num_threads(threads)
        # each output within bf16's rounding of the exact sum (and its accumulation over k inputs)
        err = (lone.double() - exact).abs() / (exact.abs() + exact.abs().mean())
        assert err.max() < 8e-3, (name, err.max().item())


def test_float32_products():
    from chatkv.kernels.cpu_invariant import RowInvariantLinear

    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(300, 576, generator=g), torch.randn(40, 576, generator=g)
    lin = RowInvariantLinear(w)
    lone = torch.cat([lin(x[r : r + 1]) for r in range(40)])
    assert torch.equal(lin(x), lone)
    assert torch.allclose(lone.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-4)


def test_bad_inputs_are_refused():
    from chatkv.kernels.cpu_invariant import RowInvariantLinear

    with pytest.raises(ValueError, match="even input size"):
        RowInvariantLinear(torch.zeros(4, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16/fp32"):
        RowInvariantLinear(torch.zeros(4, 6, dtype=torch.float16))
    lin = RowInvariantLinear(torch.zeros(4, 6, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="input"):
        lin(torch.zeros(2, 6))  # float32 into a bf16 product
    assert lin(torch.zeros(0, 6, dtype=torch.bfloat16)).shape == (0, 4)


def _reference(q, k_cache, v_cache, table, lo, ctx, scale):
    """float64 attention of each row over keys [lo, ctx) of its table."""
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kvh
    out = []
    for r in range(q.shape[0]):
        idx = torch.tensor([table[r][j // bs] * bs + j % bs for j in range(lo[r], ctx[r])])
        k = k_cache.reshape(-1, kvh, k_cache.shape[-1])[idx].double().repeat_interleave(group, 1)
        v = v_cache.reshape(-1, kvh, v_cache.shape[-1])[idx].double().repeat_interleave(group, 1)
        s = torch.einsum("hd,khd->hk", q[r].double(), k) * scale
        out.append(torch.einsum("hk,khd->hd", s.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("window", [None, 20])
def test_rows_attention(window):
    """Rows of two sequences (one a prefill chunk, its rows sharing a block table) against float64;
    each row's output the same alone as in the step, and on 1 or 2 threads."""
    from chatkv.kernels.cpu_invariant import ROW_BLOCK, rows_attention

    g = torch.Generator().manual_seed(5)
    bs, kvh, d, nh = 16, 3, 64, 9
    k_cache = torch.randn(24, bs, kvh, d, generator=g).bfloat16()
    v_cache = torch.randn(24, bs, kvh, d, generator=g).bfloat16()
    tables = [[3, 7, 1, 9, 12, 2, 5, 8], [4, 6, 10, 11, 0, 13, 14, 15]]
    rows = [(0, p) for p in range(70, 70 + 2 * ROW_BLOCK + 3)] + [(1, 127), (1, 40)]
    table = torch.tensor([tables[s] for s, _ in rows])
    ctx = torch.tensor([p + 1 for _, p in rows])
    lo = None if window is None else (ctx - window).clamp(min=0)
    q = torch.randn(len(rows), nh, d, generator=g).bfloat16()
    scale = d**-0.5
    got = rows_attention(q, k_cache, v_cache, table, lo, ctx, scale)
    los = [0] * len(rows) if lo is None else lo.tolist()
    want = _reference(q, k_cache, v_cache, table.tolist(), los, ctx.tolist(), scale)
    assert (got.double() - want).abs().max() < 2e-2  # bf16 output rounding of values ~N(0, 1/keys)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for r in (0, 17, len(rows) - 1):
                one = rows_attention(
                    q[r : r + 1],
                    k_cache,
                    v_cache,
                    table[r : r + 1],
                    None if lo is None else lo[r : r + 1],
                    ctx[r : r + 1],
                    scale,
                )
                assert torch.equal(one[0], got[r])
            assert torch.equal(rows_attention(q, k_cache, v_cache, table, lo, ctx, scale), got)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (2048, 8192)])
@pytest.mark.skipif(
    not (kernels_available() and cpu_decode.int4_mm_native()),
    reason="no AVX512-BF16 here: int4_mm is not built (tests/model/test_cpu_matmul.py skips the same way)",
)
def test_int4_many_rows_equal_the_few_row_kernel(k, n):
    """``int4_mm_many`` (a deterministic engine's wide steps) gives each row the bits ``int4_mm``
    gives it 16 rows at a time (a decode step's), at the default model's and a 1.7B model's sizes."""
    from chatkv.kernels.cpu_invariant import int4_mm_many
    from chatkv.weights.quantised import Int4Linear, quantize_int4

    g = torch.Generator().manual_seed(k + n)
    lin = Int4Linear(quantize_int4(torch.randn(n, k, generator=g) * 0.05))
    few = lin.few_rows()
    x = torch.randn(150, k, generator=g).bfloat16()
    want = torch.cat([few(x[i : i + 16]) for i in range(0, 150, 16)])
    for m in (17, 33, 64, 150):
        assert torch.equal(int4_mm_many(x[:m], lin.packed, lin.scales_zeros), want[:m]), m
