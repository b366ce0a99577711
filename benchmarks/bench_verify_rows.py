"""What each verified row costs a batch-1 decode step, and where that cost is (issue 24).

Speculation pays by how little a step of ``1 + k`` rows (the last token and ``k`` proposals)
costs against a one-row step: on a memory-bound CPU decode the weights are streamed once for
all rows, so ideally a row adds little. Here one sequence of the default model (int4, the
governor off) decodes with exactly ``k`` proposals every step (tokens of its prompt, mostly
rejected: only the row count matters), and the table gives the median step time, its ratio
to the one-row step (the baseline, same process) and the cost per extra row; then the torch
profiler's self time of the two weight-only kernels (``_weight_int4pack_mm_for_cpu``, the
projections; ``_weight_int8pack_mm``, the output matrix) per call at each row count. The CPU
model and the load are printed.

    .venv/bin/python benchmarks/bench_verify_rows.py [--steps 40]
"""

from __future__ import annotations

import argparse

from common import OtherLoad, cpu_line, each_ms, load_average, median, print_table

OPS = ("aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="timed steps per row count (the median is reported)")
    ap.add_argument("--rows", default="1,2,3,6,1,6", help="rows per step to measure, in order (1: no proposals; the repeats show the drift)")
    args = ap.parse_args()
    try:
        counts = [int(x) for x in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows: comma-separated row counts, got {args.rows!r}")
    if not counts or min(counts) < 1 or max(counts) > 16:
        ap.error(f"--rows: each count from 1 to 16 (a step's rows at most), got {args.rows!r}")
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    from torch.profiler import profile

    from chatkv.engine import Engine
    from chatkv.sampling import SamplingParams
    from chatkv.speculative import Speculator

    print(cpu_line())
    print(f"load average at start: {load_average()}")
    other = OtherLoad()
    eng = Engine.from_pretrained(adaptive_threads=False)
    ids = eng.encode_chat([{"role": "user", "content": "Write a long story about a lighthouse keeper."}])

    class Fixed(Speculator):  # exactly max_k proposals every step
        def assign(self, decodes, rows, budget):
            out = {}
            for s in decodes:
                self.state(s).key = 1
                out[s] = [ids[3]] * self.max_k
            return out

    rows_out, ops_out, base = [], [], None
    try:
        for rows in counts:
            eng.scheduler.speculator = Fixed("lookup", rows - 1, 0.2, 15) if rows > 1 else None
            seq = eng.add_request(ids, SamplingParams(max_tokens=args.steps * 8 + 64, temperature=0, ignore_eos=True))
            for _ in range(10):  # the prompt and warm steps
                eng.step()
            m = median(each_ms(eng.step, args.steps))
            base = m if base is None else base
            rows_out.append([str(rows), f"{m:.2f}", f"{m / base:.2f}x",
                             "-" if rows == 1 else f"{(m / base - 1) / (rows - 1):.3f}"])
            with profile() as prof:
                for _ in range(10):
                    eng.step()
            per = {e.key: (e.self_cpu_time_total / max(e.count, 1), e.self_cpu_time_total) for e in prof.key_averages()}
            total = sum(e.self_cpu_time_total for e in prof.key_averages())
            ops_out.append([str(rows)] + [f"{per.get(op, (0, 0))[0]:.1f}" for op in OPS]
                           + [f"{sum(per.get(op, (0, 0))[1] for op in OPS) / max(total, 1):.0%}"])
            eng.abort(seq)
    finally:
        eng.close()
    print_table(f"one sequence, step time by rows (median of {args.steps} steps), ms",
                ["rows", "step ms", "vs 1 row", "per extra row"], rows_out)
    print_table("weight-only kernels, self CPU us per call (torch profiler, 10 steps)",
                ["rows", "int4 projections", "int8 output matrix", "their share of the step"], ops_out)
    print(f"load average at end: {load_average()}; {other}")


if __name__ == "__main__":
    main()
