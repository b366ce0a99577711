"""The conversation database's ORM schema (SQLAlchemy 2, portable SQL only).

Four tables: ``conversations`` (each with its ``owner``, migration 0005, and its
``current_leaf_id``, 0006), their ``messages`` (each with its ``content_hash``, and since 0006
its ``parent_id``: messages form a tree, see ``chatkv.storage.message_tree``), at most one current
``kv_snapshots`` row per conversation, and at most one ``conversation_leases`` row (the
process generating its turn now, migration 0004). Deleting a conversation cascades to
the others in the database itself (``ON DELETE CASCADE``; SQLite needs ``foreign_keys=ON``,
which :mod:`chatkv.storage.db` sets on every connection).

Knowledge bases (retrieval) add three more: ``knowledge_bases``, their
``kb_documents`` and the documents' ``kb_chunks`` (text, offsets, heading and the
embedding as little-endian float32 bytes). A chunk's id is its id in the FAISS
index; chunk and document ids are never reused (``AUTOINCREMENT``) and a chunk row
is never updated, only deleted and replaced, so an index holding exactly the
database's chunk ids holds exactly its vectors. On SQLite, migration 0002 also
creates the FTS5 table :data:`FTS_TABLE` over ``kb_chunks.text`` (external
content) and the triggers that keep it in step; it is not an ORM model (see
:mod:`chatkv.storage.knowledge`).

Timestamps are stored as naive UTC (microseconds) and come back timezone-aware
UTC; token histories are stored as little-endian uint32 bytes. These ORM
classes never leave :mod:`chatkv.storage.repository`, which hands out plain
dataclasses instead.

Any change here needs a new Alembic revision in ``migrations/versions`` (and
``migrations.HEAD`` bumped); a test compares the migrated schema with this one.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from datetime import datetime, timezone
from typing import Any, Optional

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

from chatkv.storage.paths import LOCAL_USER  # noqa: F401 - the owner of the app's and the SDK's conversations


def message_hash(role: str, content: str) -> str:
    """The integrity hash of a message: sha256 of its role, a newline and its UTF-8 text
    (migration 0005 computes the same for the rows it upgrades)."""
    return hashlib.sha256(role.encode() + b"\n" + content.encode("utf-8", "surrogatepass")).hexdigest()


# Named constraints keep future migrations (and SQLite batch mode) deterministic.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator):
    """A datetime stored as naive UTC, returned timezone-aware (UTC).

    Naive values given to it are taken to be UTC already.
    """

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: Optional[datetime], dialect: Any) -> Optional[datetime]:
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(timezone.utc).replace(tzinfo=None)
        return value

    def process_result_value(self, value: Optional[datetime], dialect: Any) -> Optional[datetime]:
        if value is not None:
            value = value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)
        return value


class TokenIds(TypeDecorator):
    """``list[int]`` stored compactly as little-endian uint32 bytes (4 bytes a token)."""

    impl = LargeBinary
    cache_ok = True

    def process_bind_param(self, value: Optional[list[int]], dialect: Any) -> Optional[bytes]:
        if value is None:
            return None
        arr = array("I", value)  # raises OverflowError for negatives or ids >= 2**32
        if sys.byteorder == "big":
            arr.byteswap()
        return arr.tobytes()

    def process_result_value(self, value: Optional[bytes], dialect: Any) -> Optional[list[int]]:
        if value is None:
            return None
        arr = array("I")
        arr.frombytes(bytes(value))
        if sys.byteorder == "big":
            arr.byteswap()
        return arr.tolist()


assert array("I").itemsize == 4, "TokenIds needs a 4-byte unsigned int array type"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Conversation(Base):
    __tablename__ = "conversations"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(255), default="", server_default="", index=True)
    # the user the conversation belongs to (migration 0005): "local" for the app and the SDK,
    # a ``chatkv serve`` API key's user name otherwise; another user's conversation is unknown
    owner: Mapped[str] = mapped_column(String(255), default=LOCAL_USER, server_default=LOCAL_USER, index=True)
    title: Mapped[str] = mapped_column(Text, default="")
    model: Mapped[str] = mapped_column(Text, default="")
    system_prompt: Mapped[str] = mapped_column(Text, default="")
    params: Mapped[dict] = mapped_column(JSON, default=dict)
    token_ids: Mapped[list[int]] = mapped_column(TokenIds, default=list)
    token_count: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    archived: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # what the KV window holds when the history outgrew the context (chatkv.sessions.context_window);
    # None: the whole history. Written in the same transaction as token_ids.
    context: Mapped[Optional[dict]] = mapped_column(JSON(none_as_null=True))
    # the message whose branch the conversation is now (migration 0006; None: no message yet).
    # Not a foreign key: the store checks it, and a conversation's delete takes its messages.
    current_leaf_id: Mapped[Optional[int]] = mapped_column(Integer)

    messages: Mapped[list[Message]] = relationship(
        back_populates="conversation", passive_deletes=True, order_by="Message.id"
    )
    snapshot: Mapped[Optional[KVSnapshot]] = relationship(back_populates="conversation", passive_deletes=True)


class Message(Base):
    __tablename__ = "messages"
    __table_args__ = {"sqlite_autoincrement": True}  # never reuse the id of a deleted message

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    conversation_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("conversations.id", ondelete="CASCADE"), index=True
    )
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    status: Mapped[str] = mapped_column(String(16), default="complete")
    prompt_tokens: Mapped[Optional[int]] = mapped_column(Integer)
    cached_tokens: Mapped[Optional[int]] = mapped_column(Integer)
    restored_tokens: Mapped[Optional[int]] = mapped_column(Integer)
    host_tokens: Mapped[Optional[int]] = mapped_column(Integer)
    computed_tokens: Mapped[Optional[int]] = mapped_column(Integer)
    generated_tokens: Mapped[Optional[int]] = mapped_column(Integer)
    proposed_tokens: Mapped[Optional[int]] = mapped_column(Integer)  # speculative decoding, migration 0006
    accepted_tokens: Mapped[Optional[int]] = mapped_column(Integer)
    reused_tokens: Mapped[Optional[int]] = mapped_column(Integer)  # chunk KV reuse, migration 0007
    recomputed_tokens: Mapped[Optional[int]] = mapped_column(Integer)
    ttft_ms: Mapped[Optional[float]] = mapped_column(Float)
    tokens_per_s: Mapped[Optional[float]] = mapped_column(Float)
    meta: Mapped[Optional[dict]] = mapped_column(JSON(none_as_null=True))
    # sha256 of role and text (``message_hash``), written with the message (migration 0005): a
    # message whose text was changed behind the store's back is told at resume
    content_hash: Mapped[Optional[str]] = mapped_column(String(64))
    # the tree (migration 0006): the message this one follows (None: a first message), and the
    # branch's token history as of this message, delta-encoded against the parent's: keep
    # ``token_base`` of its tokens, then ``token_tail`` (None: this message carried no history,
    # the parent's holds); ``context``: the KV window's state with that history
    parent_id: Mapped[Optional[int]] = mapped_column(Integer, index=True)
    token_base: Mapped[Optional[int]] = mapped_column(Integer)
    token_tail: Mapped[Optional[list[int]]] = mapped_column(TokenIds)
    context: Mapped[Optional[dict]] = mapped_column(JSON(none_as_null=True))

    conversation: Mapped[Conversation] = relationship(back_populates="messages")


class KVSnapshot(Base):
    __tablename__ = "kv_snapshots"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    conversation_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("conversations.id", ondelete="CASCADE"), unique=True
    )
    file: Mapped[str] = mapped_column(String(255))
    model_fingerprint: Mapped[str] = mapped_column(String(128))
    kv_dtype: Mapped[str] = mapped_column(String(32))
    token_count: Mapped[int] = mapped_column(Integer)
    token_hash: Mapped[str] = mapped_column(String(128))
    nbytes: Mapped[int] = mapped_column("bytes", BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    last_used_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)

    conversation: Mapped[Conversation] = relationship(back_populates="snapshot")


class ConversationLease(Base):
    """Which process may write a conversation's turns now (see :mod:`chatkv.storage.leases`):
    one row while a process generates a turn, deleted on release and with the conversation."""

    __tablename__ = "conversation_leases"

    conversation_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("conversations.id", ondelete="CASCADE"), primary_key=True
    )
    owner: Mapped[str] = mapped_column(String(255))  # host/pid/nonce: one Store in one process
    machine: Mapped[str] = mapped_column(String(255))  # hostname|boot id|pid namespace: where ``pid`` means something
    pid: Mapped[int] = mapped_column(Integer)
    pid_start: Mapped[Optional[int]] = mapped_column(BigInteger)  # the process's start time (clock ticks since boot)
    acquired_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)


# ---------------------------------------------------------------- knowledge bases

# The SQLite FTS5 table over kb_chunks.text, created by migration 0002 (with its
# shadow tables FTS_TABLE_*), outside these models; the schema comparison skips it.
FTS_TABLE = "kb_chunks_fts"
# The same over messages.content (migration 0006): search across conversations.
MESSAGES_FTS = "messages_fts"


class KnowledgeBase(Base):
    __tablename__ = "knowledge_bases"
    __table_args__ = (
        UniqueConstraint("tenant", "name", name="uq_knowledge_bases_tenant_name"),
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    # random hex; names the KB's index files, so an index can never be taken for another KB's
    uid: Mapped[str] = mapped_column(String(32), unique=True)
    tenant: Mapped[str] = mapped_column(String(255), default="", server_default="")
    name: Mapped[str] = mapped_column(String(64))
    embedding_model: Mapped[str] = mapped_column(String(255))
    embedding_dim: Mapped[int] = mapped_column(Integer)
    # bumped by every write to the KB's documents: an open KB re-syncs its index when it moved
    revision: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)

    documents: Mapped[list[KBDocument]] = relationship(back_populates="kb", passive_deletes=True)


class KBDocument(Base):
    __tablename__ = "kb_documents"
    __table_args__ = (
        UniqueConstraint("kb_id", "source", name="uq_kb_documents_kb_id_source"),
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    kb_id: Mapped[int] = mapped_column(Integer, ForeignKey("knowledge_bases.id", ondelete="CASCADE"))
    source: Mapped[str] = mapped_column(Text)
    kind: Mapped[str] = mapped_column(String(32))
    content_hash: Mapped[str] = mapped_column(String(128))
    meta: Mapped[dict] = mapped_column("metadata", JSON, default=dict)
    text: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)

    kb: Mapped[KnowledgeBase] = relationship(back_populates="documents")
    chunks: Mapped[list[KBChunk]] = relationship(
        back_populates="document", passive_deletes=True, order_by="KBChunk.ordinal"
    )


class KBChunk(Base):
    __tablename__ = "kb_chunks"
    __table_args__ = {"sqlite_autoincrement": True}  # the FAISS id: never reused

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    document_id: Mapped[int] = mapped_column(Integer, ForeignKey("kb_documents.id", ondelete="CASCADE"), index=True)
    ordinal: Mapped[int] = mapped_column(Integer)
    start: Mapped[int] = mapped_column("char_start", Integer)  # character offsets in the document's text
    end: Mapped[int] = mapped_column("char_end", Integer)
    heading: Mapped[str] = mapped_column(Text, default="")
    text: Mapped[str] = mapped_column(Text)
    token_count: Mapped[int] = mapped_column(Integer)
    embedding: Mapped[bytes] = mapped_column(LargeBinary)  # little-endian float32, embedding_dim values

    document: Mapped[KBDocument] = relationship(back_populates="chunks")
