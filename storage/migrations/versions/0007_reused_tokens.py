"""chunk KV reuse on replies: messages.reused_tokens, messages.recomputed_tokens

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 22:00:00

A RAG reply records what chunk KV reuse did to its prompt (``rag_kv_reuse``):
``reused_tokens`` source (and pinned-document) tokens placed from their chunk KV, not computed,
and ``recomputed_tokens`` of them recomputed over it (counted in ``computed_tokens`` too). NULL
for every message from before this revision; 0 for a reply that reused nothing. Both columns
are nullable, so the upgrade is two ``ADD COLUMN`` statements on any database.
"""

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: Union[str, Sequence[str], None] = "0006"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column("messages", sa.Column("reused_tokens", sa.Integer(), nullable=True))
    op.add_column("messages", sa.Column("recomputed_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    # plain DROP COLUMN (SQLite >= 3.35), as 0003's: batch mode would recreate the table
    op.drop_column("messages", "recomputed_tokens")
    op.drop_column("messages", "reused_tokens")
