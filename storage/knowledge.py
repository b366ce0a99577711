"""The knowledge-base store: knowledge bases, their documents and chunks, and the
lexical (full-text) index over the chunks. The source of truth for retrieval.

It is over 400 lines as one repository over three tables and the FTS5 index: its
methods are short queries sharing the transaction rules below (the plain records
live in ``knowledge_records.py``).

``KnowledgeStore`` is the only way chatkv.retrieval touches these tables. Contracts:

- it hands out plain frozen records (``KBInfo``, ``DocumentInfo``, ``ChunkRecord``,
  ``WriteResult``), never ORM objects; their dict fields are copies;
- every write is one transaction, committed before the method returns; replacing a
  document (its row, the deletion of its old chunks, the insertion of the new ones
  and their full-text entries) is all-or-nothing, so a process killed mid-ingest
  leaves each document either wholly old or wholly new;
- chunk rows are never updated, only deleted and inserted, and ids are never
  reused (``AUTOINCREMENT``): a dense index holding exactly the KB's chunk ids
  holds exactly its current vectors;
- each write to a KB's documents bumps the KB's ``revision``, so a process can see
  cheaply that another one changed the KB;
- database trouble raises ``StorageError`` naming what is wrong; bad values raise
  ``InvalidRequest``.

Lexical index: SQLite FTS5, not bm25s. The FTS5 table (migration 0002) is inside
the database that holds the chunks, written by triggers in the same transaction as
the chunk rows, so it can never be out of step with them: a crash, a killed ingest
or a cascade delete leaves both consistent with nothing to rebuild or verify. It is
on disk and incremental (adding one document does not rewrite the index, unlike a
bm25s index that is saved whole), needs no extra dependency (FTS5 ships with
Python's sqlite3) and ranks with BM25 (``bm25()``) too. The cost: it exists only on
SQLite. On another database (PostgreSQL) ``has_lexical`` is False and
``lexical_search`` raises; the knowledge base then serves dense search only (and
says so once in the log). FTS5's BM25 statistics (document frequencies) are taken
over every knowledge base in the database, not the one searched: a small effect on
scores, none on which chunks match.

User queries never reach FTS5's query syntax: ``fts_query`` keeps only the words
(letters and digits), quotes each one and joins them with OR, so operators,
quotes, ``*``, parentheses or column filters typed by a user are plain words or
nothing.
"""

from __future__ import annotations

import json
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from sqlalchemy import Engine, delete, func, select, text, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, defer

from chatkv.errors import InvalidRequest, StorageError
from chatkv.storage import db
from chatkv.storage.fts import fts_query  # shared with message search (a user's words as FTS5 syntax)
from chatkv.storage.knowledge_records import (
    KB_NAME_PATTERN,
    ChunkRecord,
    DocumentInfo,
    KBInfo,
    NewChunk,
    WriteResult,
    check_kb_name,
)
from chatkv.storage.models import FTS_TABLE, KBChunk, KBDocument
from chatkv.storage.models import KnowledgeBase as KBRow
from chatkv.storage.records import check_json, check_str
from chatkv.storage.repository import CLOCK, Store

__all__ = [
    "KnowledgeStore",
    "KBInfo",
    "DocumentInfo",
    "ChunkRecord",
    "NewChunk",
    "WriteResult",
    "KB_NAME_PATTERN",
    "check_kb_name",
    "fts_query",
]

# ---------------------------------------------------------------- the store


