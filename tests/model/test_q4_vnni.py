"""The few-row products with int8 activations (kernels/cpu_q4.c: ``q4_mm`` over int4_mm's stored int4
weights, ``q8_mm`` over Int8Linear's per-channel int8 codes) at a 1.7B-4B model's projection shapes.

- The VNNI path and the portable C path give the same bits (the integer dot products are exact and
  the float32 steps are the same operations in the same order), at 2048x2048, 2048->8192,
  8192->2048 and slices of 4096<->14336.
- A row's bits are the same alone and in a step of up to 16 rows, on one thread and on two
  (speculation's verified rows are their plain decode's; the engine is deterministic).
- Against float64 over the same dequantised weights, the error is int8 activations' (as
  llama.cpp's), bounded here next to the bfloat16 path's own error.
- Non-finite activations give NaN rows; the switch (``vnni_kernels``) routes Int4Linear and
  Int8Linear to these kernels and back.
"""

from __future__ import annotations

import pytest
import torch

from chatkv.kernels import cpu_decode
from chatkv.model import fused_decode
from chatkv.weights import quantised as quant
from chatkv.weights.quantised import GROUP, Int4Linear, Int8Linear, Q4Weight, Q8Weight

built = pytest.mark.skipif(not fused_decode.kernels_available(), reason="the fused ops' library is not built here")
vnni = pytest.mark.skipif(
    not (fused_decode.kernels_available() and cpu_decode.q4_vnni_native()),
    reason="no AVX512-VNNI/VBMI here: only the portable path runs (its own tests)",
)

#: (N out, K in): q/o at 2048, gate/up 2048 -> 8192, down 8192 -> 2048, and 4096 <-> 14336 sliced
#: along the output (the slices keep their real K, which sets the length of every dot product)
SHAPES = [(2048, 2048), (8192, 2048), (2048, 8192), (1024, 4096), (512, 14336)]


def q4k_like(n: int, k: int, seed: int) -> Q4Weight:
    """Q4_K's form: per group of 32, scale = d * sc and minimum = -(dmin * m), sc and m 6-bit."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = torch.rand(n, k // 256, 1, generator=g) * 2e-3 + 1e-4
    sc = torch.randint(1, 64, (n, k // 256, 8), generator=g).float()
    m = torch.randint(0, 64, (n, k // 256, 8), generator=g).float()
    return Q4Weight(codes, (d * sc).reshape(n, -1), -(d * m).reshape(n, -1) * 0.5)


def activations(rows: int, k: int, seed: int) -> torch.Tensor:
    """Heavy-tailed rows with a few outlier channels, as a decoder's normed activations are."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp(0.5 * torch.randn(rows, k, generator=g))
    x[:, torch.randint(0, k, (4,), generator=g)] *= 20
    return x.to(torch.bfloat16)


def int8_weight(n: int, k: int, seed: int) -> Q8Weight:
    g = torch.Generator().manual_seed(seed)
    return quant.quantize_int8(torch.randn(n, k, generator=g) * 0.02)


