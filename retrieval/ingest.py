"""Ingest for KnowledgeBase: discover, load, chunk, embed, write; and IngestReport.

The functions here are KnowledgeBase's ingest path, split out of knowledge_base.py;
they take the knowledge base and are called by its ``add`` and ``add_texts`` with its
lock held and its dense index in step (``_refresh``). The contracts are in
knowledge_base.py's docstring.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Protocol, Sequence

from chatkv.errors import InvalidRequest, check_text
from chatkv.retrieval.chunking import chunk_document
from chatkv.retrieval.documents import Document, DocumentError, FileError, discover, document_from_text, load_file
from chatkv.storage.knowledge import NewChunk

if TYPE_CHECKING:
    from chatkv.retrieval.dense_index import DenseIndex
    from chatkv.retrieval.embedding import Embedder
    from chatkv.storage.knowledge import KBInfo, KnowledgeStore, WriteResult

log = logging.getLogger("chatkv.retrieval.knowledge_base")  # the KB's logger, as before the split


def join_chunks(chunks: Sequence) -> str:
    """A document's text from its chunks (in ordinal order), without the overlap between
    neighbours: the text a pinned document puts in the system message (chatkv.rag.context), and so
    the text whose chunk KV ``precompute_kv`` computes for pinning it."""
    out, end = [], -1
    for c in chunks:
        if c.start >= end:
            out.append(("\n\n" if out else "") + c.text)
        elif c.end > end:
            out.append(c.text[end - c.start :])
        end = max(end, c.end)
    return "".join(out).strip()


def quoted_chunk(hit) -> str:
    """A retrieved chunk as a RAG prompt quotes it after its number ``[n] ``: its label
    ``(file - heading)``, then its text (chatkv.rag.context.sources_block). Its chunk KV is this text's,
    label included, so a source placed from it leaves only ``[n] `` to compute."""
    name = hit.source.rsplit("/", 1)[-1]
    label = f"{name} - {hit.heading}" if hit.heading else name
    return f"({label})\n{hit.text.strip()}"


def quoted_document(source: str, chunks: Sequence) -> str:
    """A pinned document as the system message quotes it (chatkv.rag.context.documents_block): a
    ``Document:`` line naming it, then its text from its chunks."""
    return f"Document: {source.rsplit('/', 1)[-1]}\n" + join_chunks(chunks)


class KBView(Protocol):
    """What the ingest path uses of a knowledge base (``chatkv.retrieval.knowledge_base.
    KnowledgeBase`` is one); this module names it, never that class, so the two modules do
    not import each other."""

    id: int
    name: str
    embedder: Embedder
    dense: DenseIndex
    store: KnowledgeStore
    info: KBInfo
    revision: int
    rebuild_due: bool

    def applied(self, result: WriteResult) -> None: ...

    def settle(self) -> None: ...

    def write_index(self) -> None: ...


CHUNK_TOKENS = 256
OVERLAP_TOKENS = 32


@dataclass
class IngestReport:
    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    skipped: list[FileError] = field(default_factory=list)
    chunks: int = 0  # chunks embedded and written by this call
    kv_chunks: int = 0  # chunks whose chat-model KV this call computed ahead of time (precompute_kv)
    # parse: discover, load, chunk; embed: the model; index: database writes, FAISS, the index file
    seconds: dict[str, float] = field(default_factory=lambda: {"parse": 0.0, "embed": 0.0, "index": 0.0})

    def summary(self) -> str:
        s = self.seconds
        return (
            f"{len(self.added)} added, {len(self.updated)} updated, {len(self.unchanged)} unchanged, "
            f"{len(self.skipped)} skipped; {self.chunks} chunks "
            f"(parse {s['parse']:.1f} s, embed {s['embed']:.1f} s, index {s['index']:.1f} s)"
        )


@dataclass
class _Staged:
    doc: Document
    texts: list[str]  # what is embedded for each chunk
    chunks: list[NewChunk]  # embedding filled in after embedding


def file_documents(
    paths: str | Path | Iterable[str | Path],
    include: Optional[Sequence[str]],
    exclude: Optional[Sequence[str]],
    known: dict,
    report: IngestReport,
    follow_symlinks: bool = False,
) -> Iterator[tuple[Document, None]]:
    """The loaded documents of ``add``'s files, lazily; each file that cannot be is one skip
    (a symbolic link not followed, or one leading outside the given paths, among them)."""

    def skip(source: str, reason: str) -> None:
        if source in known:
            reason += "; its previous version stays in the knowledge base"
        report.skipped.append(FileError(source, reason))

    t = time.perf_counter()
    for item in discover(paths, include=include, exclude=exclude, follow_symlinks=follow_symlinks):
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


def check_texts(
    texts: Sequence[str],
    sources: Optional[Sequence[str]],
    metadata: Optional[dict[str, Any] | Sequence[Optional[dict[str, Any]]]],
) -> tuple[list[str], list[str], list[Optional[dict[str, Any]]]]:
    """``add_texts``' arguments checked: (texts, sources, one metadata per text); InvalidRequest if bad."""
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
    return texts, sources, metas


