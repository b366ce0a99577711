"""Steps of many rows in the quantised modes without a resident bfloat16 copy of the weights.

torch's int4 and int8 CPU kernels are matrix-vector products per row: right for decode, 2-3x
slower than a bfloat16 matmul for a prefill chunk of hundreds of rows. Instead of keeping a
bf16 copy of every projection for those steps (16 bits a parameter on top of the 4.5 the int4
weights take), each projection's own quantised weights are dequantised, right before its
matmul, into one buffer that every projection of the model reuses (``Scratch``: per thread,
grown to the largest projection, 3.5 MB on the default model), then multiplied in bfloat16.

The numbers are the ones the quantised kernels compute with, rounded once to bfloat16:

- int4 (``ScratchInt4``): read from the kernel's own packed weights and bfloat16 scales and
  zeros, ``w = (code - 8) * s + z`` in float32 (the product is exact, as in the kernel's fused
  multiply-add), then rounded. So a sequence's prefill and its decode compute with the same
  weights. (The resident copy, ``quant_dense="copy"``, holds ``code * scale + minimum`` from the
  float32 scale and minimum instead: the two differ by the kernel's bfloat16 rounding of s and z,
  at most 2^-9 of a weight, the size of bfloat16's own rounding.)
- int8 (``ScratchInt8``): ``code * scale`` with the float32 per-channel scale, rounded: bit for
  bit the resident copy's numbers.

Reading the int4 kernel's packing depends on its layout, which torch documents only in its
source and which differs by ISA: ``chatkv.quant.int4pack_block`` finds it by packing known codes once.
Where it is not one this module reads (or a projection's rows are not whole blocks), the
projection has no scratch path and its many-row steps run the int4 kernel, still without a copy.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from chatkv.quant import GROUP, int4pack_block

__all__ = ["Scratch", "ScratchInt4", "ScratchInt8", "scratch_int4"]


class Scratch:
    """One reusable buffer per thread, grown to the largest request (a model's largest projection)."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        self.dtype = dtype
        self._local = threading.local()

    def get(self, numel: int) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < numel:
            buf = self._local.buf = torch.empty(numel, dtype=self.dtype)
        return buf[:numel]

    @property
    def nbytes(self) -> int:
        """This thread's buffer (0 before its first many-row step)."""
        buf = getattr(self._local, "buf", None)
        return 0 if buf is None else buf.numel() * buf.element_size()


class ScratchInt4:
    """``y = x @ w.T + bias`` over an ``Int4Linear``'s packed weights, dequantised into ``scratch``
    per call (see the module docstring). Built by ``scratch_int4``."""

    __slots__ = ("packed", "scales_zeros", "bias", "n", "k", "block", "scratch")

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, bias, n: int, block: int, scratch: Scratch):
        self.packed, self.scales_zeros, self.bias, self.scratch = packed, scales_zeros, bias, scratch
        self.n, self.k, self.block = n, packed.numel() * 2 // n, block

    def weight_t(self) -> torch.Tensor:
        """``w.T`` as bfloat16 ``[K, N]`` in the scratch buffer (valid until its next use)."""
        n, k, b = self.n, self.k, self.block
        nb, half, groups = n // b, b // 2, k // GROUP
        out = self.scratch.get(k * n).view(groups, GROUP, nb, 2, half)  # [k // 32, k % 32, block, nibble, d]
        codes = self.packed.view(nb, groups, GROUP, half).permute(1, 2, 0, 3)  # byte [k // 32, k % 32, block, d]
        sz = self.scales_zeros.float()  # [K / 32, N, 2]: the kernel's bfloat16 s and z, exactly
        s = sz[..., 0].view(groups, 1, nb, 2, half)
        z = (sz[..., 1] - 8 * sz[..., 0]).view(groups, 1, nb, 2, half)  # (code - 8) * s + z = code * s + (z - 8 s)
        torch.addcmul(z[..., 0, :], codes & 0x0F, s[..., 0, :], out=out[..., 0, :])
        torch.addcmul(z[..., 1, :], codes >> 4, s[..., 1, :], out=out[..., 1, :])
        return out.view(k, n)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight_t()
        return torch.mm(x, w) if self.bias is None else torch.addmm(self.bias, x, w)


def scratch_int4(lin, scratch: Scratch) -> ScratchInt4 | None:
    """The scratch path of ``lin`` (a ``chatkv.quant.Int4Linear``), or None where this build's
    packing is not one chatkv.quant reads (``int4pack_block``) or the rows are not whole blocks."""
    block = int4pack_block()
    if block is None or lin.out_features % block or lin.packed.dtype != torch.uint8:
        return None
    return ScratchInt4(lin.packed, lin.scales_zeros, lin.bias, lin.out_features, block, scratch)


class ScratchInt8:
    """``y = x @ w.T + bias`` for per-channel int8 ``codes [N, K]`` and their float32 ``scale [N]``,
    dequantised into ``scratch`` per call: the resident copy's numbers bit for bit."""

    __slots__ = ("codes", "scale", "bias", "scratch")

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias, scratch: Scratch):
        self.codes, self.scale, self.bias, self.scratch = codes, scale.float().reshape(-1, 1), bias, scratch

    def weight(self) -> torch.Tensor:
        n, k = self.codes.shape
        return torch.mul(self.codes, self.scale, out=self.scratch.get(n * k).view(n, k))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight(), self.bias)
