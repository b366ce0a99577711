"""Prefill in the quantised modes without a resident bf16 copy: chatkv.model.prefill.

- torch's int4 packing is read back exactly, and chatkv's vectorised packing
  (chatkv.weights.quantised.pack_int4, which keeps the packing out of most of a model's load
  time) makes the same bytes;
- the scratch path computes with the decode kernel's own numbers, ``(code - 8) * s + z`` with its
  bfloat16 s and z, rounded once to bfloat16 (int4), and with the resident copy's numbers bit for
  bit (int8);
- one buffer per model and thread, the size of the largest projection (and its int8
  temporaries), no dequantising below SCRATCH_ROWS rows, and no bf16 weights kept: the int4
  model's projections hold about 4.5 bits a parameter (5 with the kernel's bf16 scales and zeros);
- a build whose packing is not one this module reads falls back to the int4 kernel, still
  without a copy.

The whole model on both paths against transformers on the same numbers is
tests/model/test_weight_paths.py (its CASES cover the scratch and the copy paths).
"""

from __future__ import annotations

import threading

import pytest
import torch

from chatkv.kernels import cpu_decode
from chatkv.model import prefill as quant_prefill
from chatkv.model.forward import Linear, LlamaModel
from chatkv.model.prefill import Scratch, ScratchInt4, ScratchInt8, scratch_int4
from chatkv.weights.gguf import read_q4
from chatkv.weights.quantised import (
    Int4Linear,
    Int8Linear,
    int4pack_block,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4pack,
)

pytestmark = pytest.mark.skipif(
    int4pack_block() is None, reason="this torch build packs int4 in a layout not read here"
)


@pytest.fixture(scope="module")
def model_dir(default_model_dir):
    return default_model_dir  # the packaged default model, converted once for the run (conftest)


def kernel_numbers(q, lin: Int4Linear) -> torch.Tensor:
    """The int4 kernel's weights ``(code - 8) * s + z`` (float32; s and z its bfloat16 ones), as bf16."""
    n, k = q.codes.shape
    s = lin.scales_zeros[..., 0].t().float()[..., None]
    z = lin.scales_zeros[..., 1].t().float()[..., None]
    return ((q.codes.float() - 8).view(n, k // 32, 32) * s + z).view(n, k).to(torch.bfloat16)


def test_the_int4_packing_is_read_back_exactly_and_made_as_torch_makes_it(model_dir):
    block = int4pack_block()
    q4 = read_q4(model_dir)
    for name in [n for n in q4 if n.startswith(("layers.0.", "layers.29."))]:
        codes = q4[name].codes
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        assert torch.equal(unpack_int4pack(packed, codes.shape[0], block), codes), name
        assert torch.equal(pack_int4(codes), packed), name  # chatkv's vectorised packing: the same bytes
    odd = torch.randint(0, 16, (80, 64), dtype=torch.uint8)  # rows not whole blocks: torch's own op
    assert torch.equal(pack_int4(odd), torch.ops.aten._convert_weight_to_int4pack_for_cpu(odd.to(torch.int32), 1))


@pytest.mark.parametrize("n, k", [(960, 576), (576, 576), (3072, 576), (576, 1536), (128, 64)])
def test_the_scratch_path_computes_with_the_int4_kernels_own_numbers(n, k):
    g = torch.Generator().manual_seed(n + k)
    q = quantize_int4(torch.randn(n, k, generator=g) * 0.05)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    lin = Int4Linear(q, bias)
    path = scratch_int4(lin, Scratch(), min_rows=40)
    assert isinstance(path, ScratchInt4)
    assert torch.equal(path.weight_t().t(), kernel_numbers(q, lin))
    assert torch.equal(path.weight_t().t(), kernel_numbers(q, lin))  # again, over its own temporaries
    x = torch.randn(40, k, generator=g).to(torch.bfloat16)
    y = path(x).float()
    ref = x.float() @ kernel_numbers(q, lin).float().t() + bias.float()
    assert (y - ref).norm() / ref.norm() < 1e-2
    # and it is what the kernel computes for one row at a time, within bf16 rounding
    one = torch.cat([lin(x[i : i + 1]) for i in range(40)]).float()
    assert (y - one).norm() / one.norm() < 1e-2
    # below min_rows: the int4 kernel itself, bit for bit
    assert torch.equal(path(x[:39]), lin(x[:39]))


@pytest.mark.parametrize("n, k", [(960, 576), (3072, 576), (576, 1536), (128, 64)])
def test_the_c_dequantising_is_the_torch_ops_bit_for_bit(n, k, monkeypatch):
    """ScratchInt4.weight_t in one C call (where the fused ops' library is built) and in torch ops:
    the same bfloat16 weights, on one thread and on two, at the kernel's real scales (and an
    outlier group, a zero scale)."""
    import chatkv.model.prefill as qp

    if not qp.native_dequantise():
        pytest.skip("the fused ops' library is not built here (no compiler, or off x86 Linux)")
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3, :32] *= 400.0
    w[5, 32:64] = 0.0
    lin = Int4Linear(quantize_int4(w))
    path = scratch_int4(lin, Scratch(), min_rows=1)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            native = path.weight_t().clone()
            monkeypatch.setattr(qp, "native_dequantise", lambda: False)
            assert torch.equal(native, path.weight_t()), threads
            monkeypatch.undo()
    finally:
        torch.set_num_threads(before)


def test_steps_below_scratch_rows_run_the_int4_kernel_and_from_there_the_scratch(monkeypatch):
    q = quantize_int4(torch.randn(128, 64, generator=torch.Generator().manual_seed(3)))
    lin = Int4Linear(q)
    path = scratch_int4(lin, Scratch())
    assert path.min_rows == quant_prefill.SCRATCH_ROWS
    dequantised = []
    real = ScratchInt4.weight_t
    monkeypatch.setattr(ScratchInt4, "weight_t", lambda self: dequantised.append(1) or real(self))
    for rows in (1, 16, quant_prefill.SCRATCH_ROWS - 1):
        path(torch.randn(rows, 64).to(torch.bfloat16))
    assert dequantised == []  # a short turn pays no dequantising
    path(torch.randn(quant_prefill.SCRATCH_ROWS, 64).to(torch.bfloat16))
    assert dequantised == [1]


def test_the_int8_scratch_path_is_the_resident_copys_numbers_bit_for_bit():
    g = torch.Generator().manual_seed(8)
    q8 = quantize_int8(torch.randn(576, 1536, generator=g))
    lin = Int8Linear(q8)
    path = ScratchInt8(lin.codes, q8.scale, None, Scratch())
    assert torch.equal(path.weight(), q8.dequantize().to(torch.bfloat16))
    x = torch.randn(32, 1536, generator=g).to(torch.bfloat16)
    copy = Linear(q8.dequantize().to(torch.bfloat16), pack=False)
    assert torch.equal(path(x), copy(x))  # the same numbers through the same F.linear


@pytest.mark.parametrize("n, k", [(6144, 2048), (2048, 8192), (14336, 4096), (37, 100)])
def test_the_native_int8_dequantising_is_torchs_numbers_at_the_products_shapes(n, k):
    """The C pass a many-row int8 step dequantises with (a GGUF's Q6_K/Q8_0 projections at the
    1.7B and 8B shapes; k = 100 runs its scalar tail) against torch.mul's rounding, over every
    code and scales from subnormal to near overflow."""
    from chatkv.model import fused_decode

    assert fused_decode.kernels_available()  # built at install on this machine class
    g = torch.Generator().manual_seed(n)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g) * 0.02
    scale[:4] = torch.tensor([1e-40, 3e38 / 127, 0.0, -0.5])  # subnormal, near overflow, zero, negative
    out = torch.empty(n, k, dtype=torch.bfloat16)
    assert torch.equal(cpu_decode.int8_weight(codes, scale, out), torch.mul(codes, scale[:, None]).to(torch.bfloat16))
    assert torch.equal(
        ScratchInt8(codes, scale[:, None], None, Scratch()).weight(),
        torch.mul(codes, scale[:, None]).to(torch.bfloat16),
    )


