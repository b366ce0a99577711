"""A user's words as a full-text query: the one place that turns typed text into SQLite FTS5
syntax (knowledge-base chunks, migration 0002; conversation messages, migration 0006) or into
plain words for the ``LIKE`` fallback other databases use. Nothing typed is ever read as FTS5
syntax or as a ``LIKE`` pattern."""

from __future__ import annotations

import re
from typing import Optional

MAX_QUERY_TERMS = 32
MAX_TERM_CHARS = 64
_WORD = re.compile(r"[^\W_]+")  # letters and digits: what FTS5's unicode61 tokenizer keeps
# Dropped from lexical queries when a query has other words (they match nearly every chunk).
STOPWORDS = frozenset(
    """a an and are as at be been but by can could did do does doing for from had has have how i if in
    into is it its me my no not of on or our should so than that the their them then there these they
    this to was we were what when where which while who whom why will with would you your""".split()
)


def query_words(query: str) -> list[str]:
    """The distinct words of ``query`` (lower case, at most ``MAX_QUERY_TERMS``); common English
    words dropped unless the query has nothing else."""
    words: list[str] = []
    for w in _WORD.findall(query.lower()):
        if len(w) <= MAX_TERM_CHARS and w not in words:
            words.append(w)
    return ([w for w in words if w not in STOPWORDS] or words)[:MAX_QUERY_TERMS]


def fts_query(query: str) -> Optional[str]:
    """An FTS5 MATCH expression for a user's words, or None when it has none.

    Each word (a run of letters/digits, at most ``MAX_TERM_CHARS`` long) is quoted
    and the words are OR-ed, so BM25 ranks rows by how many of the rarer words
    they hold; common English words are dropped unless the query has nothing else.
    """
    words = query_words(query)
    return " OR ".join(f'"{w}"' for w in words) if words else None  # a word holds no '"'


def like_pattern(word: str) -> str:
    """``%word%`` for ``LIKE ... ESCAPE '\\'``, with the word's own ``%``, ``_`` and ``\\`` escaped."""
    return "%" + word.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
