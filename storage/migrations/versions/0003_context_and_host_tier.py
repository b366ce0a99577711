"""context window state and host-tier usage: conversations.context, messages.host_tokens

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 00:00:00

``conversations.context`` (JSON, NULL = the KV holds the whole history) records what a
conversation's KV window keeps once its history outgrew the context: the overflow
policy, the sink length, the tokens and turns dropped so far, and where each kept turn
starts. It is written in the same transaction as ``token_ids``.
``messages.host_tokens`` counts the prompt tokens copied back from the host-memory tier.
Both columns are nullable, so the upgrade is two ``ADD COLUMN`` statements on any database.
"""

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: Union[str, Sequence[str], None] = "0002"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column("conversations", sa.Column("context", sa.JSON(none_as_null=True), nullable=True))
    op.add_column("messages", sa.Column("host_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    # plain DROP COLUMN (SQLite >= 3.35): batch mode would recreate the tables on SQLite, and
    # dropping the old conversations table with foreign keys on cascades to every message
    op.drop_column("messages", "host_tokens")
    op.drop_column("conversations", "context")
