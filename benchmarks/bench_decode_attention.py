"""One layer's decode attention of the default model's shape (9 query heads over 3 kv heads of 64),
the fused C op (``chatkv.kernels.cpu_decode.decode_attention``: RoPE, the KV store, attention)
against the torch ops it replaces in the same process (``kernels.attention``: store_kv and
paged_attention over the same block tables; RoPE excluded from the torch side), at batch 1 and 8
and contexts of 160 to 2,000 keys, on 1 and 2 threads; and a verification's rows (``6 rows, one
sequence``: the last token and 5 proposals, one block table, contexts n .. n + 5, as speculative
decoding computes them). The fused op has two paths, timed in the same run: ``per row`` (each row
its own work items) and ``blocked`` (the default: rows that share a
block table convert each key and value once, scores 16 keys at a time, the value sum in
registers). Microseconds per call, best of 5 runs of 200 calls, the Python wrapper's checks
included on the C side (in a decode step they are made once a step, not once a layer).

Then whole decode steps of the default model (int4, batch 1, greedy, EOS ignored) at contexts
of about 300, 2,000 and 6,000 tokens (a RAG turn's), the two paths taking turns within each
repeat: decode tok/s (``usage.tokens_per_s``, prefill excluded), medians. The CPU model and
the load are printed.

    .venv/bin/python benchmarks/bench_decode_attention.py [--no-steps] [--repeats 3] [--contexts 300,2000,6000]
"""

from __future__ import annotations

import torch
from common import OtherLoad, best_of, cpu_line, load_average, median, print_table

NH, NKV, D, BS = 9, 3, 64, 16
CASES = [(1, 160, False), (1, 600, False), (1, 2000, False), (8, 300, False), (6, 300, True), (6, 2000, True)]


