"""Write-behind snapshots: what writing every turn's KV to disk costs, against the turn itself.

A conversation of --turns turns (each user message a paragraph of ~70 tokens, replies cut at
--max-tokens greedy tokens), so the history grows ~115 tokens a turn to ~2.3k. Three engines
run the same conversation side by side, turn by turn in rotating order (so background load
hits them alike), each on its own data dir:

  (off)   write-behind disabled (the session layer's hook replaced by a no-op): the turn's
          own time, from ``send()`` to the reply
  (on)    write-behind as shipped, the writer given the user's think time: after each timed
          turn the bench waits for the writer (untimed), as a person reading the reply would
  (b2b)   write-behind with turns back to back: the writer's work overlaps the next turn

For (on): the engine thread's share of the turn (inside ``write_behind``: drain the writer's
reports, copy the new tokens' KV out of the pool, queue it), and the background writer's time
and bytes per job (its own reports: segment file + fsync, manifest + fsync). For scale, what
rewriting the whole snapshot every turn would cost: one ``KVStore.save`` of the final KV.

Prints a row per turn (medians over repeats) and the ratios: engine-thread ms / turn ms,
writer ms / turn ms, turn time on / off and b2b / off, bytes per new token early vs late,
bytes written in all / the final KV, and against a whole rewrite every turn.

    .venv/bin/python benchmarks/bench_write_behind.py [--turns 20] [--repeats 3] [--threads 1]

(--threads 1 on a shared 2-core machine: with 2 intra-op threads per engine, any other busy
process makes OpenMP threads spin against it and every figure swings several-fold.)
"""

from __future__ import annotations

import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import OtherLoad, load_average, load_engine, parser, print_table, setup  # noqa: E402

SENTENCES = [
    "The printing press spread through Europe within a few decades of its invention in Mainz.",
    "Bread dough rises because yeast ferments sugars and releases carbon dioxide, which gluten traps.",
    "Light from the Sun takes a little over eight minutes to reach the Earth.",
    "Tomatoes need warm nights to set fruit, and they sulk when the temperature drops.",
    "Roman roads were built in layers of gravel, sand and fitted stone, and many are still walkable today.",
    "A good stock simmers slowly for hours; boiling it hard makes the liquid turn cloudy.",
    "Neutron stars are so dense that a teaspoon of their material would weigh as much as a mountain.",
    "Compost works best with a mix of green material and brown material such as dry leaves.",
]


def messages(turns: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.sample(SENTENCES, 4)) + " What do you make of that?" for _ in range(turns)]


class Run:
    """One engine and its conversation; ``mode`` is "off", "on" or "b2b"."""

    def __init__(self, model_dir: Path, dtype: str, max_tokens: int, mode: str, tag: str):
        self.mode = mode
        self.data = Path(tempfile.mkdtemp(prefix=f"wb-{tag}-"))
        self.e = load_engine(model_dir, dtype, data_dir=str(self.data), num_blocks=512)
        self.snaps = self.e.session_manager.snapshots
        self.engine_s: list[float] = []
        self.export_s: list[float] = []
        self.turn_s: list[float] = []
        self.rows: list[dict] = []
        real_wb, self.real_export = self.snaps.write_behind, self.e.kv.export_kv

        def timed_export(*a, **kw):
            t0 = time.perf_counter()
            try:
                return self.real_export(*a, **kw)
            finally:
                if self.export_s:
                    self.export_s[-1] += time.perf_counter() - t0

        def timed_write_behind(*a, **kw):
            self.export_s.append(0.0)
            t0 = time.perf_counter()
            real_wb(*a, **kw)
            self.engine_s.append(time.perf_counter() - t0)

        self.snaps.write_behind = (lambda *a, **kw: None) if mode == "off" else timed_write_behind
        self.e.kv.export_kv = timed_export
        self.s = self.e.session(
            system="You are a concise assistant.", params=dict(max_tokens=max_tokens, temperature=0.0)
        )

    def turn(self, text: str) -> None:
        t0 = time.perf_counter()
        r = self.s.send(text)
        self.turn_s.append(time.perf_counter() - t0)
        kv = r.usage.prompt_tokens + r.usage.generated_tokens - 1
        self.rows.append(dict(history=kv, new=kv - (self.rows[-1]["history"] if self.rows else 0)))
        if self.mode == "on":
            self.snaps.flush()  # the user's think time: the writer finishes before the next turn

    def finish(self) -> dict:
        self.snaps.flush()
        out = dict(
            rows=self.rows,
            turn_s=self.turn_s,
            engine_s=self.engine_s,
            export_s=self.export_s,
            written=list(self.snaps.written),
        )
        if (
            self.mode == "on"
        ):  # for scale: one whole-snapshot rewrite of the final KV, as a writer without segments would write
            k, v = self.real_export(self.s.kept)
            t0 = time.perf_counter()
            meta = self.snaps.files.save(
                "whole-rewrite",
                self.s.tokens[: self.s.kept.kv_len],
                k,
                v,
                model_fingerprint=self.snaps.fingerprint,
                kv_dtype=self.snaps.kv_dtype,
            )
            out["whole_s"], out["whole_bytes"] = time.perf_counter() - t0, meta.nbytes
            self.snaps.files.delete("whole-rewrite")
        self.e.close()
        shutil.rmtree(self.data, ignore_errors=True)
        return out


