"""Batched throughput: 8 different chat prompts at once through chatkv vs transformers one at a time.

Each prompt is 30-60 tokens; each request generates 64 greedy tokens with EOS ignored.
chatkv gets the whole list in one ``engine.generate(prompts, params)`` call (continuous
batching, prefix caching off so that repeats recompute their prompts as transformers
does); transformers ``generate`` runs the prompts one after another (batch 1, its usual
chat use). Figure: total generated tokens / wall time, prefill included.

    .venv/bin/python benchmarks/bench_throughput.py [--dtype bf16|fp32|both] [--repeats 3]
"""

from __future__ import annotations

import time

from common import (
    OtherLoad,
    dtypes,
    goal,
    hf_generate,
    load_average,
    load_engine,
    load_hf,
    median,
    parser,
    print_table,
    setup,
)

GOAL = 5.0
NEW_TOKENS = 64
QUESTIONS = [
    "Why is the sky blue? Please answer in a short paragraph that a child could follow easily.",
    "Give me three tips for keeping a sourdough starter alive while I am away on holiday for two weeks.",
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about autumn leaves falling on a quiet river at dusk, and explain its imagery.",
    "How do vaccines train the immune system to recognise a virus it has never met before?",
    "Summarise the plot of Romeo and Juliet in four sentences.",
    "Which is heavier, a kilogram of feathers or a kilogram of iron, and why do people often get this question wrong?",
    "Suggest a name for a small bakery that specialises in cinnamon rolls.",
]


def prompts(engine) -> list[list[int]]:
    out = [engine.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    assert all(20 <= len(p) <= 70 for p in out), [len(p) for p in out]
    return out


def run_chatkv(engine, batch) -> tuple[float, int]:
    from chatkv.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    results = engine.generate(batch, params)
    wall = time.perf_counter() - start
    return wall, sum(r.usage.generated_tokens for r in results)


def run_hf(model, batch) -> tuple[float, int]:
    start = time.perf_counter()
    total = sum(len(hf_generate(model, ids, NEW_TOKENS)[0]) for ids in batch)
    return time.perf_counter() - start, total


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    model_dir = setup(args)
    other = OtherLoad()
    rows = []
    for dtype in dtypes(args):
        engine = load_engine(model_dir, dtype, enable_prefix_caching=False)
        hf = load_hf(model_dir, dtype)
        batch = prompts(engine)
        run_chatkv(engine, batch[:2])  # warm up both
        hf_generate(hf, batch[0], 8)
        ck, ref = [], []
        for _ in range(args.repeats):
            wall, n = run_chatkv(engine, batch)
            ck.append(n / wall)
            wall, n = run_hf(hf, batch)
            ref.append(n / wall)
        ck_rate, hf_rate = median(ck), median(ref)
        rows.append(
            [dtype, f"{hf_rate:.1f}", f"{ck_rate:.1f}", f"{ck_rate / hf_rate:.2f}x", goal(ck_rate / hf_rate, GOAL)]
        )
        del engine, hf
    lens = [len(p) for p in batch]
    print(
        f"\n{len(QUESTIONS)} prompts ({min(lens)}-{max(lens)} tokens) x {NEW_TOKENS} greedy tokens (EOS ignored), "
        f"threads={args.threads}, median of {args.repeats}, load average {load_average()}, {other}"
    )
    print_table(
        "generated tokens per second of wall time (prefill included)",
        ["dtype", "transformers, one at a time", "chatkv, all 8 batched", "ratio", "goal"],
        rows,
    )


if __name__ == "__main__":
    main()
