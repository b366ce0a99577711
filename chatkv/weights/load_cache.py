"""What transformers decided about a model directory, kept so that a warm start need not ask it again.

``AutoConfig.from_pretrained`` of a llama-family directory imports transformers' config module
for the family, which imports its activations, and through them its hub-kernels and
model-loading code, ``torch.distributed.tensor`` and sympy; ``AutoTokenizer.from_pretrained``
loads that config too, only to choose the tokenizer's class. That import is about a fifth of a
warm one-shot ``chatkv "..."``, for a dozen numbers and a class name.

So the first load keeps, in the user cache directory (``loads.json`` beside the weight check's
``weight-checks.json``; ``CHATKV_CACHE_DIR`` moves both):

- the config transformers made of a ``config.json``, as its ``to_dict()``: a later start reads it
  back as a ``ResolvedConfig``, the same attributes with the same values (the dtype by name, as
  ``to_dict`` writes it; chatkv.model.forward reads either). Only configs whose RoPE chatkv computes
  itself are kept (a scaled RoPE goes to transformers' own functions, which take its object);
- the tokenizer class ``AutoTokenizer`` chose (a transformers class): a later start calls that
  class's ``from_pretrained`` on the directory, as ``AutoTokenizer`` itself ends by doing;
- for a plain ``tokenizer.json`` tokenizer, what chatkv.weights.direct_tokenizer needs to answer
  without transformers (its backend in ``tokenizers/<sha256>.json``, checked when read back), once
  a tokenizer built from it gave transformers' results on the probes.

Each entry is keyed by the bytes of the files read (``config.json``; for the tokenizer every
file a tokenizer is made of too) and the versions of transformers and huggingface_hub, so an
edited, damaged or removed file, or an upgrade, asks transformers again. Best effort: a cache
that cannot be read or written costs only the import.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import re
from importlib import metadata
from pathlib import Path

from chatkv.storage.paths import cache_dir

log = logging.getLogger("chatkv.weights")

MAX_ENTRIES = 128  # the oldest go first


class ResolvedConfig:
    """A transformers config's ``to_dict()`` as attributes (what chatkv's model reads of it)."""

    def __init__(self, values: dict):
        self.__dict__.update(values)
        if isinstance(values.get("id2label"), dict):  # JSON made its int keys strings, as transformers reads them back
            self.id2label = {int(k): v for k, v in values["id2label"].items()}

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"ResolvedConfig({self.__dict__.get('model_type')!r})"


def cache_file() -> Path:
    return cache_dir() / "loads.json"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def key(kind: str, *files: Path) -> str | None:
    """The entry of ``kind`` for these files' bytes (a missing file counts as absent); None if one cannot be read."""
    h = hashlib.sha256()
    for f in files:
        try:
            data = f.read_bytes()
        except FileNotFoundError:
            data = b"\0absent"
        except OSError:
            return None
        h.update(len(data).to_bytes(8, "little") + data)
    return "|".join((kind, h.hexdigest(), _version("transformers"), _version("huggingface_hub")))


def _read() -> dict:
    try:
        data = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _remember(k: str, value) -> None:
    from chatkv.storage.files import atomic_write, make_private_dir

    try:
        f = cache_file()
        make_private_dir(f.parent)
        data = _read()
        data.pop(k, None)
        data[k] = value
        while len(data) > MAX_ENTRIES:
            data.pop(next(iter(data)))
        text = json.dumps(data, indent=1)
        atomic_write(f, lambda tmp: tmp.write_text(text), durable=False)
    except (OSError, TypeError, ValueError) as err:
        log.debug("load decision not cached (%s)", err)


def config(k: str | None) -> ResolvedConfig | None:
    values = _read().get(k) if k else None
    return ResolvedConfig(values) if isinstance(values, dict) and "model_type" in values else None


def remember_config(k: str | None, cfg) -> None:
    rope = getattr(cfg, "rope_parameters", None) or {}
    if k is None or not isinstance(rope, dict) or rope.get("rope_type", "default") != "default":
        return
    try:
        values = json.loads(cfg.to_json_string(use_diff=False))
    except (TypeError, ValueError, AttributeError):
        return
    _remember(k, values)


def tokenizer_class(k: str | None):
    """The transformers tokenizer class remembered under ``k``, or None."""
    name = _read().get(k) if k else None
    if not isinstance(name, str) or not name.startswith("transformers.") or ":" not in name:
        return None
    module, _, qualname = name.partition(":")
    try:
        return getattr(importlib.import_module(module), qualname)
    except (ImportError, AttributeError):
        return None


def remember_tokenizer(k: str | None, tok) -> None:
    cls = type(tok)
    if k is not None and cls.__module__.startswith("transformers.") and "." not in cls.__qualname__:
        _remember(k, f"{cls.__module__}:{cls.__qualname__}")


def _direct_key(k: str) -> str:
    return "direct:" + k


def direct_spec(k: str | None) -> dict | None:
    """The direct tokenizer's spec remembered under tokenizer key ``k`` (its backend read back and checked), or None."""
    entry = _read().get(_direct_key(k)) if k else None
    if (
        not isinstance(entry, dict)
        or not isinstance(entry.get("backend"), str)
        or not isinstance(entry.get("meta"), dict)
    ):
        return None
    digest = entry["backend"]
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        return None
    try:
        data = (cache_dir() / "tokenizers" / f"{digest}.json").read_bytes()
    except OSError:
        return None
    if hashlib.sha256(data).hexdigest() != digest:
        return None  # damaged: transformers again
    from chatkv.weights.direct_tokenizer import library_versions

    if entry["meta"].get("versions") != library_versions():
        return None  # proved with another tokenizers or jinja2: prove it again
    return dict(entry["meta"], backend=data.decode("utf-8", errors="replace"))


def remember_direct(k: str | None, spec: dict) -> None:
    from chatkv.storage.files import atomic_write, make_private_dir

    if k is None:
        return
    data = spec["backend"].encode("utf-8")
    digest = hashlib.sha256(data).hexdigest()
    try:
        d = cache_dir() / "tokenizers"
        make_private_dir(d)
        f = d / f"{digest}.json"
        if not f.is_file():
            atomic_write(f, lambda tmp: tmp.write_bytes(data), durable=False)
    except OSError as err:
        log.debug("direct tokenizer not cached (%s)", err)
        return
    _remember(_direct_key(k), {"backend": digest, "meta": {n: v for n, v in spec.items() if n != "backend"}})
