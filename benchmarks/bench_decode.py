"""Batch-1 decode speed: chatkv vs transformers ``generate`` (same weights, dtype, threads) and llama.cpp.

A short chat prompt, then N greedy tokens with EOS ignored, so every engine produces
exactly N tokens. The decode rate excludes the prefill: (N - 1) / (time of token N -
time of token 1), which is chatkv's ``decode_tokens_per_s``; transformers and llama.cpp
are timestamped per token the same way. llama.cpp runs the packaged GGUF itself
(Q4_1 weights, its own kernels), so that ratio compares engines, not identical math.

    .venv/bin/python benchmarks/bench_decode.py [--dtype bf16|fp32|both] [--tokens 128] [--repeats 3]
"""

from __future__ import annotations

import time

from common import (
    CHAT, OtherLoad, dtypes, goal, hf_generate, load_average, load_engine, load_hf, load_llama_cpp, median, parser,
    print_table, setup,
)

GOAL_HF, GOAL_LLAMA = 1.5, 0.6


def chatkv_decode(engine, ids, n):
    from chatkv.sampling import SamplingParams

    r = engine.generate(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    assert r.usage.generated_tokens == n, r.usage.generated_tokens
    return r.usage.tokens_per_s, r.token_ids


def hf_decode(model, ids, n):
    new, _, stamps = hf_generate(model, ids, n)
    return (n - 1) / (stamps[-1] - stamps[0]), new


def llama_decode(llm, ids, n):
    stamps, toks = [], []
    for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        stamps.append(time.perf_counter())
        toks.append(tok)
        if len(toks) == n:
            break
    return (n - 1) / (stamps[-1] - stamps[0]), toks


def agree(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    p = parser(__doc__.splitlines()[0], default_dtype="both")
    p.add_argument("--tokens", type=int, default=128, help="generated tokens per run")
    p.add_argument("--no-llama-cpp", action="store_true")
    args = p.parse_args()
    run_dtypes = dtypes(args)
    model_dir = setup(args)
    other = OtherLoad()
    n = args.tokens

    # llama.cpp runs the packaged GGUF, so only against the default model
    llm = None if args.no_llama_cpp or args.model else load_llama_cpp(args.threads)
    rows, notes = [], []
    for dtype in run_dtypes:
        engine = load_engine(model_dir, dtype)
        hf = load_hf(model_dir, dtype)
        ids = engine.encode_chat(CHAT)
        chatkv_decode(engine, ids, 8)  # warm up all
        hf_decode(hf, ids, 8)
        if llm is not None:
            llama_decode(llm, ids, 8)
        ck, ref, lc = [], [], []
        for _ in range(args.repeats):  # interleaved, so background load hits all alike
            rate, ck_toks = chatkv_decode(engine, ids, n)
            ck.append(rate)
            rate, hf_toks = hf_decode(hf, ids, n)
            ref.append(rate)
            if llm is not None:
                lc.append(llama_decode(llm, ids, n)[0])
        ck_rate, hf_rate = median(ck), median(ref)
        notes.append(f"{dtype}: chatkv and transformers agree on the first {agree(ck_toks, hf_toks)}/{n} greedy tokens")
        rows.append([dtype, "transformers generate", f"{hf_rate:.1f}", f"{ck_rate:.1f}", f"{ck_rate / hf_rate:.2f}x", goal(ck_rate / hf_rate, GOAL_HF)])
        if lc:
            lc_rate = median(lc)
            rows.append([dtype, "llama.cpp (GGUF Q4_1)", f"{lc_rate:.1f}", f"{ck_rate:.1f}", f"{ck_rate / lc_rate:.2f}x", goal(ck_rate / lc_rate, GOAL_LLAMA)])
        del engine, hf

    print(f"\nbatch-1 decode, {len(ids)}-token chat prompt, {n} greedy tokens (EOS ignored), "
          f"threads={args.threads}, median of {args.repeats}, load average {load_average()}, {other}")
    if llm is None and not args.no_llama_cpp and not args.model:
        print("llama.cpp: llama_cpp not importable, skipped (pip install llama-cpp-python)")
    print_table("decode tokens/s (prefill excluded)", ["dtype", "baseline", "baseline tok/s", "chatkv tok/s", "ratio", "goal"], rows)
    for line in notes:
        print(line)


if __name__ == "__main__":
    main()
