"""int4 prefill without the resident bf16 copy: quant_dense="scratch" against "copy".

Two engines on the default model in one process, int4 weights, taking turns (interleaved), each
repeat a fresh first token so nothing comes from the prefix cache except the history:

- TTFT of a 1,024-token prompt (two chunks of 512: each dequantises every projection once);
- short turns: 1, 23, 40 and 63 new tokens after a 2,000-token history held in the prefix cache
  (steps below chatkv.model.prefill.SCRATCH_ROWS run the int4 kernel on the scratch side, bf16
  from 16 rows on the copy side);
- each as process CPU time (steadier than wall time on a shared machine, and what a step costs
  the cores) and wall time, minimum over ``--repeats``; the ratio is scratch / copy.

Peak memory of the two is benchmarks/bench_decode.py --memory-only --modes int4/scratch,int4/copy.

    .venv/bin/python benchmarks/bench_quant_prefill.py [--threads 1] [--repeats 5]
"""

from __future__ import annotations

import time

from common import OtherLoad, cpu_line, load_average, parser, print_table, setup

TURNS = (1, 23, 40, 63)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.set_defaults(threads=1, repeats=5)
    args = p.parse_args()
    model_dir = setup(args)
    from chatkv.engine.core import Engine
    from chatkv.engine.sampling import SamplingParams
    from chatkv.model.prefill import SCRATCH_ROWS
    from tests.support.llama_cpp_reference import ppl_text  # Python's own pydoc topics

    other = OtherLoad()
    kw = dict(weights="int4", threads=args.threads, adaptive_threads=False, host_cache_bytes=0)
    engines = {kind: Engine.from_pretrained(model_dir, quant_dense=kind, **kw) for kind in ("copy", "scratch")}
    toks = engines["copy"].tokenizer(ppl_text())["input_ids"]
    hist, extra = toks[:2000], toks[2000:2100]
    one = SamplingParams(max_tokens=1, temperature=0)

    def timed(e, ids) -> tuple[float, float]:
        c, w = time.process_time(), time.perf_counter()
        e.generate(ids, one)
        return time.process_time() - c, time.perf_counter() - w

    for e in engines.values():  # warm up, and the history into each prefix cache
        e.generate(hist, one)
        e.generate([99] + toks[:1023], one)
    got: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in range(args.repeats):
        for kind, e in engines.items():
            got.setdefault((kind, "1k"), []).append(timed(e, [100 + r] + toks[:1023]))
            for n in TURNS:
                got.setdefault((kind, str(n)), []).append(timed(e, hist + [100 + r] + extra[: n - 1]))
    rows = []
    for what, label in [("1k", "1,024-token prompt (TTFT)")] + [
        (str(n), f"{n}-token turn after a 2k history") for n in TURNS
    ]:
        c = min(x for x, _ in got[("copy", what)]), min(w for _, w in got[("copy", what)])
        s = min(x for x, _ in got[("scratch", what)]), min(w for _, w in got[("scratch", what)])
        rows.append(
            [
                label,
                f"{c[0] * 1000:.0f}",
                f"{s[0] * 1000:.0f}",
                f"{s[0] / c[0]:.2f}x",
                f"{c[1] * 1000:.0f}",
                f"{s[1] * 1000:.0f}",
                f"{s[1] / c[1]:.2f}x",
            ]
        )
    print(f"\n{cpu_line()}")
    print(
        f"threads={args.threads}, min of {args.repeats} interleaved, scratch from {SCRATCH_ROWS} rows, "
        f"load average {load_average()}, {other}"
    )
    print_table(
        "int4 prefill: resident bf16 copy vs scratch (no copy), ms",
        ["step", "copy CPU", "scratch CPU", "ratio", "copy wall", "scratch wall", "ratio"],
        rows,
    )
    print("goal: 1,024-token TTFT <= 1.2x the copy's")


if __name__ == "__main__":
    main()
