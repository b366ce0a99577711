"""What blend's recompute share and check layers cost, the configurations taking turns.

1. **Placement alone** on the RAG evaluation's prompts (rag_eval.py: pydoc topics, top-3 hybrid
   sources, the citation instruction, the question; ``--questions`` of the tune split): per
   configuration, ``chunk_place.place`` through the prompt's last token but one (as a turn
   places it; chunk KV computed before anything is timed), against full prefill of the same
   prompt (the scheduler's forwards and its first token), every configuration and the baseline
   in turn on each question, ``--repeats`` times.
2. **Whole turns** (``--turns N``): bench_rag.py's workload (the same system prompt, 2 pinned
   documents, 3 sources a turn, chunk KV ahead of time) on one engine per configuration, the
   engines taking turns question by question (the order reversed every other turn), so a
   drifting machine favours none; median TTFT per configuration.

    CHATKV_HOME=/tmp/ckrag .venv/bin/python benchmarks/bench_rag_place.py [--configs 0.45@1,0.45@4,0.3@4]
                                                                          [--questions 10] [--turns 8]

A configuration is ``RATIO@CHECK_LAYERS`` (``rag_recompute_ratio``, ``rag_check_layers``).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from common import OtherLoad, cpu_line, load_average, load_engine, median, parser, print_table, setup


def parse(spec: str) -> list[tuple[float, int]]:
    out = []
    for part in filter(None, (x.strip() for x in spec.split(","))):
        ratio, _, layers = part.partition("@")
        try:
            r, n = float(ratio), int(layers or 1)
        except ValueError:
            r, n = -1.0, 0
        if not (0 <= r < 1 and 1 <= n <= 64):
            raise SystemExit(f"--configs: {part!r} is not RATIO@CHECK_LAYERS (0 <= RATIO < 1, 1 <= CHECK_LAYERS <= 64)")
        out.append((r, n))
    return out


def placement(configs, n_questions: int, repeats: int) -> list[list[str]]:
    from rag_eval import SYSTEM, open_kb
    from rag_metrics import load_questions

    from chatkv import Engine
    from chatkv.engine.sampling import SamplingParams
    from chatkv.rag import placement as cp
    from chatkv.rag.context import canonical, source_texts, user_message

    kb = open_kb(Path(tempfile.mkdtemp(prefix="chatkv-place-")))
    e = Engine.from_pretrained(rag_kv_disk=False)
    spent = {c: [] for c in configs}
    full, sizes = [], []
    try:
        for qi, q in enumerate(load_questions("tune")[:n_questions]):
            hits = canonical(kb.search(q["question"], k=3, mode="hybrid"))
            texts = source_texts(hits)
            prompt = e.encode_chat(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user_message(q["question"], hits)}]
            )
            sizes.append(len(prompt))
            e.on_loop(lambda: cp.entries(e, cp.chunk_store(e), texts, [cp.chunk_ids(e.tokenizer, t) for t in texts]))
            for rep in range(repeats):
                for c in configs if rep % 2 == 0 else configs[::-1]:
                    ns = ("place", qi, rep, c)
                    t = time.perf_counter()
                    placed = e.on_loop(
                        lambda: cp.place(
                            e,
                            None,
                            list(prompt),
                            0,
                            texts,
                            ns,
                            None,
                            False,
                            "blend",
                            0,
                            c[0],
                            upto=len(prompt) - 1,
                            check_layers=c[1],
                        )
                    )
                    spent[c].append(time.perf_counter() - t)
                    e.on_loop(lambda: e.kv.drop(placed.kept))
                    e.on_loop(lambda: e.kv.drop_namespace(ns))
                ns = ("full", qi, rep)
                t = time.perf_counter()
                seq = e.add_request(list(prompt), SamplingParams(max_tokens=1, temperature=0.0), namespace=ns)
                for _ in e.drive(seq):
                    pass
                full.append(time.perf_counter() - t)
                e.on_loop(lambda: e.kv.drop_namespace(ns))
    finally:
        e.close()
        kb.close()
    base = median(full)
    rows = [
        [f"{r:.0%} @{n}", f"{median(spent[(r, n)]) * 1e3:.0f}", f"{base / median(spent[(r, n)]):.2f}x"]
        for r, n in configs
    ]
    rows.append(["full prefill (the baseline: prefill + first token)", f"{base * 1e3:.0f}", "-"])
    print(f"\n{n_questions} prompts of {min(sizes)}-{max(sizes)} tokens, {repeats} repeats each")
    return rows


def turns(configs, n_turns: int, model_dir, dtype: str) -> list[list[str]]:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench_rag import PINNED, SYSTEM

    from tests.support.rag_corpus import QUESTIONS, write_corpus

    home = Path(tempfile.mkdtemp(prefix="chatkv-turns-"))
    files = write_corpus(home / "corpus")
    engines = []
    for i, (r, n) in enumerate(configs):
        e = load_engine(
            model_dir,
            dtype,
            data_dir=str(home / f"data{i}"),
            rag_kv_reuse="blend",
            rag_recompute_ratio=r,
            rag_check_layers=n,
        )
        kb = e.knowledge_base("bench")
        kb.add([str(home / "corpus")], precompute_kv=True)
        engines.append((e, kb))
    ttft = {c: [] for c in configs}
    try:
        sessions = [
            e.session(
                system=SYSTEM,
                knowledge=kb,
                top_k=3,
                documents=[str(files[d]) for d in PINNED],
                params=dict(max_tokens=8, temperature=0.0),
            )
            for e, kb in engines
        ]
        for t in range(n_turns):
            order = range(len(configs)) if t % 2 == 0 else reversed(range(len(configs)))
            for i in order:
                ttft[configs[i]].append(sessions[i].send(QUESTIONS[t % len(QUESTIONS)][0]).usage.ttft_s)
    finally:
        for e, kb in engines:
            kb.close()
            e.close()
    first = median(ttft[configs[0]])
    return [
        [
            f"{r:.0%} @{n}",
            f"{median(ttft[(r, n)]) * 1e3:.0f}",
            f"{median(ttft[(r, n)]) / first:.2f}x",
            " ".join(f"{x * 1e3:.0f}" for x in ttft[(r, n)]),
        ]
        for r, n in configs
    ]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--configs", default="0.05@1,0.3@4,0.45@1,0.45@4", help="RATIO@CHECK_LAYERS, comma-separated")
    p.add_argument("--questions", type=int, default=10, help="evaluation prompts placed (0: none)")
    p.add_argument("--turns", type=int, default=0, help="bench_rag turns per configuration, taking turns (0: none)")
    args = p.parse_args()
    configs = parse(args.configs)
    if args.questions < 0 or args.turns < 0 or args.repeats < 1:
        raise SystemExit("--questions and --turns must be >= 0, --repeats >= 1")
    model_dir = setup(args)
    print(cpu_line(), flush=True)
    print(f"load average at start: {load_average()}; threads {args.threads}")
    load = OtherLoad()
    if args.questions:
        print_table(
            "placement through the prompt's last token but one, median ms (the configurations in turn)",
            ["blend", "place ms", "full prefill / place"],
            placement(configs, args.questions, args.repeats),
        )
    if args.turns:
        print_table(
            f"bench_rag's workload, {args.turns} turns of one session per configuration, taking turns: TTFT",
            ["blend", "median ms", f"TTFT / {args.configs.split(',')[0]}'s", "per turn ms"],
            turns(configs, args.turns, model_dir, args.dtype),
        )
    print(f"\nload average at end: {load_average()}; {load}")


if __name__ == "__main__":
    main()