class KnowledgeStore:
    """Knowledge bases in the chatkv database. ``KnowledgeStore.open()``; ``close()``."""

    def __init__(self, engine: Engine, owns_engine: bool = False) -> None:
        self.engine = engine
        self._owns_engine = owns_engine
        self._read = db.read_sessions(engine)
        self._write = db.write_sessions(engine)
        self._closed = False
        self.where = db.describe(engine.url.render_as_string(hide_password=False))
        self.has_lexical = engine.dialect.name == "sqlite" and self._has_fts_table()

    @classmethod
    def open(cls, url: Optional[str] = None, data_dir: Optional[Path] = None) -> KnowledgeStore:
        """Open (creating and migrating as needed) the database, as ``Store.open`` does;
        raises StorageError when it cannot be used."""
        store = Store.open(url=url, data_dir=data_dir)
        try:
            return cls(store.engine, owns_engine=True)
        except BaseException:
            store.close()
            raise

    def close(self) -> None:
        self._closed = True
        if self._owns_engine:
            self.engine.dispose()

    def _has_fts_table(self) -> bool:
        with self._guard("look for the full-text index"), self.engine.connect() as conn:
            found = conn.execute(
                text("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = :n"), {"n": FTS_TABLE}
            ).first()
        return found is not None

    # ---------------------------------------------------------------- plumbing

    @contextmanager
    def _guard(self, doing: str) -> Iterator[None]:
        """Turn a database error into StorageError naming the database and what failed."""
        try:
            yield
        except SQLAlchemyError as e:
            raise StorageError(f"cannot {doing} in the database {self.where}: {db.explain(e, self.where)}") from e

    @contextmanager
    def _reading(self, doing: str) -> Iterator[Session]:
        if self._closed:
            raise StorageError("the knowledge store is closed")
        with self._guard(doing), self._read() as s:
            yield s

    @contextmanager
    def _writing(self, doing: str) -> Iterator[Session]:
        """A write Session in one transaction, committed on success, rolled back on error."""
        if self._closed:
            raise StorageError("the knowledge store is closed")
        with self._guard(doing), self._write.begin() as s:
            yield s

    @staticmethod
    def _kb_info(row: KBRow) -> KBInfo:
        return KBInfo(
            id=row.id,
            uid=row.uid,
            tenant=row.tenant,
            name=row.name,
            embedding_model=row.embedding_model,
            embedding_dim=row.embedding_dim,
            revision=row.revision,
            created_at=row.created_at,
            updated_at=row.updated_at,
        )

    @staticmethod
    def _touch(s: Session, kb_id: int) -> int:
        """Bump the KB's revision (in the caller's transaction); returns the new one."""
        s.execute(update(KBRow).where(KBRow.id == kb_id).values(revision=KBRow.revision + 1, updated_at=CLOCK.now()))
        revision = s.scalar(select(KBRow.revision).where(KBRow.id == kb_id))
        if revision is None:
            raise InvalidRequest(f"knowledge base {kb_id} no longer exists (deleted by another process?)")
        return revision

    # ---------------------------------------------------------------- knowledge bases

    def get_kb(self, name: str, tenant: str = "") -> Optional[KBInfo]:
        check_kb_name(name)
        check_str("tenant", tenant, 255)
        with self._reading(f"read knowledge base {name!r}") as s:
            row = s.scalar(select(KBRow).where(KBRow.tenant == tenant, KBRow.name == name))
            return None if row is None else self._kb_info(row)

    def create_kb(self, name: str, embedding_model: str, embedding_dim: int, tenant: str = "") -> KBInfo:
        """Create the knowledge base, or return it if it exists (whatever its model)."""
        check_kb_name(name)
        check_str("tenant", tenant, 255)
        check_str("embedding model", embedding_model, 255)
        if isinstance(embedding_dim, bool) or not isinstance(embedding_dim, int) or embedding_dim <= 0:
            raise InvalidRequest(f"embedding_dim must be a positive int, got {embedding_dim!r}")
        try:
            with self._writing(f"create knowledge base {name!r}") as s:
                row = s.scalar(select(KBRow).where(KBRow.tenant == tenant, KBRow.name == name))
                if row is None:
                    now = CLOCK.now()
                    row = KBRow(
                        uid=secrets.token_hex(16),
                        tenant=tenant,
                        name=name,
                        embedding_model=embedding_model,
                        embedding_dim=embedding_dim,
                        revision=0,
                        created_at=now,
                        updated_at=now,
                    )
                    s.add(row)
                    s.flush()
                return self._kb_info(row)
        except StorageError as e:
            if isinstance(e.__cause__, IntegrityError):  # created meanwhile by another process
                found = self.get_kb(name, tenant)
                if found is not None:
                    return found
            raise

    def list_kbs(self, tenant: Optional[str] = "") -> list[KBInfo]:
        """Knowledge bases by name (of ``tenant``; every tenant's when None)."""
        q = select(KBRow).order_by(KBRow.tenant, KBRow.name)
        if tenant is not None:
            q = q.where(KBRow.tenant == tenant)
        with self._reading("list knowledge bases") as s:
            return [self._kb_info(r) for r in s.scalars(q)]

    def delete_kb(self, kb_id: int) -> bool:
        """Delete a knowledge base with its documents, chunks and full-text entries."""
        with self._writing("delete a knowledge base") as s:
            return s.execute(delete(KBRow).where(KBRow.id == kb_id)).rowcount > 0

    def revision(self, kb_id: int) -> Optional[int]:
        """The KB's revision (None if it was deleted)."""
        with self._reading("read a knowledge base's revision") as s:
            return s.scalar(select(KBRow.revision).where(KBRow.id == kb_id))

    # ---------------------------------------------------------------- documents

    def document_hashes(self, kb_id: int) -> dict[str, tuple[str, dict[str, Any]]]:
        """source -> (content_hash, metadata) for every document of the KB."""
        q = select(KBDocument.source, KBDocument.content_hash, KBDocument.meta).where(KBDocument.kb_id == kb_id)
        with self._reading("read document hashes") as s:
            return {src: (h, json.loads(json.dumps(meta or {}))) for src, h, meta in s.execute(q)}

    def put_document(
        self,
        kb_id: int,
        source: str,
        kind: str,
        content_hash: str,
        metadata: dict[str, Any],
        text_: str,
        chunks: Sequence[NewChunk],
        embedding_dim: int,
    ) -> WriteResult:
        """Add the document, or replace it (row, chunks, full-text entries) if ``source``
        is already in the KB: one transaction."""
        check_str("source", source)
        check_str("kind", kind, 32)
        check_str("content_hash", content_hash, 128)
        metadata = check_json("metadata", metadata if metadata is not None else {})
        if not isinstance(metadata, dict):
            raise InvalidRequest(f"metadata must be a dict, got {type(metadata).__name__}")
        for c in chunks:
            if len(c.embedding) != 4 * embedding_dim:
                raise InvalidRequest(
                    f"chunk {c.ordinal} of {source!r} has a {len(c.embedding)}-byte embedding; "
                    f"the knowledge base holds {embedding_dim}-dim float32 vectors ({4 * embedding_dim} bytes)"
                )
        with self._writing(f"store document {source!r}") as s:
            now = CLOCK.now()
            doc = s.scalar(
                select(KBDocument)
                .where(KBDocument.kb_id == kb_id, KBDocument.source == source)
                .options(defer(KBDocument.text))
            )
            removed: tuple[int, ...] = ()
            if doc is None:
                status = "added"
                doc = KBDocument(kb_id=kb_id, source=source, created_at=now)
                s.add(doc)
            else:
                status = "updated"
                removed = tuple(s.scalars(select(KBChunk.id).where(KBChunk.document_id == doc.id).order_by(KBChunk.id)))
                # the delete trigger removes their full-text entries in this same transaction
                s.execute(delete(KBChunk).where(KBChunk.document_id == doc.id))
            doc.kind = kind
            doc.content_hash = content_hash
            doc.meta = metadata
            doc.text = text_
            doc.updated_at = now
            s.flush()
            rows = [
                KBChunk(
                    document_id=doc.id,
                    ordinal=c.ordinal,
                    start=c.start,
                    end=c.end,
                    heading=c.heading,
                    text=c.text,
                    token_count=c.token_count,
                    embedding=bytes(c.embedding),
                )
                for c in chunks
            ]
            s.add_all(rows)
            s.flush()
            revision = self._touch(s, kb_id)
            return WriteResult(doc.id, status, tuple(r.id for r in rows), removed, revision)

    def set_metadata(self, kb_id: int, source: str, metadata: dict[str, Any]) -> Optional[int]:
        """Replace a document's metadata (its chunks stay); returns the KB's new revision,
        or None if there is no such document."""
        metadata = check_json("metadata", metadata)
        if not isinstance(metadata, dict):
            raise InvalidRequest(f"metadata must be a dict, got {type(metadata).__name__}")
        with self._writing(f"update the metadata of {source!r}") as s:
            n = s.execute(
                update(KBDocument)
                .where(KBDocument.kb_id == kb_id, KBDocument.source == source)
                .values(meta=metadata, updated_at=CLOCK.now())
            ).rowcount
            return self._touch(s, kb_id) if n else None

    def remove_document(self, kb_id: int, source: str) -> Optional[WriteResult]:
        """Delete a document with its chunks and full-text entries (status "removed",
        ``removed_ids`` its chunks), or None if the KB has no such document."""
        with self._writing(f"remove document {source!r}") as s:
            doc_id = s.scalar(select(KBDocument.id).where(KBDocument.kb_id == kb_id, KBDocument.source == source))
            if doc_id is None:
                return None
            ids = tuple(s.scalars(select(KBChunk.id).where(KBChunk.document_id == doc_id).order_by(KBChunk.id)))
            s.execute(delete(KBDocument).where(KBDocument.id == doc_id))  # cascades to chunks, then FTS (trigger)
            return WriteResult(doc_id, "removed", (), ids, self._touch(s, kb_id))

    def document_index(self, kb_id: int) -> list[tuple[int, str, dict[str, Any]]]:
        """(id, source, metadata) of every document of the KB, by source: what filters read."""
        q = select(KBDocument.id, KBDocument.source, KBDocument.meta).where(KBDocument.kb_id == kb_id)
        with self._reading("list documents") as s:
            rows = [
                (i, src, json.loads(json.dumps(meta or {})))
                for i, src, meta in s.execute(q.order_by(KBDocument.source))
            ]
        return rows

    def documents(self, kb_id: int) -> list[DocumentInfo]:
        """The KB's documents, by source."""
        counts = (
            select(
                KBChunk.document_id,
                func.count(KBChunk.id).label("n"),
                func.coalesce(func.sum(KBChunk.token_count), 0).label("tokens"),
            )
            .group_by(KBChunk.document_id)
            .subquery()
        )
        q = (
            select(
                KBDocument.id,
                KBDocument.source,
                KBDocument.kind,
                KBDocument.content_hash,
                KBDocument.meta,
                func.length(KBDocument.text),
                counts.c.n,
                counts.c.tokens,
                KBDocument.created_at,
                KBDocument.updated_at,
            )
            .outerjoin(counts, counts.c.document_id == KBDocument.id)
            .where(KBDocument.kb_id == kb_id)
            .order_by(KBDocument.source)
        )
        with self._reading("list documents") as s:
            return [
                DocumentInfo(
                    id=r[0],
                    source=r[1],
                    kind=r[2],
                    content_hash=r[3],
                    metadata=json.loads(json.dumps(r[4] or {})),
                    chars=int(r[5] or 0),
                    chunks=int(r[6] or 0),
                    tokens=int(r[7] or 0),
                    created_at=r[8],
                    updated_at=r[9],
                )
                for r in s.execute(q)
            ]

    # ---------------------------------------------------------------- chunks

    def chunk_ids(self, kb_id: int) -> list[int]:
        """Every chunk id of the KB, ascending."""
        q = (
            select(KBChunk.id)
            .join(KBDocument, KBDocument.id == KBChunk.document_id)
            .where(KBDocument.kb_id == kb_id)
            .order_by(KBChunk.id)
        )
        with self._reading("list chunk ids") as s:
            return list(s.scalars(q))

    def chunk_ids_of_documents(self, document_ids: Sequence[int]) -> list[int]:
        """The chunk ids of these documents, ascending."""
        out: list[int] = []
        docs = sorted(set(int(i) for i in document_ids))
        for i in range(0, len(docs), 500):
            q = select(KBChunk.id).where(KBChunk.document_id.in_(docs[i : i + 500]))
            with self._reading("list chunk ids") as s:
                out += list(s.scalars(q))
        return sorted(out)

    def embeddings(self, kb_id: int, batch: int = 4096) -> Iterator[list[tuple[int, bytes]]]:
        """The KB's (chunk id, embedding bytes), ascending id, in lists of up to ``batch``."""
        last = 0
        while True:
            q = (
                select(KBChunk.id, KBChunk.embedding)
                .join(KBDocument, KBDocument.id == KBChunk.document_id)
                .where(KBDocument.kb_id == kb_id, KBChunk.id > last)
                .order_by(KBChunk.id)
                .limit(batch)
            )
            with self._reading("read embeddings") as s:
                rows = [(int(i), bytes(e)) for i, e in s.execute(q)]
            if not rows:
                return
            yield rows
            last = rows[-1][0]

    def embeddings_of(self, ids: Sequence[int]) -> list[tuple[int, bytes]]:
        """(chunk id, embedding bytes) for the given ids that exist, ascending id."""
        out: list[tuple[int, bytes]] = []
        ids = sorted(set(int(i) for i in ids))
        for i in range(0, len(ids), 500):
            q = select(KBChunk.id, KBChunk.embedding).where(KBChunk.id.in_(ids[i : i + 500])).order_by(KBChunk.id)
            with self._reading("read embeddings") as s:
                out += [(int(c), bytes(e)) for c, e in s.execute(q)]
        return out

    def _chunk_query(self):
        return select(
            KBChunk.id,
            KBChunk.document_id,
            KBDocument.source,
            KBChunk.ordinal,
            KBChunk.start,
            KBChunk.end,
            KBChunk.heading,
            KBChunk.text,
            KBChunk.token_count,
            KBDocument.meta,
        ).join(KBDocument, KBDocument.id == KBChunk.document_id)

    @staticmethod
    def _record(r) -> ChunkRecord:
        return ChunkRecord(
            id=r[0],
            document_id=r[1],
            source=r[2],
            ordinal=r[3],
            start=r[4],
            end=r[5],
            heading=r[6] or "",
            text=r[7],
            token_count=r[8],
            metadata=json.loads(json.dumps(r[9] or {})),
        )

    def chunks(self, kb_id: int, ids: Sequence[int]) -> dict[int, ChunkRecord]:
        """The KB's chunks with the given ids (ids of other KBs or gone are left out)."""
        out: dict[int, ChunkRecord] = {}
        ids = sorted(set(int(i) for i in ids))
        for i in range(0, len(ids), 500):
            q = self._chunk_query().where(KBDocument.kb_id == kb_id, KBChunk.id.in_(ids[i : i + 500]))
            with self._reading("read chunks") as s:
                for r in s.execute(q):
                    out[r[0]] = self._record(r)
        return out

    def chunks_of(self, kb_id: int, source: str) -> list[ChunkRecord]:
        """A document's chunks in ordinal order (empty if there is no such document)."""
        q = self._chunk_query().where(KBDocument.kb_id == kb_id, KBDocument.source == source).order_by(KBChunk.ordinal)
        with self._reading(f"read the chunks of {source!r}") as s:
            return [self._record(r) for r in s.execute(q)]

    def stats(self, kb_id: int) -> dict[str, int]:
        """documents, chunks, tokens (chunk tokens), chars (document text), embedding_bytes."""
        with self._reading("count a knowledge base") as s:
            docs, chars = s.execute(
                select(func.count(KBDocument.id), func.coalesce(func.sum(func.length(KBDocument.text)), 0)).where(
                    KBDocument.kb_id == kb_id
                )
            ).one()
            chunks, tokens, nbytes = s.execute(
                select(
                    func.count(KBChunk.id),
                    func.coalesce(func.sum(KBChunk.token_count), 0),
                    func.coalesce(func.sum(func.length(KBChunk.embedding)), 0),
                )
                .join(KBDocument, KBDocument.id == KBChunk.document_id)
                .where(KBDocument.kb_id == kb_id)
            ).one()
        return {
            "documents": int(docs),
            "chunks": int(chunks),
            "tokens": int(tokens),
            "chars": int(chars),
            "embedding_bytes": int(nbytes),
        }

    # ---------------------------------------------------------------- lexical index

    def lexical_search(
        self, kb_id: int, query: str, limit: int, document_ids: Optional[Sequence[int]] = None
    ) -> list[tuple[int, float]]:
        """(chunk id, score) of the KB's chunks matching ``query``'s words, best first
        (score = -bm25, higher is better; ties by id). ``document_ids`` restricts to
        those documents. Raises StorageError where there is no lexical index."""
        if not self.has_lexical:
            raise StorageError(f"the database {self.where} has no full-text index (it is not SQLite)")
        match = fts_query(query)
        if match is None or limit <= 0 or (document_ids is not None and not document_ids):
            return []
        sql = (
            f"SELECT f.rowid, bm25({FTS_TABLE}) AS score FROM {FTS_TABLE} AS f "
            "JOIN kb_chunks AS c ON c.id = f.rowid JOIN kb_documents AS d ON d.id = c.document_id "
            f"WHERE {FTS_TABLE} MATCH :q AND d.kb_id = :kb"
        )
        params: dict[str, Any] = {"q": match, "kb": kb_id, "n": int(limit)}
        if document_ids is not None:
            sql += " AND c.document_id IN (SELECT value FROM json_each(:docs))"
            params["docs"] = json.dumps(sorted(int(i) for i in document_ids))
        sql += " ORDER BY score, f.rowid LIMIT :n"
        with self._reading("search the full-text index") as s:
            return [(int(i), -float(score)) for i, score in s.execute(text(sql), params)]

    def lexical_entries(self) -> int:
        """How many chunks the full-text index holds, over every KB (its docsize rows)."""
        if not self.has_lexical:
            return 0
        with self._reading("count the full-text index") as s:
            return int(s.scalar(text(f"SELECT count(*) FROM {FTS_TABLE}_docsize")))

    def lexical_integrity_check(self) -> None:
        """Raise StorageError unless the full-text index matches the chunk rows exactly
        (FTS5 'integrity-check' against its content table). Reads every chunk: slow on a
        large database, meant for tests and diagnostics."""
        if not self.has_lexical:
            return
        with self._writing("check the full-text index") as s:
            s.execute(text(f"INSERT INTO {FTS_TABLE}({FTS_TABLE}, rank) VALUES ('integrity-check', 1)"))
