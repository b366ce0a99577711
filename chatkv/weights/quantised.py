"""Quantised projection weights for CPU decode: int4 in groups of 32, int8 per output channel.

(Past 400 lines on purpose: the stored forms, their packing into the int4 kernel's layout and
the two linears that compute from that layout are one contract, the layout; the linears' steps
of few rows choose between torch's kernels and chatkv's on that same layout. Split, each half
would restate the other's assumptions about it.)

Batch-1 decode streams every weight once per token, so its time follows the weights' bytes.
A GGUF's Q4_0/Q4_1/Q4_K tensors are computed as they are stored, and a float weight (a Hugging
Face directory, or a GGUF's float, Q8_0, Q5 or Q6 tensor, decoded exactly by
``dequantize_gguf_blocks``) is quantised on load:

- **int4** (``Int4Linear``): per group of 32 inputs, ``w = code * scale + minimum`` with
  ``code`` in 0..15, which is exactly GGUF's Q4_1 (Q4_0 is the case ``minimum = -8 * scale``).
  It runs on ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (or, for steps of up to 16 rows
  where the CPU has AVX512-BF16, chatkv's ``int4_mm``, which decodes each weight tile once for
  all the rows; the same numbers but for the order of float32 sums), which computes
  ``(code - 8) * s + z`` per group: ``s = scale`` and ``z = minimum + 8 * scale``. The codes
  are kept exactly; the kernel computes in bfloat16, so it takes ``s`` and ``z`` in
  bfloat16 too: a relative rounding of at most 2^-9 per weight, the same size as
  bfloat16's own rounding of every activation (Q4's own step is 1/15 of the group's range).
- **int8** (``Int8Linear``): symmetric, one scale per output channel (``code * scale``,
  code in -127..127), on ``torch.ops.aten._weight_int8pack_mm`` (the output matrix's steps of
  up to 16 rows on chatkv's ``int8_mm`` where it is built: ``Int8Linear.native_few_rows``).
- Behind a switch (``vnni_kernels``, off by default), steps of up to 16 rows take
  kernels/cpu_q4.c instead, which reads the same stored weights with the activations quantised to
  int8 per group of 32 inputs and integer dot products (AVX512-VNNI), as llama.cpp's q8 dot
  products do: each 4-bit code is multiplied as it is stored, never widened to bfloat16.

``Q4Weight``/``Q8Weight`` are the stored forms (numbers only, no kernels), what the converted
model directory keeps (``chatkv.weights.gguf``) and what the mapping tests compare bit for bit
with gguf's own reference dequantisation. Activations are bfloat16 in both modes.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch

from chatkv.kernels import cpu_decode

__all__ = [
    "GROUP",
    "Q4Weight",
    "Q8Weight",
    "Int4Linear",
    "Int8Linear",
    "quantize_int4",
    "quantize_int8",
    "from_gguf_blocks",
    "dequantize_gguf_blocks",
    "kquant_scale_min",
    "int4_supported",
    "int8_supported",
    "pack_int4",
    "unpack_int4pack",
    "int4pack_block",
    "repack_nibbles",
    "int4_from_nibbles",
]

GROUP = 32  # inputs per int4 group: GGUF's block size and the kernel's group size
#: whether steps of few rows take chatkv's kernels where they are built (kernels/cpu_matmul.c:
#: ``Int4Linear``, ``Int8Linear.native_few_rows``); ``CHATKV_FEW_ROW_KERNELS=0`` in the
#: environment or ``few_row_kernel(False)`` leaves them to torch's
_FEW_ROWS = [os.environ.get("CHATKV_FEW_ROW_KERNELS", "1").strip() != "0"]
#: whether those steps take the int8-activation products instead (kernels/cpu_q4.c, AVX512-VNNI:
#: ``q4_mm`` for ``Int4Linear``, ``q8_mm`` for every ``Int8Linear``), per weight form; off unless
#: ``CHATKV_Q4_VNNI`` is "1" (both), "int4" or "int8", or ``vnni_kernels`` turns them on. A process
#: keeps one choice: a verified row is its plain decode's bit for bit only on the same kernel.
_VNNI_ENV = os.environ.get("CHATKV_Q4_VNNI", "0").strip()
_VNNI = {"int4": _VNNI_ENV in ("1", "int4"), "int8": _VNNI_ENV in ("1", "int8")}


@dataclass
class Q4Weight:
    """``w[n, k] = codes[n, k] * scale[n, k // 32] + minimum[n, k // 32]``.

    ``perm``: where the columns are not the inputs in order (a GPTQ checkpoint's act order:
    chatkv.weights.gptq_awq), column ``j`` multiplies input ``perm[j]``, so the weight's product
    with ``x`` is ``x[:, perm] @ w.T``; ``dequantize`` gives the weight in input order."""

    codes: torch.Tensor  # uint8 [N, K], 0..15
    scale: torch.Tensor  # float32 [N, K / 32]
    minimum: torch.Tensor  # float32 [N, K / 32]
    centred: bool = False  # Q4_0: minimum == -8 * scale, dequantised as (q - 8) * scale
    perm: torch.Tensor | None = None  # long [K]: the input each column stands for; None: column k is input k

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] in input order, computed as gguf's reference does (Q4_1: ``d * q + m``;
        Q4_0: ``d * (q - 8)``; each op rounded). The two agree but for the sign of a zero."""
        n, k = self.codes.shape
        q = self.codes.float().view(n, k // GROUP, GROUP)
        if self.centred:
            w = (self.scale[..., None] * (q - 8)).view(n, k)
        else:
            w = (self.scale[..., None] * q + self.minimum[..., None]).view(n, k)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def rows(self, order: np.ndarray | torch.Tensor) -> "Q4Weight":
        idx = torch.as_tensor(np.asarray(order), dtype=torch.long)
        return Q4Weight(self.codes[idx], self.scale[idx], self.minimum[idx], self.centred, self.perm)


@dataclass
class Q8Weight:
    """``w[n, k] = codes[n, k] * scale[n, k // group]`` (group = K: one scale per channel)."""

    codes: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, K / group]

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        g = k // self.scale.shape[1]
        return (self.codes.float().view(n, -1, g) * self.scale[..., None]).view(n, k)


# --------------------------------------------------------------------------- from GGUF blocks


QK_K = 256  # weights per K-quant super-block


def _f16(b: np.ndarray) -> torch.Tensor:
    """float32 of the little-endian f16 held in the last axis (2 bytes) of ``b``."""
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32))


