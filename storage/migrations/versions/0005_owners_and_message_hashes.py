"""conversation owners and message integrity hashes: conversations.owner, messages.content_hash

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 12:00:00

``conversations.owner`` is the user a conversation belongs to: ``chatkv serve`` with several
API keys makes each key a user, and another user's conversation is unknown to it. The app and
the SDK are the one local user, ``"local"``; every conversation that exists at the upgrade
becomes the local user's (the server default), so nothing already saved changes hands.

``messages.content_hash`` is sha256(role + "\\n" + UTF-8 text) of each message, written with
the message. A message whose text was edited behind the store's back (the same length
included) no longer matches it, which a resume tells (``chatkv.sessions.manager``): the
conversation's KV is then recomputed from the stored text. The upgrade computes it for every
existing row, reading the text as bytes so that a row whose bytes are not valid UTF-8 does not
stop the upgrade (its hash is of those bytes: it will be reported as changed). The formula is
written out here rather than imported, so this revision keeps meaning what it meant.
"""

import hashlib
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: Union[str, Sequence[str], None] = "0004"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

BATCH = 1000


def upgrade() -> None:
    op.add_column("conversations", sa.Column("owner", sa.String(255), server_default="local", nullable=False))
    op.create_index(op.f("ix_conversations_owner"), "conversations", ["owner"])
    op.add_column("messages", sa.Column("content_hash", sa.String(64), nullable=True))
    messages = sa.table(
        "messages",
        sa.column("id", sa.Integer()),
        sa.column("role", sa.String()),
        sa.column("content", sa.Text()),
        sa.column("content_hash", sa.String()),
    )
    conn = op.get_bind()
    last = 0
    while True:  # in batches of ids, so a large history is not held in memory at once
        rows = conn.execute(
            sa.select(messages.c.id, messages.c.role, sa.cast(messages.c.content, sa.LargeBinary))
            .where(messages.c.id > last)
            .order_by(messages.c.id)
            .limit(BATCH)
        ).all()
        if not rows:
            break
        conn.execute(
            messages.update()
            .where(messages.c.id == sa.bindparam("row_id"))
            .values(content_hash=sa.bindparam("digest")),
            [
                {"row_id": i, "digest": hashlib.sha256(role.encode() + b"\n" + bytes(text or b"")).hexdigest()}
                for i, role, text in rows
            ],
        )
        last = rows[-1][0]


def downgrade() -> None:
    # plain DROP COLUMN (SQLite >= 3.35), as in 0003: batch mode would recreate the tables
    op.drop_column("messages", "content_hash")
    op.drop_index(op.f("ix_conversations_owner"), table_name="conversations")
    op.drop_column("conversations", "owner")
