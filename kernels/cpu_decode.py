"""Fused CPU ops of a decode step, in C (``cpu_decode.c``, ``cpu_matmul.c``), built with the
system's C compiler at first use (or by scripts/install.sh) and cached per source, compiler and
CPU; called with ctypes.

(Past ~400 lines on purpose: the build, its cache key, the ctypes signatures and the Python
wrappers of one C library change together.)

Why: at batch 1 the default model's decode step was ~4,900 torch ops (~160 a layer around its 4
matmuls: RMSNorm alone is ~13 ops on CPU, RoPE 8, the KV store 4, attention ~20), each 1-3 us of
dispatch and allocation for a few hundred numbers; measured on one thread, the step without its
matmuls took 4-5 ms of 21-25 ms (benchmarks/bench_decode_ops.py). These three functions do that
work in one call each: ``add_rms`` (the residual addition and the next RMSNorm), ``silu_mul``,
``decode_attention`` (RoPE of q and k, the KV store, attention of one-token queries).
``decode_attention`` splits its work over the step's threads (OpenMP, in torch's own libgomp):
one item per (row, kv head, ``ATTN_SEGMENT`` keys), for the query heads that share the kv head,
merged in a fixed order (the same bits on any thread count); its softmax and ``silu_mul`` take
exp 16 at a time (AVX-512): on the default model at a 31-160-token context, single-threaded on an
AMD EPYC, glibc's scalar expf makes attention 1.7 ms of a 7.6 ms step, and silu_mul takes 0.30 ms
scalar against 0.07 ms vectorised; benchmarks/bench_decode_attention.py compares it with the torch ops.

The step's quantised products of a few rows (``int4_mm``, ``int8_mm``, in cpu_matmul.c, taken by
chatkv.weights.quantised for up to ``INT4_MM_ROWS`` rows): torch's weight-only kernels decode each weight
tile again for every row, so a step of 6 rows (speculation's verification) cost 2.3-2.8x a
one-row step; these decode it once for all rows with AVX512-BF16 dot products, where the CPU
has them (AMD Zen 4, Intel Sapphire Rapids; elsewhere torch's kernels run), and with AMX tile
dot products where it has those too (Intel; ``amx``), which make an extra row nearly free.
Behind chatkv.weights.quantised's switch (``vnni_kernels``), ``q4_mm``/``q8_mm`` (cpu_q4.c) take
those steps instead: the same stored weights times int8-quantised activations with AVX512-VNNI
integer dot products (as llama.cpp's q8 dot products), so no weight is widened to bfloat16.

Never required: without a compiler, on a build failure, off Linux/x86 or with
``CHATKV_FUSED_DECODE=0``, ``load()`` is False and the model runs its torch ops (which are
the oracle: tests/model/test_cpu_decode.py compares both at the default model's real activations).
Numbers: each function rounds to bfloat16 where the torch ops it replaces round; only the order
of float32 sums differs (the norm's sum of squares is taken in float64, closer to exact).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("chatkv.kernels")

ENV = "CHATKV_FUSED_DECODE"  # "0" turns the fused decode ops off
AMX_ENV = "CHATKV_AMX"  # "0": the few-row products use AVX-512 only, where the CPU has AMX too
SOURCE = Path(__file__).with_name("cpu_decode.c")
#: the library's sources: the fused step ops, the few-row quantised products, the row-invariant float
#: products (cpu_gemm.c, chatkv.kernels.cpu_invariant), their bf16 helpers
SOURCES = (
    SOURCE,
    SOURCE.with_name("cpu_matmul.c"),
    SOURCE.with_name("cpu_gemm.c"),
    SOURCE.with_name("cpu_q4.c"),  # the few-row products with int8 activations (``q4_mm_call``)
    SOURCE.with_name("cpu_bf16.h"),
)
MAX_HEAD_DIM = 512  # the C kernel's per-head buffers
MAX_GROUP = 16  # query heads per kv head decode_attention takes (ATTN_MAX_GROUP in the C)
ATTN_SEGMENT = 64  # keys per work item of decode_attention (ATTN_SEGMENT in the C)


def heads_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether decode_attention takes these heads (its per-head buffers in the C are fixed)."""
    return (
        head_dim <= MAX_HEAD_DIM
        and num_kv_heads > 0
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
    )


