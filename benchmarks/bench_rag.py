"""RAG over one knowledge base: how much document KV is served from cache, and what that does to TTFT.

Builds a knowledge base from the labelled corpus of the tests (tests/support/rag_corpus.py: 56
documents; ingest figures: chunks/s and the parse / embed / index split), then runs 5
sessions x 10 questions on the default model. Every session pins the same two documents
after the same system prompt and retrieves 3 sources per question (chatkv's placement:
pinned documents in the system message, sources at the start of each user message).

Reported:
- the share of document tokens (pinned documents + every source block in the prompt,
  history included) whose KV came from memory or disk rather than being computed;
- TTFT of chatkv against (a) the same prompt on an engine with prefix caching off and
  (b) transformers computing the whole prompt (one forward, first token), measured on
  turns 1, 5 and 10 of the first and last session (same token ids, same process).

With ``--reuse edge,blend`` the same sessions run again, in the same process, on an engine
per ``rag_kv_reuse`` mode, twice: with no chunk KV stored (a turn places only stored chunk
KV: a first-seen chunk is computed as ``off`` computes it and its KV made while the engine is
idle, chatkv.rag.background) and with every chunk's KV computed ahead of time
(``kb.add(..., precompute_kv=True)``, as ``chatkv ingest --kv`` does). Between turns the
bench waits for that background work (a reader's pause; ``--no-pause``: back to back, when
it never runs); TTFT is measured from the turn's start and ``off`` gets the same pauses.
Every turn of each run is compared with the same turn of the ``rag_kv_reuse=off`` run:
TTFT (median ratio, worst turn, turns over 1.05x), prompt tokens computed (turns computing
more than ``off``: never, by design), and what sessions 2.. find cached on their first turn
against the whole blocks of the system prompt and pinned documents.

    CHATKV_HOME=/tmp/ckrag .venv/bin/python benchmarks/bench_rag.py [--threads 2] [--sessions 5] [--turns 10]
                                                                    [--reuse edge,blend] [--recompute-ratio R]
                                                                    [--check-layers N] [--no-pause]
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch
from common import OtherLoad, cpu_line, load_average, load_engine, load_hf, median, parser, print_table, setup

SYSTEM = "You answer questions about household products and hobbies. Be brief."
PINNED = ["zephyr-kettle", "aurora-grinder"]


def doc_spans(
    renderer, s, content: str, question: str, before: int, first_turn: bool, pinned_len: int
) -> list[tuple[int, int]]:
    """Token spans of document text in this turn's prompt: the pinned documents (first turn:
    inside the system message) and this turn's sources block (at the start of the user message)."""
    spans = []
    if first_turn:
        sys_only = len(renderer.system_prefix(s.system))
        spans.append((sys_only, pinned_len))
    src = len(renderer.user_turn(content)) - len(renderer.user_turn(question))
    if src > 0:
        if first_turn:
            start = pinned_len + 3  # "<|im_start|>user\n" after the system message
        else:
            start = before + 3
        spans.append((start, start + src))
    return spans


