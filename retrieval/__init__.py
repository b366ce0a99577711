"""chatkv.retrieval: chunking, embeddings, FAISS index, context assembly (later issue)."""
