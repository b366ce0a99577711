"""Row-invariant kernels on CPU: float products (``cpu_gemm.c``) and paged attention
(``rows_attention`` in ``cpu_decode.c``), built into cpu_decode's library.

``RowInvariantLinear(weight, bias)`` computes ``x @ weight.T + bias`` in the weight's dtype
(bfloat16 or float32) so that each output row depends on its own input row only: not on the
other rows of the call, not on how many there are, not on the thread count. A deterministic
engine (``EngineConfig.deterministic``) takes it for every projection of the float modes; with
the paged attention of ``rows_attention`` (cpu_decode.c) a token's numbers are then the same
whether it is decoded alone, beside other requests, in a prefill chunk of any length, recomputed
after a preemption, or verified after a speculative proposal.

oneDNN's products, which the fast path takes, are not: on an Intel Xeon with AMX the same row
comes out differently at 33 or more rows than alone; on AVX512-BF16 without AMX at 16 or more
(benchmarks/bench_deterministic.py measures it and the cost).
"""

from __future__ import annotations

import ctypes

import torch

from chatkv.kernels import cpu_decode

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "gemm_pack_bf16": ([_P, _P, _I, _I], None),
    "gemm_pack_f32": ([_P, _P, _I, _I], None),
    "gemm_bf16": ([_P, _I, _P, _P, _P, _I, _I, ctypes.c_int], None),
    "gemm_f32": ([_P, _I, _P, _P, _P, _I, _I, ctypes.c_int], None),
    "gemm_bf16_path": ([ctypes.c_int], ctypes.c_int),
    "rope_store": ([_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _P], None),
    "int4_mm_many": ([_P, _P, _P, _P, _I, _I, _I, ctypes.c_int], None),
    "rows_attention": (
        [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _P, _I, ctypes.c_int, _P],
        None,
    ),
}
ROW_BLOCK = 16  # rows_attention's rows a call: its scratch grows with rows x segments
_ready: ctypes.CDLL | None = None
PATHS = ("plain C", "AVX512-BF16", "AMX")


def _lib() -> ctypes.CDLL:
    global _ready
    if _ready is None:
        lib = cpu_decode.library()  # loaded by its caller (chatkv.model.fused_decode.kernels_available)
        for name, (args, res) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        _ready = lib
    return _ready


def path(want: int | None = None) -> str:
    """The path the bf16 products take on this machine (``PATHS``); ``want`` caps it (tests compare
    the paths; an engine never changes it once it computes)."""
    return PATHS[_lib().gemm_bf16_path(-1 if want is None else want)]


