"""Paged decode attention on CUDA: the Triton kernel against torch SDPA over gathered KV, in GB/s, per kv dtype.

For each kv dtype (the 16-bit ``--dtype``, and the quantised int8 and fp8_e4m3 of kernels/kv_quant.py:
uint8 rows of head_dim + 4 bytes, the values then their float32 scale) and each (sequences, context
tokens) it times, with ``triton.testing.do_bench`` (L2 flushed between runs):
- ``triton``: kernels/triton_attention.paged_attention reading K/V through shuffled block tables
  (quantised: dequantised in registers);
- ``torch``: the torch reference on the same device (gather the blocks with index_select, dequantise the
  gathered rows, then SDPA) — what chatkv runs without the kernel;
- ``sdpa``: SDPA alone over 16-bit K/V already gathered (and dequantised) contiguously (enable_gqa): a
  dense bound on the work, with no paging and no quantisation.
GB/s counts the bytes each one must read: for triton and torch the stored K/V of the rows (rows x tokens
x kv heads x row bytes x 2, row bytes = head_dim x element size, or head_dim + 4 when quantised), for
sdpa the dense 16-bit K/V; divided by the time. ``peak`` is a device-to-device copy measured in the same
run (read + write bytes), and the spec bandwidth where the device name is known. Every triton result is
checked against the reference on the same caches (max abs err printed). One call = one layer; the
step's metadata packing is done once per step for every layer, so it is warmed out of the timing.

Run: ``python benchmarks/bench_triton_decode.py`` (CUDA only; about a minute on an H100-class GPU).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SPEC_GBS = {
    "H200": 4800,
    "H100 SXM": 3350,
    "H100 PCIe": 2000,
    "H100": 3350,
    "A100-SXM4-80GB": 2039,
    "A100-SXM4-40GB": 1555,
    "A100": 1555,
    "L40S": 864,
    "L4": 300,
    "RTX 4090": 1008,
    "A10": 600,
}


def spec_bandwidth(name: str) -> float | None:
    for key, gbs in SPEC_GBS.items():  # most specific first
        if key in name:
            return gbs
    return None


def copy_bandwidth(bench) -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6


def make_pool(num_blocks, bs, kvh, d, dtype, quant, dev):
    """A K/V pool ``[2, num_blocks, bs, kv heads, row]`` of N(0, 1) values, quantised in chunks of blocks
    (kv_quant.quantize keeps fp32 temporaries: a whole 32k x 64 pool at once would take tens of GB)."""
    from chatkv.kernels import kv_quant

    if quant is None:
        return torch.randn(2, num_blocks, bs, kvh, d, dtype=dtype, device=dev)
    pool = torch.empty(2, num_blocks, bs, kvh, kv_quant.row_width(quant, d), dtype=kv_quant.STORAGE, device=dev)
    step = max(1, (1 << 24) // (bs * kvh * d))
    for i in range(0, num_blocks, step):
        n = min(step, num_blocks - i)
        pool[:, i : i + n] = kv_quant.quantize(torch.randn(2, n, bs, kvh, d, dtype=dtype, device=dev), quant)
    return pool


def measure(rows, tokens, quant, stored_bytes, dense_bytes, args, dtype, peak, spec, bench, g) -> str:
    """One (kv dtype, rows, tokens) shape: its table row. Everything it allocates is freed on return."""
    from chatkv.kernels import attention as ref
    from chatkv.kernels import kv_quant
    from chatkv.kernels import triton_attention as tri

    dev = torch.device("cuda")
    h, kvh, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    scale = 1 / math.sqrt(d)
    per_row = -(-tokens // bs)
    num_blocks = rows * per_row
    pool = make_pool(num_blocks, bs, kvh, d, dtype, quant, dev)
    k_cache, v_cache = pool[0], pool[1]
    ids = torch.randperm(num_blocks, generator=g).view(rows, per_row).tolist()
    meta = ref.build_metadata(ids, [1] * rows, [tokens] * rows, bs, device=dev)
    q = torch.randn(rows, h, d, dtype=dtype, device=dev)
    want = ref.paged_attention(q, k_cache, v_cache, meta, scale, quant=quant)
    got = tri.paged_attention(q, k_cache, v_cache, meta, scale, quant=quant)
    err = (got.float() - want.float()).abs().max().item()
    del want, got
    t_tri = bench(lambda: tri.paged_attention(q, k_cache, v_cache, meta, scale, quant=quant))
    t_ref = bench(lambda: ref.paged_attention(q, k_cache, v_cache, meta, scale, quant=quant))
    blocks = meta.decode_blocks

    def dense(cache):
        x = cache.index_select(0, blocks).view(rows, -1, kvh, cache.shape[-1])[:, :tokens]
        if quant is not None:
            x = kv_quant.dequantize(x, quant, dtype)
        return x.transpose(1, 2).contiguous()

    kd, vd = dense(k_cache), dense(v_cache)
    del pool
    k_cache = v_cache = None  # the timed lambdas hold them as cells: dropped here, before the dense copies are timed
    qd = q.view(rows, h, 1, d)
    t_sdpa = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True))
    gbs = [stored_bytes / t_tri / 1e6, stored_bytes / t_ref / 1e6, dense_bytes / t_sdpa / 1e6]
    return (
        f"{quant or args.dtype:>8} {rows:>4} {tokens:>6} {stored_bytes / 1e6:>8.0f} | "
        f"{t_tri * 1e3:>9.1f} {gbs[0]:>6.0f} "
        f"{100 * gbs[0] / peak:>5.0f} {(100 * gbs[0] / spec) if spec else float('nan'):>5.0f} | "
        f"{t_ref * 1e3:>9.1f} {gbs[1]:>6.0f} | {t_sdpa * 1e3:>8.1f} {gbs[2]:>6.0f} | "
        f"{t_ref / t_tri:>7.2f} {t_sdpa / t_tri:>6.2f} | {err:.1e}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,64", help="sequences per step")
    ap.add_argument("--tokens", default="1024,4096,16384,32768", help="context tokens per sequence")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="queries, outputs and the float cache")
    ap.add_argument("--kv", default="float,int8,fp8_e4m3", help="kv dtypes: float (--dtype), int8, fp8_e4m3")
    ap.add_argument(
        "--max-gib",
        type=float,
        default=0.0,
        help="skip shapes whose memory need exceeds this (default: 1/2 of free memory)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_triton_decode: needs a CUDA device (and a CUDA build of torch)")
    import triton.testing

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=50)

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    peak = copy_bandwidth(bench)
    spec = spec_bandwidth(props.name)
    free = torch.cuda.mem_get_info()[0]
    limit = args.max_gib * 2**30 if args.max_gib else free / 2
    h, kvh, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    print(
        f"{props.name}, {props.multi_processor_count} SMs; copy {peak:.0f} GB/s; spec {spec or '?'} GB/s; "
        f"{args.dtype}, {h} heads / {kvh} kv heads x {d}, block size {bs}"
    )
    print(
        "KV MB: the stored K/V the rows read (triton's and torch's GB/s count these bytes; sdpa's, the dense "
        f"{args.dtype} K/V)"
    )
    print(
        f"{'kv':>8} {'rows':>4} {'tokens':>6} {'KV MB':>8} | {'triton us':>9} {'GB/s':>6} {'%copy':>5} {'%spec':>5} | "
        f"{'torch us':>9} {'GB/s':>6} | {'sdpa us':>8} {'GB/s':>6} | {'x torch':>7} {'x sdpa':>6} | max err"
    )
    g = torch.Generator(device="cpu").manual_seed(0)
    elem = torch.tensor([], dtype=dtype).element_size()
    for kv in args.kv.split(","):
        quant = None if kv == "float" else kv
        row_bytes = d * elem if quant is None else d + 4
        for rows in (int(x) for x in args.rows.split(",")):
            for tokens in (int(x) for x in args.tokens.split(",")):
                stored = rows * tokens * kvh * row_bytes * 2
                dense = rows * tokens * kvh * d * elem * 2
                # pool + the reference's gathered copy + SDPA's dense copy; quantised: the reference's fp32
                # dequantised temporary (2 x dense) and its 16-bit result too
                need = 3 * dense if quant is None else 2 * stored + 4 * dense
                if need > limit:
                    print(f"{kv:>8} {rows:>4} {tokens:>6} {stored / 1e6:>8.0f} | skipped (memory)")
                    continue
                print(measure(rows, tokens, quant, stored, dense, args, dtype, peak, spec, bench, g), flush=True)
                torch.cuda.empty_cache()
    print("goal: triton >= 70% of the memory bandwidth for long contexts")


if __name__ == "__main__":
    main()
