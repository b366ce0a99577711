"""The conversation database's ORM schema (SQLAlchemy 2, portable SQL only).

Three tables: ``conversations``, their ``messages`` and at most one current
``kv_snapshots`` row per conversation. Deleting a conversation cascades to both
in the database itself (``ON DELETE CASCADE``; SQLite needs ``foreign_keys=ON``,
which :mod:`chatkv.storage.db` sets on every connection).

Timestamps are stored as naive UTC (microseconds) and come back timezone-aware
UTC; token histories are stored as little-endian uint32 bytes. These ORM
classes never leave :mod:`chatkv.storage.repository`, which hands out plain
dataclasses instead.

Any change here needs a new Alembic revision in ``migrations/versions`` (and
``migrations.HEAD`` bumped); a test compares the migrated schema with this one.
"""

from __future__ import annotations

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
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

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
    title: Mapped[str] = mapped_column(Text, default="")
    model: Mapped[str] = mapped_column(Text, default="")
    system_prompt: Mapped[str] = mapped_column(Text, default="")
    params: Mapped[dict] = mapped_column(JSON, default=dict)
    token_ids: Mapped[list[int]] = mapped_column(TokenIds, default=list)
    token_count: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    archived: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())

    messages: Mapped[list[Message]] = relationship(
        back_populates="conversation", passive_deletes=True, order_by="Message.id"
    )
    snapshot: Mapped[Optional[KVSnapshot]] = relationship(
        back_populates="conversation", passive_deletes=True
    )


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
    computed_tokens: Mapped[Optional[int]] = mapped_column(Integer)
    generated_tokens: Mapped[Optional[int]] = mapped_column(Integer)
    ttft_ms: Mapped[Optional[float]] = mapped_column(Float)
    tokens_per_s: Mapped[Optional[float]] = mapped_column(Float)
    meta: Mapped[Optional[dict]] = mapped_column(JSON(none_as_null=True))

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
