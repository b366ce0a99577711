"""conversation leases: conversation_leases

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 12:00:00

One row per conversation that a process is generating a turn of (``chatkv.storage.leases``):
the owner (host/pid/nonce), the machine identity and pid (with its start time) that let
another process on the same machine tell a dead holder, when it was taken and when it
expires. Deleted with its conversation (``ON DELETE CASCADE``). A new table only, so the
upgrade is one ``CREATE TABLE`` on any database; an upgraded database holds no leases.
Plain SQLAlchemy types, as in 0001: timestamps are naive UTC ``DateTime``.
"""

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: Union[str, Sequence[str], None] = "0003"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        "conversation_leases",
        sa.Column("conversation_id", sa.String(64), nullable=False),
        sa.Column("owner", sa.String(255), nullable=False),
        sa.Column("machine", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("pid_start", sa.BigInteger(), nullable=True),
        sa.Column("acquired_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["conversation_id"],
            ["conversations.id"],
            ondelete="CASCADE",
            name=op.f("fk_conversation_leases_conversation_id_conversations"),
        ),
        sa.PrimaryKeyConstraint("conversation_id", name=op.f("pk_conversation_leases")),
    )


def downgrade() -> None:
    op.drop_table("conversation_leases")
