"""Follow-up questions in benchmarks/rag_eval.py (``--followups``): what a follow-up is searched as.

Two sets, both scored by document as the retrieval table is (hit@1, hit@3 of chatkv's hybrid search):

- follow-ups (tests/data/rag_eval/pydoc_topics_followups.json): a question whose subject is in the
  previous user message ("Which scope does it exclude?" after "What does the nonlocal statement
  do?");
- control: the held-back questions, each after the held-back question before it (an unrelated
  previous turn): a standalone question must not be made worse by what the rewriting adds.

Each set is searched as: the message alone; ``chatkv.rag.context.standalone_query``'s rule (the
previous user message joined to a short or pronoun-led message); and the rule with the chat model's
rewrite (``chatkv.rag.rewrite.model_rewriter``, asked only for messages the rule takes for
follow-ups). The rewrite's cost is reported per call (ms, greedy, the engine's threads).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

FOLLOWUPS_FILE = Path(__file__).resolve().parent.parent / "tests" / "data" / "rag_eval" / "pydoc_topics_followups.json"
HEADERS = ["query", "set", "n", "hit@1", "hit@3"]


def load_followups(path: Path = FOLLOWUPS_FILE) -> list[dict]:
    return json.loads(Path(path).read_text(encoding="utf-8"))["questions"]


def pairs(followups: list[dict], heldback: list[dict]) -> dict[str, list[tuple[str, str, list[str]]]]:
    """(message, previous user message, gold sources) of each set."""
    previous = heldback[-1:] + heldback[:-1]
    return {
        "follow-ups": [(f["question"], f["previous"], f["sources"]) for f in followups],
        "control": [(q["question"], p["question"], q["sources"]) for p, q in zip(previous, heldback)],
    }


def followup_rows(kb, sets: dict, rewrite=None) -> tuple[list[list[str]], list[float]]:
    """The table's rows and the rewrite's per-call seconds (empty without ``rewrite``)."""
    from rag_metrics import document_rank, hit_at

    from chatkv.rag.context import is_follow_up, standalone_query

    seconds: list[float] = []

    def timed(message: str, previous: str) -> str:
        t = time.perf_counter()
        out = rewrite(message, previous)
        seconds.append(time.perf_counter() - t)
        return out

    ways = {
        "message alone": lambda m, p: m,
        "rule (default)": lambda m, p: standalone_query(m, p),
    }
    if rewrite is not None:
        ways["rule + SmolLM2-135M rewrite"] = lambda m, p: standalone_query(m, p, rewrite=timed)
    rows = []
    for name, query in ways.items():
        for set_name, items in sets.items():
            ranks = [document_rank([h.source for h in kb.search(query(m, p), k=10)], src) for m, p, src in items]
            n = len(ranks)
            h1, h3 = sum(hit_at(r, 1) for r in ranks), sum(hit_at(r, 3) for r in ranks)
            rows.append([name, set_name, str(n), f"{h1:.0f} ({h1 / n:.1%})", f"{h3:.0f} ({h3 / n:.1%})"])
    flagged = {s: sum(is_follow_up(m) for m, _, _ in items) for s, items in sets.items()}
    print("messages the rule takes for follow-ups: " + ", ".join(f"{s} {k}/{len(sets[s])}" for s, k in flagged.items()))
    return rows, seconds
