"""KV quantisation: int8 and fp8 (e4m3) rows with their scale stored next to them.

The contract every kernel and every KV mover shares (the torch reference here, the Triton
kernels, the block pool, the host tier, snapshots):

- A quantised cache holds **bytes** (``torch.uint8``). One *row* is one token's key (or
  value) for one KV head: ``head_dim`` quantised elements, then ``SCALE_BYTES`` bytes that
  are the row's float32 scale (native byte order). So a cache of logical shape
  ``[..., head_dim]`` is stored as ``[..., head_dim + SCALE_BYTES]``: the scales live in the
  block pool beside the blocks they scale, and anything that copies rows (copy-on-write, the
  host tier, spill and restore, snapshots) carries the quantised form and its scales
  without knowing either.
- Scales are symmetric, per token and per head: ``scale = max|x| / QMAX`` over the row,
  ``q = round(x / scale)`` for int8 (QMAX 127), ``q = fp8_e4m3(x / scale)`` for fp8
  (QMAX 448, the largest finite e4m3 value; the cast rounds to nearest). A row of zeros gets
  scale 0 and decodes to zeros. The value is ``q * scale``.
- Quantisation happens when KV is stored (``store_kv``); attention dequantises what it
  reads, the rows it gathers, never the whole cache.
- Requantising a dequantised row gives the same bytes back (its largest element is exactly
  ``QMAX * scale``), so a round trip through float (RoPE shifts excepted) loses nothing more.

``head_dim`` must be a multiple of 4 so that every scale is 4-byte aligned (it is for every
model this engine runs: 64, 128, ...).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4
# kv dtype name -> (element dtype the bytes are read as, largest magnitude stored)
FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "int8": (torch.int8, 127.0),
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
}
STORAGE = torch.uint8


def row_width(quant: str | None, head_dim: int) -> int:
    """Elements of one stored row: ``head_dim``, plus the scale's bytes when quantised."""
    if quant is None:
        return head_dim
    _check(quant)
    assert head_dim % SCALE_BYTES == 0, f"quantised KV needs a head_dim divisible by {SCALE_BYTES}, not {head_dim}"
    return head_dim + SCALE_BYTES


def _check(quant: str) -> None:
    if quant not in FORMATS:
        raise ValueError(f"unknown KV quantisation {quant!r}: expected one of {', '.join(FORMATS)}")


def quantize(x: torch.Tensor, quant: str) -> torch.Tensor:
    """Rows ``[..., head_dim]`` (any float dtype) -> stored rows ``[..., head_dim + 4]`` uint8."""
    _check(quant)
    elem, qmax = FORMATS[quant]
    d = x.shape[-1]
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # divided by a tensor, not a Python number: CUDA turns x / number into x * (1 / number), an ulp off at
    # times, and the scales (so the bytes) would then depend on the device
    scale = amax / torch.full_like(amax, qmax)
    # a division, not a product with 1/scale: exact at the row's largest value, and no overflow
    # of 1/scale for a subnormal scale; a zero row stays zeros (not 0/0)
    y = torch.where(scale > 0, xf / scale, torch.zeros_like(xf))
    if quant == "int8":
        q = y.round_().clamp_(-qmax, qmax).to(torch.int8)
    else:
        q = y.clamp_(-qmax, qmax).to(elem)
    out = torch.empty(*x.shape[:-1], d + SCALE_BYTES, dtype=STORAGE, device=x.device)
    out[..., :d] = q.view(STORAGE)
    out[..., d:] = scale.view(STORAGE)  # the float32 scale's 4 bytes
    return out


def dequantize(rows: torch.Tensor, quant: str, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows ``[..., head_dim + 4]`` uint8 -> values ``[..., head_dim]`` in ``dtype``."""
    values, s = split(rows, quant, torch.float32)
    out = values * s[..., None]  # scaled in float32, rounded once
    return out if dtype == torch.float32 else out.to(dtype)


def split(rows: torch.Tensor, quant: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored rows ``[..., head_dim + 4]`` -> ``(values [..., head_dim] in dtype, scales [...] float32)``,
    the values unscaled and exact (int8 and e4m3 values fit bf16, fp16 and fp32): a row is
    ``values * scale``. For attention that applies the scales to its scores and probabilities
    instead of to every element (chatkv.kernels.attention's quantised decode).

    Views, not copies, of strided rows (any slice of a gather along tokens keeps every row
    4-byte aligned). On CPU, e4m3 is read by moving its bits into a bfloat16 (torch converts
    float8 one element at a time: 2x slower on a decode's gathered rows): the 7 bits under the
    sign become a bf16's exponent and top mantissa bits, exponent bias 127 instead of 7, so times
    2^120 (exact) it is the value, subnormals included; the NaN bytes (never stored for a finite
    row, whose scale is then not finite anyway) read as +-480."""
    _check(quant)
    elem, _ = FORMATS[quant]
    d = rows.shape[-1] - SCALE_BYTES
    q = rows[..., :d].view(elem)  # same element size: a view even of a strided slice
    if quant == "fp8_e4m3" and q.device.type == "cpu":
        b = q.view(torch.int8).to(torch.int16)  # sign-extended: b & -128 keeps the sign bit
        values = ((b & 0x7F) << 4 | (b & -128) << 8).view(torch.bfloat16) * 2.0**120
        values = values if dtype == torch.bfloat16 else values.to(dtype)
    else:
        values = q.to(dtype)
    try:
        s = rows[..., d:].view(torch.float32)[..., 0]
    except RuntimeError:
        s = rows[..., d:].contiguous().view(torch.float32)[..., 0]
    return values, s


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scales ``[...]`` of stored rows ``[..., head_dim + 4]``."""
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)[..., 0]
