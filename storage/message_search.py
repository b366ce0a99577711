"""Search across conversations: the messages whose text holds a user's words.

On SQLite it reads the FTS5 index ``messages_fts`` (migration 0006, kept in step with the
messages by triggers) and ranks by BM25, then recency. Elsewhere (PostgreSQL), or on a SQLite
built without FTS5, it falls back to ``LIKE`` (case-insensitive): the messages holding any of
the words, those holding more of them first, then the newest.
Either way it sees every branch of a conversation, and only the conversations of the given
owner and tenant. Used only by ``chatkv.storage.repository.Store.search``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sqlalchemy import Float, Integer, and_, case, column, func, literal, or_, select, text
from sqlalchemy.orm import Session

from chatkv.storage.fts import fts_query, like_pattern, query_words
from chatkv.storage.models import MESSAGES_FTS, Conversation, Message
from chatkv.storage.records import MessageInfo, message_info

SNIPPET_CHARS = 120


@dataclass(frozen=True)
class SearchHit:
    """One message that matched: its conversation, the message itself, and a short excerpt
    around the first word found (plain text, no markup)."""

    conversation_id: str
    title: str
    message: MessageInfo
    snippet: str


def has_fts(s: Session) -> bool:
    if s.bind.dialect.name != "sqlite":
        return False
    return (
        s.execute(text("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = :n"), {"n": MESSAGES_FTS}).first()
        is not None
    )


def search(s: Session, query: str, owner: str, tenant: Optional[str], limit: int) -> list[SearchHit]:
    words = query_words(query)
    if not words:
        return []
    scope = [Conversation.owner == owner] + ([Conversation.tenant == tenant] if tenant is not None else [])
    q = select(Message, Conversation.title).join(Conversation, Message.conversation_id == Conversation.id)
    if has_fts(s):
        ranked = (
            text(f"SELECT rowid AS id, bm25({MESSAGES_FTS}) AS score FROM {MESSAGES_FTS} WHERE {MESSAGES_FTS} MATCH :q")
            .bindparams(q=fts_query(query))
            .columns(column("id", Integer), column("score", Float))
            .subquery()
        )
        q = q.join(ranked, ranked.c.id == Message.id).where(*scope).order_by(ranked.c.score, Message.id.desc())
    else:
        like = [func.lower(Message.content).like(like_pattern(w), escape="\\") for w in words]
        held = sum((case((w, 1), else_=0) for w in like), literal(0))  # how many of the words it holds
        q = q.where(and_(*scope, or_(*like))).order_by(held.desc(), Message.id.desc())
    return [
        SearchHit(m.conversation_id, title, message_info(m), snippet(m.content, words))
        for m, title in s.execute(q.limit(limit))
    ]


def snippet(content: str, words: list[str], width: int = SNIPPET_CHARS) -> str:
    """About ``width`` characters of ``content`` around the first of ``words`` found (its
    start when none is found as typed: a stemmed match), on one line."""
    flat = " ".join(content.split())
    low = flat.lower()
    at = min((i for i in (low.find(w) for w in words) if i >= 0), default=0)
    start = max(0, at - width // 3)
    out = flat[start : start + width]
    return ("…" if start else "") + out + ("…" if start + width < len(flat) else "")
