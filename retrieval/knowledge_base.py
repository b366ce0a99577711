"""Knowledge bases: ingest files and texts, search them densely, lexically or both.

(Just past 400 lines: the contracts below are the SDK's documentation of knowledge bases; the
ingest and search paths already live in ingest.py and search.py.)

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

The ingest path (discover, load, chunk, embed, write) is in ingest.py, the search
path (candidates, fusion, filters) in search.py; KnowledgeBase holds the lock and
the invariant (the dense index holds exactly the database's chunk ids at the
revision it last saw) and delegates to them.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

from chatkv.errors import ChatKVError, InvalidRequest, check_text
from chatkv.retrieval import ingest as ingest_path
from chatkv.retrieval import search as search_path
from chatkv.retrieval.dense_index import HNSW_THRESHOLD, DenseIndex, kind_for
from chatkv.retrieval.embedding import Embedder
from chatkv.retrieval.ingest import CHUNK_TOKENS, OVERLAP_TOKENS, IngestReport  # noqa: F401 (re-exported)
from chatkv.retrieval.search import MAX_K, MODES, RRF_K, Hit, rrf  # noqa: F401 (re-exported)
from chatkv.storage import paths
from chatkv.storage.knowledge import DocumentInfo, KBInfo, KnowledgeStore, WriteResult, check_kb_name

log = logging.getLogger(__name__)

# Chunks embedded together before their documents are written; read at each call, so
# setting knowledge_base.EMBED_GROUP takes effect (the crash test writes one at a time).
EMBED_GROUP = 256


class KnowledgeBase:
    """A named knowledge base; ``KnowledgeBase.open(name)``. See the module docstring."""

    def __init__(
        self,
        store: KnowledgeStore,
        info: KBInfo,
        embedder: Embedder,
        index_dir: Path,
        hnsw_threshold: int = HNSW_THRESHOLD,
        owns_store: bool = True,
    ) -> None:
        self.store = store
        self.info = info
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
        self.warned_no_lexical = False
        self.revision = -1
        self.rebuild_due = False  # a removal the index could not apply (HNSW): rebuild before use
        # fn(chunk texts, progress) -> chunks whose KV it computed: set by Engine.knowledge_base (precompute_kv)
        self.kv_precompute: Optional[Callable[[list[str], bool], int]] = None
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
                raise InvalidRequest(
                    f"there is no knowledge base {name!r}" + (f" for tenant {tenant!r}" if tenant else "")
                )
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
        revision = self.store.revision(self.id)
        ids = self.store.chunk_ids(self.id)
        loaded = DenseIndex.load(self.index_path, ids, self.info.embedding_dim, self._identity)
        if loaded is not None:
            self.dense = loaded
        elif not ids:
            self.dense = DenseIndex(self.info.embedding_dim)  # nothing to rebuild: written at the first ingest
        else:
            log.warning(
                "knowledge base %r: rebuilding its dense index (%d chunks) from the embeddings in the database",
                self.name,
                len(ids),
            )
            self._rebuild()
            self.write_index()
        self.revision = revision if revision is not None else -1

    def _rebuild(self) -> None:
        """The dense index anew from the database's embeddings (reads them all; no embedding)."""
        self.rebuild_due = False
        ids: list[int] = []
        parts: list[np.ndarray] = []
        for rows in self.store.embeddings(self.id):
            ids += [i for i, _ in rows]
            parts.append(self._vectors([e for _, e in rows]))
        vecs = np.concatenate(parts) if parts else np.zeros((0, self.info.embedding_dim), np.float32)
        self.dense = DenseIndex.build(self.info.embedding_dim, ids, vecs, self.hnsw_threshold)

    def _vectors(self, blobs: Sequence[bytes]) -> np.ndarray:
        dim = self.info.embedding_dim
        bad = [len(b) for b in blobs if len(b) != 4 * dim]
        if bad:
            raise ChatKVError(f"knowledge base {self.name!r} holds an embedding of {bad[0]} bytes, not {4 * dim}")
        return np.frombuffer(b"".join(blobs), dtype="<f4").astype(np.float32, copy=False).reshape(len(blobs), dim)

    def write_index(self) -> None:
        try:
            self.dense.write(self.index_path, self._identity)
        except OSError as e:  # the database has everything: the next open rebuilds
            log.warning(
                "knowledge base %r: cannot write its dense index %s (%s); it will be rebuilt on open",
                self.name,
                self.index_path,
                e,
            )

    def settle(self) -> None:
        """Rebuild the dense index if a removal could not be applied, or if it outgrew flat."""
        outgrown = self.dense.kind != kind_for(self.dense.ntotal, self.hnsw_threshold) and (
            self.dense.ntotal > self.hnsw_threshold
        )
        if self.rebuild_due or outgrown:
            self._rebuild()
            self.rebuild_due = False

    def _refresh(self) -> None:
        """Bring the dense index in step if another process changed the KB."""
        if self._closed:
            raise ChatKVError(f"knowledge base {self.name!r} is closed")
        revision = self.store.revision(self.id)
        if revision is None:
            raise ChatKVError(f"knowledge base {self.name!r} was deleted")
        if revision == self.revision:
            return
        db_ids = np.asarray(self.store.chunk_ids(self.id), dtype=np.int64)
        held = self.dense.ids()
        gone = np.setdiff1d(held, db_ids)
        new = np.setdiff1d(db_ids, held)
        if len(gone) and not self.dense.remove(gone):
            self.rebuild_due = True
        elif len(new):
            rows = self.store.embeddings_of(new.tolist())
            self.dense.add([i for i, _ in rows], self._vectors([e for _, e in rows]))
        self.settle()
        self.revision = revision

    def applied(self, result: WriteResult) -> None:
        """Apply one of our own writes' removals to the dense index (the caller adds the new
        vectors unless the index is now due for a rebuild: HNSW cannot delete, so it is
        rebuilt once at the end of the call, by ``settle``)."""
        if result.removed_ids and not self.dense.remove(result.removed_ids):
            self.rebuild_due = True
        if result.revision == self.revision + 1:
            self.revision = result.revision  # nobody else wrote in between
        # else: another process wrote too; the next _refresh() diffs the ids

    # ------------------------------------------------------------------ ingest
    # ------------------------------------------------------------------ ingest (ingest.py)

    def add(
        self,
        paths: str | Path | Iterable[str | Path],
        include: Optional[Sequence[str]] = None,
        exclude: Optional[Sequence[str]] = None,
        progress: bool = False,
        follow_symlinks: bool = False,
        precompute_kv: bool = False,
    ) -> IngestReport:
        """Ingest files and directories (recursively; include/exclude globs). See the module docstring.

        Symbolic links inside a directory are skipped (each one a ``report.skipped`` entry) unless
        ``follow_symlinks``; followed, a link resolving outside every given path is still skipped.
        A path given here is always taken, link or not. ``precompute_kv``: compute the chat
        model's KV of every chunk of the documents given now, ahead of their first retrieval
        (``rag_kv_reuse``; only for a knowledge base opened by ``Engine.knowledge_base``)."""
        self._check_precompute(precompute_kv)
        report = IngestReport()
        with self._lock:
            self._refresh()
            known = self.store.document_hashes(self.id)
            docs = ingest_path.file_documents(paths, include, exclude, known, report, follow_symlinks)
            self._ingest(docs, known, report, progress)
        if precompute_kv:
            self._precompute(report, progress)
        return report

    def _check_precompute(self, precompute_kv: bool) -> None:
        if precompute_kv and self.kv_precompute is None:
            raise InvalidRequest(
                "precompute_kv needs the chat model: open the knowledge base with Engine.knowledge_base"
            )

    def _precompute(self, report: IngestReport, progress: bool) -> None:
        """The chunk KV of every document of ``report`` (added, updated, unchanged), through the
        engine's hook: each chunk as a RAG prompt quotes it, and each document whole as pinning it
        puts it in the system message (``ingest_path.quoted_chunk``, ``quoted_document``)."""
        texts = []
        for src in report.added + report.updated + report.unchanged:
            chunks = self.chunks_of(src)
            texts += [ingest_path.quoted_chunk(h) for h in chunks] + [ingest_path.quoted_document(src, chunks)]
        report.kv_chunks = self.kv_precompute(texts, progress)

    def add_texts(
        self,
        texts: Sequence[str],
        sources: Optional[Sequence[str]] = None,
        metadata: Optional[dict[str, Any] | Sequence[Optional[dict[str, Any]]]] = None,
        precompute_kv: bool = False,
    ) -> IngestReport:
        """Ingest texts. ``sources`` names them (default ``text:<sha256 prefix>``, so the
        same text is the same document); ``metadata`` is one dict for all or one per text.
        A text's source works like a file's path: the same source with another text
        replaces it. ``precompute_kv``: as ``add``'s."""
        self._check_precompute(precompute_kv)
        texts, sources, metas = ingest_path.check_texts(texts, sources, metadata)
        report = IngestReport()
        with self._lock:
            self._refresh()
            known = self.store.document_hashes(self.id)
            self._ingest(ingest_path.text_documents(texts, sources, metas, report), known, report, False)
        if precompute_kv:
            self._precompute(report, False)
        return report

    def _ingest(self, docs, known: dict, report: IngestReport, progress: bool) -> None:
        ingest_path.ingest(self, docs, known, report, progress, EMBED_GROUP)

    # ------------------------------------------------------------------ removing

    def _resolve(self, source: str) -> Optional[str]:
        """The stored source ``source`` names: itself, its resolved path, or the one
        source ending in "/<source>"; None if none. InvalidRequest if ambiguous."""
        check_text("source", source)
        rows = self.store.document_index(self.id)
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
            raise InvalidRequest(
                f"{source!r} matches {len(matches)} documents ({', '.join(matches[:3])}...): give its full source"
            )
        return matches[0] if matches else None

    def _remove_source(self, source: str) -> bool:
        result = self.store.remove_document(self.id, source)
        if result is None:
            return False
        self.applied(result)
        return True

    def remove(self, source: str) -> bool:
        """Remove a document, its chunks, vectors and lexical entries. False if it is not in the KB."""
        with self._lock:
            self._refresh()
            found = self._resolve(source)
            if found is None or not self._remove_source(found):
                return False
            self.settle()
            self.write_index()
            return True

    # ------------------------------------------------------------------ reading

    def search(
        self, query: str, k: int = 5, mode: str = "hybrid", filters: Optional[dict[str, Any]] = None
    ) -> list[Hit]:
        """The ``k`` best chunks for ``query``; see the module docstring and search.py. An empty query finds nothing."""
        search_path.check_search(query, k, mode, filters)
        if not query.strip():
            return []
        with self._lock:
            self._refresh()
            return search_path.search(self, query, k, mode, filters)

    def chunks_of(self, source: str) -> list[Hit]:
        """A document's chunks in ordinal order (score 0.0), e.g. to pin the whole document;
        empty if it is not in the KB."""
        with self._lock:
            self._refresh()
            found = self._resolve(source)
            if found is None:
                return []
            return [search_path.hit(r, 0.0) for r in self.store.chunks_of(self.id, found)]

    def documents(self) -> list[DocumentInfo]:
        """The KB's documents (source, kind, hash, metadata, sizes), by source."""
        with self._lock:
            self._refresh()
            return self.store.documents(self.id)

    def stats(self) -> dict[str, Any]:
        """Counts and index facts: documents, chunks, tokens, chars, embedding_bytes,
        model, dim, index kind, vectors and file bytes, whether lexical search exists."""
        with self._lock:
            self._refresh()
            out: dict[str, Any] = {"name": self.name}
            out.update(self.store.stats(self.id))
            try:
                index_bytes = self.index_path.stat().st_size
            except OSError:
                index_bytes = 0
            out.update(
                model=self.info.embedding_model,
                dim=self.info.embedding_dim,
                index=self.dense.kind,
                vectors=self.dense.ntotal,
                index_bytes=index_bytes,
                lexical=self.store.has_lexical,
            )
            return out

    def check(self) -> list[str]:
        """Problems found comparing the indexes with the database (empty when consistent):
        the dense index's ids against the chunk rows, the FTS5 index against the chunk
        texts (FTS5 'integrity-check', reads every chunk). For tests and diagnostics."""
        with self._lock:
            self._refresh()
            problems = []
            db_ids = np.asarray(self.store.chunk_ids(self.id), dtype=np.int64)
            held = np.sort(self.dense.ids())
            if not np.array_equal(held, db_ids):
                problems.append(f"dense index holds {len(held)} ids, the database {len(db_ids)} chunks")
            try:
                self.store.lexical_integrity_check()
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
                    self.store.close()

    def __enter__(self) -> KnowledgeBase:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KnowledgeBase({self.name!r}, {self.dense.ntotal} chunks, {self.info.embedding_model})"
