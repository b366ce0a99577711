"""The RAG evaluation's metrics and question set, as pure functions (benchmarks/rag_eval.py runs
them; tests/rag/test_rag_eval.py tests them). Nothing here loads a model or a knowledge base.

- Retrieval is scored by document, as tests/retrieval/test_retrieval_quality.py does: a question's rank is the
  position of the first of its gold ``sources`` (topic names) among the *distinct* documents of the
  search's chunk hits, in order. ``hit@k``: rank <= k; ``MRR@k``: mean of 1/rank over the questions
  (0 when the rank is over k or there is none). ``answer_in`` asks a stricter thing of the chunks
  themselves: does one of the first k chunk texts hold the gold answer (normalised)?
- Answers are scored as SQuAD does: the text normalised (lower case, punctuation and the articles
  a/an/the dropped, whitespace collapsed), then exact match and token-level F1 against the gold
  answer; ``contains``: the normalised gold answer appears inside the normalised reply.
- Citation precision: of the sources a reply cites as ``[n]`` (n from 1 to the number of sources
  shown), the share whose text holds the gold answer; a reply citing nothing has no precision (None)
  and counts in the citation rate instead.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from pathlib import Path
from typing import Iterable, Optional, Sequence

QUESTIONS_FILE = Path(__file__).resolve().parent.parent / "tests" / "data" / "rag_eval" / "pydoc_topics_qa.json"
SPLITS = ("tune", "heldback", "all")
_PUNCT = set(string.punctuation) | set("“”‘’—–…")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_CITATION = re.compile(r"\[(\d{1,3})\]")


def load_questions(split: str = "tune", path: Path = QUESTIONS_FILE) -> list[dict]:
    """The questions of ``split`` ("tune", "heldback" or "all"), in file order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    questions = json.loads(Path(path).read_text(encoding="utf-8"))["questions"]
    return [q for q in questions if split == "all" or q["split"] == split]


def normalize_answer(text: str) -> str:
    """Lower case, punctuation and articles removed, whitespace collapsed (SQuAD's normalisation)."""
    text = "".join(" " if ch in _PUNCT else ch for ch in text.lower())
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    """Token-level F1 of the normalised texts (1.0 when both are empty)."""
    p, g = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not p or not g:
        return float(p == g)
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def contains(text: str, gold: str) -> bool:
    """The normalised gold answer appears in the normalised text (on word boundaries)."""
    g = normalize_answer(gold)
    return bool(g) and f" {g} " in f" {normalize_answer(text)} "


def document_rank(ranked_sources: Iterable[str], gold: Iterable[str]) -> Optional[int]:
    """1-based rank of the first gold source among the distinct sources, in order; None if absent."""
    gold = set(gold)
    seen: list[str] = []
    for s in ranked_sources:
        if s not in seen:
            seen.append(s)
            if s in gold:
                return len(seen)
    return None


def hit_at(rank: Optional[int], k: int) -> float:
    return float(rank is not None and rank <= k)


def reciprocal_rank(rank: Optional[int], k: int) -> float:
    return 1.0 / rank if rank is not None and rank <= k else 0.0


def answer_in(chunk_texts: Sequence[str], gold: str, k: int) -> float:
    """1.0 if one of the first ``k`` chunk texts holds the gold answer."""
    return float(any(contains(t, gold) for t in chunk_texts[:k]))


def cited_numbers(reply: str, n_sources: int) -> list[int]:
    """The distinct source numbers 1..n_sources a reply cites as [n], in order of first citation."""
    out: list[int] = []
    for m in _CITATION.findall(reply):
        i = int(m)
        if 1 <= i <= n_sources and i not in out:
            out.append(i)
    return out


def citation_precision(reply: str, source_texts: Sequence[str], gold: str) -> Optional[float]:
    """Share of the cited sources whose text holds the gold answer; None when nothing is cited."""
    cited = cited_numbers(reply, len(source_texts))
    if not cited:
        return None
    return sum(contains(source_texts[i - 1], gold) for i in cited) / len(cited)


def retrieval_row(ranks: Sequence[Optional[int]], answer_hits: Sequence[float]) -> dict:
    """hit@1, hit@3, hit@10, MRR@10 (means over the questions) and answer-in-top-3-chunks."""
    n = len(ranks)
    if n == 0:
        raise ValueError("no questions")
    return {
        "hit@1": sum(hit_at(r, 1) for r in ranks) / n,
        "hit@3": sum(hit_at(r, 3) for r in ranks) / n,
        "hit@10": sum(hit_at(r, 10) for r in ranks) / n,
        "mrr@10": sum(reciprocal_rank(r, 10) for r in ranks) / n,
        "answer@3": sum(answer_hits) / n,
        "n": n,
    }


def answer_row(replies: Sequence[str], golds: Sequence[str], sources: Sequence[Sequence[str]]) -> dict:
    """Exact match, F1, contains (means), citation precision (mean over replies that cite) and rate."""
    n = len(replies)
    if n == 0 or len(golds) != n or len(sources) != n:
        raise ValueError("replies, golds and sources must be equally long and not empty")
    precisions = [citation_precision(r, s, g) for r, s, g in zip(replies, sources, golds)]
    cited = [p for p in precisions if p is not None]
    return {
        "em": sum(exact_match(r, g) for r, g in zip(replies, golds)) / n,
        "f1": sum(f1_score(r, g) for r, g in zip(replies, golds)) / n,
        "contains": sum(contains(r, g) for r, g in zip(replies, golds)) / n,
        "citation_precision": sum(cited) / len(cited) if cited else None,
        "cite_rate": len(cited) / n,
        "n": n,
    }
