"""What the deterministic engine costs, and why it exists, on the default model.

Why: oneDNN's bf16 products (the fast path's) give a row different bits depending on how many
rows share the call. The first table counts, for the default model's projection shapes, the rows
of an M-row call whose output differs from the same row computed alone (chatkv's
RowInvariantLinear, run in the same table, never differs).

Cost: two engines on the packaged model in the same process, ``deterministic=True`` (the
default) and ``False``, prefix caching and speculation off, measured alternately (median of
``--reps``): single-stream decode (16-token prompt, 128 tokens, EOS ignored), the time to the
first token of 128-, 512- and 1,024-token prompts, and batched throughput (8 and 32 requests of a
64-token prompt and 64 tokens each, all submitted at once). Prints the CPU model and the load.

    .venv/bin/python benchmarks/bench_deterministic.py [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from chatkv.engine.core import Engine  # noqa: E402
from chatkv.engine.sampling import SamplingParams  # noqa: E402
from chatkv.model.self_check import cpu_model  # noqa: E402


def onednn_rows(shapes: list[tuple[int, int]], ms=(8, 16, 33, 64, 256)) -> list[str]:
    from chatkv.kernels.cpu_invariant import RowInvariantLinear, path
    from chatkv.model.forward import Linear
    from chatkv.model.fused_decode import kernels_available

    assert kernels_available(), "the CPU kernels did not build here"

    lines = [f"| product (in x out) | rows in the call | oneDNN rows differing from alone | {path()} rows differing |"]
    lines.append("|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for k, n in shapes:
        w = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16()
        x = torch.randn(max(ms), k, generator=g).bfloat16()
        fast, inv = Linear(w), RowInvariantLinear(w)
        lone_f = torch.cat([fast(x[r : r + 1]) for r in range(max(ms))])
        lone_i = torch.cat([inv(x[r : r + 1]) for r in range(max(ms))])
        for m in ms:
            df = int((~(fast(x[:m]) == lone_f[:m]).all(1)).sum())
            di = int((~(inv(x[:m]) == lone_i[:m]).all(1)).sum())
            lines.append(f"| {k} x {n} | {m} | {df} of {m} | {di} of {m} |")
    return lines


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    print(f"CPU: {cpu_model()}; torch threads {torch.get_num_threads()}; load at start {os.getloadavg()}")
    print()
    print("\n".join(onednn_rows([(576, 960), (576, 3072), (1536, 576), (576, 49152)])))
    print()
    engines = {
        det: Engine.from_pretrained(None, deterministic=det, speculative="off", enable_prefix_caching=False)
        for det in (True, False)
    }
    eng = engines[True]
    print(f"model: the packaged default, {eng.weights.label}; deterministic engine's path: {eng.model.invariant}")
    vocab = [i for i in range(1000, 20000, 7)]
    prompt = lambda n, salt=0: [vocab[(i * 31 + salt) % len(vocab)] for i in range(n)]  # noqa: E731
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    cases = {
        "decode tok/s (1 stream, 128 tokens)": lambda e: 128 / timed(lambda: e.generate(prompt(16), greedy(128))),
        **{
            f"TTFT s, {n}-token prompt": (lambda n: lambda e: timed(lambda: e.generate(prompt(n, n), greedy(1))))(n)
            for n in (128, 512, 1024)
        },
        **{
            f"throughput tok/s, {c} requests at once": (
                lambda c: lambda e: c * 64 / timed(lambda: e.generate([prompt(64, s) for s in range(c)], greedy(64)))
            )(c)
            for c in (8, 32)
        },
    }
    for e in engines.values():  # warm: kernels built, tables grown
        e.generate(prompt(64), greedy(8))
    print()
    print("| measure | deterministic | fast path | ratio |")
    print("|---|---|---|---|")
    for name, fn in cases.items():
        got = {True: [], False: []}
        for _ in range(args.reps):
            for det, e in engines.items():
                got[det].append(fn(e))
        a, b = statistics.median(got[True]), statistics.median(got[False])
        better = "higher is better" if "tok/s" in name else "lower is better"
        print(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.2f} ({better}) |")
    print()
    print(f"load at end {os.getloadavg()}")
    for e in engines.values():
        e.close()


if __name__ == "__main__":
    main()
