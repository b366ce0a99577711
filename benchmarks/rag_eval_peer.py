"""The peer of benchmarks/rag_eval.py: LlamaIndex's default hybrid retriever on the same topics and MiniLM.

Benchmark-only packages (not in scripts/install.sh):

    .venv/bin/pip install llama-index-core llama-index-embeddings-huggingface llama-index-retrievers-bm25

Pipeline, as its documentation sets it up: one ``Document`` per topic, ``VectorStoreIndex`` over
the default node parser (``SentenceSplitter``, 1024-token chunks, 200 overlapping), embedded with
``HuggingFaceEmbedding(model_name=<the packaged MiniLM directory>)``; ``BM25Retriever`` over the
same nodes; ``QueryFusionRetriever(mode="reciprocal_rerank", num_queries=1)`` fusing the two (one
query: no LLM rewrites them). Everything runs offline; no LLM is configured (``Settings.llm = None``).
"""

from __future__ import annotations

from typing import Callable, Union

Retriever = Callable[[str, int], list[tuple[str, str]]]


def llamaindex_retriever(texts: dict[str, str]) -> Union[Retriever, str]:
    """A ``retrieve(question, k) -> [(topic, chunk text)]`` over LlamaIndex's fusion retriever, or a
    sentence saying why it cannot run here."""
    try:
        from llama_index.core import Document, Settings, VectorStoreIndex
        from llama_index.core.node_parser import SentenceSplitter
        from llama_index.core.retrievers import QueryFusionRetriever
        from llama_index.embeddings.huggingface import HuggingFaceEmbedding
        from llama_index.retrievers.bm25 import BM25Retriever
    except ImportError as e:
        return (
            f"LlamaIndex is not installed ({e}); pip install llama-index-core "
            "llama-index-embeddings-huggingface llama-index-retrievers-bm25"
        )
    from chatkv.retrieval.embedding import default_model_dir

    Settings.llm = None
    Settings.embed_model = HuggingFaceEmbedding(model_name=str(default_model_dir()))
    splitter = SentenceSplitter()  # its defaults: what from_documents uses when given none
    docs = [Document(text=t, metadata={"topic": name}, id_=name) for name, t in texts.items()]
    index = VectorStoreIndex.from_documents(docs, transformations=[splitter])
    nodes = list(index.docstore.docs.values())
    cache: dict[int, object] = {}

    def fusion(k: int):
        if k not in cache:
            cache[k] = QueryFusionRetriever(
                [index.as_retriever(similarity_top_k=k), BM25Retriever.from_defaults(nodes=nodes, similarity_top_k=k)],
                similarity_top_k=k,
                num_queries=1,
                mode="reciprocal_rerank",
                use_async=False,
            )
        return cache[k]

    def retrieve(question: str, k: int) -> list[tuple[str, str]]:
        return [(n.node.metadata["topic"], n.node.get_content()) for n in fusion(k).retrieve(question)]

    retrieve.chunks = len(nodes)  # type: ignore[attr-defined]
    return retrieve