def text_documents(
    texts: list[str], sources: list[str], metas: list[Optional[dict[str, Any]]], report: IngestReport
) -> Iterator[tuple[Document, Optional[dict[str, Any]]]]:
    """The documents of ``add_texts``' texts, lazily; a text that cannot be one is a skip."""
    for text, source, meta in zip(texts, sources, metas):
        t = time.perf_counter()
        try:
            doc = document_from_text(text, source, metadata=dict(meta or {}))
        except DocumentError as e:
            report.skipped.append(FileError(e.source, e.reason))
            continue
        report.seconds["parse"] += time.perf_counter() - t
        yield doc, meta


def ingest(kb: KBView, docs, known: dict, report: IngestReport, progress: bool, embed_group: int) -> None:
    """Chunk, embed (``embed_group`` chunks at a time) and write ``docs``; then the index file."""
    max_tokens = min(CHUNK_TOKENS, kb.embedder.max_tokens)
    overlap = min(OVERLAP_TOKENS, max_tokens // 4)
    pending: list[_Staged] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc=f"ingesting into {kb.name}", unit="chunk")
    try:
        for doc, _ in docs:
            old = known.get(doc.source)
            if old is not None and old[0] == doc.content_hash:
                if old[1] != doc.metadata:
                    revision = kb.store.set_metadata(kb.id, doc.source, doc.metadata)
                    if revision is not None and revision == kb.revision + 1:
                        kb.revision = revision
                    report.updated.append(doc.source)
                else:
                    report.unchanged.append(doc.source)
                continue
            t = time.perf_counter()
            try:
                chunks = chunk_document(doc, kb.embedder.count_tokens, max_tokens=max_tokens, overlap_tokens=overlap)
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
                [embedding_text(doc, c) for c in chunks],
                [
                    NewChunk(c.ordinal, c.start, c.end, c.heading or "", c.text, kb.embedder.count_tokens(c.text), b"")
                    for c in chunks
                ],
            )
            report.seconds["parse"] += time.perf_counter() - t
            known[doc.source] = (doc.content_hash, doc.metadata)
            pending.append(staged)
            if sum(len(p.chunks) for p in pending) >= embed_group:
                _flush(kb, pending, report, bar)
                pending = []
        _flush(kb, pending, report, bar)
    finally:
        if bar is not None:
            bar.close()
        t = time.perf_counter()
        if report.added or report.updated or report.chunks:
            kb.write_index()
        report.seconds["index"] += time.perf_counter() - t


def embedding_text(doc: Document, chunk) -> str:
    """What is embedded for a chunk: its heading path, if any, then its text."""
    heading = (chunk.heading or "").strip()
    if heading and not chunk.text.lstrip().startswith(heading):
        return f"{heading}\n{chunk.text}"
    return chunk.text


def _flush(kb: KBView, pending: list[_Staged], report: IngestReport, bar) -> None:
    """Embed the staged documents together, then write each in its own transaction."""
    if not pending:
        return
    t = time.perf_counter()
    texts = [x for p in pending for x in p.texts]
    vectors = kb.embedder.encode(texts)
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
        result = kb.store.put_document(
            kb.id, d.source, d.kind, d.content_hash, d.metadata, d.text, chunks, kb.info.embedding_dim
        )
        kb.applied(result)
        if not kb.rebuild_due:
            kb.dense.add(result.added_ids, vecs)
        (report.added if result.status == "added" else report.updated).append(d.source)
        report.chunks += n
    kb.settle()
    report.seconds["index"] += time.perf_counter() - t
    if bar is not None:
        bar.update(len(texts))
