"""chatkv.retrieval: knowledge bases for RAG.

Loaders (documents.py), structure-following chunking (chunking.py), sentence
embeddings (embedding.py), the FAISS dense index (dense_index.py) and the
knowledge base that ties them to the database and the FTS5 lexical index
(knowledge_base.py; its ingest path in ingest.py, its search path in search.py)::

    from chatkv.retrieval import KnowledgeBase
    kb = KnowledgeBase.open("python-docs")
    kb.add(["docs/", "notes.md"])
    hits = kb.search("how do decorators work?", k=5)

Importing this package loads neither torch nor transformers; the embedding
model loads when first needed.
"""

from chatkv.retrieval.embedding import Embedder
from chatkv.retrieval.knowledge_base import Hit, IngestReport, KnowledgeBase
from chatkv.storage.knowledge import DocumentInfo

__all__ = ["KnowledgeBase", "Hit", "IngestReport", "Embedder", "DocumentInfo"]
