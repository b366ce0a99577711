"""What each verified row costs a batch-1 decode step, and where that cost is.

Speculation pays by how little a step of ``1 + k`` rows (the last token and ``k`` proposals)
costs against a one-row step: on a memory-bound CPU decode the weights are streamed once for
all rows, so ideally a row adds little. Here one sequence of the default model (int4, the
governor off) decodes with exactly ``k`` proposals every step (tokens of its prompt, mostly
rejected: only the row count matters), once with torch's weight-only kernels
(``_weight_int4pack_mm_for_cpu``, the projections; ``_weight_int8pack_mm``, the output matrix;
the baseline, same process) and once with chatkv's (kernels/cpu_matmul.c, which decode each
weight tile once for all rows), every row count and both kernels step by step in turn on the
same sequence. The table gives the step time, the cost
per extra row against the one-row step, and the speed-up; then the torch profiler's self time
of torch's two kernels per call at each row count. The CPU model and the load are printed.

    .venv/bin/python benchmarks/bench_verify_rows.py [--steps 40] [--rounds 3]
"""

from __future__ import annotations

import argparse

from common import OtherLoad, cpu_line, each_ms, load_average, median, print_table

OPS = ("aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--steps",
        type=int,
        default=30,
        help="timed steps of each kind per row count and round (the median is reported)",
    )
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the row counts")
    ap.add_argument(
        "--rows",
        default="1,2,3,4,6,8",
        help="rows per step to measure, in order (1: no proposals; the repeats show the drift)",
    )
    args = ap.parse_args()
    try:
        counts = [int(x) for x in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows: comma-separated row counts, got {args.rows!r}")
    if not counts or min(counts) < 1 or max(counts) > 16:
        ap.error(f"--rows: each count from 1 to 16 (a step's rows at most), got {args.rows!r}")
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    from torch.profiler import profile

    from chatkv.engine.core import Engine
    from chatkv.engine.sampling import SamplingParams
    from chatkv.engine.speculative import Speculator

    print(cpu_line())
    print(f"load average at start: {load_average()}")
    other = OtherLoad()
    eng = Engine.from_pretrained(adaptive_threads=False)
    ids = eng.encode_chat([{"role": "user", "content": "Write a long story about a lighthouse keeper."}])

    class Fixed(Speculator):  # exactly ``k`` proposals every step (0: none, a plain one-row step)
        k = 0

        def assign(self, decodes, rows, budget):
            out = {}
            for s in decodes:
                if self.k:
                    self.state(s).key = 1
                    out[s] = [ids[3]] * self.k
            return out

    from chatkv.kernels import cpu_decode
    from chatkv.weights import quantised as quant

    kernels_before, amx_before = quant.few_row_kernel(), cpu_decode.amx()
    # (name, chatkv's few-row kernels, on AMX tiles): torch's kernels are the baseline
    variants = [("torch kernels", False, False), ("chatkv AVX-512", True, False)]
    if amx_before:
        variants.append(("chatkv AMX", True, True))

    def use(ours: bool, tiles: bool) -> None:
        quant.few_row_kernel(ours)
        cpu_decode.amx(tiles)

    fixed = Fixed("lookup", max(counts), 0.2, 15)
    eng.scheduler.speculator = fixed
    steps: dict[tuple[int, str], list[float]] = {}
    ops_out = []
    try:
        for rnd in range(args.rounds):
            seq = eng.add_request(
                ids,
                SamplingParams(
                    max_tokens=args.steps * len(counts) * 2 * max(counts) + 64, temperature=0, ignore_eos=True
                ),
            )
            for _ in range(10):  # the prompt and warm steps
                eng.step()
            # every row count with each variant, step by step in turn on one sequence: all see
            # the same machine and the same context lengths (this machine's speed drifted by tens
            # of percent within minutes)
            for _ in range(args.steps):
                for rows in counts:
                    for name, ours, tiles in variants:
                        fixed.k = rows - 1
                        use(ours, tiles)
                        steps.setdefault((rows, name), []).append(each_ms(eng.step, 1)[0])
            if rnd == 0:
                use(False, False)
                for rows in counts:
                    fixed.k = rows - 1
                    with profile() as prof:
                        for _ in range(10):
                            eng.step()
                    per = {
                        e.key: (e.self_cpu_time_total / max(e.count, 1), e.self_cpu_time_total)
                        for e in prof.key_averages()
                    }
                    total = sum(e.self_cpu_time_total for e in prof.key_averages())
                    ops_out.append(
                        [str(rows)]
                        + [f"{per.get(op, (0, 0))[0]:.1f}" for op in OPS]
                        + [f"{sum(per.get(op, (0, 0))[1] for op in OPS) / max(total, 1):.0%}"]
                    )
            eng.abort(seq)
    finally:
        use(kernels_before, amx_before)
        eng.close()
    native = bool(eng.model.layers[0].qkv.few_rows())
    best = {key: median(v) for key, v in steps.items()}
    rows_out = []
    for rows in dict.fromkeys(counts):
        line = [str(rows)]
        for name, _, _ in variants:
            m, base = best[(rows, name)], best[(1, name)] if (1, name) in best else None
            line += [f"{m:.2f}", "-" if rows == 1 or not base else f"{(m / base - 1) / (rows - 1):.3f}"]
        line += [f"{best[(rows, 'torch kernels')] / best[(rows, name)]:.2f}x" for name, _, _ in variants[1:]]
        rows_out.append(line)
    head = ["rows"] + [h for name, _, _ in variants for h in (name, "per extra row")]
    head += [f"{name} vs torch" for name, _, _ in variants[1:]]
    print_table(
        f"one sequence, step time by rows, ms (median of {args.steps * args.rounds} steps each, in turn); "
        f"chatkv's kernels {'built' if native else 'NOT built here (no AVX512-BF16): the chatkv columns are torch'}"
        f"{'' if amx_before else '; no AMX here (or not granted): no AMX column'}",
        head,
        rows_out,
    )
    print_table(
        "torch's weight-only kernels, self CPU us per call (torch profiler, 10 steps)",
        ["rows", "int4 projections", "int8 output matrix", "their share of the step"],
        ops_out,
    )
    print(f"load average at end: {load_average()}; {other}")


if __name__ == "__main__":
    main()
