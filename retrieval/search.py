"""Search for KnowledgeBase: dense and FTS5 candidates, reciprocal rank fusion, filters, Hits.

The functions here are KnowledgeBase's search path, split out of knowledge_base.py;
``search`` takes the knowledge base and is called by its ``search`` with its lock held
and its dense index in step (``_refresh``). The contracts are in knowledge_base.py's
docstring.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence

from chatkv.errors import InvalidRequest, check_text
from chatkv.storage.knowledge import ChunkRecord, KnowledgeStore

if TYPE_CHECKING:
    from chatkv.retrieval.dense_index import DenseIndex
    from chatkv.retrieval.embedding import Embedder

log = logging.getLogger("chatkv.retrieval.knowledge_base")  # the KB's logger, as before the split


class KBView(Protocol):
    """What the search path uses of a knowledge base (``chatkv.retrieval.knowledge_base.
    KnowledgeBase`` is one); this module names it, never that class, so the two modules do
    not import each other."""

    id: int
    name: str
    embedder: Embedder
    dense: DenseIndex
    store: KnowledgeStore
    warned_no_lexical: bool


MODES = ("hybrid", "dense", "lexical")
RRF_K = 60
MAX_K = 1000


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


def hit(r: ChunkRecord, score: float) -> Hit:
    return Hit(r.text, float(score), r.source, r.id, r.document_id, r.ordinal, r.start, r.end, r.heading, r.metadata)


def rrf(rankings: Sequence[Sequence[int]], k: int = RRF_K) -> list[tuple[int, float]]:
    """Reciprocal rank fusion: (id, sum over rankings of 1/(k + rank)), best first, ties by id."""
    scores: dict[int, float] = {}
    for ranking in rankings:
        for rank, i in enumerate(ranking, 1):
            scores[i] = scores.get(i, 0.0) + 1.0 / (k + rank)
    return sorted(scores.items(), key=lambda x: (-x[1], x[0]))


def check_search(query: str, k: int, mode: str, filters: Optional[dict[str, Any]]) -> None:
    """``search``'s arguments checked; InvalidRequest if bad."""
    check_text("query", query)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise InvalidRequest(f"k must be an int from 1 to {MAX_K}, got {k!r}")
    if mode not in MODES:
        raise InvalidRequest(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    if filters is not None and not isinstance(filters, dict):
        raise InvalidRequest(f"filters must be a dict, got {type(filters).__name__}")


def search(kb: KBView, query: str, k: int, mode: str, filters: Optional[dict[str, Any]]) -> list[Hit]:
    """The ``k`` best chunks for a checked, non-blank ``query``."""
    if mode == "lexical" and not kb.store.has_lexical:
        raise InvalidRequest(f"lexical search needs SQLite's FTS5; the database {kb.store.where} is not SQLite")
    if mode == "hybrid" and not kb.store.has_lexical:
        if not kb.warned_no_lexical:
            log.warning(
                "knowledge base %r: no lexical index on %s (not SQLite): hybrid search is dense-only",
                kb.name,
                kb.store.where,
            )
            kb.warned_no_lexical = True
        mode = "dense"
    doc_ids = chunk_ids = None
    if filters:
        doc_ids = filter_documents(kb.store, kb.id, filters)
        if not doc_ids:
            return []
        chunk_ids = kb.store.chunk_ids_of_documents(doc_ids) if mode != "lexical" else None
    n = max(4 * k, 20)
    dense: list[tuple[int, float]] = []
    lexical: list[tuple[int, float]] = []
    if mode in ("dense", "hybrid"):
        vector = kb.embedder.encode([query])[0]
        dense = kb.dense.search(vector, n, chunk_ids)
    if mode in ("lexical", "hybrid"):
        lexical = kb.store.lexical_search(kb.id, query, n, doc_ids)
    if mode == "dense":
        ranked = sorted(dense, key=lambda x: (-x[1], x[0]))
    elif mode == "lexical":
        ranked = sorted(lexical, key=lambda x: (-x[1], x[0]))
    else:
        ranked = rrf([[i for i, _ in dense], [i for i, _ in lexical]])
    ranked = ranked[:k]
    records = kb.store.chunks(kb.id, [i for i, _ in ranked])
    return [hit(records[i], s) for i, s in ranked if i in records]


def filter_documents(store: KnowledgeStore, kb_id: int, filters: dict[str, Any]) -> list[int]:
    """Ids of the KB's documents that pass every filter."""
    for key in filters:
        if not isinstance(key, str):
            raise InvalidRequest(f"filter keys must be strings, got {key!r}")
    source_glob = filters.get("source")
    if source_glob is not None and not isinstance(source_glob, str):
        raise InvalidRequest(f"the 'source' filter must be a string (a glob), got {source_glob!r}")
    wanted = {k: v for k, v in filters.items() if k != "source"}
    out = []
    for doc_id, source, meta in store.document_index(kb_id):
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