def attention_scratch(rows: int, num_heads: int, num_kv_heads: int, head_dim: int, max_ctx: int) -> torch.Tensor:
    """decode_attention's float32 scratch: each (row, kv head, segment of ``ATTN_SEGMENT`` keys)
    item's max, sum and unnormalised output per query head, ``[segments, floats]``."""
    segs = max(1, -(-max_ctx // ATTN_SEGMENT))
    return torch.empty(segs, rows * num_heads * (head_dim + 2), dtype=torch.float32)


_P, _I, _D, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_float
_SIGNATURES = {
    "add_rms": [_P, _P, _P, _P, _I, _I, _D],
    "silu_mul": [_P, _P, _I, _I],
    "decode_attention": [_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _P, _P, _I, ctypes.c_int, _P],
    "int4_weight_t": [_P, _P, _P, _I, _I, _I, ctypes.c_int],
    "int4_mm": [_P, _P, _P, _P, _I, _I, _I, ctypes.c_int],
    "int8_mm": [_P, _P, _P, _P, _I, _I, _I, ctypes.c_int],
    "int8_weight": [_P, _P, _P, _I, _I, ctypes.c_int],
}
INT4_MM_ROWS = 16  # the most rows int4_mm takes (INT4_MM_ROWS in the C)
INT4_MM_GROUPS = 1024  # the most groups of 32 inputs it takes (INT4_MM_GROUPS in the C)
_lib: ctypes.CDLL | None | bool = False  # False: not looked for yet


def _cpu_key() -> str:
    """What the build depends on besides the source: the CPU's flags (it is built -march=native).
    Not the compiler's version: a library once built runs as it is (and asking gcc would cost
    every start-up a process)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()}|{flags}"


def digest() -> str:
    """The C sources' hash: what a self-check's verdict on the fused path holds for (chatkv.model.self_check)."""
    return hashlib.sha256(_sources()).hexdigest()[:12]


def _sources() -> bytes:
    return b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in SOURCES)


def build(directory: Path) -> Path | None:
    """The shared library in ``directory`` (the caller's cache: chatkv.model.fused_decode gives chatkv's),
    compiled unless it is there; None when it cannot be built here."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    key = _cpu_key()
    src = _sources()
    digest = hashlib.sha256(src + key.encode()).hexdigest()[:20]
    target = directory / f"cpu_decode-{digest}.so"
    if target.is_file():
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
        # -fopenmp: decode_attention's threads; the libgomp.so.1 it needs is the one torch has
        # already loaded (same soname), so both share one runtime and one pool of threads
        cmd = [
            "gcc",
            "-O3",
            "-march=native",
            "-fopenmp",
            "-fno-math-errno",
            "-shared",
            "-fPIC",
            "-o",
            tmp,
            *(str(p) for p in SOURCES if p.suffix == ".c"),
            "-lm",
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            log.warning("fused decode ops not built (%s): %s; the torch ops are used", " ".join(cmd), out.stderr[-500:])
            os.unlink(tmp)
            return None
        os.replace(tmp, target)  # atomic: a concurrent first use sees the whole file or none
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("fused decode ops not built (%s); the torch ops are used", err)
        return None
    return target


def load(directory: Path) -> bool:
    """Build (once per source and CPU, into ``directory``) and load the library; whether it loaded.
    Looked for once per process: later calls answer the first one's result."""
    global _lib
    if _lib is False:
        _lib = None
        if os.environ.get(ENV, "1").strip() != "0":
            path = build(directory)
            if path is not None:
                try:
                    lib = ctypes.CDLL(str(path))
                    for name, args in _SIGNATURES.items():
                        getattr(lib, name).argtypes = args
                        getattr(lib, name).restype = None
                    for name in ("q4_mm", "q8_mm"):  # int8 activations (cpu_q4.c): 0, or -1 without memory
                        getattr(lib, name).argtypes = [_P, _P, _P, _P, _I, _I, _I, ctypes.c_int, ctypes.c_int]
                        getattr(lib, name).restype = ctypes.c_int
                    for name in ("int4_mm_native", "int8_mm_native", "q4_vnni_native"):
                        getattr(lib, name).argtypes, getattr(lib, name).restype = [], ctypes.c_int
                    lib.set_attention_blocked.argtypes, lib.set_attention_blocked.restype = [ctypes.c_int], ctypes.c_int
                    lib.amx_enable.argtypes, lib.amx_enable.restype = [ctypes.c_int], ctypes.c_int
                    lib.amx_enable(int(os.environ.get(AMX_ENV, "1").strip() != "0"))
                    _lib = lib
                except OSError as err:
                    log.warning("fused decode ops not loaded (%s); the torch ops are used", err)
    return _lib is not None


def loaded() -> bool | None:
    """Whether ``load`` loaded the library; None before it was tried (a check for hot paths,
    with no directory to compute)."""
    return None if _lib is False else _lib is not None


def library() -> ctypes.CDLL:
    if not _lib:
        raise RuntimeError("the fused decode ops are not loaded (cpu_decode.load)")
    return _lib


def _check(t: torch.Tensor, dtype: torch.dtype, name: str) -> int:
    if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name}: expected a contiguous CPU {dtype} tensor, got {t.dtype} {tuple(t.shape)}")
    return t.data_ptr()


def add_rms(h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor, eps: float) -> None:
    """``h += y`` (bf16 ``y``, or none), then ``out = bf16(rms_norm(h) * weight)``; h float32 ``[rows, n]``."""
    rows, n = h.shape
    if weight.shape != (n,) or out.shape != (rows, n) or (y is not None and y.shape != (rows, n)):
        raise ValueError(f"add_rms: shapes h {tuple(h.shape)}, weight {tuple(weight.shape)}, out {tuple(out.shape)}")
    yp = None if y is None else _check(y, torch.bfloat16, "y")
    library().add_rms(
        _check(h, torch.float32, "h"),
        yp,
        _check(weight, torch.float32, "weight"),
        _check(out, torch.bfloat16, "out"),
        rows,
        n,
        eps,
    )


def silu_mul(gu: torch.Tensor, out: torch.Tensor) -> None:
    """``out = silu(g) * u`` in bfloat16, ``gu = [g, u]`` along the last axis (``[rows, 2n]``)."""
    rows, n2 = gu.shape
    if n2 % 2 or out.shape != (rows, n2 // 2):
        raise ValueError(f"silu_mul: shapes gu {tuple(gu.shape)}, out {tuple(out.shape)}")
    library().silu_mul(_check(gu, torch.bfloat16, "gu"), _check(out, torch.bfloat16, "out"), rows, n2 // 2)


def attention_blocked(on: bool) -> bool:
    """Choose ``decode_attention``'s path: True (the default) the register-blocked one, where
    rows sharing a block table (a verification's) convert each key once; False each row's own
    items, the path before it (benchmarks/bench_decode_attention.py compares them). Returns the
    choice before. Either gives a row the same bits whatever else is in the step."""
    return bool(library().set_attention_blocked(int(on)))


def decode_attention(
    qkv: torch.Tensor,
    table: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    blocks: torch.Tensor,
    ctx: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    out: torch.Tensor,
    scratch: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """One layer's attention of ``rows`` one-token queries (see cpu_decode.c): qkv bf16
    ``[rows, (H + 2 KVH) D]``; table bf16 ``[positions, 2, D]`` (cos, sign-folded sin); k/v_cache
    bf16 ``[blocks, block_size, KVH, D]``; slots, positions, ctx int64 ``[rows]``; blocks int64
    ``[rows, max_blocks]`` (row r's keys are its first ctx[r]); out bf16 ``[rows, H D]``;
    scratch: (bf16 ``[rows, H D]``, ``attention_scratch(...)``). Bounds are the caller's (the
    model's metadata); only shapes and dtypes are checked here."""
    rows = qkv.shape[0]
    nb, bs, kvh, d = k_cache.shape
    if (
        qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d
        or kvh != num_kv_heads
        or not heads_supported(num_heads, num_kv_heads, d)
        or v_cache.shape != k_cache.shape
        or table.shape[1:] != (2, d)
        or out.shape != (rows, num_heads * d)
        or blocks.dim() != 2
        or blocks.shape[0] != rows
        or slots.shape != (rows,)
        or ctx.shape != (rows,)
        or positions.shape != (rows,)
        or scratch[0].numel() < rows * num_heads * d
        or scratch[1].dim() != 2
        or scratch[1].shape[1] != rows * num_heads * (d + 2)
        or (rows and scratch[1].shape[0] * ATTN_SEGMENT < int(ctx.max()))
    ):
        raise ValueError("decode_attention: inconsistent shapes")
    library().decode_attention(
        _check(qkv, torch.bfloat16, "qkv"),
        _check(table, torch.bfloat16, "table"),
        _check(positions, torch.int64, "positions"),
        _check(k_cache, torch.bfloat16, "k_cache"),
        _check(v_cache, torch.bfloat16, "v_cache"),
        _check(slots, torch.int64, "slots"),
        _check(blocks, torch.int64, "blocks"),
        _check(ctx, torch.int64, "ctx"),
        blocks.shape[1],
        bs,
        rows,
        num_heads,
        num_kv_heads,
        d,
        scale,
        _check(scratch[0], torch.bfloat16, "scratch"),
        _check(scratch[1], torch.float32, "scores"),
        scratch[1].shape[0],
        torch.get_num_threads(),
        _check(out, torch.bfloat16, "out"),
    )


def int4_weight_t(packed: torch.Tensor, scales_zeros: torch.Tensor, out: torch.Tensor, block: int) -> torch.Tensor:
    """``w.T`` of torch's CPU int4 packing (uint8 ``[N, K / 2]`` in blocks of ``block`` rows) and
    its bfloat16 ``scales_zeros`` (``[K / 32, N, 2]``) into ``out`` (bfloat16 ``[K, N]``): ``(code -
    8) * s + z`` rounded as chatkv.model.prefill's torch ops round it, on the current threads."""
    groups, n, two = scales_zeros.shape
    k = groups * 32
    if two != 2 or packed.numel() * 2 != n * k or out.shape != (k, n) or n % block or block % 2:
        raise ValueError(
            f"int4_weight_t: packed {tuple(packed.shape)}, scales_zeros {tuple(scales_zeros.shape)}, "
            f"out {tuple(out.shape)}, block {block}"
        )
    library().int4_weight_t(
        _check(packed, torch.uint8, "packed"),
        _check(scales_zeros, torch.bfloat16, "scales_zeros"),
        _check(out, torch.bfloat16, "out"),
        n,
        k,
        block,
        torch.get_num_threads(),
    )
    return out


def int8_weight(codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Per-channel int8 ``codes`` ``[N, K]`` times their float32 ``scale`` (``N`` numbers) into
    ``out`` (bfloat16 ``[N, K]``), rounded as ``torch.mul(codes, scale[:, None], out=out)`` rounds
    it (the product in float32, then bfloat16), on the current threads."""
    n, k = codes.shape
    if scale.numel() != n or out.shape != (n, k):
        raise ValueError(f"int8_weight: codes {tuple(codes.shape)}, scale {tuple(scale.shape)}, out {tuple(out.shape)}")
    library().int8_weight(
        _check(codes, torch.int8, "codes"),
        _check(scale, torch.float32, "scale"),
        _check(out, torch.bfloat16, "out"),
        n,
        k,
        torch.get_num_threads(),
    )
    return out


def int4_mm_native() -> bool:
    """Whether ``int4_mm`` is built here: it needs AVX512-BF16 and AVX512-VBMI (AMD Zen 4, Intel
    Sapphire Rapids and later; not an AVX-512 Xeon without bfloat16), and the library loaded."""
    return bool(loaded()) and bool(_lib.int4_mm_native())


def amx(on: bool | None = None) -> bool:
    """Whether the few-row products run on AMX tiles (cpu_matmul.c; Intel Sapphire Rapids and
    later, where Linux grants the tile state); ``on`` turns them on or off (benchmarks compare:
    a process should keep one choice, as a verified row is its plain decode's bit for bit only
    on the same kernel)."""
    if not loaded():
        return False
    return _lib.amx_enable(-1 if on is None else int(on)) >= 1


def int4_mm_call(packed: torch.Tensor, scales_zeros: torch.Tensor):
    """``x @ w.T`` (bfloat16 ``[rows, N]``) for torch's CPU int4 packing in blocks of 64 rows and
    its ``scales_zeros``, as ``torch.ops.aten._weight_int4pack_mm_for_cpu`` computes it but for the
    order of float32 sums, with each weight tile decoded once for all rows (see cpu_matmul.c), as
    a call of ``x`` alone (see ``_rows_call``); a row's result does not depend on the other rows.
    False where it is not built here (``int4_mm_native``) or the weights are not whole blocks of
    64 output rows of at most ``INT4_MM_GROUPS`` groups: torch's kernel takes those."""
    if not int4_mm_native() or scales_zeros.dim() != 3:
        return False
    groups, n, two = scales_zeros.shape
    if (
        two != 2
        or packed.numel() * 2 != n * groups * 32
        or n % 64
        or groups > INT4_MM_GROUPS
        or packed.dtype != torch.uint8
        or not packed.is_contiguous()
    ):
        return False
    return _rows_call(
        "int4_mm",
        _lib.int4_mm,
        (packed, torch.uint8, "packed"),
        (scales_zeros, torch.bfloat16, "scales_zeros"),
        n,
        groups * 32,
    )


def int8_mm_call(codes: torch.Tensor, scales: torch.Tensor):
    """``x @ codes.T * scales`` (int8 ``[N, K]`` codes, one bfloat16 scale per output channel, as
    chatkv.weights.quantised.Int8Linear holds them) as a call of ``x`` (see ``_rows_call``), each row of codes
    read once for all of the step's rows (see cpu_matmul.c); a row's result does not depend on the
    other rows. False where it is not built here or these weights do not fit it."""
    if not (loaded() and _lib.int8_mm_native()):
        return False
    if codes.dim() != 2 or scales.shape != (codes.shape[0],) or codes.shape[1] % 32 or codes.shape[0] % 2:
        return False
    return _rows_call(
        "int8_mm", _lib.int8_mm, (codes, torch.int8, "codes"), (scales, torch.bfloat16, "scales"), *codes.shape
    )


def _rows_call(name: str, fn, weight: tuple, scale: tuple, n: int, k: int, status: bool = False):
    """The few-row product ``fn`` of fixed weights as a call of ``x`` alone, their pointers taken
    once (a decode step makes 4 a layer): x a contiguous bfloat16 ``[rows, K]`` of 1 to
    ``INT4_MM_ROWS`` rows; out bfloat16 ``[rows, N]``, on the current threads. ``status``: cpu_q4.c's
    products, which take a portable flag (off here) and return nonzero without memory."""
    wp, sp = _check(*weight), _check(*scale)
    keep = (weight[0], scale[0])  # alive while their pointers are used

    def call(x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if (
            x.dtype != torch.bfloat16
            or not x.is_contiguous()
            or x.shape[1:] != (k,)
            or not 0 < rows <= INT4_MM_ROWS
            or keep is None
        ):
            raise ValueError(f"{name}: x {x.dtype} {tuple(x.shape)} for {k} inputs, at most {INT4_MM_ROWS} rows")
        y = torch.empty(rows, n, dtype=torch.bfloat16)
        args = (x.data_ptr(), wp, sp, y.data_ptr(), rows, n, k, torch.get_num_threads())
        if status:
            if fn(*args, 0):
                raise MemoryError(f"{name}: no memory for {rows} x {k} int8 activations")
        else:
            fn(*args)
        return y

    return call


def q4_vnni_native() -> bool:
    """Whether ``q4_mm``/``q8_mm`` (cpu_q4.c) run on AVX512-VNNI here (Intel Ice Lake and later, AMD
    Zen 4); elsewhere their portable C path gives the same bits, too slowly to be taken."""
    return bool(loaded()) and bool(_lib.q4_vnni_native())


def q4_mm(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, portable: bool = False) -> torch.Tensor:
    """``x @ w.T`` (bfloat16 ``[rows, N]``) of ``int4_mm``'s weights (torch's CPU int4 packing in
    blocks of 64 rows and its bfloat16 ``scales_zeros``) with ``x`` quantised to int8 per group of 32
    inputs and integer dot products (cpu_q4.c); ``portable``: its plain C path (the same bits)."""
    groups, n, _ = scales_zeros.shape
    return _q8_call("q4_mm", x, packed, torch.uint8, scales_zeros, n, groups * 32, portable)


def q8_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, portable: bool = False) -> torch.Tensor:
    """``x @ codes.T * scales`` of ``int8_mm``'s weights (int8 ``[N, K]``, a bfloat16 scale per output
    channel) with ``x`` quantised to int8 per group of 32 inputs (cpu_q4.c); ``portable`` as ``q4_mm``'s."""
    return _q8_call("q8_mm", x, codes, torch.int8, scales, *codes.shape, portable)


def _q8_call(name: str, x, weight, wtype, scale, n: int, k: int, portable: bool) -> torch.Tensor:
    rows = x.shape[0]
    if x.dim() != 2 or x.shape[1] != k or not 0 < rows <= INT4_MM_ROWS:
        raise ValueError(f"{name}: x {tuple(x.shape)} for {k} inputs, 1 to {INT4_MM_ROWS} rows")
    y = torch.empty(rows, n, dtype=torch.bfloat16)
    fn = getattr(library(), name)
    args = (_check(weight, wtype, "weight"), _check(scale, torch.bfloat16, "scale"), y.data_ptr(), rows, n, k)
    if fn(_check(x, torch.bfloat16, "x"), *args, torch.get_num_threads(), int(portable)):
        raise MemoryError(f"{name}: no memory for {rows} x {k} int8 activations")
    return y


def q4_mm_call(packed: torch.Tensor, scales_zeros: torch.Tensor):
    """``q4_mm`` of fixed weights as a call of ``x`` alone (as ``int4_mm_call``), or False where
    VNNI is not built here or the weights are not ``int4_mm``'s layout in blocks of 64 rows."""
    if not q4_vnni_native() or scales_zeros.dim() != 3 or packed.dtype != torch.uint8 or not packed.is_contiguous():
        return False
    groups, n, two = scales_zeros.shape
    if two != 2 or packed.numel() * 2 != n * groups * 32 or n % 64 or not scales_zeros.is_contiguous():
        return False
    weight, scale = (packed, torch.uint8, "packed"), (scales_zeros, torch.bfloat16, "scales_zeros")
    return _rows_call("q4_mm", _lib.q4_mm, weight, scale, n, groups * 32, status=True)


def q8_mm_call(codes: torch.Tensor, scales: torch.Tensor):
    """``q8_mm`` of fixed weights as a call of ``x`` alone, or False where VNNI is not built here or
    the weights do not fit it (``K`` a multiple of 32, ``N`` of 4)."""
    if not q4_vnni_native() or codes.dim() != 2 or codes.dtype != torch.int8 or not codes.is_contiguous():
        return False
    if scales.shape != (codes.shape[0],) or codes.shape[1] % 32 or codes.shape[0] % 4:
        return False
    weight, scale = (codes, torch.int8, "codes"), (scales, torch.bfloat16, "scales")
    return _rows_call("q8_mm", _lib.q8_mm, weight, scale, *codes.shape, status=True)


class DecodeStep:
    """One decode step's fused calls, with the pointers of its fixed tensors taken once (a layer
    then costs 3 ctypes calls): built by the model for a step whose every row is a one-token
    query over its own full-attention keys (``LlamaModel._fused_step``)."""

    def __init__(
        self,
        h: torch.Tensor,
        table: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        blocks: torch.Tensor,
        ctx: torch.Tensor,
        max_ctx: int,
        kv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        intermediate: int,
        scale: float,
        eps: float,
    ):
        lib = library()
        rows, hidden = h.shape
        nb, bs = kv.shape[2], kv.shape[3]
        if (
            kv.dtype != torch.bfloat16
            or not kv.is_contiguous()
            or kv.shape[4:] != (num_kv_heads, head_dim)
            or not heads_supported(num_heads, num_kv_heads, head_dim)
            or blocks.shape[1] * bs < max_ctx
            or slots.shape != (rows,)
        ):
            raise ValueError("DecodeStep: inconsistent step")
        # the C code indexes with these unchecked: a bad block table must be an error, not a stray write
        if rows and (
            int(blocks.min()) < 0
            or int(blocks.max()) >= nb
            or int(slots.min()) < 0
            or int(slots.max()) >= nb * bs
            or int(positions.max()) >= table.shape[0]
            or int(ctx.min()) < 1
        ):
            raise ValueError("DecodeStep: a block, slot or position outside the pool or the RoPE table")
        self.lib, self.rows, self.hidden, self.eps = lib, rows, hidden, eps
        self.h = h
        self.normed = torch.empty(rows, hidden, dtype=torch.bfloat16)
        self.o = torch.empty(rows, num_heads * head_dim, dtype=torch.bfloat16)
        self.act = torch.empty(rows, intermediate, dtype=torch.bfloat16)
        self._keep = (table, positions, slots, blocks, ctx, kv)  # alive while their pointers are used
        self._q = torch.empty(rows, num_heads * head_dim, dtype=torch.bfloat16)
        threads = torch.get_num_threads()  # what the step's governor set (chatkv.model.cpu_threads)
        self._scores = attention_scratch(rows, num_heads, num_kv_heads, head_dim, max(max_ctx, 1))
        self._h, self._normed, self._o, self._act = (
            _check(t, dt, n)
            for t, dt, n in (
                (h, torch.float32, "h"),
                (self.normed, torch.bfloat16, "normed"),
                (self.o, torch.bfloat16, "o"),
                (self.act, torch.bfloat16, "act"),
            )
        )
        layer_elems = kv.stride(0)
        base = kv.data_ptr()
        self._kv = [
            (base + 2 * (layer * layer_elems), base + 2 * (layer * layer_elems + kv.stride(1)))
            for layer in range(kv.shape[0])
        ]
        self._attn_args = (
            _check(table, torch.bfloat16, "table"),
            _check(positions, torch.int64, "positions"),
            _check(slots, torch.int64, "slots"),
            _check(blocks, torch.int64, "blocks"),
            _check(ctx, torch.int64, "ctx"),
            blocks.shape[1],
            bs,
            rows,
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
            self._q.data_ptr(),
            self._scores.data_ptr(),
            self._scores.shape[0],
            threads,
            self._o,
        )
        self._qkv_width = (num_heads + 2 * num_kv_heads) * head_dim
        self._inter = intermediate

    def norm(self, y: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        """``h += y``; returns ``normed = bf16(rms_norm(h) * weight)`` (weight float32, contiguous)."""
        if y is not None and (y.dtype != torch.bfloat16 or not y.is_contiguous() or y.shape != self.h.shape):
            raise ValueError(f"DecodeStep.norm: y {y.dtype} {tuple(y.shape)}")
        self.lib.add_rms(
            self._h,
            None if y is None else y.data_ptr(),
            weight.data_ptr(),
            self._normed,
            self.rows,
            self.hidden,
            self.eps,
        )
        return self.normed

    def attention(self, qkv: torch.Tensor, layer: int) -> torch.Tensor:
        """RoPE, the KV store and attention of layer ``layer``; returns ``o`` (bf16 ``[rows, H D]``)."""
        if qkv.dtype != torch.bfloat16 or not qkv.is_contiguous() or qkv.shape != (self.rows, self._qkv_width):
            raise ValueError(f"DecodeStep.attention: qkv {qkv.dtype} {tuple(qkv.shape)}")
        t, pos, slots, blocks, ctx, *rest = self._attn_args
        k, v = self._kv[layer]
        self.lib.decode_attention(qkv.data_ptr(), t, pos, k, v, slots, blocks, ctx, *rest)
        return self.o

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        if gu.dtype != torch.bfloat16 or not gu.is_contiguous() or gu.shape != (self.rows, 2 * self._inter):
            raise ValueError(f"DecodeStep.silu_mul: gu {gu.dtype} {tuple(gu.shape)}")
        self.lib.silu_mul(gu.data_ptr(), self._act, self.rows, self._inter)
        return self.act