def run_sessions(engine, kb, renderer, pinned, questions, args, pause=False):
    """The sessions x questions workload: (share of document tokens served from cache, the measured
    turns as (prompt ids, TTFT s, reused chunk tokens), every turn's usage in order). ``pause``:
    after each turn, wait for the chunk KV made in the background (chatkv.rag.background)."""
    from chatkv.rag import background
    from chatkv.rag import context as rag_context

    greedy = dict(max_tokens=8, temperature=0.0)
    doc_total = doc_cached = 0
    measured, every = [], []
    for si in range(args.sessions):
        s = engine.session(system=SYSTEM, knowledge=kb, top_k=3, documents=pinned, params=greedy)
        pinned_len = len(renderer.system_prefix(s.system_content))
        history_docs = 0  # document tokens already in the session's history
        for t in range(args.turns):
            q = questions[(si * args.turns + t) % len(questions)]
            before = len(s.tokens)
            r = s.send(q)
            if pause:
                background.settle(engine)
            content = rag_context.user_message(q, r.sources)  # the user message as it was sent
            spans = doc_spans(renderer, s, content, q, before, t == 0, pinned_len)
            reused = r.usage.cached_tokens + r.usage.restored_tokens
            new_docs = sum(e - b for b, e in spans)
            doc_total += history_docs + new_docs
            doc_cached += history_docs if reused >= before - engine.kv.block_size else 0
            doc_cached += sum(max(0, min(e, reused) - b) for b, e in spans)
            history_docs += new_docs
            every.append((r.usage, pinned_len))
            if si in (0, args.sessions - 1) and t in (0, args.turns // 2 - 1, args.turns - 1):
                measured.append((s.tokens[: r.usage.prompt_tokens], r.usage.ttft_s, r.usage.reused_tokens))
        s.close()

    return doc_cached / max(doc_total, 1), measured, every


def compare(label: str, every, base, block: int, turns: int) -> list[str]:
    """One row of the per-mode table: this run's turns against the ``off`` run's, turn by turn."""
    ratios = [b.ttft_s / u.ttft_s for (u, _), (b, _) in zip(every, base)]  # > 1: faster than off
    slower = sum(1 for (u, _), (b, _) in zip(every, base) if u.ttft_s > 1.05 * b.ttft_s)
    more = sum(1 for (u, _), (b, _) in zip(every, base) if u.computed_tokens > b.computed_tokens)
    firsts = [(u.cached_tokens, pinned // block * block) for i, (u, pinned) in enumerate(every) if i % turns == 0]
    later = firsts[1:] or firsts
    cached = min(c / max(w, 1) for c, w in later)
    reused = sum(u.reused_tokens for u, _ in every)
    return [
        label,
        f"{median([u.ttft_s for u, _ in every]) * 1e3:.0f}",
        f"{median(ratios):.2f}x",
        f"{min(ratios):.2f}x",
        f"{slower}/{len(every)}",
        f"{sum(u.computed_tokens for u, _ in every)}",
        f"{more}",
        f"{reused}",
        f"{cached:.0%}",
    ]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--sessions", type=int, default=5)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--reuse", default="", help="rag_kv_reuse modes to run as well, e.g. edge,blend")
    p.add_argument(
        "--recompute-ratio",
        type=float,
        default=None,
        help="blend's rag_recompute_ratio (default: the engine's); rag_eval.py --reuse gates it",
    )
    p.add_argument("--check-layers", type=int, default=None, help="blend's rag_check_layers (default: the engine's)")
    p.add_argument(
        "--no-pause",
        action="store_true",
        help="run the turns back to back (no wait for the chunk KV made in the background between turns)",
    )
    args = p.parse_args()
    model_dir = setup(args)
    print(cpu_line(), flush=True)
    load = OtherLoad()
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from chatkv.engine.sampling import SamplingParams
    from tests.support.rag_corpus import QUESTIONS, write_corpus

    home = Path(tempfile.mkdtemp(prefix="chatkv-rag-"))
    files = write_corpus(home / "corpus")
    # the baseline is prefix caching alone: no chunk KV placed, whatever the engine's default mode
    engine = load_engine(model_dir, args.dtype, data_dir=str(home / "data"), rag_kv_reuse="off")
    kb = engine.knowledge_base("bench")
    t0 = time.perf_counter()
    report = kb.add([str(home / "corpus")])
    ingest_s = time.perf_counter() - t0
    sec = report.seconds
    print(
        f"\ningest: {len(report.added)} documents, {report.chunks} chunks in {ingest_s:.2f} s = "
        f"{report.chunks / ingest_s:.1f} chunks/s (parse {sec.get('parse', 0):.2f} s, "
        f"embed {sec.get('embed', 0):.2f} s, "
        f"index {sec.get('index', 0):.2f} s); {len(report.skipped)} skipped"
    )

    renderer = engine.session_manager.renderer
    pinned = [str(files[d]) for d in PINNED]
    questions = [q for q, _ in QUESTIONS]
    pause = not args.no_pause
    share, measured, base = run_sessions(engine, kb, renderer, pinned, questions, args, pause)
    modes = [m for m in args.reuse.split(",") if m and m != "off"]
    by_mode, runs = {}, []
    for mode in modes:
        extra = {}
        if mode == "blend" and args.recompute_ratio is not None:
            extra["rag_recompute_ratio"] = args.recompute_ratio
        if mode == "blend" and args.check_layers is not None:
            extra["rag_check_layers"] = args.check_layers
        for ahead in (False, True):
            shutil.rmtree(home / "data" / "chunk_kv", ignore_errors=True)  # each run starts with none stored
            e = load_engine(model_dir, args.dtype, data_dir=str(home / "data"), rag_kv_reuse=mode, **extra)
            kbm = e.knowledge_base("bench")
            if ahead:
                t1 = time.perf_counter()
                n = kbm.add([str(home / "corpus")], precompute_kv=True).kv_chunks  # as chatkv ingest --kv
                print(
                    f"{mode}: chunk KV of every chunk and document ahead of time ({n} computed) "
                    f"in {time.perf_counter() - t1:.1f} s"
                )
            _, m, every = run_sessions(e, kbm, e.session_manager.renderer, pinned, questions, args, pause)
            if ahead:
                by_mode[mode] = m
            runs.append((f"{mode}, chunk KV {'ahead of time' if ahead else 'not precomputed'}", every))
            kbm.close()
            e.close()

    off = load_engine(model_dir, args.dtype, enable_prefix_caching=False, num_blocks=1024, rag_kv_reuse="off")
    hf = load_hf(model_dir, args.dtype)

    def baseline(prompt, with_hf=True):
        r = off.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        if not with_hf:
            return r.usage.ttft_s, None
        t1 = time.perf_counter()
        with torch.inference_mode():
            hf(torch.tensor([prompt])).logits[0, -1].argmax()
        return r.usage.ttft_s, time.perf_counter() - t1

    off_ttft, hf_ttft, ck_ttft = [], [], []
    for prompt, ck, _ in measured:
        o, h = baseline(prompt)
        off_ttft.append(o)
        hf_ttft.append(h)
        ck_ttft.append(ck)
    mode_rows = {}
    for mode, turns in by_mode.items():
        mode_rows[mode] = [
            (len(prompt), ck, reused, baseline(prompt, with_hf=False)[0]) for prompt, ck, reused in turns
        ]

    print(
        f"\n{args.sessions} sessions x {args.turns} questions, 2 pinned documents + 3 sources a turn, "
        f"threads={args.threads}, load average {load_average()}, {load}"
    )
    print(
        f"document tokens in prompts served from cache (memory or disk): {share:.1%}  "
        f"(goal >= 80%: {'MET' if share >= 0.8 else 'not met'})"
    )
    m_ck, m_off, m_hf = median(ck_ttft) * 1e3, median(off_ttft) * 1e3, median(hf_ttft) * 1e3
    rows = [
        ["chatkv rag_kv_reuse=off (pinned documents + history cached)", f"{m_ck:.0f}", "-"],
        ["chatkv with prefix caching off", f"{m_off:.0f}", f"{m_off / m_ck:.1f}x (goal >= 4x)"],
        ["transformers, whole prompt", f"{m_hf:.0f}", f"{m_hf / m_ck:.1f}x (goal >= 4x)"],
    ]
    for mode, mr in mode_rows.items():
        m = median([ck for _, ck, _, _ in mr]) * 1e3
        rows.append(
            [
                f"chatkv rag_kv_reuse={mode} (chunk KV ahead of time)",
                f"{m:.0f}",
                f"caching off {median([o for *_, o in mr]) * 1e3 / m:.1f}x, reuse off {m_ck / m:.1f}x",
            ]
        )
    print_table(
        f"TTFT on {len(measured)} turns (1, {args.turns // 2}, {args.turns} of sessions 1 and {args.sessions}), "
        "median ms",
        ["case", "TTFT ms", "chatkv is faster by"],
        rows,
    )
    if runs:
        header = [
            "rag_kv_reuse",
            "TTFT median ms",
            "median vs off",
            "worst turn vs off",
            "turns > 1.05x off",
            "tokens computed",
            "turns computing more than off",
            "chunk tokens placed",
            "sessions 2.. first turn cached / system+pinned whole blocks",
        ]
        rows2 = [compare("off (prefix caching alone)", base, base, engine.kv.block_size, args.turns)]
        rows2 += [compare(label, every, base, engine.kv.block_size, args.turns) for label, every in runs]
        for label, every in runs:  # the turns over 1.05x off's, to tell noise from cost
            for i, ((u, _), (o, _)) in enumerate(zip(every, base)):
                if u.ttft_s > 1.05 * o.ttft_s:
                    print(
                        f"  {label}: session {i // args.turns + 1} turn {i % args.turns + 1}: "
                        f"{u.ttft_s * 1e3:.0f} ms against off's {o.ttft_s * 1e3:.0f} ms; tokens computed "
                        f"{u.computed_tokens} against {o.computed_tokens}, placed {u.reused_tokens}, "
                        f"cached {u.cached_tokens} against {o.cached_tokens}"
                    )
        print_table(
            f"every turn against the same turn of rag_kv_reuse=off ({args.sessions} x {args.turns} turns; "
            f"between turns {'a pause for the background chunk KV' if pause else 'none'}; x > 1: faster than off)",
            header,
            rows2,
        )
    print("per turn (prompt tokens: chatkv / caching off / transformers ms):")
    for (prompt, *_), ck, of, hf_t in zip(measured, ck_ttft, off_ttft, hf_ttft):
        print(
            f"  {len(prompt):5d}: {ck * 1e3:6.0f} / {of * 1e3:6.0f} / {hf_t * 1e3:6.0f}  "
            f"({of / ck:.1f}x, {hf_t / ck:.1f}x)"
        )
    for mode, mr in mode_rows.items():
        print(
            f"rag_kv_reuse={mode}, per turn (prompt tokens, chunk tokens reused: TTFT / caching off ms; "
            "against caching off (goal >= 4x) and reuse off at the same turn (goal >= 3x on new sources)):"
        )
        for (n, ck, reused, of), reuse_off in zip(mr, ck_ttft):
            print(f"  {n:5d}, {reused:4d}: {ck * 1e3:6.0f} / {of * 1e3:6.0f}  ({of / ck:.1f}x, {reuse_off / ck:.1f}x)")
    engine.close()


if __name__ == "__main__":
    main()
