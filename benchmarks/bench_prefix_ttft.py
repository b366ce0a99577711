"""Time to first token with a cached 1k-token prefix vs the same request cold.

A ~1,000-token document is the shared prefix (think: RAG context or a long chat history).
Warm: one request (document + question A) fills the radix prefix cache; then a second
request, document + a different ~20-token question, computes only its question.
Cold: the same second request on an engine with ``enable_prefix_caching=False``, which
computes all ~1,050 prompt tokens. Figure: ``result.usage.ttft_s`` (queueing, prefill, first
sample) of the second request.

    .venv/bin/python benchmarks/bench_prefix_ttft.py [--dtype bf16|fp32|both] [--repeats 3]
"""

from __future__ import annotations

import random

from common import OtherLoad, dtypes, goal, load_average, load_engine, median, parser, print_table, setup

GOAL = 10.0
PREFIX_TOKENS = 1024
QUESTIONS = [
    "Which of the stations above recorded the highest rainfall, and in which month did it happen?",
    "List every station whose wind speed was above twenty knots on any day mentioned in the log.",
    "What was the average temperature at the northern stations during the second week described?",
    "Name the observer who reported fog most often, and explain how the fog reports were verified.",
]
PRIMING_QUESTION = "Summarise the weather log above in two sentences for a general reader."


def document(tokenizer, n_tokens: int) -> str:
    """A deterministic weather log cut to about ``n_tokens`` tokens."""
    rng = random.Random(0)
    stations = ["Aberdeen", "Brest", "Cork", "Dover", "Esbjerg", "Faro", "Gdansk", "Hull", "Inverness", "Jersey"]
    skies = ["clear", "overcast", "light rain", "heavy rain", "fog", "drizzle", "sleet", "broken cloud"]
    observers = ["M. Okafor", "L. Brandt", "S. Rossi", "K. Tanaka", "A. Novak"]
    lines = []
    while True:
        day = len(lines) + 1
        lines.append(
            f"Day {day}, {rng.choice(stations)}: {rng.choice(skies)}, {rng.randint(-3, 24)} C, "
            f"wind {rng.randint(2, 35)} knots from {rng.choice(['N', 'NE', 'E', 'SE', 'S', 'SW', 'W', 'NW'])}, "
            f"rainfall {rng.randint(0, 40)} mm, observer {rng.choice(observers)}."
        )
        text = "Weather log:\n" + "\n".join(lines)
        if len(tokenizer(text)["input_ids"]) >= n_tokens:
            return text


def request(engine, doc: str, question: str) -> list[int]:
    return engine.encode_chat(
        [
            {"role": "system", "content": "Answer using only the document the user gives."},
            {"role": "user", "content": f"{doc}\n\nQuestion: {question}"},
        ]
    )


def first_token(engine, ids):
    from chatkv.engine.sampling import SamplingParams

    return engine.generate(ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    assert args.repeats <= len(QUESTIONS), f"at most {len(QUESTIONS)} repeats (one fresh question each)"
    model_dir = setup(args)
    other = OtherLoad()
    rows, notes = [], []
    for dtype in dtypes(args):
        warm_engine = load_engine(model_dir, dtype)
        cold_engine = load_engine(model_dir, dtype, enable_prefix_caching=False)
        doc = document(warm_engine.tokenizer, PREFIX_TOKENS)
        for e in (warm_engine, cold_engine):  # warm up the code paths (short prompts, not the document)
            first_token(e, e.encode_chat([{"role": "user", "content": "Hello there, how are you today?"}]))
        primed = first_token(warm_engine, request(warm_engine, doc, PRIMING_QUESTION))
        warm, cold, cached = [], [], []
        for q in QUESTIONS[: args.repeats]:
            ids = request(warm_engine, doc, q)
            r = first_token(warm_engine, ids)
            warm.append(r.usage.ttft_s)
            cached.append(r.usage.cached_tokens)
            r = first_token(cold_engine, ids)
            assert r.usage.cached_tokens == 0
            cold.append(r.usage.ttft_s)
        w, c = median(warm), median(cold)
        rows.append(
            [
                dtype,
                f"{len(ids)}",
                f"{min(cached)}",
                f"{c * 1e3:.0f}",
                f"{w * 1e3:.1f}",
                f"{c / w:.1f}x",
                goal(c / w, GOAL),
            ]
        )
        notes.append(
            f"{dtype}: priming request {primed.usage.prompt_tokens} tokens, TTFT {primed.usage.ttft_s * 1e3:.0f} ms"
        )
        del warm_engine, cold_engine
    print(
        f"\nTTFT of a {PREFIX_TOKENS}-token-prefix request + a new question, threads={args.threads}, "
        f"median of {args.repeats}, load average {load_average()}, {other}"
    )
    print_table(
        "time to first token",
        ["dtype", "prompt tokens", "cached tokens", "cold TTFT ms", "cached-prefix TTFT ms", "cold / cached", "goal"],
        rows,
    )
    for line in notes:
        print(line)


if __name__ == "__main__":
    main()
