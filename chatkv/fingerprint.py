"""A model fingerprint: what must match for cached KV to be reusable.

Covers the config, the tokenizer and chat template files, and every weights
file (its size plus a hash of its first and last MiB, which include the
safetensors header with every tensor's name, shape and offset). Hashing the
whole weights would cost a second per start on this class of machine.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_TEXT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
_MIB = 2**20


def model_fingerprint(model_dir: str | Path) -> str:
    path = Path(model_dir)
    h = hashlib.sha256()
    for name in _TEXT_FILES:
        f = path / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}\0".encode())
        with f.open("rb") as fh:
            h.update(fh.read(_MIB))
            if size > 2 * _MIB:
                fh.seek(size - _MIB)
                h.update(fh.read(_MIB))
    return h.hexdigest()[:32]
