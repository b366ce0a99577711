"""Follow-up rewriting by the chat model (chatkv/rag/rewrite.py) as ``standalone_query``'s option.

The rule decides which messages are follow-ups; the rewrite is asked only for those, and a blank
rewrite falls back to the rule's joined text. The model path runs the packaged SmolLM2-135M and a
real knowledge base (MiniLM, FAISS, FTS5) over three reference-manual topics."""

from __future__ import annotations

import pytest

from chatkv.rag import context as rag_context
from chatkv.rag.rewrite import EXAMPLES, MAX_TOKENS, clean, model_rewriter, rewrite_messages

PREVIOUS = "What does the nonlocal statement do?"
FOLLOW_UP = "Which scope does it exclude?"


def test_the_rewrite_is_asked_only_for_what_the_rule_takes_for_a_follow_up():
    asked = []

    def rewrite(message, previous):
        asked.append((message, previous))
        return "Which scope does the nonlocal statement exclude?"

    standalone = "Explain in detail how sourdough bread is proofed overnight at home"
    assert rag_context.standalone_query(standalone, PREVIOUS, rewrite=rewrite) == standalone
    assert rag_context.standalone_query(FOLLOW_UP, None, rewrite=rewrite) == FOLLOW_UP
    assert asked == []
    got = rag_context.standalone_query(f"  {FOLLOW_UP} ", f" {PREVIOUS} ", rewrite=rewrite)
    assert got == "Which scope does the nonlocal statement exclude?"
    assert asked == [(FOLLOW_UP, PREVIOUS)]  # both stripped


def test_a_blank_rewrite_keeps_the_rules_query():
    def blank(message, previous):
        return "  "

    assert rag_context.standalone_query(FOLLOW_UP, PREVIOUS, rewrite=blank) == f"{PREVIOUS} {FOLLOW_UP}"
    assert rag_context.standalone_query(FOLLOW_UP, PREVIOUS) == f"{PREVIOUS} {FOLLOW_UP}"
    assert rag_context.is_follow_up("and its default?") and rag_context.is_follow_up("It was what, again, in the end?")
    assert not rag_context.is_follow_up("Which names are left out by from module import star?")


def test_clean_takes_one_line_without_labels_or_quotes_and_refuses_rambles():
    assert clean(' "Which scope does nonlocal exclude?"\nMore text', FOLLOW_UP, PREVIOUS) == (
        "Which scope does nonlocal exclude?"
    )
    assert clean("Standalone question: What is X?", FOLLOW_UP, PREVIOUS) == "What is X?"
    assert clean("\n\n  \n", FOLLOW_UP, PREVIOUS) is None
    assert clean("“”", FOLLOW_UP, PREVIOUS) is None
    assert clean("word " * 60, FOLLOW_UP, PREVIOUS) is None  # longer than both questions together


def test_the_prompt_ends_with_the_follow_up_after_worked_examples():
    messages = rewrite_messages(FOLLOW_UP, PREVIOUS)
    assert messages[0]["role"] == "system"
    assert [m["role"] for m in messages[1:]] == ["user", "assistant"] * len(EXAMPLES) + ["user"]
    assert messages[-1]["content"].startswith(f"Previous question: {PREVIOUS}\nFollow-up question: {FOLLOW_UP}")
    assert all("nonlocal" not in m["content"] for m in messages[:-1])  # no example names an evaluation topic


@pytest.fixture(scope="module")
def engine(tmp_path_factory, default_model_home):
    mp = pytest.MonkeyPatch()
    mp.setenv("CHATKV_HOME", str(default_model_home(tmp_path_factory.mktemp("home"))))
    from chatkv import Engine

    e = Engine.from_pretrained()
    yield e
    e.close()
    mp.undo()


@pytest.fixture(scope="module")
def topics_kb(tmp_path_factory):
    from pydoc_data.topics import topics

    from chatkv.retrieval import Embedder, KnowledgeBase

    kb = KnowledgeBase.open("topics", data_dir=tmp_path_factory.mktemp("kb"), embedder=Embedder())
    names = ["nonlocal", "global", "lambda"]
    kb.add_texts([topics[n] for n in names], sources=names)
    yield kb
    kb.close()


def test_the_packaged_model_rewrites_a_follow_up_into_a_query_that_finds_its_topic(engine, topics_kb):
    rewrite = model_rewriter(engine)
    out = rewrite(FOLLOW_UP, PREVIOUS)
    assert isinstance(out, str) and "\n" not in out
    assert len(engine.tokenizer(out)["input_ids"]) <= MAX_TOKENS
    assert rewrite(FOLLOW_UP, PREVIOUS) == out  # greedy: the same rewrite every time
    query = rag_context.standalone_query(FOLLOW_UP, PREVIOUS, rewrite=rewrite)
    assert query == (out or f"{PREVIOUS} {FOLLOW_UP}")
    assert topics_kb.search(query, k=1)[0].source == "nonlocal"


def test_the_followup_table_scores_each_way_of_searching(topics_kb):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from rag_followup_eval import HEADERS, followup_rows

    sets = {
        "follow-ups": [(FOLLOW_UP, PREVIOUS, ["nonlocal"])],
        "control": [("How are anonymous functions made with lambda expressions?", PREVIOUS, ["lambda"])],
    }
    rows, seconds = followup_rows(topics_kb, sets, rewrite=lambda m, p: "Which scope does nonlocal exclude?")
    assert len(seconds) == 1  # asked for the follow-up only
    assert all(len(r) == len(HEADERS) for r in rows)
    by = {(r[0], r[1]): r[3] for r in rows}
    assert by[("rule (default)", "follow-ups")].startswith("1 ")
    assert by[("rule + SmolLM2-135M rewrite", "follow-ups")].startswith("1 ")
    assert by[("rule (default)", "control")].startswith("1 ") and by[("message alone", "control")].startswith("1 ")
