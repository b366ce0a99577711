"""conversations as trees: messages.parent_id, per-message token history, conversations.current_leaf_id

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 15:00:00

A conversation's messages form a tree: each message names its ``parent_id`` (None for
a first message), and ``conversations.current_leaf_id`` is the message whose branch is the
conversation now. Editing or regenerating adds a sibling; nothing is ever deleted by branching.

Each message may carry the token history of its branch as of that message, delta-encoded
against its parent's: ``token_base`` tokens of the parent's history are kept, then
``token_tail`` follows (see ``chatkv.storage.message_tree``). A message that carried none
(NULL, as every message from before this revision) leaves its parent's history unchanged;
``context`` is the KV window's state with that history (None: unknown or the whole history).
So the canonical tokens of any branch are derived from its messages without re-tokenising;
``conversations.token_ids`` stays the current branch's.

The upgrade turns every existing linear history into a parent chain, in id order (the order
the store always listed them in), and makes each conversation's newest message its current
leaf; its token history stays in ``conversations.token_ids``. ``parent_id`` and
``current_leaf_id`` are plain integers, not foreign keys (the store checks them, and a
conversation's delete takes its messages with it), so SQLite adds them with ALTER TABLE.

Replies also record speculative decoding's counts: ``proposed_tokens`` drafted, of which
``accepted_tokens`` were generated (NULL before this revision).

On SQLite it also creates ``messages_fts``, an FTS5 index over ``messages.content`` kept in
step by triggers (search across conversations), and fills it from the messages already there.
"""

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: Union[str, Sequence[str], None] = "0005"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

BATCH = 1000
# SQLite: an FTS5 index over messages.content (external content), kept in step by triggers
# as the knowledge base's is (0002), for search across conversations; filled from the rows
# already there. Other databases search with LIKE (chatkv.storage.message_search).
FTS_SQL = (
    "CREATE VIRTUAL TABLE messages_fts USING fts5("
    "content, content='messages', content_rowid='id', "
    "tokenize='porter unicode61 remove_diacritics 2')",
    "CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN "
    "INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END",
    "CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN "
    "INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content); END",
    "CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages BEGIN "
    "INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content); "
    "INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END",
    "INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')",
)


def upgrade() -> None:
    op.add_column("messages", sa.Column("parent_id", sa.Integer(), nullable=True))
    op.add_column("messages", sa.Column("token_base", sa.Integer(), nullable=True))
    op.add_column("messages", sa.Column("token_tail", sa.LargeBinary(), nullable=True))
    op.add_column("messages", sa.Column("context", sa.JSON(), nullable=True))
    # speculative decoding's counts of a reply: tokens drafted, and of those generated
    op.add_column("messages", sa.Column("proposed_tokens", sa.Integer(), nullable=True))
    op.add_column("messages", sa.Column("accepted_tokens", sa.Integer(), nullable=True))
    op.create_index(op.f("ix_messages_parent_id"), "messages", ["parent_id"])
    op.add_column("conversations", sa.Column("current_leaf_id", sa.Integer(), nullable=True))
    messages = sa.table(
        "messages",
        sa.column("id", sa.Integer()),
        sa.column("conversation_id", sa.String()),
        sa.column("parent_id", sa.Integer()),
    )
    conversations = sa.table("conversations", sa.column("id", sa.String()), sa.column("current_leaf_id", sa.Integer()))
    conn = op.get_bind()
    last_id, last_of = 0, {}  # conversation -> its newest message so far (ids only grow)
    while True:  # in batches of ids, so a large history is not held in memory at once
        rows = conn.execute(
            sa.select(messages.c.id, messages.c.conversation_id)
            .where(messages.c.id > last_id)
            .order_by(messages.c.id)
            .limit(BATCH)
        ).all()
        if not rows:
            break
        links = []
        for mid, conv in rows:
            if conv in last_of:
                links.append({"row_id": mid, "parent": last_of[conv]})
            last_of[conv] = mid
        if links:
            conn.execute(
                messages.update()
                .where(messages.c.id == sa.bindparam("row_id"))
                .values(parent_id=sa.bindparam("parent")),
                links,
            )
        last_id = rows[-1][0]
    if conn.dialect.name == "sqlite":
        for statement in FTS_SQL:
            op.execute(statement)
    if last_of:
        conn.execute(
            conversations.update()
            .where(conversations.c.id == sa.bindparam("conv"))
            .values(current_leaf_id=sa.bindparam("leaf")),
            [{"conv": c, "leaf": m} for c, m in last_of.items()],
        )


def downgrade() -> None:
    # plain DROP COLUMN (SQLite >= 3.35), as in 0003 and 0005. The branches other than the
    # current one become messages of one flat list again (the store before 0006 lists them all).
    if op.get_bind().dialect.name == "sqlite":
        for trigger in ("messages_fts_update", "messages_fts_delete", "messages_fts_insert"):
            op.execute(f"DROP TRIGGER IF EXISTS {trigger}")
        op.execute("DROP TABLE IF EXISTS messages_fts")
    op.drop_column("conversations", "current_leaf_id")
    op.drop_index(op.f("ix_messages_parent_id"), table_name="messages")
    op.drop_column("messages", "accepted_tokens")
    op.drop_column("messages", "proposed_tokens")
    op.drop_column("messages", "context")
    op.drop_column("messages", "token_tail")
    op.drop_column("messages", "token_base")
    op.drop_column("messages", "parent_id")
