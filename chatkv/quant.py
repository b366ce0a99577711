"""Quantised projection weights for CPU decode: int4 in groups of 32, int8 per output channel.

Batch-1 decode streams every weight once per token, so its time follows the weights' bytes.
A GGUF's Q4_0/Q4_1 tensors are computed as they are stored, and a float weight (a Hugging
Face directory, or a GGUF's float or Q8_0 tensor) is quantised on load:

- **int4** (``Int4Linear``): per group of 32 inputs, ``w = code * scale + minimum`` with
  ``code`` in 0..15, which is exactly GGUF's Q4_1 (Q4_0 is the case ``minimum = -8 * scale``).
  It runs on ``torch.ops.aten._weight_int4pack_mm_for_cpu``, which computes
  ``(code - 8) * s + z`` per group: ``s = scale`` and ``z = minimum + 8 * scale``. The codes
  are kept exactly; the kernel computes in bfloat16, so it takes ``s`` and ``z`` in
  bfloat16 too: a relative rounding of at most 2^-9 per weight, the same size as
  bfloat16's own rounding of every activation (Q4's own step is 1/15 of the group's range).
- **int8** (``Int8Linear``): symmetric, one scale per output channel (``code * scale``,
  code in -127..127), on ``torch.ops.aten._weight_int8pack_mm``.

``Q4Weight``/``Q8Weight`` are the stored forms (numbers only, no kernels), what the converted
model directory keeps (``chatkv.weights.gguf``) and what the mapping tests compare bit for bit
with gguf's own reference dequantisation. Activations are bfloat16 in both modes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["GROUP", "Q4Weight", "Q8Weight", "Int4Linear", "Int8Linear", "quantize_int4", "quantize_int8",
           "from_gguf_blocks", "int4_supported", "int8_supported"]

GROUP = 32  # inputs per int4 group: GGUF's block size and the kernel's group size


@dataclass
class Q4Weight:
    """``w[n, k] = codes[n, k] * scale[n, k // 32] + minimum[n, k // 32]``."""

    codes: torch.Tensor  # uint8 [N, K], 0..15
    scale: torch.Tensor  # float32 [N, K / 32]
    minimum: torch.Tensor  # float32 [N, K / 32]
    centred: bool = False  # Q4_0: minimum == -8 * scale, dequantised as (q - 8) * scale

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], computed as gguf's reference does (Q4_1: ``d * q + m``; Q4_0:
        ``d * (q - 8)``; each op rounded). The two agree but for the sign of a zero."""
        n, k = self.codes.shape
        q = self.codes.float().view(n, k // GROUP, GROUP)
        if self.centred:
            return (self.scale[..., None] * (q - 8)).view(n, k)
        return (self.scale[..., None] * q + self.minimum[..., None]).view(n, k)

    def rows(self, order: np.ndarray | torch.Tensor) -> "Q4Weight":
        idx = torch.as_tensor(np.asarray(order), dtype=torch.long)
        return Q4Weight(self.codes[idx], self.scale[idx], self.minimum[idx], self.centred)


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


def from_gguf_blocks(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> Q4Weight | Q8Weight:
    """The stored numbers of a GGUF tensor of type ``kind`` (Q4_0, Q4_1, Q8_0), from its raw
    bytes ``raw`` (``[N, bytes per row]`` uint8, as ``gguf.GGUFReader`` gives them), ``shape``
    = (N, K). Layouts (ggml): Q4_0 block = f16 d, 16 bytes of nibbles (element j in the low
    nibble of byte j, element j + 16 in the high one), w = (q - 8) * d; Q4_1 = f16 d, f16 m,
    the same nibbles, w = q * d + m; Q8_0 = f16 d, 32 int8, w = q * d."""
    n, k = shape
    if k % GROUP:
        raise ValueError(f"a {kind} tensor of {k} columns is not whole blocks of {GROUP}")
    head = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}.get(kind)
    if head is None:
        raise ValueError(f"GGUF type {kind} is not mapped (Q4_0, Q4_1, Q8_0 are)")
    per = head + (GROUP if kind == "Q8_0" else GROUP // 2)
    blocks = np.ascontiguousarray(raw).reshape(n, k // GROUP, per)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if kind == "Q8_0":
        codes = torch.from_numpy(blocks[..., head:].copy().view(np.int8).reshape(n, k))
        return Q8Weight(codes, d)
    nib = torch.from_numpy(blocks[..., head:].copy())  # [N, K/32, 16]
    codes = torch.cat((nib & 0x0F, nib >> 4), dim=-1).reshape(n, k)
    if kind == "Q4_1":
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        return Q4Weight(codes.contiguous(), d, m)
    return Q4Weight(codes.contiguous(), d, d * -8.0, centred=True)  # -8d: exact, a power of two


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
        part = w[i : i + rows].float()
        s = part.abs().amax(1, keepdim=True) / 127
        scale[i : i + rows] = s
        s = torch.where(s == 0, torch.ones_like(s), s)
        codes[i : i + rows] = torch.clamp(torch.round(part / s), -127, 127).to(torch.int8)
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

    __slots__ = ("packed", "scales_zeros", "bias", "out_features", "dense", "dense_rows")

    def __init__(self, q: Q4Weight, bias: torch.Tensor | None = None, dense=None, dense_rows: int = 16):
        n, k = q.codes.shape
        self.out_features = n
        self.dense, self.dense_rows = dense, dense_rows
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.codes.to(torch.int32).contiguous(), 1)
        zero = q.minimum + 8 * q.scale  # the kernel's (code - 8) * s + z
        self.scales_zeros = torch.stack((q.scale.t(), zero.t()), dim=-1).to(torch.bfloat16).contiguous()  # [K/32, N, 2]
        self.bias = None if bias is None else bias.to(torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] >= self.dense_rows:
            return self.dense(x)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, GROUP, self.scales_zeros)
        return y if self.bias is None else y + self.bias


class Int8Linear:
    """``y = x @ w.T + bias`` for a per-channel ``Q8Weight``; x bfloat16 ``[T, K]``."""

    __slots__ = ("codes", "scales", "bias", "out_features", "dense", "dense_rows")

    def __init__(self, q: Q8Weight, bias: torch.Tensor | None = None, dense=None, dense_rows: int = 16):
        if q.scale.shape[1] != 1:
            raise ValueError("Int8Linear takes one scale per output channel")
        self.out_features = q.codes.shape[0]
        self.dense, self.dense_rows = dense, dense_rows  # as Int4Linear's
        self.codes = q.codes.contiguous()
        self.scales = q.scale[:, 0].to(torch.bfloat16).contiguous()
        self.bias = None if bias is None else bias.to(torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] >= self.dense_rows:
            return self.dense(x)
        y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.codes, self.scales)
        return y if self.bias is None else y + self.bias
