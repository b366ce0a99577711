"""One decode-shaped quantised product (1, 4, 8 rows) on the current few-row path and on the int8-activation
VNNI path (kernels/cpu_q4.c), in the same run, at a 1.7B-4B model's projection shapes.

    .venv/bin/python benchmarks/bench_q4_decode.py [--threads 2] [--rows 1 4 8] [--pool-mb 768]

int4 (Q4_K's form): ``int4_mm`` (AMX tiles where the CPU has them, else AVX512-BF16; every code
widened to bfloat16) against ``q4_mm``. int8 per channel (the groups holding Q6_K tensors):
torch's ``_weight_int8pack_mm`` (what ``Int8Linear`` runs for the projections) and ``int8_mm``
against ``q8_mm``. Each timed call takes the next of a pool of copies of the weights (``--pool-mb``
in all, above the last-level cache), so the weights come from memory, as in a decode step; read
bandwidth = the weights' bytes (codes and scales) / time. The CPU model and the load average
are printed with each table: on a shared machine the ratios hold better than the rates.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import OtherLoad, cpu_line, load_average  # noqa: E402
from chatkv.kernels import cpu_decode  # noqa: E402
from chatkv.model import fused_decode  # noqa: E402
from chatkv.weights.quantised import Int4Linear, Q4Weight  # noqa: E402

SHAPES = [(2048, 2048), (8192, 2048), (2048, 8192), (14336, 4096)]  # (N out, K in): 2048x2048 .. 4096x14336


def pool_of(make, nbytes: int, pool_mb: int) -> list:
    return [make() for _ in range(max(2, -(-pool_mb * 2**20 // nbytes)))]


def timed(fn, pool: list, x: torch.Tensor, seconds: float) -> float:
    """Microseconds per call of ``fn(weights, x)`` over the pool, cycled, after one pass: the 10th
    percentile (a shared machine's preemptions land in the slow tail; each call still reads its
    weights from memory)."""
    for w in pool:
        fn(w, x)
    times = []
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end or len(times) < 2 * len(pool):
        w = pool[i % len(pool)]
        t = time.perf_counter()
        fn(w, x)
        times.append(time.perf_counter() - t)
        i += 1
    times.sort()
    return times[len(times) // 10] * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--pool-mb", type=int, default=768, help="weights cycled through (above the LLC: from memory)")
    p.add_argument("--seconds", type=float, default=1.0, help="timed seconds per case")
    p.add_argument("--int8", action="store_true", help="also the int8 per-channel products (Q6_K groups)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if not (fused_decode.kernels_available() and cpu_decode.q4_vnni_native()):
        sys.exit("the fused ops with AVX512-VNNI are not built here: nothing to compare")
    print(cpu_line())
    print(f"threads {a.threads}, AMX tiles for int4_mm/int8_mm: {cpu_decode.amx()}, pool {a.pool_mb} MiB")
    g = torch.Generator().manual_seed(0)
    other = OtherLoad()
    print(f"load average at start: {load_average()}")
    print("\nint4 (bytes = packed codes + bf16 scale/zero per 32)")
    print(f"{'N x K':>12} {'rows':>4} {'int4_mm us':>11} {'GB/s':>6} {'q4_mm us':>9} {'GB/s':>6} {'speedup':>7}  load")
    for n, k in SHAPES:
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scale = torch.rand(n, k // 32, generator=g) * 0.02
        lin = Int4Linear(Q4Weight(codes, scale, -8 * scale))
        nbytes = lin.packed.numel() + lin.scales_zeros.numel() * 2
        pool = pool_of(lambda: (lin.packed.clone(), lin.scales_zeros.clone()), nbytes, a.pool_mb)  # noqa: B023
        for rows in a.rows:
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
            old = timed(lambda w, x: cpu_decode.int4_mm_call(*w)(x), pool, x, a.seconds)
            new = timed(lambda w, x: cpu_decode.q4_mm(x, *w), pool, x, a.seconds)
            print(
                f"{n:>5} x {k:<5} {rows:>4} {old:>11.0f} {nbytes / old / 1e3:>6.1f}"
                f" {new:>9.0f} {nbytes / new / 1e3:>6.1f} {old / new:>6.2f}x  {load_average()}"
            )
        del pool
    if a.int8:
        print("\nint8 per channel (bytes = codes + bf16 scale)")
        head = f"{'N x K':>12} {'rows':>4} {'torch us':>9} {'int8_mm us':>10} {'q8_mm us':>9} {'GB/s':>6}"
        print(f"{head} {'vs torch':>8}  load")
        for n, k in SHAPES:
            codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
            scales = (torch.rand(n, generator=g) * 0.01).to(torch.bfloat16)
            nbytes = codes.numel() + scales.numel() * 2
            pool = pool_of(lambda: (codes.clone(), scales.clone()), nbytes, a.pool_mb)  # noqa: B023
            for rows in a.rows:
                x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
                tt = timed(lambda w, x: torch.ops.aten._weight_int8pack_mm(x, *w), pool, x, a.seconds)
                old = timed(lambda w, x: cpu_decode.int8_mm_call(*w)(x), pool, x, a.seconds)
                new = timed(lambda w, x: cpu_decode.q8_mm(x, *w), pool, x, a.seconds)
                print(
                    f"{n:>5} x {k:<5} {rows:>4} {tt:>9.0f} {old:>10.0f} {new:>9.0f} {nbytes / new / 1e3:>6.1f}"
                    f" {tt / new:>7.2f}x  {load_average()}"
                )
            del pool
    print(f"\nload average at end: {load_average()}; {other}")


if __name__ == "__main__":
    main()