def setup_case(rows: int, ctx: int, one_sequence: bool):
    from chatkv.kernels import build_metadata, cpu_decode

    g = torch.Generator().manual_seed(rows * ctx)
    per = ctx // BS + 1
    if one_sequence:  # a verification: one table, each row one key further
        tables = [list(range(per))[::-1]] * rows
        ctxs = [ctx - rows + 1 + i for i in range(rows)]
    else:
        tables = [list(range(i * per, (i + 1) * per))[::-1] for i in range(rows)]
        ctxs = [ctx - i for i in range(rows)]
    positions = torch.tensor([c - 1 for c in ctxs])
    slots = torch.tensor([tables[i][(c - 1) // BS] * BS + (c - 1) % BS for i, c in enumerate(ctxs)])
    qkv = torch.randn(rows, (NH + 2 * NKV) * D, generator=g).bfloat16()
    k_pool = torch.randn(per * rows, BS, NKV, D, generator=g).bfloat16()
    v_pool = torch.randn(per * rows, BS, NKV, D, generator=g).bfloat16()
    table = torch.randn(ctx + 1, 2, D, generator=g).bfloat16()
    out = torch.empty(rows, NH * D, dtype=torch.bfloat16)
    scratch = (torch.empty(rows, NH * D, dtype=torch.bfloat16), cpu_decode.attention_scratch(rows, NH, NKV, D, ctx))
    meta = build_metadata(tables, [1] * rows, ctxs, BS)
    return dict(
        tables=tables,
        ctx=torch.tensor(ctxs),
        positions=positions,
        slots=slots,
        qkv=qkv,
        k=k_pool,
        v=v_pool,
        table=table,
        out=out,
        scratch=scratch,
        meta=meta,
        blocks=torch.tensor(tables),
    )


STEP_CONTEXTS = (300, 2000, 6000)
FILLER = (
    "The committee met on Tuesday to review the budget, the hiring plan and the schedule for the new "
    "library wing; each item was discussed at length and the minutes were circulated afterwards. "
)


def decode_steps(repeats: int, tokens: int, contexts=STEP_CONTEXTS) -> list[list[str]]:
    """[context, per-row tok/s, blocked tok/s, ratio] of the default model's batch-1 decode."""
    from chatkv.engine.core import Engine
    from chatkv.engine.sampling import SamplingParams
    from chatkv.kernels import cpu_decode

    eng = Engine.from_pretrained(speculative="off", adaptive_threads=False)
    out = []
    try:
        for ctx in contexts:
            text = FILLER * (ctx // 30 + 1)
            ids = eng.encode_chat([{"role": "user", "content": text}])[:ctx]
            params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
            eng.generate(ids, SamplingParams(max_tokens=4, temperature=0))  # the prompt's KV, cached for both
            rates = {False: [], True: []}
            for rep in range(repeats):
                for blocked in (False, True) if rep % 2 == 0 else (True, False):
                    cpu_decode.attention_blocked(blocked)
                    try:
                        rates[blocked].append(eng.generate(ids, params).usage.tokens_per_s)
                    finally:
                        cpu_decode.attention_blocked(True)
            a, b = median(rates[False]), median(rates[True])
            out.append([str(len(ids)), f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}x"])
    finally:
        eng.close()
    return out


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-steps", action="store_true", help="only the per-call table")
    ap.add_argument("--repeats", type=int, default=3, help="whole-step runs per path and context (median)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded per whole-step run")
    ap.add_argument(
        "--contexts", default=",".join(map(str, STEP_CONTEXTS)), help="prompt tokens of the whole-step runs"
    )
    args = ap.parse_args()
    from chatkv.kernels import cpu_decode
    from chatkv.kernels.attention import paged_attention, store_kv
    from chatkv.model import fused_decode

    if not fused_decode.kernels_available():
        raise SystemExit("the fused decode ops are not built here (no compiler?): nothing to compare")
    print(cpu_line())
    other = OtherLoad()
    print(f"load average {load_average()}; query heads {NH}, kv heads {NKV}, head size {D}, block size {BS}")
    rows_out = []
    before = torch.get_num_threads()
    for rows, ctx, one in CASES:
        c = setup_case(rows, ctx, one)
        for threads in (1, 2):
            torch.set_num_threads(threads)

            def fused():
                cpu_decode.decode_attention(
                    c["qkv"],
                    c["table"],
                    c["positions"],
                    c["k"],
                    c["v"],
                    c["slots"],
                    c["blocks"],
                    c["ctx"],
                    NH,
                    NKV,
                    0.125,
                    c["out"],
                    c["scratch"],
                )

            x = c["qkv"].view(rows, NH + 2 * NKV, D)

            def torch_ops():
                store_kv(c["k"], c["v"], c["meta"].slot_mapping, x[:, NH : NH + NKV], x[:, NH + NKV :])
                paged_attention(x[:, :NH].contiguous(), c["k"], c["v"], c["meta"], 0.125)

            a = best_of(torch_ops, 200, warm=20)
            cpu_decode.attention_blocked(False)
            try:
                b = best_of(fused, 200, warm=20)
            finally:
                cpu_decode.attention_blocked(True)
            f = best_of(fused, 200, warm=20)
            what = f"{rows} rows, one sequence" if one else str(rows)
            rows_out.append(
                [what, str(ctx), str(threads), f"{a:.1f}", f"{b:.1f}", f"{f:.1f}", f"{b / f:.2f}x", f"{a / f:.2f}x"]
            )
    torch.set_num_threads(before)
    print_table(
        "one layer's decode attention, us per call",
        [
            "batch",
            "context",
            "threads",
            "torch ops us",
            "fused per row us",
            "fused blocked us",
            "blocked vs per row",
            "blocked vs torch",
        ],
        rows_out,
    )
    if not args.no_steps:
        print_table(
            f"the default model's decode, batch 1, {args.tokens} tokens, threads {torch.get_num_threads()}, "
            f"tok/s (median of {args.repeats}, the paths in turn)",
            ["prompt tokens", "fused per row", "fused blocked", "blocked vs per row"],
            decode_steps(args.repeats, args.tokens, [int(c) for c in args.contexts.split(",")]),
        )
    print(f"load average at the end {load_average()}; {other}")


if __name__ == "__main__":
    main()
