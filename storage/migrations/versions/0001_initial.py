"""initial schema: conversations, messages, kv_snapshots

Revision ID: 0001
Revises:
Create Date: 2025-01-01 00:00:00

Written out in full with plain SQLAlchemy types (not ``Base.metadata.create_all``)
so that later model changes never alter what this revision creates. Timestamps
are naive UTC ``DateTime`` and ``token_ids`` is ``LargeBinary`` (little-endian
uint32), as ``models.UTCDateTime`` and ``models.TokenIds`` read and write them.
"""

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0001"
down_revision: Union[str, Sequence[str], None] = None
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        "conversations",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(255), server_default="", nullable=False),
        sa.Column("title", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("system_prompt", sa.Text(), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("token_ids", sa.LargeBinary(), nullable=False),
        sa.Column("token_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.Column("archived", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_conversations")),
    )
    op.create_index(op.f("ix_conversations_tenant"), "conversations", ["tenant"])
    op.create_index(op.f("ix_conversations_updated_at"), "conversations", ["updated_at"])

    op.create_table(
        "messages",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("conversation_id", sa.String(64), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("content", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("cached_tokens", sa.Integer(), nullable=True),
        sa.Column("restored_tokens", sa.Integer(), nullable=True),
        sa.Column("computed_tokens", sa.Integer(), nullable=True),
        sa.Column("generated_tokens", sa.Integer(), nullable=True),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("tokens_per_s", sa.Float(), nullable=True),
        sa.Column("meta", sa.JSON(none_as_null=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["conversation_id"],
            ["conversations.id"],
            name=op.f("fk_messages_conversation_id_conversations"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_messages")),
        sqlite_autoincrement=True,
    )
    op.create_index(op.f("ix_messages_conversation_id"), "messages", ["conversation_id"])

    op.create_table(
        "kv_snapshots",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("conversation_id", sa.String(64), nullable=False),
        sa.Column("file", sa.String(255), nullable=False),
        sa.Column("model_fingerprint", sa.String(128), nullable=False),
        sa.Column("kv_dtype", sa.String(32), nullable=False),
        sa.Column("token_count", sa.Integer(), nullable=False),
        sa.Column("token_hash", sa.String(128), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("last_used_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["conversation_id"],
            ["conversations.id"],
            name=op.f("fk_kv_snapshots_conversation_id_conversations"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_kv_snapshots")),
        sa.UniqueConstraint("conversation_id", name=op.f("uq_kv_snapshots_conversation_id")),
    )
    op.create_index(op.f("ix_kv_snapshots_last_used_at"), "kv_snapshots", ["last_used_at"])


def downgrade() -> None:
    op.drop_table("kv_snapshots")
    op.drop_table("messages")
    op.drop_table("conversations")
