"""RAG context for a session's turns: pinned documents, retrieved sources, citations.

Where the text goes (chosen so that KV is shared, see docs/how-to/rag.md, "RAG and the KV cache"):

- **Pinned documents** are part of the system message, right after the system prompt,
  in the order given (their chunks in ordinal order). Every session with the same system
  prompt and documents renders the same first tokens, so their KV is one radix-tree path,
  pinned while any such session is open, and saved in each session's snapshot.
- **Retrieved sources** open the user message of their turn, numbered ``[1]..[n]`` in a
  canonical order (document, then ordinal), before the question. The conversation's
  history is never re-rendered, so it stays a prefix from turn to turn; two sessions
  whose first turns retrieve the same chunks share that KV too (the question comes
  after them). Later turns of different sessions share only what precedes their
  histories: the system prompt and pinned documents.

Follow-up questions ("and its default?") are made standalone by a simple rule, not the
model: a message of at most ``FOLLOW_UP_WORDS`` words, or one starting with a
connective or a pronoun, is searched together with the previous user message. With
``rewrite`` (``chatkv.rag.rewrite.model_rewriter``: the chat model restates the follow-up), a
message the rule takes for a follow-up is searched as the model's standalone question instead; it
is an option, off unless given, because the packaged 135M model's rewrites retrieve no better than
the rule and cost a generation each (figures in chatkv/rag/rewrite.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

from chatkv.errors import InvalidRequest

FOLLOW_UP_WORDS = 6
_FOLLOW_UP_START = re.compile(
    r"^(and|but|or|so|also|what about|how about|then|it|its|it's|they|their|them|this|that|these|those|he|she|"
    r"his|her|why|how come)\b",
    re.IGNORECASE,
)
_CITATION = re.compile(r"\[(\d{1,3})\]")
INSTRUCTION = "Answer the question using the sources above when they help, and cite them as [n]."


@dataclass(frozen=True)
class Source:
    """A retrieved chunk as the reply lists it: its number in the prompt and whether the reply cited it."""

    number: int
    cited: bool
    text: str
    source: str
    chunk_id: int
    heading: str
    score: float
    start: int
    end: int

    def as_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def is_follow_up(message: str) -> bool:
    """The rule: at most ``FOLLOW_UP_WORDS`` words, or a start with a connective or a pronoun."""
    text = message.strip()
    return len(text.split()) <= FOLLOW_UP_WORDS or bool(_FOLLOW_UP_START.match(text))


def standalone_query(
    message: str, previous_user_message: str | None, rewrite: Callable[[str, str], str] | None = None
) -> str:
    """The text to search for: the message, with the previous one for a short follow-up.

    ``rewrite(message, previous_user_message)``, when given, is asked only for a message the rule
    takes for a follow-up; its answer is the query unless it is blank, in which case the rule's
    joined text is."""
    text = message.strip()
    if not previous_user_message or not is_follow_up(text):
        return text
    joined = f"{previous_user_message.strip()} {text}"
    if rewrite is not None:
        return rewrite(text, previous_user_message.strip()).strip() or joined
    return joined


def canonical(hits: Sequence) -> list:
    """Hits in document order (document id, then ordinal): the same chunks give the same tokens."""
    return sorted(hits, key=lambda h: (h.document_id, h.ordinal))


def source_texts(hits: Sequence) -> list[str]:
    """The sources' texts as ``sources_block`` quotes them after their numbers (chunk KV's texts)."""
    from chatkv.retrieval.ingest import quoted_chunk

    return [quoted_chunk(h) for h in hits]


def sources_block(hits: Sequence) -> str:
    from chatkv.retrieval.ingest import quoted_chunk  # here: the retrieval package loads only for RAG

    parts = [f"[{i}] {quoted_chunk(h)}" for i, h in enumerate(hits, 1)]
    return "Sources:\n" + "\n\n".join(parts)


def user_message(question: str, hits: Sequence) -> str:
    """The user message of a RAG turn: the numbered sources, the instruction, then the question."""
    if not hits:
        return question
    return f"{sources_block(hits)}\n\n{INSTRUCTION}\nQuestion: {question}"


def fit_sources(question: str, hits: Sequence, fits: Callable[[str], bool]) -> tuple[str, list]:
    """Drop the lowest-ranked hits (``hits`` best first), then shorten the last one kept, until
    ``fits(message)``; returns the message and the hits it holds, in canonical order. The
    question alone is returned when no source fits."""
    ranked = list(hits)
    while ranked:
        kept = canonical(ranked)
        msg = user_message(question, kept)
        if fits(msg):
            return msg, kept
        if len(ranked) == 1:  # shorten the only one left, by halves, before giving up on it
            h = ranked[0]
            text = h.text
            while len(text) > 200:
                text = text[: len(text) // 2]
                trimmed = _with_text(h, text.rstrip() + " ...")
                msg = user_message(question, [trimmed])
                if fits(msg):
                    return msg, [trimmed]
        ranked.pop()  # the lowest-ranked one goes
    return question, []


def _with_text(hit, text: str):
    from dataclasses import replace

    return replace(hit, text=text, end=hit.start + len(text))


def sources_of(reply_text: str, hits: Sequence) -> list[Source]:
    """The reply's sources: every hit of the prompt, numbered as there, marked cited if ``[n]`` appears."""
    cited = {int(n) for n in _CITATION.findall(reply_text)}
    return [
        Source(i, i in cited, h.text, h.source, h.chunk_id, h.heading, float(h.score), h.start, h.end)
        for i, h in enumerate(hits, 1)
    ]


def pinned_texts(documents: Sequence[tuple[str, Sequence]]) -> list[str]:
    """The pinned documents' texts as ``documents_block`` writes them (chunk KV's texts)."""
    from chatkv.retrieval.ingest import quoted_document

    return [quoted_document(source, chunks) for source, chunks in documents if chunks]


def documents_block(system: str | None, documents: Sequence[tuple[str, Sequence]]) -> str | None:
    """The system message with pinned documents after the system prompt: ``documents`` is
    ``(source, chunks in ordinal order)`` pairs in the order given."""
    if not documents:
        return system
    from chatkv.retrieval.ingest import quoted_document

    parts = []
    for source, chunks in documents:
        if not chunks:
            raise InvalidRequest(f"pinned document '{source}' is not in the knowledge base")
        parts.append(quoted_document(source, chunks))
    head = (system.strip() + "\n\n") if system else ""
    return head + "The following documents are available:\n\n" + "\n\n".join(parts)
