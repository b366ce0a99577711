"""knowledge bases: knowledge_bases, kb_documents, kb_chunks, and (SQLite) the FTS5 index

Revision ID: 0002
Revises: 0001
Create Date: 2025-02-01 00:00:00

Written out in full, like 0001. On SQLite it also creates ``kb_chunks_fts``, an
FTS5 table over ``kb_chunks.text`` with external content (``content='kb_chunks'``,
rowid = chunk id: the text is stored once, in kb_chunks), and three triggers that
write it in the same statement, hence the same transaction, as the chunk rows: an
insert indexes the new text, a delete (also one cascaded from its document or its
knowledge base) removes exactly the old text, an update of the text does both. So
the lexical index can never be out of step with the chunks. The tokenizer is
``porter unicode61 remove_diacritics 2`` (stemmed, case- and accent-folded words).
Other databases get no lexical index (see chatkv.storage.knowledge).
"""

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0002"
down_revision: Union[str, Sequence[str], None] = "0001"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

FTS_SQL = (
    "CREATE VIRTUAL TABLE kb_chunks_fts USING fts5("
    "text, content='kb_chunks', content_rowid='id', "
    "tokenize='porter unicode61 remove_diacritics 2')",
    "CREATE TRIGGER kb_chunks_fts_insert AFTER INSERT ON kb_chunks BEGIN "
    "INSERT INTO kb_chunks_fts(rowid, text) VALUES (new.id, new.text); END",
    "CREATE TRIGGER kb_chunks_fts_delete AFTER DELETE ON kb_chunks BEGIN "
    "INSERT INTO kb_chunks_fts(kb_chunks_fts, rowid, text) VALUES ('delete', old.id, old.text); END",
    "CREATE TRIGGER kb_chunks_fts_update AFTER UPDATE OF text ON kb_chunks BEGIN "
    "INSERT INTO kb_chunks_fts(kb_chunks_fts, rowid, text) VALUES ('delete', old.id, old.text); "
    "INSERT INTO kb_chunks_fts(rowid, text) VALUES (new.id, new.text); END",
)


def upgrade() -> None:
    op.create_table(
        "knowledge_bases",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("uid", sa.String(32), nullable=False),
        sa.Column("tenant", sa.String(255), server_default="", nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("embedding_model", sa.String(255), nullable=False),
        sa.Column("embedding_dim", sa.Integer(), nullable=False),
        sa.Column("revision", sa.Integer(), server_default="0", nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_knowledge_bases")),
        sa.UniqueConstraint("uid", name=op.f("uq_knowledge_bases_uid")),
        sa.UniqueConstraint("tenant", "name", name=op.f("uq_knowledge_bases_tenant_name")),
        sqlite_autoincrement=True,
    )

    op.create_table(
        "kb_documents",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("kb_id", sa.Integer(), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("content_hash", sa.String(128), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["kb_id"], ["knowledge_bases.id"], name=op.f("fk_kb_documents_kb_id_knowledge_bases"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_kb_documents")),
        sa.UniqueConstraint("kb_id", "source", name=op.f("uq_kb_documents_kb_id_source")),
        sqlite_autoincrement=True,
    )

    op.create_table(
        "kb_chunks",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("document_id", sa.Integer(), nullable=False),
        sa.Column("ordinal", sa.Integer(), nullable=False),
        sa.Column("char_start", sa.Integer(), nullable=False),
        sa.Column("char_end", sa.Integer(), nullable=False),
        sa.Column("heading", sa.Text(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("token_count", sa.Integer(), nullable=False),
        sa.Column("embedding", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["document_id"], ["kb_documents.id"], name=op.f("fk_kb_chunks_document_id_kb_documents"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_kb_chunks")),
        sqlite_autoincrement=True,
    )
    op.create_index(op.f("ix_kb_chunks_document_id"), "kb_chunks", ["document_id"])

    if op.get_bind().dialect.name == "sqlite":
        for statement in FTS_SQL:
            op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        for trigger in ("kb_chunks_fts_update", "kb_chunks_fts_delete", "kb_chunks_fts_insert"):
            op.execute(f"DROP TRIGGER IF EXISTS {trigger}")
        op.execute("DROP TABLE IF EXISTS kb_chunks_fts")
    op.drop_table("kb_chunks")
    op.drop_table("kb_documents")
    op.drop_table("knowledge_bases")