def exact_int4(lin: Int4Linear, q: Q4Weight, x: torch.Tensor) -> torch.Tensor:
    """float64 ``x @ w.T`` over the weights the kernels compute with: ``(code - 8) * s + z``, s, z bfloat16."""
    n, k = q.codes.shape
    sz = lin.scales_zeros.double()
    w = (q.codes.double().view(n, k // GROUP, GROUP) - 8) * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]
    return x.double() @ w.view(n, k).t()


def exact_int8(lin: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    return (x.double() @ lin.codes.double().t()) * lin.scales.double()


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@vnni
@pytest.mark.parametrize("n,k", SHAPES)
def test_the_vnni_and_portable_paths_give_the_same_bits(n, k):
    q = q4k_like(n, k, seed=n + k)
    lin = Int4Linear(q)
    x = activations(3, k, seed=k)
    fast = cpu_decode.q4_mm(x, lin.packed, lin.scales_zeros)
    assert torch.equal(
        fast.view(torch.int16), cpu_decode.q4_mm(x, lin.packed, lin.scales_zeros, portable=True).view(torch.int16)
    )
    l8 = Int8Linear(int8_weight(n, k, seed=n))
    fast8 = cpu_decode.q8_mm(x, l8.codes, l8.scales)
    assert torch.equal(
        fast8.view(torch.int16), cpu_decode.q8_mm(x, l8.codes, l8.scales, portable=True).view(torch.int16)
    )
    assert fast.abs().max() > 0 and fast8.abs().max() > 0


@built
@pytest.mark.parametrize("portable", [False, True])
def test_a_rows_bits_are_the_same_alone_in_any_step_and_on_any_thread_count(portable, one_thread):
    if not portable and not cpu_decode.q4_vnni_native():
        pytest.skip("no AVX512-VNNI here")
    n, k = (2048, 2048) if not portable else (256, 2048)
    q = q4k_like(n, k, seed=1)
    lin, l8 = Int4Linear(q), Int8Linear(int8_weight(n, k, seed=2))
    x = activations(16, k, seed=3)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        whole4 = cpu_decode.q4_mm(x, lin.packed, lin.scales_zeros, portable)
        whole8 = cpu_decode.q8_mm(x, l8.codes, l8.scales, portable)
        if threads == 1:
            first4, first8 = whole4, whole8
        assert torch.equal(whole4.view(torch.int16), first4.view(torch.int16))
        assert torch.equal(whole8.view(torch.int16), first8.view(torch.int16))
        for rows in range(1, 17):  # each step of 1..16 rows (every row-block remainder of both kernels)
            part = x[16 - rows :].contiguous()
            assert torch.equal(cpu_decode.q4_mm(part, lin.packed, lin.scales_zeros, portable), whole4[16 - rows :])
            assert torch.equal(cpu_decode.q8_mm(part, l8.codes, l8.scales, portable), whole8[16 - rows :])


@built
@pytest.mark.parametrize("n,k", SHAPES)
def test_error_against_float64_is_int8_activations_own(n, k):
    """Relative error (Frobenius, over 4 rows) of the int8-activation product against float64 over
    the same weights: int8 activations per 32 inputs cost ~0.4-0.6% (about 3x the bfloat16 path's,
    whose error is its output's rounding); bounded at 1%, and at 5x the bfloat16 path's."""
    q = q4k_like(n, k, seed=7)
    lin = Int4Linear(q)
    x = activations(4, k, seed=8)
    ref = exact_int4(lin, q, x)
    rel = lambda y: ((y.double() - ref).norm() / ref.norm()).item()  # noqa: E731
    new = rel(cpu_decode.q4_mm(x, lin.packed, lin.scales_zeros, portable=not cpu_decode.q4_vnni_native()))
    bf16 = rel(torch.ops.aten._weight_int4pack_mm_for_cpu(x, lin.packed, GROUP, lin.scales_zeros))
    assert new < 0.025 and new < 12 * bf16, (new, bf16)
    l8 = Int8Linear(int8_weight(n, k, seed=9))
    ref8 = exact_int8(l8, x)
    new8 = ((cpu_decode.q8_mm(x, l8.codes, l8.scales).double() - ref8).norm() / ref8.norm()).item()
    torch8 = ((torch.ops.aten._weight_int8pack_mm(x, l8.codes, l8.scales).double() - ref8).norm() / ref8.norm()).item()
    assert new8 < 0.025 and new8 < 12 * torch8, (new8, torch8)


@built
def test_non_finite_activations_give_nan_rows_and_zero_rows_zero():
    n, k = 128, 256
    lin, l8 = Int4Linear(q4k_like(n, k, seed=4)), Int8Linear(int8_weight(n, k, seed=5))
    x = activations(3, k, seed=6)
    x[0, 5] = float("inf")
    x[1] = 0
    for portable in (False, True):
        if not portable and not cpu_decode.q4_vnni_native():
            continue
        for y in (
            cpu_decode.q4_mm(x, lin.packed, lin.scales_zeros, portable),
            cpu_decode.q8_mm(x, l8.codes, l8.scales, portable),
        ):
            assert y[0].isnan().all() and (y[1] == 0).all() and y[2].isfinite().all()


@vnni
def test_the_switch_routes_the_linears_and_back():
    n, k = 256, 512
    q = q4k_like(n, k, seed=10)
    lin, l8 = Int4Linear(q), Int8Linear(int8_weight(n, k, seed=11))
    x = activations(5, k, seed=12)
    before = quant.vnni_kernels()
    try:
        quant.vnni_kernels(False, False)
        old4, old8 = lin(x), l8(x)
        assert torch.equal(old8, torch.ops.aten._weight_int8pack_mm(x, l8.codes, l8.scales))
        quant.vnni_kernels(True, True)
        assert torch.equal(lin(x), cpu_decode.q4_mm(x, lin.packed, lin.scales_zeros))
        assert torch.equal(l8(x), cpu_decode.q8_mm(x, l8.codes, l8.scales))
        quant.vnni_kernels(False, False)
        assert torch.equal(lin(x), old4) and torch.equal(l8(x), old8)
    finally:
        quant.vnni_kernels(*before)


@built
def test_bad_calls_are_errors():
    lin = Int4Linear(q4k_like(64, 64, seed=13))
    with pytest.raises(ValueError, match="q4_mm"):
        cpu_decode.q4_mm(torch.zeros(17, 64, dtype=torch.bfloat16), lin.packed, lin.scales_zeros)
    with pytest.raises(ValueError, match="q4_mm"):
        cpu_decode.q4_mm(torch.zeros(1, 32, dtype=torch.bfloat16), lin.packed, lin.scales_zeros)
    with pytest.raises(ValueError, match="x"):
        cpu_decode.q4_mm(torch.zeros(1, 64), lin.packed, lin.scales_zeros)
    assert cpu_decode.q4_mm_call(lin.packed[:-1], lin.scales_zeros) is False  # not the layout's size
    assert cpu_decode.q8_mm_call(torch.zeros(6, 64, dtype=torch.int8), torch.ones(6, dtype=torch.bfloat16)) is False


def _logits_in_steps(model, ids: list[int], rows: int) -> torch.Tensor:
    """Logits after every token of ``ids``, computed in steps of ``rows`` tokens (few-row products)."""
    from chatkv.config import EngineConfig
    from chatkv.engine.model_runner import BatchItem, ModelRunner

    runner = ModelRunner(model, EngineConfig(block_size=16, num_blocks=-(-len(ids) // 16) + 1))
    table = runner.pool.allocate(-(-len(ids) // 16))
    steps = [ids[s : s + rows] for s in range(0, len(ids), rows)]
    batches = [runner.build_batch([BatchItem(part, i * rows, table, logits="all")]) for i, part in enumerate(steps)]
    return torch.cat([runner.forward(b).float() for b in batches])


@vnni
def test_the_q4_k_m_fixture_on_int8_activations_passes_the_llama_cpp_gate(tmp_path):
    """The engine as shipped on llama.cpp's own Q4_K_M file (Q4_K groups int4, Q6_K groups and the
    output matrix int8), every product of few rows on cpu_q4.c, against llama.cpp's logits:
    within tests/model/test_quant_weights.py's gate (1.5x the exact dequantisation's distance,
    mean and max; measured 1.38x / 1.14x, against 1.28x / 1.07x on the bfloat16 kernels). Steps of
    1 and of 8 tokens give the same logits bit for bit."""
    from chatkv.config import EngineConfig
    from chatkv.engine.core import Engine
    from chatkv.weights.gguf import convert_gguf
    from tests.support.kquant_fixtures import fixture
    from tests.weights.test_gguf_kquants import exact_and_llama

    f32 = convert_gguf(fixture("Q4_K_M"), tmp_path / "f32", dtype=torch.float32, progress=False)
    config, weights, cases, LlamaModel = exact_and_llama(f32, "Q4_K_M")
    engine = Engine(
        convert_gguf(fixture("Q4_K_M"), tmp_path / "model", progress=False),
        EngineConfig(data_dir=str(tmp_path / "data"), num_blocks=16),
    )
    assert (engine.weights.weights, engine.weights.head) == ("int4", "int8")

    def distance(model, rows: int) -> tuple[float, float, list[torch.Tensor]]:
        d, got = [], []
        for ids, ref in cases:
            got.append(_logits_in_steps(model, ids, rows))
            d.append((got[-1] - ref).abs().max(-1).values)
        d = torch.cat(d)
        return d.mean().item(), d.max().item(), got

    exact = distance(LlamaModel(config, weights, torch.float32), 512)
    before = quant.vnni_kernels()
    try:
        quant.vnni_kernels(True, True)
        mean, worst, one = distance(engine.model, 1)
        eight = distance(engine.model, 8)[2]
    finally:
        quant.vnni_kernels(*before)
    assert mean <= 1.5 * exact[0] and worst <= 1.5 * exact[1], (mean, worst, exact[:2])
    assert all(torch.equal(a, b) for a, b in zip(one, eight))
