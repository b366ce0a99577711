"""The RAG evaluation: its question set is sound and its metrics compute what
benchmarks/rag_metrics.py says they do. The evaluation itself is benchmarks/rag_eval.py (it needs
the models and minutes); nothing here loads a model."""

from __future__ import annotations

import json
import re
import sys

import pytest

from benchmarks.rag_metrics import (
    QUESTIONS_FILE,
    answer_in,
    answer_row,
    citation_precision,
    cited_numbers,
    contains,
    document_rank,
    exact_match,
    f1_score,
    hit_at,
    load_questions,
    normalize_answer,
    reciprocal_rank,
    retrieval_row,
)


def _norm(s: str) -> str:
    return re.sub(r"\s+", " ", s).strip()


@pytest.fixture(scope="module")
def data():
    return json.loads(QUESTIONS_FILE.read_text(encoding="utf-8"))


def test_question_set_shape(data):
    qs = data["questions"]
    assert len(qs) >= 100
    assert sum(q["split"] == "heldback" for q in qs) == 30
    assert {q["split"] for q in qs} == {"tune", "heldback"}
    assert len({q["id"] for q in qs}) == len(qs)
    assert len({q["question"] for q in qs}) == len(qs)
    for q in qs:
        assert q["question"].strip() and q["answer"].strip() and q["sources"]
        assert q["topic"] in q["sources"]
    assert "never" in data["heldback"].lower()
    assert len(load_questions("tune")) + len(load_questions("heldback")) == len(load_questions("all")) == len(qs)
    with pytest.raises(ValueError):
        load_questions("test")


def test_every_answer_is_in_its_sources(data):
    """The check the file describes: the evidence is a verbatim quote of each source topic, the
    answer part of the evidence, and the sources are every topic holding it."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" != data["python"]:
        pytest.skip(f"written against Python {data['python']}'s pydoc_data; its text differs between versions")
    from pydoc_data.topics import topics

    texts = {k: _norm(v) for k, v in topics.items()}
    for q in data["questions"]:
        evidence = _norm(q["evidence"])
        assert _norm(q["answer"]) in evidence, q["id"]
        assert sorted(k for k, v in texts.items() if evidence in v) == q["sources"], q["id"]
        assert all(contains(texts[s], q["answer"]) for s in q["sources"]), q["id"]


def test_normalize_and_answer_scores():
    assert normalize_answer("The “Ellipsis” object!") == "ellipsis object"
    assert normalize_answer("  a  NameError,  ") == "nameerror"
    assert exact_match("NameError.", "nameerror") == 1.0
    assert exact_match("It raises NameError", "NameError") == 0.0
    assert f1_score("It raises NameError", "NameError") == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))
    assert f1_score("nothing alike", "NameError") == 0.0
    assert f1_score("", "") == 1.0 and f1_score("x", "") == 0.0
    assert f1_score("x b b", "b b c") == pytest.approx(2 / 3)
    assert f1_score("a b b", "b b c") == pytest.approx(0.8)  # "a" is an article: dropped
    assert contains("It is written as Ellipsis or ...", '"Ellipsis" or "..."')
    assert not contains("NameErrors", "NameError")  # whole words only
    assert not contains("anything", "")


def test_ranks_hits_and_mrr():
    ranked = ["a", "a", "b", "c", "b", "d"]
    assert document_rank(ranked, ["c"]) == 3  # distinct documents: a, b, c
    assert document_rank(ranked, ["d", "b"]) == 2
    assert document_rank(ranked, ["z"]) is None
    assert hit_at(3, 3) == 1.0 and hit_at(4, 3) == 0.0 and hit_at(None, 10) == 0.0
    assert reciprocal_rank(2, 10) == 0.5 and reciprocal_rank(11, 10) == 0.0 and reciprocal_rank(None, 10) == 0.0
    row = retrieval_row([1, 2, None, 5], [1.0, 0.0, 0.0, 1.0])
    assert row["hit@1"] == 0.25 and row["hit@3"] == 0.5 and row["hit@10"] == 0.75
    assert row["mrr@10"] == pytest.approx((1 + 0.5 + 0 + 0.2) / 4)
    assert row["answer@3"] == 0.5 and row["n"] == 4
    with pytest.raises(ValueError):
        retrieval_row([], [])
    assert answer_in(["x", "y", "the NameError"], "NameError", 3) == 1.0
    assert answer_in(["x", "y", "the NameError"], "NameError", 2) == 0.0


def test_citations():
    sources = ["raises NameError here", "nothing", "NameError again"]
    assert cited_numbers("see [2] and [1], [2] again, [7] and [0] are not sources", 3) == [2, 1]
    assert citation_precision("It is NameError [1].", sources, "NameError") == 1.0
    assert citation_precision("[1][2]", sources, "NameError") == 0.5
    assert citation_precision("NameError, no citation", sources, "NameError") is None
    row = answer_row(["NameError [1]", "a KeyError [2]", "no idea"], ["NameError"] * 3, [sources] * 3)
    assert row["em"] == 0.0  # "[1]" is left as the token "1"
    assert row["contains"] == pytest.approx(1 / 3)
    assert row["citation_precision"] == 0.5 and row["cite_rate"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        answer_row(["a"], [], [])


def test_the_followups_are_sound_and_need_their_previous_question():
    """tests/data/rag_eval/pydoc_topics_followups.json, checked as the question set is: the evidence
    quotes each source topic, the answer is part of it; each follow-up and its previous question
    are distinct, and the control pairs each held-back question with another held-back one."""
    from benchmarks.rag_followup_eval import FOLLOWUPS_FILE, load_followups, pairs

    data = json.loads(FOLLOWUPS_FILE.read_text(encoding="utf-8"))
    fus = load_followups()
    assert len(fus) >= 20 and len({f["id"] for f in fus}) == len(fus)
    assert all(f["previous"].strip() and f["question"].strip() and f["previous"] != f["question"] for f in fus)
    sets = pairs(fus, load_questions("heldback"))
    assert len(sets["follow-ups"]) == len(fus) and len(sets["control"]) == 30
    assert all(m != p for m, p, _ in sets["control"])
    if f"{sys.version_info.major}.{sys.version_info.minor}" != data["python"]:
        pytest.skip(f"written against Python {data['python']}'s pydoc_data; its text differs between versions")
    from pydoc_data.topics import topics

    texts = {k: _norm(v) for k, v in topics.items()}
    for f in fus:
        evidence = _norm(f["evidence"])
        assert _norm(f["answer"]) in evidence, f["id"]
        assert f["topic"] in f["sources"], f["id"]
        assert sorted(k for k, v in texts.items() if evidence in v) == f["sources"], f["id"]


def test_the_peer_says_it_is_not_installed_where_llamaindex_is_absent():
    """rag_eval.py's peer row without LlamaIndex: a sentence naming what to install, no exception
    (a child process where ``import llama_index`` fails as it does when the package is absent)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys; sys.modules['llama_index'] = None\n"
        "from benchmarks.rag_eval_peer import llamaindex_retriever\n"
        "print(llamaindex_retriever({'a': 'text'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "LlamaIndex is not installed" in out.stdout and "pip install llama-index-core" in out.stdout