def test_one_buffer_per_thread_shared_by_every_projection_and_no_bf16_weights_kept(model_dir):
    model = LlamaModel.from_pretrained(model_dir, dtype=torch.bfloat16, weights_mode="int4", head_mode="int8")
    projections = [p for layer in model.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(isinstance(p, Int4Linear) and isinstance(p.dense, ScratchInt4) for p in projections)
    assert all(p.dense.scratch is model.scratch for p in projections)
    params = sum(p.out_features * p.dense.k for p in projections)
    held = sum(
        p.packed.numel() * p.packed.element_size() + p.scales_zeros.numel() * p.scales_zeros.element_size()
        for p in projections
    )
    assert held * 8 / params == pytest.approx(5.0, abs=0.01)  # 4 bits a code + the kernel's bf16 s and z per 32
    largest = max(p.out_features * p.dense.k for p in projections)
    assert model.scratch.nbytes == 0  # nothing before a many-row step
    from chatkv.model.self_check import path_logits

    path_logits(model, list(range(quant_prefill.SCRATCH_ROWS - 1)), batched=True)
    assert model.scratch.nbytes == 0  # a step below SCRATCH_ROWS: the int4 kernel
    path_logits(model, list(range(quant_prefill.SCRATCH_ROWS)), batched=True)
    # one bf16 buffer: the largest projection's, and its int8 temporaries where torch ops dequantise
    assert model.scratch.nbytes == (2 if quant_prefill.native_dequantise() else 3) * largest
    seen = []
    t = threading.Thread(target=lambda: seen.append(model.scratch.get(8).data_ptr()))
    t.start()
    t.join()
    assert seen[0] != model.scratch.get(8).data_ptr()  # another thread never writes into this one's


def test_a_packing_this_module_cannot_read_falls_back_to_the_int4_kernel_without_a_copy(model_dir, monkeypatch):
    from chatkv.weights import quantised as quant

    monkeypatch.setattr(quant, "int4pack_block", lambda: None)  # torch packs, as it does in such a build
    monkeypatch.setattr(quant_prefill, "int4pack_block", lambda: None)
    model = LlamaModel.from_pretrained(model_dir, dtype=torch.bfloat16, weights_mode="int4", head_mode="int8")
    assert all(layer.qkv.dense is None and layer.down.dense is None for layer in model.layers)
    q = quantize_int4(torch.randn(96, 64))
    assert scratch_int4(Int4Linear(q), Scratch()) is None
    monkeypatch.undo()
    assert scratch_int4(Int4Linear(quantize_int4(torch.randn(80, 64))), Scratch()) is None  # rows not whole blocks
