"""The dense (vector) index of a knowledge base: FAISS, derived from the database.

``DenseIndex`` wraps a FAISS ``IndexIDMap2`` whose ids are the chunk row ids in the
database and whose vectors are their normalised embeddings (inner product = cosine).

- Kind: ``IndexFlatIP`` (exact) while the knowledge base has at most
  ``HNSW_THRESHOLD`` (50,000) chunks; above that ``IndexHNSWFlat`` with inner
  product (M=32, efConstruction=80, efSearch = max(64, 2k)): a flat scan of 50,000
  384-dim vectors costs about 10 ms a query on one core and grows linearly, HNSW
  stays around a millisecond at a recall near 0.99. HNSW cannot delete vectors, so
  removing chunks from an HNSW index means rebuilding it (``remove`` says so).
- File: ``write(path)`` uses ``faiss.write_index`` on a temporary file in the same
  directory, fsyncs it, makes it 0600 and renames it over ``path``; then a small
  JSON sidecar (``<path>.json``: format, kind, dim, ntotal, byte size and crc32 of
  the index file, plus the caller's identity fields) is written the same way. A
  reader sees the old pair or the new one; a crash between the two renames leaves a
  sidecar whose crc32 does not match, i.e. a refused index.
- ``load(path, expected_ids, dim)`` never trusts the file: it returns None, with
  the reason logged, for a missing or unreadable file or sidecar, a crc32 or size
  mismatch (damage), a FAISS parse error, another index type or dimension, other
  identity fields, or an id set that differs from ``expected_ids`` (out of step with
  the database). The caller then rebuilds from the database's embeddings. The
  crc32 is checked before FAISS parses a byte, so damaged files never reach it.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from pathlib import Path
from typing import Any, Optional, Sequence

import faiss
import numpy as np

from chatkv.storage.files import atomic_write, make_private_dir

log = logging.getLogger(__name__)

HNSW_THRESHOLD = 50_000
HNSW_M = 32
HNSW_EF_CONSTRUCTION = 80
HNSW_EF_SEARCH = 64
FORMAT = 1
FLAT, HNSW = "flat", "hnsw"


def kind_for(n: int, hnsw_threshold: int = HNSW_THRESHOLD) -> str:
    """The index kind for ``n`` vectors: flat up to ``hnsw_threshold``, HNSW above."""
    return HNSW if n > hnsw_threshold else FLAT


def sidecar_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _as_ids(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(ids, dtype=np.int64).reshape(-1))


def _as_vectors(vectors: np.ndarray, dim: int) -> np.ndarray:
    v = np.ascontiguousarray(np.asarray(vectors, dtype=np.float32))
    if v.ndim == 1:
        v = v.reshape(1, -1)
    if v.ndim != 2 or v.shape[1] != dim:
        raise ValueError(f"vectors must be [n, {dim}], got shape {v.shape}")
    return v


class DenseIndex:
    """A FAISS ``IndexIDMap2`` of chunk ids; see the module docstring."""

    def __init__(self, dim: int, kind: str = FLAT, index: Optional[faiss.Index] = None) -> None:
        if kind not in (FLAT, HNSW):
            raise ValueError(f"unknown index kind {kind!r}")
        self.dim = dim
        self.kind = kind
        if index is None:
            if kind == FLAT:
                inner = faiss.IndexFlatIP(dim)
            else:
                inner = faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
                inner.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
            index = faiss.IndexIDMap2(inner)  # the wrapper keeps a reference to inner
        self.index = index

    @classmethod
    def build(
        cls, dim: int, ids: Sequence[int] | np.ndarray, vectors: np.ndarray, hnsw_threshold: int = HNSW_THRESHOLD
    ) -> DenseIndex:
        """A new index of the right kind for ``len(ids)`` vectors, holding them."""
        ids = _as_ids(ids)
        out = cls(dim, kind_for(len(ids), hnsw_threshold))
        out.add(ids, vectors)
        return out

    # ------------------------------------------------------------------ contents

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    def ids(self) -> np.ndarray:
        """The ids held, in index order."""
        return faiss.vector_to_array(self.index.id_map).astype(np.int64, copy=False)

    def add(self, ids: Sequence[int] | np.ndarray, vectors: np.ndarray) -> None:
        ids = _as_ids(ids)
        v = _as_vectors(vectors, self.dim)
        if len(ids) != len(v):
            raise ValueError(f"{len(ids)} ids for {len(v)} vectors")
        if len(ids):
            self.index.add_with_ids(v, ids)

    def remove(self, ids: Sequence[int] | np.ndarray) -> bool:
        """Remove these ids (those absent are ignored). Returns False, removing nothing,
        when the index cannot delete (HNSW): the caller rebuilds it instead."""
        ids = _as_ids(ids)
        if not len(ids):
            return True
        if self.kind == HNSW:
            return False
        self.index.remove_ids(faiss.IDSelectorBatch(ids))
        return True

    def search(
        self, query: np.ndarray, k: int, allowed_ids: Optional[Sequence[int] | np.ndarray] = None
    ) -> list[tuple[int, float]]:
        """The ``k`` nearest (id, inner product), best first, for one query vector;
        only among ``allowed_ids`` when given."""
        q = _as_vectors(query, self.dim)[:1]
        k = min(int(k), self.ntotal)
        if k <= 0:
            return []
        sel = None
        if allowed_ids is not None:
            allowed = _as_ids(allowed_ids)
            if not len(allowed):
                return []
            sel = faiss.IDSelectorBatch(allowed)  # referenced below until the search returns
        if self.kind == HNSW:
            params = faiss.SearchParametersHNSW(efSearch=max(HNSW_EF_SEARCH, 2 * k))
            if sel is not None:
                params.sel = sel
        else:
            params = faiss.SearchParameters(sel=sel) if sel is not None else None
        scores, ids = self.index.search(q, k, params=params)
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]

    # ------------------------------------------------------------------ files

    def write(self, path: str | os.PathLike, identity: Optional[dict[str, Any]] = None) -> None:
        """Write the index atomically to ``path`` (0600), then its sidecar. Raises OSError."""
        path = Path(path)
        make_private_dir(path.parent)
        crc_size: list[int] = []

        def write_index(tmp: Path) -> None:
            faiss.write_index(self.index, str(tmp))
            crc, size = 0, 0
            with open(tmp, "rb") as f:
                while block := f.read(1 << 20):
                    crc = zlib.crc32(block, crc)
                    size += len(block)
            crc_size[:] = [crc, size]

        atomic_write(path, write_index)
        meta = {
            "format": FORMAT,
            "kind": self.kind,
            "dim": self.dim,
            "ntotal": self.ntotal,
            "bytes": crc_size[1],
            "crc32": crc_size[0],
            "identity": identity or {},
        }
        data = json.dumps(meta, sort_keys=True).encode()
        atomic_write(sidecar_path(path), lambda tmp: tmp.write_bytes(data))

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        expected_ids: Sequence[int] | np.ndarray,
        dim: int,
        identity: Optional[dict[str, Any]] = None,
    ) -> Optional[DenseIndex]:
        """The index at ``path`` if it is whole and holds exactly ``expected_ids`` with
        dimension ``dim`` (and, when given, the same identity fields); else None with
        the reason logged at WARNING (INFO for a missing file)."""
        path = Path(path)

        def refuse(why: str, level: int = logging.WARNING) -> None:
            log.log(level, "dense index %s not used: %s", path, why)
            return None

        if not path.exists():
            return refuse("it does not exist", logging.INFO)
        try:
            meta = json.loads(sidecar_path(path).read_bytes())
            if not isinstance(meta, dict):
                raise ValueError("not a JSON object")
        except FileNotFoundError:
            return refuse(f"its sidecar {sidecar_path(path).name} is missing")
        except (OSError, ValueError) as e:
            return refuse(f"its sidecar {sidecar_path(path).name} is unreadable ({e})")
        if meta.get("format") != FORMAT:
            return refuse(f"sidecar format {meta.get('format')!r}, expected {FORMAT}")
        if meta.get("dim") != dim:
            return refuse(f"dimension {meta.get('dim')!r}, the knowledge base's is {dim}")
        if identity is not None and meta.get("identity") != identity:
            return refuse(f"it was built for {meta.get('identity')!r}, not {identity!r}")
        try:
            data = path.read_bytes()
        except OSError as e:
            return refuse(f"it cannot be read ({e})")
        if len(data) != meta.get("bytes") or zlib.crc32(data) != meta.get("crc32"):
            return refuse(
                f"it is damaged ({len(data)} bytes, crc32 {zlib.crc32(data):08x}; "
                f"written as {meta.get('bytes')} bytes, crc32 {meta.get('crc32', 0) or 0:08x})"
            )
        try:
            index = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
        except (RuntimeError, MemoryError, ValueError) as e:
            return refuse(f"FAISS cannot read it ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
        if not isinstance(index, faiss.IndexIDMap2):
            return refuse(f"it is a {type(index).__name__}, not an IndexIDMap2")
        inner = faiss.downcast_index(index.index)
        kind = (
            FLAT if isinstance(inner, faiss.IndexFlatIP) else HNSW if isinstance(inner, faiss.IndexHNSWFlat) else None
        )
        if kind is None or kind != meta.get("kind") or index.metric_type != faiss.METRIC_INNER_PRODUCT:
            return refuse(f"its inner index is a {type(inner).__name__}, not a flat or HNSW inner-product index")
        if index.d != dim:
            return refuse(f"dimension {index.d}, the knowledge base's is {dim}")
        out = cls(dim, kind, index)
        held = np.sort(out.ids())
        want = np.sort(_as_ids(expected_ids))
        if len(held) != len(want) or not np.array_equal(held, want):
            missing = len(np.setdiff1d(want, held))
            extra = len(np.setdiff1d(held, want))
            return refuse(f"out of step with the database: {missing} chunk(s) missing, {extra} not in the database")
        return out
