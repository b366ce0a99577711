"""A model fingerprint: what must match for cached KV to be reusable.

Covers the config, the tokenizer and chat template files, and the full bytes of
every weights file. Hashing ~270 MB of weights takes a fraction of a second, so
each file's digest is remembered in ``<cache_dir>/fingerprints.json`` keyed by
(path, size, mtime, inode) and recomputed only when one of those changes. Without a
``cache_dir`` the user's cache directory keeps them (``CHATKV_CACHE_DIR``, else the
platform's, as chatkv.model.self_check's verdicts): an engine given no data directory
(a one-shot ``chatkv "..."``) hashed the whole model at every start.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from chatkv.storage.files import atomic_write, make_private_dir
from chatkv.storage.paths import cache_dir as user_cache_dir

_TEXT_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)
_CHUNK = 8 * 2**20


def _file_digest(f: Path, cache: dict) -> str:
    st = f.stat()
    key = f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
    if key not in cache:
        h = hashlib.sha256()
        with f.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
        cache[key] = h.hexdigest()
    return cache[key]


def model_fingerprint(model_dir: str | Path, cache_dir: str | Path | None = None) -> str:
    """A 32-hex-digit digest of everything in ``model_dir`` that decides the KV it computes.

    ``cache_dir`` (default: the user's cache directory) keeps the per-file digests of the
    weights between calls (best effort: an unwritable cache is ignored). Never raises for
    the cache; an unreadable model file raises OSError.
    """
    path = Path(model_dir)
    cache_file = Path(cache_dir or user_cache_dir()) / "fingerprints.json"
    cache: dict = {}
    if cache_file.is_file():
        try:
            cache = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            cache = {}
        if not isinstance(cache, dict):  # damaged: start over
            cache = {}
    before = dict(cache)
    h = hashlib.sha256()
    for name in _TEXT_FILES:
        f = path / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    # a converted GGUF's quantised tensors are in quantized/ (chatkv.weights.gguf_tensors)
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("quantized/*.safetensors")):
        h.update(f"{f.relative_to(path)}:{_file_digest(f, cache)}\0".encode())
    if cache != before:
        try:  # best effort: a cache that cannot be written only costs the next start a re-hash
            make_private_dir(cache_file.parent)
            data = json.dumps(cache)
            atomic_write(cache_file, lambda tmp: tmp.write_text(data), durable=False)
        except OSError:
            pass
    return h.hexdigest()[:32]
