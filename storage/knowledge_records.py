"""What the knowledge-base store hands out and accepts: plain frozen records of knowledge
bases, documents and chunks (never ORM objects), and the check of a knowledge base's name.
Used by ``chatkv.storage.knowledge.KnowledgeStore``, which re-exports them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from chatkv.errors import InvalidRequest

KB_NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")


# ---------------------------------------------------------------- plain data


@dataclass(frozen=True)
class KBInfo:
    id: int
    uid: str
    tenant: str
    name: str
    embedding_model: str
    embedding_dim: int
    revision: int
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class DocumentInfo:
    id: int
    source: str
    kind: str
    content_hash: str
    metadata: dict[str, Any]
    chars: int
    chunks: int
    tokens: int
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class ChunkRecord:
    id: int
    document_id: int
    source: str
    ordinal: int
    start: int
    end: int
    heading: str
    text: str
    token_count: int
    metadata: dict[str, Any]  # the document's


@dataclass(frozen=True)
class NewChunk:
    """A chunk to store: ``embedding`` is the vector as little-endian float32 bytes."""

    ordinal: int
    start: int
    end: int
    heading: str
    text: str
    token_count: int
    embedding: bytes


@dataclass(frozen=True)
class WriteResult:
    document_id: int
    status: str  # "added", "updated" or "removed"
    added_ids: tuple[int, ...]  # the new chunks' ids, in ordinal order
    removed_ids: tuple[int, ...]  # the replaced (or removed) chunks' ids
    revision: int  # the KB's revision after this write


def check_kb_name(name: object) -> str:
    """``name`` if it is 1-64 characters of ``[A-Za-z0-9_.-]`` and not only dots, else InvalidRequest."""
    if not isinstance(name, str) or not KB_NAME_PATTERN.fullmatch(name) or set(name) == {"."}:
        raise InvalidRequest(
            f"invalid knowledge base name {name!r}: it must be 1-64 characters of A-Z, a-z, 0-9, "
            "'_', '.' or '-', and not only dots"
        )
    return name
