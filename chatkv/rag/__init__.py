"""RAG: the context a turn's prompt gets from documents, and the retrieved chunks' KV.

``context`` (pinned documents, retrieved sources, citations), ``chunk_kv`` (retrieved chunks'
KV in a canonical frame, in memory and on disk), ``placement`` (placing chunks' KV into a
turn's prompt, ``rag_kv_reuse``) and ``blend`` (CacheBlend's selective recompute). Finding the
chunks is ``chatkv.retrieval``. Import the module you need: this package imports nothing itself.
"""