def run_all(model_dir: Path, dtype: str, msgs: list[str], max_tokens: int, rep: int) -> dict[str, dict]:
    runs = [Run(model_dir, dtype, max_tokens, mode, f"r{rep}{mode}") for mode in ("off", "on", "b2b")]
    for i, m in enumerate(msgs):
        for j in range(len(runs)):
            runs[(i + j + rep) % len(runs)].turn(m)
    return {r.mode: r.finish() for r in runs}


def main() -> None:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=24)
    args = p.parse_args()
    model_dir = setup(args)
    dtype = "bf16" if args.dtype == "both" else args.dtype
    load = OtherLoad()
    msgs = messages(args.turns, 1)
    run_all(model_dir, dtype, msgs[:2], args.max_tokens, 0)  # warm-up: weights, kernels, the writer
    results = [run_all(model_dir, dtype, msgs, args.max_tokens, rep) for rep in range(args.repeats)]
    offs, ons, b2bs = ([r[m] for r in results] for m in ("off", "on", "b2b"))

    med = lambda xs: statistics.median(xs)  # noqa: E731
    table, per_new, turn_ratio = [], [], []
    for i in range(args.turns):
        off_ms = 1000 * med([o["turn_s"][i] for o in offs])
        on_ms = 1000 * med([o["turn_s"][i] for o in ons])
        b2b_ms = 1000 * med([o["turn_s"][i] for o in b2bs])
        eng_ms = 1000 * med([o["engine_s"][i] for o in ons])
        exp_ms = 1000 * med([o["export_s"][i] for o in ons])
        w = [o["written"][i] for o in ons]
        wr_ms = 1000 * med([x.seconds for x in w])
        nbytes = int(med([x.nbytes for x in w]))
        merged = any(x.merged for x in w)
        row = ons[0]["rows"][i]
        if not merged and i:
            per_new.append(nbytes / row["new"])
        turn_ratio.append(on_ms / off_ms)
        table.append(
            [
                i + 1,
                row["history"],
                row["new"],
                f"{off_ms:.0f}",
                f"{on_ms:.0f}",
                f"{b2b_ms:.0f}",
                f"{eng_ms:.2f}",
                f"{exp_ms:.2f}",
                f"{wr_ms:.1f}",
                f"{nbytes:,}",
                f"{nbytes / row['new']:,.0f}",
                "merge" if merged else "",
            ]
        )
    print_table(
        f"write-behind, {args.turns} turns, {dtype}, {args.threads} thread(s) (medians of {args.repeats})",
        [
            "turn",
            "history",
            "new tok",
            "turn ms off",
            "on",
            "b2b",
            "engine ms",
            "of it: KV copy",
            "writer ms",
            "bytes",
            "bytes/new tok",
            "",
        ],
        table,
    )
    total = lambda runs: sum(1000 * med([o["turn_s"][i] for o in runs]) for i in range(args.turns))  # noqa: E731
    turns_off = total(offs)
    eng_total = sum(1000 * med([o["engine_s"][i] for o in ons]) for i in range(args.turns))
    wr_total = sum(1000 * med([o["written"][i].seconds for o in ons]) for i in range(args.turns))
    written = med([sum(x.nbytes for x in o["written"]) for o in ons])
    final = ons[0]["rows"][-1]["history"]
    whole_bytes, whole_ms = ons[0]["whole_bytes"], 1000 * med([o["whole_s"] for o in ons])
    rewrite_all = sum(r["history"] for r in ons[0]["rows"]) * whole_bytes / final
    early, late = statistics.mean(per_new[:3]), statistics.mean(per_new[-3:])
    print(
        f"\nengine thread, all turns: {eng_total:.1f} ms = {100 * eng_total / turns_off:.2f}% of the turns' own "
        f"{turns_off:.0f} ms"
    )
    print(
        f"writer thread, all turns: {wr_total:.0f} ms = {100 * wr_total / turns_off:.1f}% of the turns' time "
        f"(in the background)"
    )
    print(
        f"turn time with write-behind / without: {total(ons) / turns_off:.3f}x (median per turn "
        f"{med(turn_ratio):.3f}x); back to back, the writer overlapping the next turn: {total(b2bs) / turns_off:.3f}x"
    )
    print(
        f"bytes per new token: {early:,.0f} early, {late:,.0f} late ({late / early:.3f}x) while the history grew "
        f"{ons[0]['rows'][-1]['history'] / ons[0]['rows'][0]['history']:.1f}x"
    )
    print(
        f"bytes written in all: {written:,.0f} = {written / whole_bytes:.2f}x the final KV snapshot "
        f"({whole_bytes:,} B); rewriting it whole every turn: {rewrite_all:,.0f} B "
        f"({written / rewrite_all:.3f}x of that)"
    )
    print(
        f"one whole rewrite at {final} tokens: {whole_ms:.0f} ms vs the last turn's write-behind "
        f"{1000 * med([o['written'][-1].seconds for o in ons]):.1f} ms"
    )
    print(f"load average {load_average()}; {load}")


if __name__ == "__main__":
    main()
