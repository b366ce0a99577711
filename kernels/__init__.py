"""chatkv.kernels: attention over paged KV and KV storage.

``attention_backend(device)`` is the dispatch point: the torch reference in
``attention.py`` runs everywhere (and is the oracle for any faster kernel); a
Triton backend for CUDA plugs in here (later issue).
"""

from chatkv.kernels.attention import AttentionMetadata, build_metadata, paged_attention, store_kv


def attention_backend(device) -> tuple:
    """Return ``(store_kv, paged_attention)`` for ``device``."""
    return store_kv, paged_attention


__all__ = ["AttentionMetadata", "attention_backend", "build_metadata", "paged_attention", "store_kv"]