def _blocks(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """``raw`` as ``[N, blocks per row, bytes per block]`` uint8, checked against ``shape``."""
    n, k = shape
    size = _BLOCK.get(kind)
    if size is None:
        raise ValueError(f"GGUF type {kind} is not mapped ({', '.join(_BLOCK)} are)")
    per, nbytes = size
    if k % per:
        raise ValueError(f"a {kind} tensor of {k} columns is not whole blocks of {per}")
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.size != n * (k // per) * nbytes:
        raise ValueError(f"{raw.size} bytes are not a {kind} tensor of shape {shape}")
    return raw.reshape(n, k // per, nbytes)


#: GGUF type -> (weights per block, bytes per block), as ggml's block structs
_BLOCK = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
    "IQ4_NL": (32, 18),
    "IQ4_XS": (QK_K, 136),
}

#: IQ4_NL/IQ4_XS: the 16 values a 4-bit index stands for (ggml's kvalues_iq4nl), as float32
_IQ4_VALUES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]).float()
#: byte b -> (value of its low nibble, value of its high nibble): one lookup per byte, no unpacking
_IQ4_PAIRS = torch.stack((_IQ4_VALUES[torch.arange(256) & 0x0F], _IQ4_VALUES[torch.arange(256) >> 4]), dim=-1)


