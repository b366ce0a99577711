"""KV snapshots of a conversation, one safetensors file per snapshot.

(Past ~400 lines on purpose: the format is written and verified in one file, so the writer
and the checks on load cannot drift apart.)

A snapshot holds, for every layer ``i``, the keys ``k.i`` and values ``v.i`` of
the first ``T`` tokens of a conversation, laid out by token (shape
``[T, num_kv_heads, head_dim]``, independent of the engine's block size; quantised
kv dtypes, ``int8@...`` and ``fp8_e4m3@...``, store uint8 rows whose last 4 bytes are
the row's scale, and ``head_dim`` is that row's width), plus
the tensor ``token_ids`` (int64 ``[T]``). The safetensors header metadata
(str -> str) records:

    format_version, model_fingerprint, kv_dtype, token_count, token_hash,
    num_layers, num_kv_heads, head_dim, extra_tensors, checksum

``checksum`` covers the tensor bytes, which safetensors does not checksum:
``"crc32:<8 hex>"`` = CRC-32 over, for every tensor name in sorted order,
``name (utf-8) + b"\\0" + crc32(tensor bytes) as 4 big-endian bytes``. The
per-tensor CRCs run in threads (zlib releases the GIL). CRC-32 was chosen over
sha256/blake2b because it is as fast as hardware SHA-256 here and much faster
where SHA extensions are missing, and it is certain to catch any burst of up to
32 flipped bits; it guards against damage, not against an adversary.

Contracts:

- Snapshots are a cache. ``KVStore(root)`` never raises: a directory that
  cannot be created or read (read-only, full disk) is logged once and every
  ``save`` then raises ``OSError``, which the caller logs and survives.
- ``save`` writes a temporary file in the same directory, fsyncs it, renames
  it over ``<key>.safetensors`` and fsyncs the directory: a reader (or a crash
  at any moment) sees either the old complete snapshot or the new one. Any
  I/O failure (ENOSPC, EROFS, EIO, including those inside safetensors) is an
  ``OSError``, and the previous snapshot is left intact.
- ``load`` checks every field and the data checksum. Any mismatch or damage is
  logged, the file is deleted and :class:`SnapshotInvalid` is raised naming
  what was wrong; the caller recomputes the tokens. Returned tensors are
  backed by a private (copy-on-write) mmap of the file.
- Keys are ``[A-Za-z0-9_-]{1,128}``; anything else is a ``ValueError``.
- ``extra_tensors`` is always written empty; a snapshot declaring some (a
  layout another build may write) is refused by ``load`` with ``ValueError``
  and kept.
- A directory the store creates is mode 0700 (an existing one is left as it
  is); snapshot files are 0600. Nothing is pickled.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import secrets
import struct
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from chatkv.errors import SnapshotInvalid
from chatkv.storage.files import atomic_write, make_private_dir

__all__ = ["FORMAT_VERSION", "SnapshotMeta", "KVStore", "token_hash"]

FORMAT_VERSION = 1
# kv dtypes whose tensors are rows of bytes: head_dim quantised values, then the row's float32
# scale (chatkv.kernels.kv_quant); the header's head_dim is then the row's width (head_dim + 4)
QUANTISED = ("int8", "fp8_e4m3")
SUFFIX = ".safetensors"

log = logging.getLogger("chatkv.storage")

_KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
# ".<key>.<pid>.<process nonce>.<write nonce>.tmp": never matches *.safetensors
_TEMP_RE = re.compile(r"\.([A-Za-z0-9_-]{1,128})\.(\d+)\.([0-9a-f]{16})\.([0-9a-f]{8})\.tmp")
# safetensors' save_file writes its own ".tmpXXXXXX" beside the target and renames it over
# ours; a writer killed meanwhile leaves it (no pid to tell whose: removed once stale)
_LIB_TEMP_RE = re.compile(r"\.tmp[A-Za-z0-9]{6}")
_OS_ERROR_RE = re.compile(r"os error (\d+)")
_PROCESS_NONCE = secrets.token_hex(8)
_STALE_TEMP_S = 3600.0  # a temp file this old is left over whoever wrote it
_PARALLEL_MIN_BYTES = 4 << 20
_META_FIELDS = (
    "format_version",
    "model_fingerprint",
    "kv_dtype",
    "token_count",
    "token_hash",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "extra_tensors",
    "checksum",
)


@dataclass(frozen=True)
class SnapshotMeta:
    """What a snapshot's header says, plus the file's size and path."""

    format_version: int
    model_fingerprint: str
    kv_dtype: str
    token_count: int
    token_hash: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    nbytes: int
    file: str
    extra_tensors: tuple[str, ...] = ()
    checksum: str = ""


def token_hash(token_ids: Sequence[int]) -> str:
    """sha256 (hex) over the token ids as int64 little-endian bytes."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).hexdigest()


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(f"invalid snapshot key {key!r}: use 1-128 characters of A-Z a-z 0-9 _ -")
    return key


