"""Batch-1 decode of the default int4 model with the fused CPU decode ops (chatkv.model.fused_decode) and
with the torch ops they replace, interleaved in one process, beside llama.cpp on the same GGUF.

Per variant: decode tokens/s (greedy, EOS ignored, prefill excluded, as bench_decode), the torch
ops a generated token costs (profiler events), and the CPU time of one decode step on one
thread (``time.thread_time``, the best of 5 runs of 40 steps at a 200-token context: on a busy
machine CPU time decides where wall time cannot). Ratios are to the torch-ops variant and to
llama.cpp in the same run; the CPU model and the load are printed.

    .venv/bin/python benchmarks/bench_decode_ops.py [--threads 2] [--tokens 128] [--repeats 5]
"""

from __future__ import annotations

import time

import torch
from common import (
    CHAT,
    OtherLoad,
    best_of,
    common_prefix,
    cpu_line,
    llama_decode,
    load_average,
    load_llama_cpp,
    median,
    parser,
    print_table,
    setup,
)

VARIANTS = ("fused", "torch ops")


def decode(engine, ids, n):
    from chatkv.engine.sampling import SamplingParams

    r = engine.generate(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return r.usage.tokens_per_s, r.token_ids


def ops_per_token(engine, ids, n: int = 16) -> float:
    from torch.profiler import ProfilerActivity, profile

    decode(engine, ids, 4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode(engine, ids, n + 1)
    return sum(e.count for e in prof.key_averages()) / (n + 1)


def step_cpu_us(engine) -> float:
    """CPU microseconds of one decode step (build_batch + forward) on one thread, best of 5."""
    from chatkv.engine.model_runner import BatchItem

    runner = engine.runner
    table = runner.pool.allocate(13)  # 208 slots
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:

        def step():
            return runner.forward(runner.build_batch([BatchItem([42], 200, table, "last")]))

        return best_of(step, 40, clock=time.thread_time)
    finally:
        torch.set_num_threads(before)
        runner.pool.decref(table)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--no-llama-cpp", action="store_true")
    args = p.parse_args()
    setup(args)
    from chatkv.engine.core import Engine

    other = OtherLoad()
    engine = Engine.from_pretrained(weights="int4", speculative="off")
    model = engine.model
    if not model.fused_decode:
        raise SystemExit("the fused decode ops are not available here (no C compiler, or CHATKV_FUSED_DECODE=0)")
    llm = None if args.no_llama_cpp else load_llama_cpp(args.threads)
    ids = engine.encode_chat(CHAT)

    def use(v: str) -> None:
        model.fused_decode = v == "fused"

    rate = {v: [] for v in VARIANTS}
    toks: dict[str, list[int]] = {}
    lc: list[float] = []
    for v in VARIANTS:  # warm up
        use(v)
        decode(engine, ids, 8)
    if llm is not None:
        llama_decode(llm, ids, 8)
    for _ in range(args.repeats):  # interleaved, so background load hits all alike
        for v in VARIANTS:
            use(v)
            r, toks[v] = decode(engine, ids, args.tokens)
            rate[v].append(r)
        if llm is not None:
            lc.append(llama_decode(llm, ids, args.tokens)[0])
    ops, cpu = {}, {}
    for v in VARIANTS:
        use(v)
        ops[v] = ops_per_token(engine, ids)
        cpu[v] = step_cpu_us(engine)
    use("fused")

    base = median(rate["torch ops"])
    lc_rate = median(lc) if lc else None
    same = common_prefix(toks["fused"], toks["torch ops"])
    rows = []
    for v in VARIANTS:
        r = median(rate[v])
        rows.append(
            [
                v,
                f"{r:.1f}",
                f"{r / base:.2f}x",
                f"{r / lc_rate:.2f}x" if lc_rate else "-",
                f"{ops[v]:.0f}",
                f"{cpu[v] / 1000:.2f}",
                f"{cpu['torch ops'] / cpu[v]:.2f}x",
            ]
        )
    print(f"\n{cpu_line()}")
    print(
        f"{len(ids)}-token chat prompt, {args.tokens} greedy tokens, threads={args.threads}, median of "
        f"{args.repeats} interleaved, load average {load_average()}, {other}"
    )
    print(
        "llama.cpp (the packaged GGUF, Q4_1): "
        + (
            f"{lc_rate:.1f} tok/s"
            if lc_rate
            else "llama_cpp not importable, skipped (pip install llama-cpp-python==0.3.36)"
        )
    )
    print_table(
        "batch-1 decode, default int4 model: fused decode ops vs the torch ops",
        [
            "decode step",
            "tok/s",
            "vs torch ops",
            "vs llama.cpp",
            "torch ops / token",
            "step CPU ms (1 thread)",
            "CPU vs torch ops",
        ],
        rows,
    )
    print(
        f"greedy tokens equal between the two: {same}/{args.tokens} from the start "
        f"(both round to bf16; the order of float32 sums differs)"
    )


if __name__ == "__main__":
    main()
