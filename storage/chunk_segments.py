"""Retrieved chunks' KV on disk: one safetensors file per chunk (chatkv.rag.chunk_kv's disk tier).

A chunk's KV is computed once in its canonical frame (a fixed short prefix, then the chunk's
tokens at fixed positions; see chatkv/rag/chunk_kv.py) and kept here under its key: a hash of the
chunk's text, the model fingerprint and the kv dtype, so a chunk whose text changed has
another key and never reads the old KV. Each file is a ``KVStore`` snapshot (same format,
crc32 checksum, atomic write, checks on load) of the chunk's own tokens, with header fields
``chunk_frame`` (where the chunk's first token sat) and ``chunk_text_hash``, which a load
requires. A file that fails any check is discarded with a warning (``KVStore.load``) and the
caller computes the chunk again: a slower turn, never a wrong one.

Files are a cache: ``budget_bytes`` bounds the directory, the least recently used files
(by modification time, refreshed on every hit) going first.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Sequence

import torch

from chatkv.errors import SnapshotInvalid
from chatkv.storage.kv_store import SUFFIX, KVStore

log = logging.getLogger("chatkv.rag.chunk_kv")

__all__ = ["ChunkSegments", "chunk_key"]


def chunk_key(text_hash: str, model_fingerprint: str, kv_dtype: str, frame: Sequence[int]) -> str:
    """The file key of a chunk's KV: its text's hash, the model, the kv dtype and the canonical
    frame's prefix tokens (another frame is other KV)."""
    h = hashlib.sha256()
    for part in (text_hash, model_fingerprint, kv_dtype, ",".join(map(str, frame))):
        h.update(part.encode())
        h.update(b"\0")
    return "chunk-" + h.hexdigest()[:40]


class ChunkSegments:
    def __init__(self, root: Path, budget_bytes: int = 2 * 2**30):
        self.store = KVStore(Path(root))
        self.budget = budget_bytes

    def save(
        self,
        key: str,
        token_ids: Sequence[int],
        k: list[torch.Tensor],
        v: list[torch.Tensor],
        *,
        model_fingerprint: str,
        kv_dtype: str,
        frame: int,
        text_hash: str,
    ) -> None:
        """Write a chunk's KV (per-layer ``[tokens, kv_heads, row]``, the pool's stored form).
        A failure to write is a warning: the KV stays in memory only."""
        try:
            self.store.save(
                key,
                token_ids,
                k,
                v,
                model_fingerprint=model_fingerprint,
                kv_dtype=kv_dtype,
                extra_meta={"chunk_frame": str(frame), "chunk_text_hash": text_hash},
            )
        except (OSError, ValueError) as e:
            log.warning("chunk KV %s could not be written (%s); it is kept in memory only", key, e)
            return
        self._enforce_budget()

    def load(
        self,
        key: str,
        token_ids: Sequence[int],
        *,
        model_fingerprint: str,
        kv_dtype: str,
        frame: int,
        text_hash: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """The chunk's KV from disk, or None when there is none or it fails a check (damage and
        mismatches are logged and the file removed by KVStore.load)."""
        path = self.store.path(key)
        if not path.exists():
            return None
        try:
            k, v, n = self.store.load(
                key,
                token_ids=token_ids,
                model_fingerprint=model_fingerprint,
                kv_dtype=kv_dtype,
                num_layers=num_layers,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                min_tokens=len(token_ids),
                expect={"chunk_frame": str(frame), "chunk_text_hash": text_hash},
            )
        except (SnapshotInvalid, ValueError) as e:
            log.warning("chunk KV %s is unusable (%s); computing it again", key, e)
            return None
        try:
            os.utime(path)  # recently used: the budget removes others first
        except OSError:
            pass
        return k, v

    def _enforce_budget(self) -> None:
        try:
            files = [p for p in self.store.root.iterdir() if p.name.endswith(SUFFIX)]
            stats = sorted(((p.stat().st_mtime, p.stat().st_size, p) for p in files), key=lambda t: t[0])
        except OSError:
            return
        total = sum(s for _, s, _ in stats)
        for _, size, p in stats:
            if total <= self.budget:
                break
            try:
                p.unlink()
                total -= size
            except OSError:
                pass
