"""A GGUF file given as the model (``--model X.gguf``, ``Engine.from_pretrained("X.gguf")``):
prepared once into the data directory, keyed by its content, and found again on every later start.

The prepared directory is ``<data dir>/models/gguf/<stem>-<key>-<dtype>``, where ``key`` hashes
the file's size, its first 4 MiB (the header, the metadata and the tensor index, and the first
tensors) and its last 1 MiB, so the same file copied elsewhere finds the same directory and two
different files never share one. Its completion marker records the file's size, mtime and the
SHA-256 of all its bytes, taken while it was prepared:

- same size and mtime as recorded: the directory is used at once (a few stat calls and one small
  read: a start does not read a multi-GB file);
- same size, another mtime (the file was copied or touched): the whole file is hashed once; the
  same bytes keep the directory (the marker takes the new mtime), other bytes prepare it again.

A file that is not a GGUF (its first four bytes are not ``GGUF``), a damaged or truncated one, or
one of an architecture the converter does not know, is one ``ModelNotFound`` or
``UnsupportedModel`` naming the file, and a data directory that cannot take it (a full or
read-only disk) one ``StorageError``; the conversion builds in a temporary sibling that is
removed on any failure, so nothing half-written is left. A file that changes while it is being
prepared is refused, and what was prepared from it removed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError

from chatkv.errors import ChatKVError, ModelNotFound, StorageError
from chatkv.storage.files import atomic_write
from chatkv.weights.gguf import FORMAT_VERSION, MARKER, convert_gguf, dtype_name

MAGIC = b"GGUF"
HEAD_BYTES = 4 << 20
TAIL_BYTES = 1 << 20
_CHUNK = 8 << 20


def is_gguf_file(path: str | Path) -> bool:
    """True if ``path`` is a regular file that starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def content_key(path: Path, size: int) -> str:
    """16 hex digits of SHA-256 over the size, the first 4 MiB and the last 1 MiB of the file."""
    h = hashlib.sha256(str(size).encode() + b"\0")
    with open(path, "rb") as f:
        h.update(f.read(HEAD_BYTES))
        if size > HEAD_BYTES:
            f.seek(max(HEAD_BYTES, size - TAIL_BYTES))
            h.update(f.read(TAIL_BYTES))
    return h.hexdigest()[:16]


def full_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def prepared_dir(gguf_path: Path, home: Path, dtype: torch.dtype, size: int) -> Path:
    return Path(home) / "models" / "gguf" / f"{gguf_path.stem}-{content_key(gguf_path, size)}-{dtype_name(dtype)}"


def _marker(out_dir: Path) -> dict:
    try:
        marker = json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def _rewrite_marker(out_dir: Path, marker: dict) -> None:
    """Replace the marker whole (storage's atomic_write); a failure only means the next start
    hashes the file again."""
    try:
        atomic_write(out_dir / MARKER, lambda tmp: tmp.write_text(json.dumps(marker)), durable=False)
    except OSError:
        pass


def ensure_gguf_model(
    gguf_path: str | Path,
    home: Path | None = None,
    dtype: torch.dtype = torch.bfloat16,
    progress: bool | Callable[[int, int], None] = True,
) -> Path:
    """The prepared directory of the GGUF file ``gguf_path``, preparing it first if needed
    (``progress`` as ``convert_gguf`` takes it)."""
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise ModelNotFound(f"model path '{gguf_path}' is not a file or directory (chatkv never downloads weights)")
    if not is_gguf_file(path):
        raise ModelNotFound(
            f"model file '{gguf_path}' is not a GGUF file (it does not start with 'GGUF'); "
            "--model takes a GGUF file or a Hugging Face model directory"
        )
    if home is None:
        from chatkv.storage.paths import data_dir

        home = data_dir()
    before = path.stat()
    out_dir = prepared_dir(path, Path(home), dtype, before.st_size)
    marker = _marker(out_dir)
    if marker.get("format_version") == FORMAT_VERSION and marker.get("source_size") == before.st_size:
        if marker.get("source_mtime_ns") == before.st_mtime_ns:
            return out_dir
        digest = full_sha256(path)
        if digest == marker.get("source_sha256") and path.stat().st_mtime_ns == before.st_mtime_ns:
            _rewrite_marker(out_dir, {**marker, "source_mtime_ns": before.st_mtime_ns})
            return out_dir
    else:
        digest = full_sha256(path)
    try:
        convert_gguf(path, out_dir, dtype=dtype, progress=progress, source_sha256=digest)
    except ChatKVError:  # the file's own fault (ModelNotFound is also an OSError): said as it is
        raise
    except (OSError, SafetensorError) as e:  # a full or read-only disk (safetensors' writes raise its own error)
        raise StorageError(
            f"the GGUF file '{gguf_path}' could not be prepared into '{out_dir.parent}': "
            f"{getattr(e, 'strerror', None) or e}"
        ) from e
    after = path.stat()
    if (after.st_size, after.st_mtime_ns, after.st_ino) != (before.st_size, before.st_mtime_ns, before.st_ino):
        shutil.rmtree(out_dir, ignore_errors=True)
        raise ModelNotFound(
            f"model file '{gguf_path}' changed while it was being prepared; start again once it is whole"
        )
    return out_dir
