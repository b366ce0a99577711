"""Steps of many rows in the quantised modes without a resident bfloat16 copy of the weights.

torch's int4 and int8 CPU kernels are matrix-vector products per row: right for decode, 2-3x
slower than a bfloat16 matmul for a prefill chunk of hundreds of rows. Instead of keeping a
bf16 copy of every projection for those steps (16 bits a parameter on top of the 4.5 the int4
weights take), each projection's own quantised weights are dequantised, right before its
matmul, into one buffer that every projection of the model reuses (``Scratch``: per thread,
grown to the largest projection, 3.5 MB on the default model, and its int8 temporaries where
torch ops dequantise: 5.3 MB), then multiplied in bfloat16. The dequantising is one C call
where the fused decode ops' library is built (``native_dequantise``), torch ops elsewhere.
Steps of fewer than ``SCRATCH_ROWS`` rows run the int4 kernel instead ("Which rows" below).

The numbers are the ones the quantised kernels compute with, rounded once to bfloat16:

- int4 (``ScratchInt4``): read from the kernel's own packed weights and bfloat16 scales and
  zeros, ``w = (code - 8) * s + z`` in float32 (the product is exact, as in the kernel's fused
  multiply-add), then rounded. So a sequence's prefill and its decode compute with the same
  weights. (The resident copy, ``quant_dense="copy"``, holds ``code * scale + minimum`` from the
  float32 scale and minimum instead: the two differ by the kernel's bfloat16 rounding of s and z,
  at most 2^-9 of a weight, the size of bfloat16's own rounding.)
- int8 (``ScratchInt8``): ``code * scale`` with the float32 per-channel scale, rounded: bit for
  bit the resident copy's numbers (one C pass, ``cpu_decode.int8_weight``, where the fused ops are
  built: torch's mixed-dtype multiply takes ~15x a copy's time).

Reading the int4 kernel's packing depends on its layout, which torch documents only in its
source and which differs by ISA: ``chatkv.weights.quantised.int4pack_block`` finds it by packing known codes once.
Where it is not one this module reads (or a projection's rows are not whole blocks), the
projection has no scratch path and its many-row steps run the int4 kernel, still without a copy.

Which rows (int4): the dequantising costs a step the same whatever its rows (a pass over every
weight, ~125 ms of one core's CPU for the default model's 106 M projection weights on an
Intel Xeon with AMX, loaded), while the int4 kernel costs each row (~2.9 ms a row there) and
the bf16 matmul next to nothing with AMX (512 rows: 150 ms for all 30 layers). So steps of
fewer than ``SCRATCH_ROWS`` (64) rows run the int4 kernel, with no dequantising: the two cost
the same at about 75 rows there (CPU time, one thread: 64 rows 193 vs 213 ms, 96 rows 273 vs
223). On the 2-core AMD EPYC of the earlier figures the kernel's rows cost less against its
bf16 matmul (docs/reference/weights.md), so there the crossing is higher, ~130 rows by those figures;
64 leaves it slower between there and 64 rows, never by more than the dequantising.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from chatkv.kernels import cpu_decode
from chatkv.weights.quantised import GROUP, int4pack_block

__all__ = ["SCRATCH_ROWS", "Scratch", "ScratchInt4", "ScratchInt8", "scratch_int4"]

#: int4 steps of fewer rows than this run the int4 kernel even where the scratch path is on
#: (module docstring, "Which rows"); chatkv.model.self_check's prompt is at least this long.
SCRATCH_ROWS = 64


class Scratch:
    """One reusable buffer per thread, grown to the largest request (a model's largest
    projection's bf16 weights; 1.5x that with the torch ops' int8 temporaries)."""

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


def native_dequantise() -> bool:
    """Whether ``ScratchInt4.weight_t`` runs as one C call (chatkv.kernels.cpu_decode, built for the
    fused decode ops): the torch ops' numbers bit for bit (tests/model/test_quant_prefill.py), measured
    4x cheaper on one thread (the default model's projections: 14 vs 55 ms, AMD EPYC)."""
    from chatkv.model import fused_decode

    return fused_decode.kernels_available()


class ScratchInt4:
    """``y = x @ w.T + bias`` over an ``Int4Linear``'s packed weights: steps of ``min_rows`` rows or
    more dequantise them into ``scratch`` (see the module docstring), fewer run the int4 kernel.
    Built by ``scratch_int4``."""

    __slots__ = ("packed", "scales_zeros", "bias", "n", "k", "block", "scratch", "min_rows")

    def __init__(
        self,
        packed: torch.Tensor,
        scales_zeros: torch.Tensor,
        bias,
        n: int,
        block: int,
        scratch: Scratch,
        min_rows: int = 0,
    ):
        self.packed, self.scales_zeros, self.bias, self.scratch = packed, scales_zeros, bias, scratch
        self.n, self.k, self.block, self.min_rows = n, packed.numel() * 2 // n, block, min_rows

    def weight_t(self) -> torch.Tensor:
        """``w.T`` as bfloat16 ``[K, N]`` in the scratch buffer (valid until its next use).

        Every op is one contiguous pass the vectorised kernels take (strided scales or a
        mixed-dtype product made the first version 2x slower): ``byte ^ 0x88`` read as int8 holds
        both nibbles' ``code - 8`` as signed 4-bit numbers, an arithmetic shift sign-extends
        each, a copy moves it into its ``[K, N]`` place as bfloat16 (exact: -8..7), and one
        ``addcmul`` with the kernel's s and z (made contiguous, ``[K / 32, 1, N]``) computes
        ``(code - 8) * s + z`` in float32 and rounds it once, as before."""
        n, k, b = self.n, self.k, self.block
        if native_dequantise():  # the same numbers in one pass of C (kernels/cpu_decode.c), ~4x cheaper
            return cpu_decode.int4_weight_t(self.packed, self.scales_zeros, self.scratch.get(k * n).view(k, n), b)
        nb, half, groups, e = n // b, b // 2, k // GROUP, k * n
        buf = self.scratch.get(e + e // 2)  # the weights, then two int8 temporaries of e / 2 bytes
        out = buf[:e].view(k, nb, 2, half)  # [k, block, nibble, d]: column block * b + nibble * half + d
        tmp = buf[e:].view(torch.int8)
        q, hi = tmp[: e // 2].view(nb, k, half), tmp[e // 2 :].view(nb, k, half)  # byte [block, k, d]
        torch.bitwise_xor(self.packed.view(nb, k, half).view(torch.int8), -0x78, out=q)  # -0x78: 0x88 as int8
        torch.bitwise_right_shift(q, 4, out=hi)  # high nibble - 8
        out[:, :, 1].copy_(hi.permute(1, 0, 2))
        q.bitwise_left_shift_(4).bitwise_right_shift_(4)  # low nibble - 8
        out[:, :, 0].copy_(q.permute(1, 0, 2))
        w = out.view(groups, GROUP, n)
        sz = self.scales_zeros  # [K / 32, N, 2]: the kernel's bfloat16 s and z
        torch.addcmul(sz[..., 1].contiguous().unsqueeze(1), w, sz[..., 0].contiguous().unsqueeze(1), out=w)
        return out.view(k, n)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self.min_rows:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, GROUP, self.scales_zeros)
            return y if self.bias is None else y + self.bias
        w = self.weight_t()
        return torch.mm(x, w) if self.bias is None else torch.addmm(self.bias, x, w)


def scratch_int4(lin, scratch: Scratch, min_rows: int | None = None) -> ScratchInt4 | None:
    """The scratch path of ``lin`` (a ``chatkv.weights.quantised.Int4Linear``) for its steps of ``min_rows``
    (default ``SCRATCH_ROWS``) rows or more, or None where this build's packing is not one
    chatkv.weights.quantised reads (``int4pack_block``) or the rows are not whole blocks."""
    block = int4pack_block()
    if block is None or lin.out_features % block or lin.packed.dtype != torch.uint8:
        return None
    return ScratchInt4(
        lin.packed,
        lin.scales_zeros,
        lin.bias,
        lin.out_features,
        block,
        scratch,
        SCRATCH_ROWS if min_rows is None else min_rows,
    )


class ScratchInt8:
    """``y = x @ w.T + bias`` for per-channel int8 ``codes [N, K]`` and their float32 ``scale [N]``,
    dequantised into ``scratch`` per call: the resident copy's numbers bit for bit."""

    __slots__ = ("codes", "scale", "bias", "scratch")

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias, scratch: Scratch):
        self.codes, self.scale, self.bias, self.scratch = (
            codes,
            scale.float().reshape(-1, 1).contiguous(),
            bias,
            scratch,
        )

    def weight(self) -> torch.Tensor:
        n, k = self.codes.shape
        out = self.scratch.get(n * k).view(n, k)
        if native_dequantise() and self.codes.is_contiguous():  # the same numbers in one pass of C
            return cpu_decode.int8_weight(self.codes, self.scale, out)
        return torch.mul(self.codes, self.scale, out=out)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight(), self.bias)