class RowInvariantLinear:
    """``y = x @ weight.T + bias``, each row computed alone (see the module doc). The weight is
    packed once (the plain copy is not kept); inputs and outputs are in the weight's dtype."""

    __slots__ = ("packed", "bias", "out_features", "in_features", "dtype")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        if weight.dtype not in (torch.bfloat16, torch.float32) or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"RowInvariantLinear: a CPU bf16/fp32 matrix, got {weight.dtype} {tuple(weight.shape)}")
        n, k = weight.shape
        if weight.dtype == torch.bfloat16 and k % 2:
            raise ValueError(f"RowInvariantLinear: bf16 weights need an even input size, got {k}")
        self.out_features, self.in_features, self.dtype = n, k, weight.dtype
        blocks = -(-n // 16)
        w = weight.contiguous()
        lib = _lib()
        if self.dtype == torch.bfloat16:
            self.packed = torch.empty(blocks * k * 16, dtype=torch.bfloat16)
            lib.gemm_pack_bf16(w.data_ptr(), self.packed.data_ptr(), n, k)
        else:
            self.packed = torch.empty(blocks * k * 16, dtype=torch.float32)
            lib.gemm_pack_f32(w.data_ptr(), self.packed.data_ptr(), n, k)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @property
    def weight(self) -> None:
        """No plain copy is kept (the packed one replaces it), as ``forward.Linear`` when packed."""
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype or x.shape[-1] != self.in_features:
            raise ValueError(
                f"RowInvariantLinear: input {x.dtype} {tuple(x.shape)}, weight {self.dtype} k={self.in_features}"
            )
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()
        rows = x2.shape[0]
        y = torch.empty(rows, self.out_features, dtype=self.dtype)
        if rows:
            fn = _lib().gemm_bf16 if self.dtype == torch.bfloat16 else _lib().gemm_f32
            fn(
                x2.data_ptr(),
                rows,
                self.packed.data_ptr(),
                None if self.bias is None else self.bias.data_ptr(),
                y.data_ptr(),
                self.out_features,
                self.in_features,
                torch.get_num_threads(),
            )
        return y.view(*lead, self.out_features)


def int4_mm_many(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """``int4_mm`` (cpu_matmul.c) for any number of rows: the numbers ``int4_mm`` gives called
    ``INT4_MM_ROWS`` rows at a time, in one pass over the weights where AMX runs. ``packed`` and
    ``scales_zeros``: an ``Int4Linear``'s, in ``cpu_decode.int4_mm_call``'s layout (its caller checks)."""
    groups, n, _ = scales_zeros.shape
    k = groups * 32
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"int4_mm_many: x {x.dtype} {tuple(x.shape)} for {k} inputs")
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    if x.shape[0]:
        ptrs = (x.data_ptr(), packed.data_ptr(), scales_zeros.data_ptr(), y.data_ptr())
        _lib().int4_mm_many(*ptrs, x.shape[0], n, k, torch.get_num_threads())
    return y


def rope_store(
    qkv: torch.Tensor,
    table: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """``decode_attention``'s RoPE and KV store for every row (cpu_decode.c ``rope_store``): qkv bf16
    ``[rows, (H + 2 KVH) D]``, table bf16 ``[positions, 2, D]``; the rotated keys and the values go
    into their slots of the caches; returns the rotated queries, bf16 ``[rows, H, D]``."""
    rows = qkv.shape[0]
    d = k_cache.shape[-1]
    if (
        qkv.dtype != torch.bfloat16
        or not qkv.is_contiguous()
        or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d
        or k_cache.dtype != torch.bfloat16
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or slots.shape != (rows,)
        or positions.shape != (rows,)
        or (rows and int(positions.max()) >= table.shape[0])
        or (rows and not 0 <= int(slots.min()) <= int(slots.max()) < k_cache.shape[0] * k_cache.shape[1])
    ):
        raise ValueError("rope_store: inconsistent shapes, positions or slots")
    q = torch.empty(rows, num_heads, d, dtype=torch.bfloat16)
    ptrs = (qkv.data_ptr(), table.contiguous().data_ptr(), positions.contiguous().data_ptr())
    caches = (k_cache.data_ptr(), v_cache.data_ptr(), slots.contiguous().data_ptr())
    _lib().rope_store(*ptrs, *caches, rows, num_heads, num_kv_heads, d, q.data_ptr())
    return q


def rows_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    lo: torch.Tensor | None,
    ctx: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of ``rows`` one-token queries, each over its own keys: q bf16 ``[rows, H, D]``
    (rotated); k/v_cache bf16 ``[blocks, block_size, KVH, D]`` with every row's keys stored;
    blocks int64 ``[rows, max_blocks]``; row r attends to keys ``[lo[r], ctx[r])`` (``lo`` None:
    from 0). Returns bf16 ``[rows, H, D]``. A row's bits depend on its query and keys only
    (cpu_decode.c, rows_attention). The rows go ``ROW_BLOCK`` a call, which bounds the scratch."""
    rows, nh, d = q.shape
    nb, bs, nkv, dk = k_cache.shape
    if (
        q.dtype != torch.bfloat16
        or k_cache.dtype != torch.bfloat16
        or v_cache.shape != k_cache.shape
        or dk != d
        or not cpu_decode.heads_supported(nh, nkv, d)
        or blocks.shape[0] != rows
        or ctx.shape != (rows,)
        or (lo is not None and lo.shape != (rows,))
    ):
        raise ValueError("rows_attention: inconsistent shapes or dtypes")
    q = q.contiguous()
    out = torch.empty_like(q)
    blocks, ctx = blocks.contiguous(), ctx.contiguous()
    lo = None if lo is None else lo.contiguous()
    lib, threads, width = _lib(), torch.get_num_threads(), blocks.shape[1]
    for r0 in range(0, rows, ROW_BLOCK):
        r1 = min(rows, r0 + ROW_BLOCK)
        n = r1 - r0
        scores = cpu_decode.attention_scratch(n, nh, nkv, d, int(ctx[r0:r1].max()))
        lib.rows_attention(
            q[r0].data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            blocks[r0].data_ptr(),
            None if lo is None else lo[r0:r1].data_ptr(),
            ctx[r0:r1].data_ptr(),
            width,
            bs,
            n,
            nh,
            nkv,
            d,
            scale,
            scores.data_ptr(),
            scores.shape[0],
            threads,
            out[r0].data_ptr(),
        )
    return out
