"""What a change of the compute thread count costs a step: whether a governor drop
from 2 to 1 threads mid-turn has a price of its own (one observation under load put it at 270-710 ms).

The thread governor (chatkv.model.cpu_threads) moves torch's intra-op threads between 2 and 1 as
another process takes and frees a core. If a change had a price of its own (OpenMP re-forming
its pool, oneDNN re-creating primitives for the new thread count), the first step after it would
be slower than the later ones at the same count. Here, in one process on the default int4
model with the governor off (so only this script changes the count):

- decode: the first 3 steps after each change against the median of the 20 steps at that count;
- prefill: the first ~200-token prompt (no prefix hit) after each change against the next two
  at that count.

A ratio near 1.0 means a change costs nothing beyond running at the new count. The CPU model
and the load are printed.

    .venv/bin/python benchmarks/bench_thread_switch.py
"""

from __future__ import annotations

import torch
from common import OtherLoad, cpu_line, each_ms, load_average, median, print_table

COUNTS = [2, 1, 2, 1, 2]


def main() -> None:
    from chatkv import Engine, SamplingParams

    print(cpu_line())
    print(f"load average at start: {load_average()}")
    other = OtherLoad()
    eng = Engine.from_pretrained(adaptive_threads=False)
    decode_rows, prefill_rows = [], []
    try:
        seq = eng.add_request(
            "Write a long story about a cat.", SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
        )
        for _ in range(30):  # warm: the prompt and the first steps at 2 threads
            eng.step()
        for i, n in enumerate(COUNTS):
            torch.set_num_threads(n)
            ts = each_ms(eng.step, 20)
            m = median(ts)
            decode_rows.append(
                [f"{i}: -> {n}", " ".join(f"{x:.1f}" for x in ts[:3]), f"{m:.1f}", f"{max(ts[:3]) / m:.2f}x"]
            )
        eng.abort(seq)
        one = SamplingParams(max_tokens=1, temperature=0)
        torch.set_num_threads(2)
        eng.generate("Warm: " + "the quick brown fox jumps over the lazy dog " * 20, one)
        for i, n in enumerate(COUNTS):
            torch.set_num_threads(n)
            prompts = iter(f"Story {i}.{j}: " + "the quick brown fox jumps over the lazy dog " * 20 for j in range(3))
            ts = each_ms(lambda: eng.generate(next(prompts), one), 3)
            prefill_rows.append(
                [f"{i}: -> {n}", f"{ts[0]:.0f}", f"{median(ts[1:]):.0f}", f"{ts[0] / median(ts[1:]):.2f}x"]
            )
    finally:
        eng.close()
    print_table(
        "decode steps after each change of the thread count, ms",
        ["change", "first 3 steps", "median of 20", "slowest first / median"],
        decode_rows,
    )
    print_table(
        "a ~200-token prefill (TTFT of 1 token) after each change, ms",
        ["change", "first", "next two (median)", "first / next"],
        prefill_rows,
    )
    print(f"load average at end: {load_average()}; {other}")


if __name__ == "__main__":
    main()
