"""Knowledge bases: ingest files and texts, search them densely, lexically or both.

A ``KnowledgeBase`` is a named set of documents in the chatkv database (any
SQLAlchemy URL; SQLite by default), for one tenant. Contracts:

- The database is the source of truth: documents, chunks, their text, offsets,
  headings, metadata and embeddings (float32 bytes; nothing is pickled). The
  lexical index (SQLite FTS5) lives in the same database and is written by the
  same transactions (see chatkv.storage.knowledge). The dense index (FAISS, see
  dense_index.py) is derived: ``<data_dir>/kb/<name>/<uid>.faiss`` plus a JSON
  sidecar, ``uid`` being the KB's random id (so a KB deleted and created again, or
  another tenant's KB of the same name, never takes this one's file).
- On open the dense index is loaded and checked against the database (whole, same
  KB and model, exactly the database's chunk ids). A missing, damaged or stale one
  is rebuilt from the stored embeddings (no re-embedding), logged, and written back.
- Ingest (``add``, ``add_texts``): each file is discovered, loaded, chunked by
  tokens of the embedding model (at most min(256, the model's limit) tokens, 32
  overlapping) and embedded in batches; then written to the database in one
  transaction per document, so a process killed mid-ingest leaves every document
  wholly old or wholly new. A file whose content hash is unchanged is not embedded
  again; a changed one replaces its chunks (old vectors leave the index, old text
  leaves the FTS index in the same transaction). One bad file is one ``FileError``
  in ``IngestReport.skipped``; the rest goes on. A file that cannot be ingested any
  more (emptied, damaged, unreadable) keeps its previous version in the KB (the
  error says so): nothing saved is lost to a bad read; ``remove`` drops it. After the database, the dense index
  is updated in memory and written atomically once per call; if the process dies
  before that, the next open finds it stale and rebuilds it.
- Search: ``mode="hybrid"`` (default) fuses the dense and the lexical rankings
  (each ``max(4k, 20)`` candidates) by reciprocal rank fusion, score = sum of
  1/(60 + rank); ``"dense"`` (score = cosine similarity) and ``"lexical"`` (score =
  -BM25) use one. On a database without FTS5 (not SQLite) hybrid is dense-only, with
  one logged warning, and lexical raises InvalidRequest. ``filters`` keep documents
  whose metadata equals each given value (a list, tuple or set value: any of them);
  the key ``"source"`` matches the document's source with a glob (fnmatch). Results
  are ordered by score, then chunk id, so they are reproducible.
- Another process writing the same KB bumps its revision in the database; every
  call here checks it (one small query) and brings the dense index back in step.
- Sources are what the loader names them (a file's resolved absolute path; the
  given name for texts). ``remove`` and ``chunks_of`` also accept a relative path
  or a unique trailing part of a source ("notes.md").

A KnowledgeBase is safe to share between threads (one lock).

This file is over 400 lines because the class is one unit: opening, ingest, removal
and search all keep the same invariant (the dense index holds exactly the
database's chunk ids at the revision it last saw) under one lock.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from chatkv.errors import ChatKVError, InvalidRequest, check_text
from chatkv.retrieval.dense_index import HNSW_THRESHOLD, DenseIndex, kind_for
from chatkv.retrieval.embedding import Embedder
from chatkv.storage import paths
from chatkv.storage.knowledge import (
    ChunkRecord,
    DocumentInfo,
    KBInfo,
    KnowledgeStore,
    NewChunk,
    WriteResult,
    check_kb_name,
)
from chatkv.retrieval.documents import Document, DocumentError, FileError, discover, document_from_text, load_file
from chatkv.retrieval.chunking import chunk_document

log = logging.getLogger(__name__)

MODES = ("hybrid", "dense", "lexical")
RRF_K = 60
MAX_K = 1000
CHUNK_TOKENS = 256
OVERLAP_TOKENS = 32
EMBED_GROUP = 256  # chunks embedded together before their documents are written


@dataclass(frozen=True)
class Hit:
    text: str
    score: float
    source: str
    chunk_id: int
    document_id: int
    ordinal: int
    start: int  # character offsets of ``text`` in the document's text
    end: int
    heading: str
    metadata: dict[str, Any]  # the document's


@dataclass
class IngestReport:
    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    skipped: list[FileError] = field(default_factory=list)
    chunks: int = 0  # chunks embedded and written by this call
    # parse: discover, load, chunk; embed: the model; index: database writes, FAISS, the index file
    seconds: dict[str, float] = field(default_factory=lambda: {"parse": 0.0, "embed": 0.0, "index": 0.0})

    def summary(self) -> str:
        s = self.seconds
        return (
            f"{len(self.added)} added, {len(self.updated)} updated, {len(self.unchanged)} unchanged, "
            f"{len(self.skipped)} skipped; {self.chunks} chunks "
            f"(parse {s['parse']:.1f} s, embed {s['embed']:.1f} s, index {s['index']:.1f} s)"
        )


def _hit(r: ChunkRecord, score: float) -> Hit:
    return Hit(r.text, float(score), r.source, r.id, r.document_id, r.ordinal, r.start, r.end, r.heading, r.metadata)


def rrf(rankings: Sequence[Sequence[int]], k: int = RRF_K) -> list[tuple[int, float]]:
    """Reciprocal rank fusion: (id, sum over rankings of 1/(k + rank)), best first, ties by id."""
    scores: dict[int, float] = {}
    for ranking in rankings:
        for rank, i in enumerate(ranking, 1):
            scores[i] = scores.get(i, 0.0) + 1.0 / (k + rank)
    return sorted(scores.items(), key=lambda x: (-x[1], x[0]))


@dataclass
class _Staged:
    doc: Document
    texts: list[str]  # what is embedded for each chunk
    chunks: list[NewChunk]  # embedding filled in after embedding


class KnowledgeBase:
    """A named knowledge base; ``KnowledgeBase.open(name)``. See the module docstring."""

    def __init__(
        self, store: KnowledgeStore, info: KBInfo, embedder: Embedder, index_dir: Path,
        hnsw_threshold: int = HNSW_THRESHOLD, owns_store: bool = True,
    ) -> None:
        self._store = store
        self._info = info
        self.embedder = embedder
        self.name = info.name
        self.tenant = info.tenant
        self.id = info.id
        self.index_dir = index_dir
        self.index_path = index_dir / f"{info.uid}.faiss"
        self.hnsw_threshold = hnsw_threshold
        self._owns_store = owns_store
        self._lock = threading.RLock()
        self._closed = False
        self._warned_no_lexical = False
        self._revision = -1
        self._rebuild_due = False  # a removal the index could not apply (HNSW): rebuild before use
        self.dense: DenseIndex = DenseIndex(info.embedding_dim)
        self._identity = {"kb": info.uid, "model": info.embedding_model}
        self._load_or_rebuild()

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(
        cls,
        name: str,
        data_dir: Optional[str | Path] = None,
        db_url: Optional[str] = None,
        embedder: Optional[Embedder] = None,
        tenant: str = "",
        create: bool = True,
        hnsw_threshold: int = HNSW_THRESHOLD,
    ) -> KnowledgeBase:
        """Open the knowledge base ``name`` (creating it unless ``create`` is False).

        ``data_dir`` defaults to ``chatkv.storage.paths.data_dir()``; the database to
        ``sqlite:///<data_dir>/chatkv.db``; ``embedder`` to ``Embedder()`` (the packaged
        MiniLM). A KB built with another embedding model is refused (its vectors would
        not compare). Raises InvalidRequest for a bad name or an unknown KB with
        ``create=False``, StorageError when the database cannot be used, ModelNotFound
        when the embedding model cannot be loaded.
        """
        check_kb_name(name)
        root = paths.data_dir(data_dir)
        store = KnowledgeStore.open(url=db_url, data_dir=root)
        try:
            info = store.get_kb(name, tenant)
            if info is None and not create:
                raise InvalidRequest(f"there is no knowledge base {name!r}" + (f" for tenant {tenant!r}" if tenant else ""))
            if embedder is None:
                embedder = Embedder()
            if info is None:
                info = store.create_kb(name, embedder.model_id, embedder.dim, tenant)
            if info.embedding_model != embedder.model_id or info.embedding_dim != embedder.dim:
                raise InvalidRequest(
                    f"knowledge base {name!r} was embedded with {info.embedding_model} ({info.embedding_dim} dims); "
                    f"this embedder is {embedder.model_id} ({embedder.dim} dims): open it with that model's directory "
                    "(embedder=Embedder(model_dir)), or ingest into a new knowledge base"
                )
            return cls(store, info, embedder, root / "kb" / name, hnsw_threshold)
        except BaseException:
            store.close()
            raise

    @staticmethod
    def names(data_dir: Optional[str | Path] = None, db_url: Optional[str] = None, tenant: str = "") -> list[str]:
        """The names of the tenant's knowledge bases, sorted."""
        store = KnowledgeStore.open(url=db_url, data_dir=paths.data_dir(data_dir))
        try:
            return [kb.name for kb in store.list_kbs(tenant)]
        finally:
            store.close()

    def _load_or_rebuild(self) -> None:
        """Take the index file if it matches the database, else rebuild it from the stored embeddings."""
        revision = self._store.revision(self.id)
        ids = self._store.chunk_ids(self.id)
        loaded = DenseIndex.load(self.index_path, ids, self._info.embedding_dim, self._identity)
        if loaded is not None:
            self.dense = loaded
        elif not ids:
            self.dense = DenseIndex(self._info.embedding_dim)  # nothing to rebuild: written at the first ingest
        else:
            log.warning(
                "knowledge base %r: rebuilding its dense index (%d chunks) from the embeddings in the database",
                self.name, len(ids),
            )
            self._rebuild()
            self._write_index()
        self._revision = revision if revision is not None else -1

    def _rebuild(self) -> None:
        """The dense index anew from the database's embeddings (reads them all; no embedding)."""
        self._rebuild_due = False
        ids: list[int] = []
        parts: list[np.ndarray] = []
        for rows in self._store.embeddings(self.id):
            ids += [i for i, _ in rows]
            parts.append(self._vectors([e for _, e in rows]))
        vecs = np.concatenate(parts) if parts else np.zeros((0, self._info.embedding_dim), np.float32)
        self.dense = DenseIndex.build(self._info.embedding_dim, ids, vecs, self.hnsw_threshold)

    def _vectors(self, blobs: Sequence[bytes]) -> np.ndarray:
        dim = self._info.embedding_dim
        bad = [len(b) for b in blobs if len(b) != 4 * dim]
        if bad:
            raise ChatKVError(f"knowledge base {self.name!r} holds an embedding of {bad[0]} bytes, not {4 * dim}")
        return np.frombuffer(b"".join(blobs), dtype="<f4").astype(np.float32, copy=False).reshape(len(blobs), dim)

    def _write_index(self) -> None:
        try:
            self.dense.write(self.index_path, self._identity)
        except OSError as e:  # the database has everything: the next open rebuilds
            log.warning("knowledge base %r: cannot write its dense index %s (%s); it will be rebuilt on open",
                        self.name, self.index_path, e)

    def _settle(self) -> None:
        """Rebuild the dense index if a removal could not be applied, or if it outgrew flat."""
        outgrown = self.dense.kind != kind_for(self.dense.ntotal, self.hnsw_threshold) and (
            self.dense.ntotal > self.hnsw_threshold
        )
        if self._rebuild_due or outgrown:
            self._rebuild()
            self._rebuild_due = False

    def _refresh(self) -> None:
        """Bring the dense index in step if another process changed the KB."""
        if self._closed:
            raise ChatKVError(f"knowledge base {self.name!r} is closed")
        revision = self._store.revision(self.id)
        if revision is None:
            raise ChatKVError(f"knowledge base {self.name!r} was deleted")
        if revision == self._revision:
            return
        db_ids = np.asarray(self._store.chunk_ids(self.id), dtype=np.int64)
        held = self.dense.ids()
        gone = np.setdiff1d(held, db_ids)
        new = np.setdiff1d(db_ids, held)
        if len(gone) and not self.dense.remove(gone):
            self._rebuild_due = True
        elif len(new):
            rows = self._store.embeddings_of(new.tolist())
            self.dense.add([i for i, _ in rows], self._vectors([e for _, e in rows]))
        self._settle()
        self._revision = revision

    def _applied(self, result: WriteResult) -> None:
        """Apply one of our own writes' removals to the dense index (the caller adds the new
        vectors unless the index is now due for a rebuild: HNSW cannot delete, so it is
        rebuilt once at the end of the call, by ``_settle``)."""
        if result.removed_ids and not self.dense.remove(result.removed_ids):
            self._rebuild_due = True
        if result.revision == self._revision + 1:
            self._revision = result.revision  # nobody else wrote in between
        # else: another process wrote too; the next _refresh() diffs the ids

    # ------------------------------------------------------------------ ingest

    def add(
        self,
        paths: str | Path | Iterable[str | Path],
        include: Optional[Sequence[str]] = None,
        exclude: Optional[Sequence[str]] = None,
        progress: bool = False,
    ) -> IngestReport:
        """Ingest files and directories (recursively; include/exclude globs). See the module docstring."""
        report = IngestReport()
        with self._lock:
            self._refresh()
            known = self._store.document_hashes(self.id)

            def skip(source: str, reason: str) -> None:
                if source in known:
                    reason += "; its previous version stays in the knowledge base"
                report.skipped.append(FileError(source, reason))

            def docs():
                t = time.perf_counter()
                for item in discover(paths, include=include, exclude=exclude):
                    if isinstance(item, FileError):
                        skip(item.source, item.reason)
                        continue
                    try:
                        doc = load_file(item)
                    except DocumentError as e:
                        skip(e.source, e.reason)
                        continue
                    except Exception as e:  # a loader bug or a library error must not stop the ingest
                        log.debug("loading %s failed", item, exc_info=True)
                        skip(str(item), f"cannot be loaded: {type(e).__name__}: {e}")
                        continue
                    report.seconds["parse"] += time.perf_counter() - t
                    yield doc, None
                    t = time.perf_counter()

            self._ingest(docs(), known, report, progress)
        return report

    def add_texts(
        self,
        texts: Sequence[str],
        sources: Optional[Sequence[str]] = None,
        metadata: Optional[dict[str, Any] | Sequence[Optional[dict[str, Any]]]] = None,
    ) -> IngestReport:
        """Ingest texts. ``sources`` names them (default ``text:<sha256 prefix>``, so the
        same text is the same document); ``metadata`` is one dict for all or one per text.
        A text's source works like a file's path: the same source with another text
        replaces it."""
        if isinstance(texts, str):
            raise InvalidRequest("add_texts() takes a list of texts, not one string")
        texts = list(texts)
        for t in texts:
            check_text("text", t)
        if sources is None:
            sources = ["text:" + hashlib.sha256(t.encode("utf-8")).hexdigest()[:16] for t in texts]
        else:
            if isinstance(sources, str):
                raise InvalidRequest("sources must be a list with one source per text")
            sources = [check_text("source", s) for s in sources]
            if len(sources) != len(texts):
                raise InvalidRequest(f"{len(sources)} sources for {len(texts)} texts")
            if any(not s.strip() for s in sources):
                raise InvalidRequest("a source is empty")
        dupes = sorted({s for s in sources if sources.count(s) > 1})
        if dupes:
            raise InvalidRequest(f"sources must be unique; repeated: {dupes[:5]}")
        if metadata is None or isinstance(metadata, dict):
            metas = [metadata] * len(texts)
        else:
            metas = list(metadata)
            if len(metas) != len(texts):
                raise InvalidRequest(f"{len(metas)} metadata dicts for {len(texts)} texts")
        for m in metas:
            if m is not None and not isinstance(m, dict):
                raise InvalidRequest(f"metadata must be a dict, got {type(m).__name__}")
        report = IngestReport()
        with self._lock:
            self._refresh()
            known = self._store.document_hashes(self.id)

            def docs():
                for text, source, meta in zip(texts, sources, metas):
                    t = time.perf_counter()
                    try:
                        doc = document_from_text(text, source, metadata=dict(meta or {}))
                    except DocumentError as e:
                        report.skipped.append(FileError(e.source, e.reason))
                        continue
                    report.seconds["parse"] += time.perf_counter() - t
                    yield doc, meta

            self._ingest(docs(), known, report, False)
        return report

    def _ingest(self, docs, known: dict, report: IngestReport, progress: bool) -> None:
        max_tokens = min(CHUNK_TOKENS, self.embedder.max_tokens)
        overlap = min(OVERLAP_TOKENS, max_tokens // 4)
        pending: list[_Staged] = []
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(desc=f"ingesting into {self.name}", unit="chunk")
        try:
            for doc, _ in docs:
                old = known.get(doc.source)
                if old is not None and old[0] == doc.content_hash:
                    if old[1] != doc.metadata:
                        revision = self._store.set_metadata(self.id, doc.source, doc.metadata)
                        if revision is not None and revision == self._revision + 1:
                            self._revision = revision
                        report.updated.append(doc.source)
                    else:
                        report.unchanged.append(doc.source)
                    continue
                t = time.perf_counter()
                try:
                    chunks = chunk_document(doc, self.embedder.count_tokens, max_tokens=max_tokens, overlap_tokens=overlap)
                except Exception as e:  # one document's trouble is its own
                    log.debug("chunking %s failed", doc.source, exc_info=True)
                    report.skipped.append(FileError(doc.source, f"cannot be chunked: {type(e).__name__}: {e}"))
                    continue
                chunks = [c for c in chunks if c.text.strip()]
                if not chunks:
                    reason = "no text to index (empty or whitespace only)"
                    if old is not None:
                        reason += "; its previous version stays in the knowledge base"
                    report.skipped.append(FileError(doc.source, reason))
                    report.seconds["parse"] += time.perf_counter() - t
                    continue
                staged = _Staged(
                    doc,
                    [self._embedding_text(doc, c) for c in chunks],
                    [NewChunk(c.ordinal, c.start, c.end, c.heading or "", c.text, self.embedder.count_tokens(c.text), b"")
                     for c in chunks],
                )
                report.seconds["parse"] += time.perf_counter() - t
                known[doc.source] = (doc.content_hash, doc.metadata)
                pending.append(staged)
                if sum(len(p.chunks) for p in pending) >= EMBED_GROUP:
                    self._flush(pending, report, bar)
                    pending = []
            self._flush(pending, report, bar)
        finally:
            if bar is not None:
                bar.close()
            t = time.perf_counter()
            if report.added or report.updated or report.chunks:
                self._write_index()
            report.seconds["index"] += time.perf_counter() - t

    @staticmethod
    def _embedding_text(doc: Document, chunk) -> str:
        """What is embedded for a chunk: its heading path, if any, then its text."""
        heading = (chunk.heading or "").strip()
        if heading and not chunk.text.lstrip().startswith(heading):
            return f"{heading}\n{chunk.text}"
        return chunk.text

    def _flush(self, pending: list[_Staged], report: IngestReport, bar) -> None:
        if not pending:
            return
        t = time.perf_counter()
        texts = [x for p in pending for x in p.texts]
        vectors = self.embedder.encode(texts)
        report.seconds["embed"] += time.perf_counter() - t
        t = time.perf_counter()
        row = 0
        for p in pending:
            n = len(p.chunks)
            vecs = vectors[row : row + n]
            row += n
            chunks = [
                NewChunk(c.ordinal, c.start, c.end, c.heading, c.text, c.token_count, v.astype("<f4").tobytes())
                for c, v in zip(p.chunks, vecs)
            ]
            d = p.doc
            result = self._store.put_document(
                self.id, d.source, d.kind, d.content_hash, d.metadata, d.text, chunks, self._info.embedding_dim
            )
            self._applied(result)
            if not self._rebuild_due:
                self.dense.add(result.added_ids, vecs)
            (report.added if result.status == "added" else report.updated).append(d.source)
            report.chunks += n
        self._settle()
        report.seconds["index"] += time.perf_counter() - t
        if bar is not None:
            bar.update(len(texts))

    # ------------------------------------------------------------------ removing

    def _resolve(self, source: str) -> Optional[str]:
        """The stored source ``source`` names: itself, its resolved path, or the one
        source ending in "/<source>"; None if none. InvalidRequest if ambiguous."""
        check_text("source", source)
        rows = self._store.document_index(self.id)
        stored = {src for _, src, _ in rows}
        if source in stored:
            return source
        try:
            absolute = str(Path(source).expanduser().resolve())
        except (OSError, RuntimeError, ValueError):
            absolute = None
        if absolute in stored:
            return absolute
        tail = "/" + source.strip("/")
        matches = sorted(s for s in stored if s.endswith(tail))
        if len(matches) > 1:
            raise InvalidRequest(f"{source!r} matches {len(matches)} documents ({', '.join(matches[:3])}...): give its full source")
        return matches[0] if matches else None

    def _remove_source(self, source: str) -> bool:
        result = self._store.remove_document(self.id, source)
        if result is None:
            return False
        self._applied(result)
        return True

    def remove(self, source: str) -> bool:
        """Remove a document, its chunks, vectors and lexical entries. False if it is not in the KB."""
        with self._lock:
            self._refresh()
            found = self._resolve(source)
            if found is None or not self._remove_source(found):
                return False
            self._settle()
            self._write_index()
            return True

    # ------------------------------------------------------------------ reading

    def search(
        self, query: str, k: int = 5, mode: str = "hybrid", filters: Optional[dict[str, Any]] = None
    ) -> list[Hit]:
        """The ``k`` best chunks for ``query``; see the module docstring. An empty query finds nothing."""
        check_text("query", query)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
            raise InvalidRequest(f"k must be an int from 1 to {MAX_K}, got {k!r}")
        if mode not in MODES:
            raise InvalidRequest(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        if filters is not None and not isinstance(filters, dict):
            raise InvalidRequest(f"filters must be a dict, got {type(filters).__name__}")
        if not query.strip():
            return []
        with self._lock:
            self._refresh()
            if mode == "lexical" and not self._store.has_lexical:
                raise InvalidRequest(
                    f"lexical search needs SQLite's FTS5; the database {self._store.where} is not SQLite"
                )
            if mode == "hybrid" and not self._store.has_lexical:
                if not self._warned_no_lexical:
                    log.warning("knowledge base %r: no lexical index on %s (not SQLite): hybrid search is dense-only",
                                self.name, self._store.where)
                    self._warned_no_lexical = True
                mode = "dense"
            doc_ids = chunk_ids = None
            if filters:
                doc_ids = self._filter(filters)
                if not doc_ids:
                    return []
                chunk_ids = self._store.chunk_ids_of_documents(doc_ids) if mode != "lexical" else None
            n = max(4 * k, 20)
            dense: list[tuple[int, float]] = []
            lexical: list[tuple[int, float]] = []
            if mode in ("dense", "hybrid"):
                vector = self.embedder.encode([query])[0]
                dense = self.dense.search(vector, n, chunk_ids)
            if mode in ("lexical", "hybrid"):
                lexical = self._store.lexical_search(self.id, query, n, doc_ids)
            if mode == "dense":
                ranked = sorted(dense, key=lambda x: (-x[1], x[0]))
            elif mode == "lexical":
                ranked = sorted(lexical, key=lambda x: (-x[1], x[0]))
            else:
                ranked = rrf([[i for i, _ in dense], [i for i, _ in lexical]])
            ranked = ranked[:k]
            records = self._store.chunks(self.id, [i for i, _ in ranked])
            return [_hit(records[i], s) for i, s in ranked if i in records]

    def _filter(self, filters: dict[str, Any]) -> list[int]:
        """Ids of the documents that pass every filter."""
        for key in filters:
            if not isinstance(key, str):
                raise InvalidRequest(f"filter keys must be strings, got {key!r}")
        source_glob = filters.get("source")
        if source_glob is not None and not isinstance(source_glob, str):
            raise InvalidRequest(f"the 'source' filter must be a string (a glob), got {source_glob!r}")
        wanted = {k: v for k, v in filters.items() if k != "source"}
        out = []
        for doc_id, source, meta in self._store.document_index(self.id):
            if source_glob is not None and not fnmatch.fnmatchcase(source, source_glob):
                continue
            ok = True
            for key, value in wanted.items():
                if key not in meta:
                    ok = False
                elif isinstance(value, (list, tuple, set, frozenset)):
                    ok = meta[key] in list(value)
                else:
                    ok = meta[key] == value
                if not ok:
                    break
            if ok:
                out.append(doc_id)
        return out

    def chunks_of(self, source: str) -> list[Hit]:
        """A document's chunks in ordinal order (score 0.0), e.g. to pin the whole document;
        empty if it is not in the KB."""
        with self._lock:
            self._refresh()
            found = self._resolve(source)
            if found is None:
                return []
            return [_hit(r, 0.0) for r in self._store.chunks_of(self.id, found)]

    def documents(self) -> list[DocumentInfo]:
        """The KB's documents (source, kind, hash, metadata, sizes), by source."""
        with self._lock:
            self._refresh()
            return self._store.documents(self.id)

    def stats(self) -> dict[str, Any]:
        """Counts and index facts: documents, chunks, tokens, chars, embedding_bytes,
        model, dim, index kind, vectors and file bytes, whether lexical search exists."""
        with self._lock:
            self._refresh()
            out: dict[str, Any] = {"name": self.name}
            out.update(self._store.stats(self.id))
            try:
                index_bytes = self.index_path.stat().st_size
            except OSError:
                index_bytes = 0
            out.update(
                model=self._info.embedding_model, dim=self._info.embedding_dim, index=self.dense.kind,
                vectors=self.dense.ntotal, index_bytes=index_bytes, lexical=self._store.has_lexical,
            )
            return out

    def check(self) -> list[str]:
        """Problems found comparing the indexes with the database (empty when consistent):
        the dense index's ids against the chunk rows, the FTS5 index against the chunk
        texts (FTS5 'integrity-check', reads every chunk). For tests and diagnostics."""
        with self._lock:
            self._refresh()
            problems = []
            db_ids = np.asarray(self._store.chunk_ids(self.id), dtype=np.int64)
            held = np.sort(self.dense.ids())
            if not np.array_equal(held, db_ids):
                problems.append(f"dense index holds {len(held)} ids, the database {len(db_ids)} chunks")
            try:
                self._store.lexical_integrity_check()
            except ChatKVError as e:
                problems.append(f"lexical index: {e}")
            return problems

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Release the database connections. The KB is unusable afterwards."""
        with self._lock:
            if not self._closed:
                self._closed = True
                if self._owns_store:
                    self._store.close()

    def __enter__(self) -> KnowledgeBase:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KnowledgeBase({self.name!r}, {self.dense.ntotal} chunks, {self._info.embedding_model})"