def _torch_dtype(kv_dtype: str) -> torch.dtype:
    """The tensors' dtype for a kv dtype name: a torch dtype name (``bfloat16``), optionally
    ``@`` the dtype the KV was computed in (``float32@bfloat16``); quantised KV
    (``int8@...``, ``fp8_e4m3@...``) is stored as its uint8 rows."""
    if not isinstance(kv_dtype, str):
        raise ValueError(f"unknown kv dtype {kv_dtype!r}")
    stored, _, computed = kv_dtype.partition("@")
    if computed and not isinstance(getattr(torch, computed, None), torch.dtype):
        raise ValueError(f"unknown kv dtype {kv_dtype!r}")
    if stored in QUANTISED:
        return torch.uint8
    dt = getattr(torch, stored, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown kv dtype {kv_dtype!r}")
    return dt


def _tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A zero-copy uint8 view of a contiguous CPU tensor's bytes."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    names = sorted(tensors)
    bufs = [_tensor_bytes(tensors[n]) for n in names]
    workers = min(4, os.cpu_count() or 1)
    crcs = None
    if workers > 1 and sum(b.nbytes for b in bufs) >= _PARALLEL_MIN_BYTES:
        try:
            with ThreadPoolExecutor(workers) as ex:  # a fresh pool: safe after fork()
                crcs = list(ex.map(zlib.crc32, bufs))
        except RuntimeError:  # "cannot schedule new futures after interpreter shutdown": the atexit writes
            crcs = None
    if crcs is None:
        crcs = [zlib.crc32(b) for b in bufs]
    summary = b"".join(n.encode() + b"\0" + struct.pack(">I", c) for n, c in zip(names, crcs))
    return f"crc32:{zlib.crc32(summary):08x}"


def _independent(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors whose bytes do not overlap (safetensors refuses
    shared memory, e.g. the same tensor passed as k and v): overlaps are cloned."""
    out, spans = {}, []
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        if any(start < e and s < end for s, e in spans):
            t = t.clone()
            start = t.data_ptr()
            end = start + t.numel() * t.element_size()
        spans.append((start, end))
        out[name] = t
    return out


def _save_file(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors' save_file, its I/O failures (a SafetensorError) turned into OSError."""
    try:
        save_file(tensors, path, metadata=metadata)
    except SafetensorError as e:
        m = _OS_ERROR_RE.search(str(e))
        code = int(m.group(1)) if m else errno.EIO
        raise OSError(code, f"writing {path} failed: {os.strerror(code)} ({e})") from e


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class KVStore:
    """Snapshots of conversations' KV caches under one directory."""

    def __init__(self, root: Path):
        """Use ``root`` (created 0700 if missing). Never raises for the directory: a
        problem is logged, and ``save`` raises it again later."""
        self.root = Path(root)
        try:
            make_private_dir(self.root)
            removed = self.cleanup_temp()
        except OSError as e:
            log.warning("kv store %s is unusable (%s); conversations will not keep their KV on disk", self.root, e)
            return
        if removed:
            log.warning("kv store %s: removed %d temp file(s) left by interrupted writes", self.root, removed)

    # ---------------------------------------------------------------- paths
    def path(self, key: str) -> Path:
        return self.root / (_check_key(key) + SUFFIX)

    def keys(self) -> set[str]:
        """The keys of every snapshot file (none if the directory does not exist)."""
        out = set()
        for entry in self.dir_entries():
            if entry.name.endswith(SUFFIX) and entry.is_file():
                stem = entry.name[: -len(SUFFIX)]
                if _KEY_RE.fullmatch(stem):
                    out.add(stem)
        return out

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def dir_entries(self) -> list[os.DirEntry]:
        """The store directory's entries (none if it does not exist)."""
        try:
            with os.scandir(self.root) as it:
                return list(it)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def cleanup_temp(self) -> int:
        """Remove temp files of interrupted writes; return how many were removed.

        A temp file is left over when its writer process is gone, when it is
        this pid's but from an earlier process (pid reuse), or when it is older
        than an hour; safetensors' own temp files (``.tmpXXXXXX``, no pid)
        once they are an hour old. Temp files of live writers are kept. Never
        raises for a missing or read-only directory.
        """
        removed = 0
        now = time.time()
        for entry in self.dir_entries():
            m = _TEMP_RE.fullmatch(entry.name)
            if m is None and not _LIB_TEMP_RE.fullmatch(entry.name):
                continue
            try:
                age = now - entry.stat().st_mtime
            except FileNotFoundError:
                continue
            if m is None:  # safetensors' own: only its age tells
                stale = False
            elif int(m.group(2)) == os.getpid():
                stale = m.group(3) != _PROCESS_NONCE
            else:
                stale = not _pid_alive(int(m.group(2)))
            if stale or age > _STALE_TEMP_S:
                try:
                    os.unlink(entry.path)
                    removed += 1
                except OSError:  # gone meanwhile, or a read-only directory: nothing to do
                    pass
        return removed

    # ----------------------------------------------------------------- save
    def save(
        self,
        key: str,
        token_ids: Sequence[int],
        k: Sequence[torch.Tensor],
        v: Sequence[torch.Tensor],
        *,
        model_fingerprint: str,
        kv_dtype: str,
        extra_meta: Mapping[str, str] | None = None,
    ) -> SnapshotMeta:
        """Write the snapshot of ``key`` atomically, replacing any older one.

        ``k[i]``/``v[i]``: layer i, shape ``[len(token_ids), num_kv_heads,
        head_dim]``, dtype ``kv_dtype``. ``extra_meta``: more header fields (str -> str,
        none of the standard ones), e.g. a segment's place in its conversation, which
        ``load(expect=...)`` can require. Bad arguments raise ``ValueError``; a
        write that fails (full disk, read-only or missing directory) raises
        ``OSError`` and leaves any older snapshot of ``key`` as it was.
        """
        path = self.path(key)
        dtype = _torch_dtype(kv_dtype)
        ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64)).reshape(-1)
        T = ids.numel()
        if T == 0:
            raise ValueError(f"snapshot {key}: no tokens to save")
        if len(k) != len(v) or len(k) == 0:
            raise ValueError(f"snapshot {key}: {len(k)} key layers and {len(v)} value layers")
        if not isinstance(model_fingerprint, str) or not model_fingerprint:
            raise ValueError(f"snapshot {key}: empty model fingerprint")
        shape = tuple(k[0].shape)
        if len(shape) != 3 or shape[0] != T:
            raise ValueError(f"snapshot {key}: layer 0 keys have shape {shape}, expected [{T}, heads, head_dim]")
        tensors: dict[str, torch.Tensor] = {"token_ids": ids.contiguous()}
        for name, layers in (("k", k), ("v", v)):
            for i, t in enumerate(layers):
                if tuple(t.shape) != shape or t.dtype != dtype:
                    raise ValueError(
                        f"snapshot {key}: {name}.{i} is {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}"
                    )
                tensors[f"{name}.{i}"] = t
        tensors = _independent(tensors)
        metadata = {
            "format_version": str(FORMAT_VERSION),
            "model_fingerprint": model_fingerprint,
            "kv_dtype": kv_dtype,
            "token_count": str(T),
            "token_hash": token_hash(ids.numpy()),
            "num_layers": str(len(k)),
            "num_kv_heads": str(shape[1]),
            "head_dim": str(shape[2]),
            "extra_tensors": "",
            "checksum": _checksum(tensors),
        }
        for name, value in (extra_meta or {}).items():
            if name in metadata or not isinstance(name, str) or not isinstance(value, str):
                raise ValueError(f"snapshot {key}: extra header field {name!r}={value!r} is not a new str field")
            metadata[name] = value

        make_private_dir(self.root)  # it may have been removed, or unwritable at start
        tmp = self.root / f".{key}.{os.getpid()}.{_PROCESS_NONCE}.{secrets.token_hex(4)}.tmp"
        atomic_write(path, lambda p: _save_file(tensors, p, metadata), tmp=tmp)
        return self._meta_from(metadata, path, path.stat().st_size)

    # ----------------------------------------------------------------- read
    @staticmethod
    def _meta_from(metadata: Mapping[str, str] | None, path: Path, nbytes: int) -> SnapshotMeta:
        key = path.name[: -len(SUFFIX)]
        if not metadata:
            raise SnapshotInvalid(f"snapshot {key}: header has no metadata")
        missing = [f for f in _META_FIELDS if f not in metadata]
        if missing:
            raise SnapshotInvalid(f"snapshot {key}: header lacks {', '.join(missing)}")
        ints = {}
        for f in ("format_version", "token_count", "num_layers", "num_kv_heads", "head_dim"):
            s = metadata[f]
            if not (s.isascii() and s.isdigit()):
                raise SnapshotInvalid(f"snapshot {key}: header field {f}={s!r} is not a count")
            ints[f] = int(s)
        extras = metadata["extra_tensors"]
        return SnapshotMeta(
            format_version=ints["format_version"],
            model_fingerprint=metadata["model_fingerprint"],
            kv_dtype=metadata["kv_dtype"],
            token_count=ints["token_count"],
            token_hash=metadata["token_hash"],
            num_layers=ints["num_layers"],
            num_kv_heads=ints["num_kv_heads"],
            head_dim=ints["head_dim"],
            nbytes=nbytes,
            file=str(path),
            extra_tensors=tuple(extras.split(",")) if extras else (),
            checksum=metadata["checksum"],
        )

    def load(
        self,
        key: str,
        *,
        token_ids: Sequence[int],
        model_fingerprint: str,
        kv_dtype: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        min_tokens: int = 0,
        expect: Mapping[str, str] | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
        """Load and verify the snapshot of ``key``; return ``(k_layers, v_layers, n)``.

        The stored tokens must be a prefix of ``token_ids`` (the conversation
        may have grown since); ``n`` is their count. Any mismatch (fingerprint,
        kv dtype, geometry, format version, tokens not a prefix of
        ``token_ids``) or damage (missing, truncated, not safetensors, wrong
        shapes, checksum) logs a warning, deletes the file and raises
        :class:`SnapshotInvalid`. A valid snapshot of fewer than ``min_tokens``
        tokens raises :class:`SnapshotInvalid` too, but is kept. A snapshot
        declaring extra tensors (a layout this build does not read) raises
        ``ValueError`` and is kept. ``expect``: header fields that must hold exactly
        these values (any other value is a mismatch, as above).
        """
        path = self.path(key)
        _torch_dtype(kv_dtype)  # a bad argument is the caller's error, not the file's
        try:
            inode = path.stat().st_ino
        except FileNotFoundError:
            msg = f"snapshot {key}: no file {path}"
            log.warning(msg)
            raise SnapshotInvalid(msg) from None
        try:
            return self._read_verified(
                path,
                key,
                token_ids,
                model_fingerprint,
                kv_dtype,
                num_layers,
                num_kv_heads,
                head_dim,
                min_tokens,
                expect or {},
            )
        except _TooShort as e:
            log.info(str(e))
            raise SnapshotInvalid(str(e)) from None
        except _OtherLayout as e:
            raise ValueError(str(e)) from None
        except SnapshotInvalid as e:
            reason, cause = str(e), None
        except Exception as e:  # safetensors, OS and torch errors alike: the file is unusable
            reason, cause = f"snapshot {key}: unreadable ({type(e).__name__}: {e})", e
        log.warning("%s; discarding %s", reason, path)
        try:
            if path.stat().st_ino == inode:  # not a newer snapshot written meanwhile
                path.unlink()
        except OSError:  # gone meanwhile, or a read-only directory: it stays refused either way
            pass
        raise SnapshotInvalid(reason) from cause

    def _read_verified(
        self, path, key, token_ids, model_fingerprint, kv_dtype, num_layers, num_kv_heads, head_dim, min_tokens, expect
    ):
        want_ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        with safe_open(path, framework="pt") as f:
            raw = f.metadata()
            meta = self._meta_from(raw, path, 0)
            bad = lambda what: SnapshotInvalid(f"snapshot {key}: {what}")  # noqa: E731
            for name, value in expect.items():
                if raw.get(name) != value:
                    raise bad(f"header field {name} is {raw.get(name)!r}, expected {value!r}")
            if meta.format_version != FORMAT_VERSION:
                raise bad(f"format version {meta.format_version}, this build reads {FORMAT_VERSION}")
            if meta.model_fingerprint != model_fingerprint:
                raise bad(
                    f"model fingerprint differs (stored {meta.model_fingerprint!r}, expected {model_fingerprint!r})"
                )
            if meta.kv_dtype != kv_dtype:
                raise bad(f"kv dtype differs (stored {meta.kv_dtype}, expected {kv_dtype})")
            stored_geo = (meta.num_layers, meta.num_kv_heads, meta.head_dim)
            if stored_geo != (num_layers, num_kv_heads, head_dim):
                raise bad(
                    f"geometry differs (stored layers/kv heads/head dim {stored_geo}, "
                    f"expected {(num_layers, num_kv_heads, head_dim)})"
                )
            n = meta.token_count
            if n == 0:
                raise bad("holds no tokens")
            if n > want_ids.size:
                raise bad(f"holds {n} tokens but the conversation has only {want_ids.size}")
            if token_hash(want_ids[:n]) != meta.token_hash:
                raise bad(f"token ids differ: the stored {n} tokens are not a prefix of the conversation")
            if n < min_tokens:
                raise _TooShort(f"snapshot {key}: holds {n} tokens, fewer than the {min_tokens} wanted")
            layer_names = [f"{p}.{i}" for p in "kv" for i in range(num_layers)]
            expected = set(layer_names) | {"token_ids"} | set(meta.extra_tensors)
            names = set(f.keys())
            if names != expected:
                diff = sorted(names ^ expected)[:4]
                raise bad(f"tensor names differ from the header's ({', '.join(diff)})")
            if meta.extra_tensors:
                raise _OtherLayout(
                    f"snapshot {key} holds extra tensors {', '.join(meta.extra_tensors)}, "
                    f"a layout this build does not read"
                )
            tensors = {name: f.get_tensor(name) for name in names}
        dtype = _torch_dtype(kv_dtype)
        shape = (n, num_kv_heads, head_dim)
        for name in layer_names:
            t = tensors[name]
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise bad(f"tensor {name} is {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}")
        ids = tensors["token_ids"]
        if ids.dtype != torch.int64 or tuple(ids.shape) != (n,):
            raise bad(f"tensor token_ids is {ids.dtype} {tuple(ids.shape)}, expected int64 ({n},)")
        if _checksum(tensors) != meta.checksum:
            raise bad(f"tensor data checksum differs (stored {meta.checksum}): the file is damaged")
        stored_ids = ids.numpy()
        if token_hash(stored_ids) != meta.token_hash or not np.array_equal(stored_ids, want_ids[:n]):
            raise bad("stored token_ids do not match the header's token hash")
        k_layers = [tensors[f"k.{i}"] for i in range(num_layers)]
        v_layers = [tensors[f"v.{i}"] for i in range(num_layers)]
        return k_layers, v_layers, n


class _TooShort(Exception):
    """A valid snapshot shorter than min_tokens: not used, but not deleted."""


class _OtherLayout(ValueError):
    """Not damage: a well-formed snapshot in a layout this build does not read (kept)."""
