"""Retrieved chunks' KV in a canonical frame: the KV manager's chunk owner.

A chunk's KV is computed once, in a **canonical frame**: a fixed short prefix (``frame``
tokens: the model's start tokens, the same for every chunk), then the chunk's tokens at
positions ``len(frame) ..``. Placed into a prompt (chatkv.rag.placement) its keys are
re-rotated to the positions it takes there (RoPE rotations compose: ``LlamaModel.rotate_keys``,
the rotation a moving sink window uses); values are position-free.

An entry is kept by **key** = hash of the chunk's text + model fingerprint + kv dtype + the
frame's tokens (``storage.chunk_segments.chunk_key``): a chunk whose text changed has another
key, so it gets new KV, never the old. Entries are held as host-memory tensors (the pool's
stored form, ``[tokens, kv_heads, row]`` per layer), in an LRU of their own bounded by
``budget_bytes`` (evicted entries stay on disk), and written through to disk as one safetensors
file each (``storage.chunk_segments``); a restarted process reads them back instead of
computing them. A damaged or mismatched file is discarded with a warning and the chunk is
computed again.

This store holds no pool block between turns: placing a chunk copies its rows into the
request's own blocks. So it adds nothing to the pool's reference counts, and
``KVManager.check_integrity`` has nothing of it to account for; ``KVManager.stats`` reports it.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from chatkv.storage.chunk_segments import ChunkSegments, chunk_key


@dataclass(eq=False)
class ChunkEntry:
    """One chunk's KV in its canonical frame: ``k[i]``/``v[i]`` are layer i's rows of ``tokens``,
    whose first token sat at position ``frame`` (the frame prefix's length)."""

    key: str
    tokens: tuple[int, ...]
    frame: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k) * 2


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class ChunkKV:
    """The chunk owner: an LRU of ChunkEntry in host memory over a directory of files (or none)."""

    def __init__(
        self,
        fingerprint: str,
        kv_dtype: str,
        frame: Sequence[int],
        geometry: tuple[int, int, int],
        root: Path | None,
        budget_bytes: int = 256 * 2**20,
        disk_budget_bytes: int = 2 * 2**30,
    ):
        self.fingerprint, self.kv_dtype = fingerprint, kv_dtype
        self.frame = tuple(int(t) for t in frame)
        self.geometry = geometry  # (layers, kv heads, head dim) of a file's check
        self.budget = budget_bytes
        self.disk = ChunkSegments(root, disk_budget_bytes) if root is not None else None
        self._entries: OrderedDict[str, ChunkEntry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        # lifetime counters: entries found in memory, read from disk, computed, evicted from memory
        self.hits = self.loaded = self.computed = self.evicted = 0
        self.filler = None  # chatkv.rag.background.Filler: chunks queued to be made when the engine is idle

    def key(self, text: str) -> str:
        return chunk_key(text_hash(text), self.fingerprint, self.kv_dtype, self.frame)

    def get(self, text: str, tokens: Sequence[int]) -> ChunkEntry | None:
        """The chunk's KV from memory, else from disk (then kept in memory), else None."""
        key = self.key(text)
        tokens = tuple(tokens)
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e.tokens == tokens:
                self._entries.move_to_end(key)
                self.hits += 1
                return e
        if self.disk is None:
            return None
        layers, heads, dim = self.geometry
        got = self.disk.load(
            key,
            tokens,
            model_fingerprint=self.fingerprint,
            kv_dtype=self.kv_dtype,
            frame=len(self.frame),
            text_hash=text_hash(text),
            num_layers=layers,
            num_kv_heads=heads,
            head_dim=dim,
        )
        if got is None:
            return None
        e = ChunkEntry(key, tokens, len(self.frame), got[0], got[1])
        self._keep(e)
        self.loaded += 1
        return e

    def put(self, text: str, tokens: Sequence[int], k: list[torch.Tensor], v: list[torch.Tensor]) -> ChunkEntry:
        """Keep a freshly computed chunk's KV (in memory and on disk)."""
        e = ChunkEntry(
            self.key(text),
            tuple(tokens),
            len(self.frame),
            [x.cpu().contiguous() for x in k],
            [x.cpu().contiguous() for x in v],
        )
        self.computed += 1
        self._keep(e)
        if self.disk is not None:
            self.disk.save(
                e.key,
                e.tokens,
                e.k,
                e.v,
                model_fingerprint=self.fingerprint,
                kv_dtype=self.kv_dtype,
                frame=e.frame,
                text_hash=text_hash(text),
            )
        return e

    def _keep(self, e: ChunkEntry) -> None:
        with self._lock:
            old = self._entries.pop(e.key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[e.key] = e
            self._bytes += e.nbytes
            while self._bytes > self.budget and len(self._entries) > 1:
                _, gone = self._entries.popitem(last=False)
                self._bytes -= gone.nbytes
                self.evicted += 1

    def clear(self) -> None:
        """Drop every entry from memory (the files stay)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> dict[str, int]:
        return {
            "chunk_entries": len(self._entries),
            "chunk_bytes": self._bytes,
            "chunk_hits": self.hits,
            "chunk_loaded": self.loaded,
            "chunk_computed": self.computed,
            "chunk_evicted": self.evicted,
        }
