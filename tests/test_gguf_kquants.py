"""GGUF K-quants computed natively (issue 19, item 4).

- Decoding: chatkv.quant's decoders of Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1 blocks equal gguf-py's
  reference dequantisation bit for bit, on blocks of random bytes (every code and 6-bit scale
  pattern; f16 super-block scales drawn finite) and, for the types gguf-py can quantise, on its
  own quantiser's blocks.
- Q4_K is int4 groups of 32 as stored: ``from_gguf_blocks`` keeps its codes, with
  ``scale = d * sc`` and ``minimum = -dmin * m``, and torch's int4 kernel computes with them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K, dequantize, quantize

from chatkv.quant import GROUP, Int4Linear, dequantize_gguf_blocks, from_gguf_blocks, kquant_scale_min

#: (weights per block, bytes per block, offsets of the block's f16 scales): ggml's block structs
LAYOUT = {"Q4_K": (256, 144, (0, 2)), "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,)),
          "Q5_0": (32, 22, (0,)), "Q5_1": (32, 24, (0, 2))}


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a), dtype=np.float32).view(np.uint32)


def random_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """``[rows, bytes per row]`` of random bytes, but for finite f16 scales (some zero)."""
    per, size, scales = LAYOUT[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
    for at in scales:
        d = (rng.standard_normal((rows, cols // per, 1)) * 0.01).astype(np.float16)
        d[0, 0] = 0.0
        raw[..., at : at + 2] = d.view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", list(LAYOUT))
def test_random_blocks_dequantise_bit_for_bit_as_ggufs_reference(kind):
    rows, cols = 8, 1024
    raw = random_blocks(kind, rows, cols, seed=len(kind) + ord(kind[1]))
    ref = dequantize(raw, GGMLQuantizationType[kind]).reshape(rows, cols)
    ours = dequantize_gguf_blocks(kind, raw, (rows, cols))
    assert ours.dtype == torch.float32 and ours.shape == (rows, cols)
    assert np.array_equal(bits(ref), bits(ours))


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1"])
def test_ggufs_own_quantised_blocks_dequantise_bit_for_bit(kind):
    g = np.random.default_rng(11)
    w = (g.standard_t(5, size=(6, 4 * GROUP)) * 0.05).astype(np.float32)
    w[0, :GROUP] = 0.0  # an all-zero block (scale 0)
    raw = quantize(w, GGMLQuantizationType[kind])
    ref = dequantize(raw, GGMLQuantizationType[kind]).reshape(w.shape)
    assert np.array_equal(bits(ref), bits(dequantize_gguf_blocks(kind, raw, w.shape)))
    assert np.abs(ref - w).max() <= np.abs(w).max() / 15  # it is a 5-bit quantisation of w, not noise


def test_scales_and_minimums_unpack_as_ggufs_reference():
    packed = np.random.default_rng(5).integers(0, 256, size=(4096, 12), dtype=np.uint8)
    sc, mn = kquant_scale_min(packed)
    ref_sc, ref_mn = Q4_K.get_scale_min(packed)
    assert np.array_equal(sc.numpy(), ref_sc) and np.array_equal(mn.numpy(), ref_mn)
    assert int(sc.max()) == 63 and int(mn.max()) == 63  # all six bits reached


def test_q4_k_is_int4_groups_of_32_with_its_own_codes():
    rows, cols = 16, 512
    raw = random_blocks("Q4_K", rows, cols, seed=3)
    q = from_gguf_blocks("Q4_K", raw, (rows, cols))
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (rows, cols) and q.scale.shape == (rows, cols // GROUP)
    # the codes are the file's nibbles: the first 64 weights of a super-block are its first 32 bytes'
    # low nibbles then their high nibbles
    qs = raw.reshape(rows, cols // 256, 144)[:, 0, 16:48]
    assert np.array_equal(q.codes[:, :32].numpy(), qs & 0x0F) and np.array_equal(q.codes[:, 32:64].numpy(), qs >> 4)
    d = raw.reshape(rows, cols // 256, 144)[:, 0, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    dmin = raw.reshape(rows, cols // 256, 144)[:, 0, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    sc, mn = Q4_K.get_scale_min(raw.reshape(rows, cols // 256, 144)[:, 0, 4:16].copy())
    assert np.array_equal(bits(q.scale[:, :8]), bits(d[:, None] * sc.astype(np.float32)))
    assert np.array_equal(bits(q.minimum[:, :8]), bits(-(dmin[:, None] * mn.astype(np.float32))))
    # torch's int4 kernel on these numbers (s and z in bf16, as for Q4_1) is the dequantised matmul
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ref = x.float() @ q.dequantize().t()
    y = Int4Linear(q)(x).float()
    assert torch.allclose(y, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item()), (y - ref).abs().max()


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_wrong_sizes_are_refused(kind):
    raw = random_blocks(kind, 2, 256, seed=1)
    with pytest.raises(ValueError, match="not whole blocks of 256"):
        dequantize_gguf_blocks(kind, raw, (2, 128))
    with pytest.raises(ValueError, match="bytes are not"):
        dequantize_gguf_blocks(kind, raw[:, :-1], (2, 256))