def kquant_scale_min(packed: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit minimums of a Q4_K/Q5_K super-block, from its 12
    packed bytes ``packed[..., 12]`` (ggml's get_scale_min_k4): sub-block j < 4 has scale
    ``b[j] & 63`` and minimum ``b[j + 4] & 63``; j >= 4 takes its low 4 bits from byte j + 4
    (scale: low nibble, minimum: high nibble) and its top 2 bits from the top 2 bits of byte
    j - 4 (scale) or byte j (minimum). Returns two uint8 tensors ``[..., 8]``."""
    b = torch.from_numpy(np.ascontiguousarray(packed, dtype=np.uint8))
    lo, mid, hi = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = torch.cat((lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)), dim=-1)
    mn = torch.cat((mid & 63, (hi >> 4) | ((mid >> 6) << 4)), dim=-1)
    return sc, mn


def _nibbles_32(qs: torch.Tensor) -> torch.Tensor:
    """K-quant low nibbles: each 32 bytes hold two sub-blocks of 32, the first in the low nibbles
    and the second in the high ones. ``qs[..., 32 * c]`` -> codes ``[..., 64 * c]``."""
    q = qs.unflatten(-1, (-1, 1, 32))
    return torch.cat((q & 0x0F, q >> 4), dim=-2).flatten(-3)


def _q5_high_bits(qh: np.ndarray) -> torch.Tensor:
    """Q5_0/Q5_1: bit j of the block's little-endian uint32 is weight j's fifth bit -> [..., 32] uint8."""
    bits = np.unpackbits(np.ascontiguousarray(qh, dtype=np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(bits)


def from_gguf_blocks(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> Q4Weight | Q8Weight:
    """The stored numbers of a GGUF tensor of type ``kind`` (Q4_0, Q4_1, Q4_K, Q8_0), from its raw
    bytes ``raw`` (``[N, bytes per row]`` uint8, as ``gguf.GGUFReader`` gives them), ``shape``
    = (N, K). Layouts (ggml): Q4_0 block = f16 d, 16 bytes of nibbles (element j in the low
    nibble of byte j, element j + 16 in the high one), w = (q - 8) * d; Q4_1 = f16 d, f16 m,
    the same nibbles, w = q * d + m; Q8_0 = f16 d, 32 int8, w = q * d.

    Q4_K (super-block of 256 = f16 d, f16 dmin, 12 bytes of 6-bit scales and minimums, 128
    bytes of nibbles) is ``w = (d * sc) * q - (dmin * m)`` per sub-block of 32: exactly a
    ``Q4Weight`` group with ``scale = d * sc`` and ``minimum = -(dmin * m)`` (float32 products of
    an f16 and a 6-bit integer, negation exact), so its 4-bit codes are kept as they are."""
    n, k = shape
    if kind not in ("Q4_0", "Q4_1", "Q8_0", "Q4_K"):
        raise ValueError(f"GGUF type {kind} has no exact 4- or 8-bit form (Q4_0, Q4_1, Q4_K, Q8_0 have)")
    blocks = _blocks(kind, raw, shape)
    d = _f16(blocks[..., 0:2])
    if kind == "Q4_K":
        dmin = _f16(blocks[..., 2:4])
        sc, mn = kquant_scale_min(blocks[..., 4:16])  # [N, K/256, 8]
        codes = _nibbles_32(torch.from_numpy(blocks[..., 16:].copy())).reshape(n, k)
        scale = (d[..., None] * sc.float()).reshape(n, k // GROUP)
        minimum = -(dmin[..., None] * mn.float()).reshape(n, k // GROUP)
        return Q4Weight(codes.contiguous(), scale, minimum)
    head = 4 if kind == "Q4_1" else 2
    if kind == "Q8_0":
        codes = torch.from_numpy(blocks[..., head:].copy().view(np.int8).reshape(n, k))
        return Q8Weight(codes, d)
    nib = torch.from_numpy(blocks[..., head:].copy())  # [N, K/32, 16]
    codes = torch.cat((nib & 0x0F, nib >> 4), dim=-1).reshape(n, k)
    if kind == "Q4_1":
        m = _f16(blocks[..., 2:4])
        return Q4Weight(codes.contiguous(), d, m)
    return Q4Weight(codes.contiguous(), d, d * -8.0, centred=True)  # -8d: exact, a power of two


def dequantize_gguf_blocks(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    """float32 ``[N, K]`` of a GGUF tensor of a mapped type, computed as ggml's dequantize_row_*
    (and gguf-py's reference) does, each product rounded in float32, so bit for bit the same.

    Besides ``from_gguf_blocks``' types, the 5- and 6-bit ones (ggml layouts):
    - Q5_0: f16 d, 4 bytes of fifth bits (bit j of a little-endian uint32 is weight j's), 16
      bytes of nibbles as Q4_0's; ``w = d * (q - 16)``. Q5_1: f16 d, f16 m, then the same;
      ``w = d * q + m``.
    - Q5_K: f16 d, f16 dmin, 12 bytes of scales/minimums (as Q4_K), 32 bytes of fifth bits
      (sub-block i's weight l has bit i of byte l), 128 bytes of nibbles (as Q4_K);
      ``w = (d * sc) * q - (dmin * m)``.
    - Q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16
      weights), f16 d. In each half of 128 weights (64 low bytes ``ql``, 32 high bytes ``qh``),
      weight ``32 * i + l`` (i = 0..3, l = 0..31) has low bits ``ql[l + 32 * (i % 2)]`` (low
      nibble for i < 2, high nibble otherwise) and high bits ``(qh[l] >> 2 * i) & 3``;
      ``w = (d * sc) * (q - 32)``.

    And the non-linear 4-bit ones, whose indices pick from ``_IQ4_VALUES`` (one table lookup per byte:
    about twice as fast as gguf's numpy reference on one core, and a file of them is decoded at every load):
    - IQ4_NL: f16 d, 16 bytes of indices (as Q4_0's nibbles); ``w = d * value[i]``.
    - IQ4_XS: super-block of 256 = f16 d, a little-endian uint16 of high scale bits, 4 bytes of low
      scale nibbles, 128 bytes of indices (sub-block of 32 after sub-block, each as IQ4_NL's).
      Sub-block j's 6-bit scale has its low 4 bits in the nibble j % 2 of byte j // 2 and its top
      2 bits at bit 2 * j of the uint16; ``w = (d * (scale - 32)) * value[i]``.
    """
    n, k = shape
    if kind in ("Q4_0", "Q4_1", "Q8_0", "Q4_K"):
        return from_gguf_blocks(kind, raw, shape).dequantize()
    blocks = _blocks(kind, raw, shape)
    if kind in ("IQ4_NL", "IQ4_XS"):
        head = 2 if kind == "IQ4_NL" else 8
        qs = torch.from_numpy(blocks[..., head:].copy())  # [N, B, 16 * sub-blocks]
        pairs = _IQ4_PAIRS.index_select(0, qs.flatten().int()).view(*qs.shape[:2], -1, 16, 2)
        values = pairs.transpose(-1, -2)  # [N, B, sub-blocks, 2, 16]: the 16 low nibbles', then the high ones'
        d = _f16(blocks[..., 0:2])
        if kind == "IQ4_NL":
            return (d[..., None, None, None] * values).reshape(n, k)
        low = torch.from_numpy(blocks[..., 4:8].copy())  # [N, S, 4]: sub-blocks 2b and 2b + 1
        low = torch.stack((low & 0x0F, low >> 4), dim=-1).flatten(-2).int()  # [N, S, 8]
        high = torch.from_numpy(blocks[..., 2:4].copy().view("<u2").astype(np.int32))  # [N, S, 1]
        high = (high >> torch.arange(0, 16, 2, dtype=torch.int32)) & 3  # [N, S, 8]
        dl = d[..., None] * ((low | (high << 4)) - 32).float()
        return (dl[..., None, None] * values).reshape(n, k)
    if kind in ("Q5_0", "Q5_1"):
        head = 2 if kind == "Q5_0" else 4
        d = _f16(blocks[..., 0:2])[..., None]
        high = _q5_high_bits(blocks[..., head : head + 4])  # [N, K/32, 32]
        nib = torch.from_numpy(blocks[..., head + 4 :].copy())
        q = torch.cat((nib & 0x0F, nib >> 4), dim=-1) | (high << 4)
        if kind == "Q5_0":
            return (d * (q.float() - 16)).reshape(n, k)
        return (d * q.float() + _f16(blocks[..., 2:4])[..., None]).reshape(n, k)
    if kind == "Q5_K":
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        sc, mn = kquant_scale_min(blocks[..., 4:16])
        qh = torch.from_numpy(blocks[..., 16:48].copy())  # [N, S, 32]
        low = _nibbles_32(torch.from_numpy(blocks[..., 48:].copy())).unflatten(-1, (8, 32))
        high = (qh[..., None, :] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1  # [N, S, 8, 32]
        q = (low | (high << 4)).float()
        scale, minimum = d[..., None] * sc.float(), dmin[..., None] * mn.float()
        return (scale[..., None] * q - minimum[..., None]).reshape(n, k)
    # Q6_K
    ql = torch.from_numpy(blocks[..., 0:128].copy()).unflatten(-1, (2, 2, 32))  # [N, S, half, i % 2, l]
    qh = torch.from_numpy(blocks[..., 128:192].copy()).unflatten(-1, (2, 1, 32))  # [N, S, half, 1, l]
    sc = torch.from_numpy(blocks[..., 192:208].copy().view(np.int8)).float()  # [N, S, 16]
    d = _f16(blocks[..., 208:210])
    low = torch.cat((ql & 0x0F, ql >> 4), dim=-2)  # i = 0..3 along dim -2
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 3
    q = ((low | (high << 4)).to(torch.int8) - 32).float().reshape(n, k // QK_K, 16, 16)
    return ((d[..., None] * sc)[..., None] * q).reshape(n, k)


# --------------------------------------------------------------------------- from float weights


def quantize_int4(w: torch.Tensor) -> Q4Weight:
    """Asymmetric int4 per group of 32 along the input (as Q4_1: the group's min and (max - min) / 15)."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"int4 needs whole groups of {GROUP} inputs; this weight has {k}")
    g = w.float().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.clamp(torch.round((g - lo[..., None]) / safe[..., None]), 0, 15).to(torch.uint8)
    return Q4Weight(codes.view(n, k), scale, lo)


def quantize_int8(w: torch.Tensor, rows: int = 4096) -> Q8Weight:
    """Symmetric int8, one scale per output channel (``rows`` at a time: an output matrix of
    49152 x 576 would otherwise take several fp32 copies of itself at once)."""
    codes = torch.empty(w.shape, dtype=torch.int8)
    scale = torch.empty(w.shape[0], 1)
    for i in range(0, w.shape[0], rows):
        part = w[i : i + rows].to(torch.float32, copy=True)  # a copy even of float32 weights: divided in place below
        s = part.abs().amax(1, keepdim=True) / 127
        scale[i : i + rows] = s
        s = torch.where(s == 0, torch.ones_like(s), s)
        # in place (the same numbers: every value is whole and in range before the cast)
        codes[i : i + rows] = part.div_(s).round_().clamp_(-127, 127)
    return Q8Weight(codes, scale)


# --------------------------------------------------------------------------- kernels


@functools.cache
def _kernel_works(quantize, linear) -> bool:
    """Whether ``linear`` (over ``quantize``'s weights) runs in this torch build and agrees with
    a float matmul over the dequantised weights (int4: the kernel computes ``(code - 8) * s + z``)."""
    try:
        g = torch.Generator().manual_seed(0)
        q = quantize(torch.randn(64, 64, generator=g))
        x = torch.randn(2, 64, generator=g).to(torch.bfloat16)
        return torch.allclose(linear(q)(x).float(), x.float() @ q.dequantize().t(), rtol=2e-2, atol=5e-2)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def unpack_int4pack(packed: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """The codes ``uint8 [N, K]`` of torch's CPU int4 packing ``packed`` (``uint8 [N, K / 2]``) of
    ``n`` rows in blocks of ``block``: block ``b``'s bytes are ``[K, block / 2]``, byte ``[k, d]``
    holding row ``b * block + d`` in its low nibble and row ``b * block + block / 2 + d`` in its
    high one (aten/src/ATen/native/cpu/int4mm_kernel.cpp, weight_to_int4pack_kernel)."""
    k = packed.numel() * 2 // n
    p = packed.reshape(n // block, k, block // 2)
    return torch.cat((p & 0x0F, p >> 4), dim=-1).transpose(1, 2).reshape(n, k)


@functools.cache
def int4pack_block() -> int | None:
    """Rows per block of the int4 packing in this torch build on this CPU (64 on AVX-512, 32 on
    AVX2; ``unpack_int4pack``), found by packing known codes once; None when it packs some other
    way (then ``pack_int4`` leaves it to torch and chatkv.model.prefill has no scratch path)."""
    try:
        codes = torch.randint(0, 16, (128, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None
    if packed.dtype != torch.uint8 or packed.numel() != codes.numel() // 2:
        return None
    for block in (64, 32):
        if torch.equal(unpack_int4pack(packed, 128, block), codes.to(torch.uint8)):
            return block
    return None


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """``codes`` (uint8 ``[N, K]``, 0..15) in the int4 kernel's packed layout: torch's own
    ``_convert_weight_to_int4pack_for_cpu``, the same bytes, computed with a few vectorised uint8
    ops where the layout is known (that op takes the codes as int32, 4 bytes each, and packs them
    one at a time: most of a model's load time)."""
    n, k = codes.shape
    block = int4pack_block()
    if block is None or n % block or codes.dtype != torch.uint8:
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    c = codes.view(n // block, 2, block // 2, k).permute(0, 3, 1, 2)  # [block, K, nibble, d]
    out = torch.empty(n // block, k, block // 2, dtype=torch.uint8)
    torch.bitwise_or(c[..., 0, :], c[..., 1, :] << 4, out=out)
    return out.view(n, k // 2)


def repack_nibbles(nibbles: torch.Tensor) -> torch.Tensor | None:
    """``pack_int4`` of codes stored two a byte along their row (byte ``j``: code ``2j`` in its low
    nibble, ``2j + 1`` in its high one; chatkv.weights.gguf's 4-bit file), made from those bytes
    without unpacking them (at start-up, unpacking and packing again was most of the load); None
    where the kernel's layout is not the one known here (``int4pack_block``)."""
    n, half = nibbles.shape
    block = int4pack_block()
    if block is None or n % block or nibbles.dtype != torch.uint8:
        return None
    # numpy: one transposing copy, then contiguous uint8 ops on one thread (torch's threads, each
    # op waiting for the slowest, made these small ops 5x slower on a busy machine)
    x = np.ascontiguousarray(nibbles.numpy().reshape(n // block, 2, block // 2, half).transpose(0, 3, 1, 2))
    lo, hi = x[:, :, 0], x[:, :, 1]  # rows d and block/2 + d, byte j of each: [blocks, K/2, block/2]
    out = np.empty_like(x)  # [blocks, K, block/2] with k = 2j + parity: the layout pack_int4 makes
    np.bitwise_or(lo & 0x0F, hi << 4, out=out[:, :, 0])
    np.bitwise_or(lo >> 4, hi & 0xF0, out=out[:, :, 1])
    return torch.from_numpy(out.reshape(n, half))


def int4_from_nibbles(parts: list, bias: torch.Tensor | None = None, dense_rows: int = 16) -> "Int4Linear | None":
    """An ``Int4Linear`` of ``parts`` (``(nibbles, scale, minimum)`` each) fused along the output:
    ``Int4Linear(Q4Weight(...))`` of their unpacked codes bit for bit; None where ``repack_nibbles`` is."""
    packed = [repack_nibbles(p) for p, _, _ in parts]
    if any(p is None for p in packed):
        return None
    cat = lambda xs: xs[0] if len(xs) == 1 else torch.cat(xs)  # noqa: E731
    return Int4Linear.from_packed(
        cat(packed), cat([s for _, s, _ in parts]), cat([m for _, _, m in parts]), bias, None, dense_rows
    )


def int4_supported() -> bool:
    return _kernel_works(quantize_int4, Int4Linear)


def int8_supported() -> bool:
    return _kernel_works(quantize_int8, Int8Linear)


class Int4Linear:
    """``y = x @ w.T + bias`` for a ``Q4Weight``; x bfloat16 ``[T, K]`` on CPU.

    torch's int4 kernel is a matrix-vector product per row: fastest for a decode step of a
    few sequences, 3x slower than bfloat16 oneDNN for a 256-row prefill chunk. Given
    ``dense`` (the same weights dequantised, any callable linear), steps of ``dense_rows``
    rows or more use it instead. Measured on the default model in whole decode steps (where the
    bf16 weights do not stay in cache, unlike a matmul timed alone): aggregate decode of 8
    sequences 523 tok/s 4-bit vs 455 dense, 16: 635 vs 612, 32: 792 vs 700; so 16."""

    __slots__ = ("packed", "scales_zeros", "bias", "out_features", "dense", "dense_rows", "_native", "_vnni", "perm")

    def __init__(self, q: Q4Weight, bias: torch.Tensor | None = None, dense=None, dense_rows: int = 16):
        self._set(pack_int4(q.codes), q.scale, q.minimum, bias, dense, dense_rows)
        # ``q.perm`` (a GPTQ act order): every path, ``dense`` included, computes over x[:, perm]
        self.perm = q.perm

    @classmethod
    def from_packed(
        cls,
        packed: torch.Tensor,
        scale: torch.Tensor,
        minimum: torch.Tensor,
        bias: torch.Tensor | None = None,
        dense=None,
        dense_rows: int = 16,
    ) -> "Int4Linear":
        """From codes already in the kernel's layout (``pack_int4``/``repack_nibbles``)."""
        lin = cls.__new__(cls)
        lin._set(packed, scale, minimum, bias, dense, dense_rows)  # the class's own instance, made without __init__
        return lin

    def _set(self, packed, scale, minimum, bias, dense, dense_rows) -> None:
        self.out_features = scale.shape[0]
        self.dense, self.dense_rows = dense, dense_rows
        self.packed = packed
        zero = minimum + 8 * scale  # the kernel's (code - 8) * s + z
        self.scales_zeros = torch.stack((scale.t(), zero.t()), dim=-1).to(torch.bfloat16).contiguous()  # [K/32, N, 2]
        self.bias = None if bias is None else bias.to(torch.bfloat16)
        self._native = None  # int4_mm's call for this weight, once asked (``few_rows``)
        self._vnni = None  # q4_mm's, once asked (``vnni_rows``)
        self.perm = None  # the inputs in order (``__init__`` takes a Q4Weight's own)

    def few_rows(self):
        """``int4_mm``'s call for this weight (chatkv.kernels.cpu_decode: each weight tile decoded
        once for all of a step's rows, up to ``INT4_MM_ROWS``), or False where it is not built
        here or this weight is not in its layout; looked up once the fused ops have been loaded."""
        return _looked_up(
            self, lambda: int4pack_block() == 64 and cpu_decode.int4_mm_call(self.packed, self.scales_zeros)
        )

    def vnni_rows(self):
        """``q4_mm``'s call for this weight (kernels/cpu_q4.c: int8 activations, VNNI), or False
        where it is not built here or this weight is not in its layout; looked up once."""
        if self._vnni is None:
            if cpu_decode.loaded() is None:
                return False
            self._vnni = int4pack_block() == 64 and cpu_decode.q4_mm_call(self.packed, self.scales_zeros)
        return self._vnni

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The dense path for ``dense_rows`` rows or more; else ``int4_mm`` where ``_few_rows``
        gives it, torch's int4 kernel otherwise. The choice depends only on the row count and the
        machine, and ``int4_mm`` computes each row alone, so a verified proposal computes as its
        plain decode does. With ``perm`` the inputs are selected first, for every path."""
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if self.dense is not None and x.shape[0] >= self.dense_rows:
            return self.dense(x)
        x = x.contiguous()
        native = _few_rows(self, x)
        y = (
            native(x)
            if native
            else torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)
        )
        return y if self.bias is None else y + self.bias


def vnni_kernels(int4: bool | None = None, int8: bool | None = None) -> tuple[bool, bool]:
    """Whether steps of few rows take the int8-activation products (kernels/cpu_q4.c) for
    ``Int4Linear`` and for ``Int8Linear``, where they are built; set either (benchmarks compare)."""
    if int4 is not None:
        _VNNI["int4"] = bool(int4)
    if int8 is not None:
        _VNNI["int8"] = bool(int8)
    return _VNNI["int4"], _VNNI["int8"]


def few_row_kernel(on: bool | None = None) -> bool:
    """Whether steps of few rows take chatkv's kernels (``Int4Linear``, ``Int8Linear``); set it
    with ``on`` (benchmarks compare)."""
    if on is not None:
        _FEW_ROWS[0] = bool(on)
    return _FEW_ROWS[0]


def _looked_up(lin, make):
    """``lin``'s few-row call, made by ``make`` (False: none) once the fused ops' library has been
    looked for; False before that, asking again at the next step.
    ``_native`` is the slot Int4Linear and Int8Linear keep this call in: this helper is theirs."""
    if lin._native is None:  # the slot of the linear this helper serves (see above)
        if cpu_decode.loaded() is None:
            return False
        lin._native = make()
    return lin._native


def _few_rows(lin, x: torch.Tensor):
    """The few-row call for this step of ``x`` (1 to ``INT4_MM_ROWS`` rows; 0 rows take torch's
    kernel, which returns the empty result), or False. Where ``vnni_kernels`` is on for the weight's
    form, its ``vnni_rows`` (whatever the row count: one kernel for every step of few rows)."""
    if not (0 < x.shape[0] <= cpu_decode.INT4_MM_ROWS and _FEW_ROWS[0]):
        return False
    if _VNNI["int4" if isinstance(lin, Int4Linear) else "int8"]:
        vnni = lin.vnni_rows()
        if vnni:
            return vnni
    return lin.few_rows()


class Int8Linear:
    """``y = x @ w.T + bias`` for a per-channel ``Q8Weight``; x bfloat16 ``[T, K]``."""

    __slots__ = ("codes", "scales", "bias", "out_features", "dense", "dense_rows", "_native", "_vnni")

    def __init__(self, q: Q8Weight, bias: torch.Tensor | None = None, dense=None, dense_rows: int = 16):
        if q.scale.shape[1] != 1:
            raise ValueError("Int8Linear takes one scale per output channel")
        self.out_features = q.codes.shape[0]
        self.dense, self.dense_rows = dense, dense_rows  # as Int4Linear's
        self.codes = q.codes.contiguous()
        self.scales = q.scale[:, 0].to(torch.bfloat16).contiguous()
        self.bias = None if bias is None else bias.to(torch.bfloat16)
        self._native = False  # torch's kernel, unless ``native_few_rows``: as Int4Linear's once asked
        self._vnni = None  # q8_mm's call, once asked (``vnni_rows``)

    def native_few_rows(self) -> "Int8Linear":
        """Let steps of few rows take ``int8_mm`` (chatkv.kernels.cpu_decode) where it is built: the
        output matrix's choice (chatkv.model.forward), whose top logits ExactTop recomputes exactly anyway.
        Not the int8 projections': int8_mm's sums, though as close to exact per call as torch's,
        took the int8 mode's logits further from transformers' (4.8% of their spread against 3.3%,
        over six chat prompts; tests/model/test_weight_paths.py allows 4.5%)."""
        self._native = None
        return self

    def few_rows(self):
        """``int8_mm``'s call for this weight, or False; as Int4Linear's."""
        return _looked_up(self, lambda: cpu_decode.int8_mm_call(self.codes, self.scales))

    def vnni_rows(self):
        """``q8_mm``'s call for this weight (kernels/cpu_q4.c), or False; as Int4Linear's."""
        if self._vnni is None:
            if cpu_decode.loaded() is None:
                return False
            self._vnni = cpu_decode.q8_mm_call(self.codes, self.scales)
        return self._vnni

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] >= self.dense_rows:
            return self.dense(x)
        x = x.contiguous()
        native = _few_rows(self, x)
        y = native(x) if native else torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)
        return y if self.bias is None else y + self.bias
