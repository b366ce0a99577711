"""chatkv.weights: reading a model directory, and a clear error for every broken one.

Real files throughout: a seeded tiny Llama saved by transformers, then copied
and damaged one way per test.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import chatkv.weights
from chatkv.engine.core import Engine
from chatkv.errors import ChatKVError, ModelNotFound, UnsupportedModel
from chatkv.model.forward import LlamaModel
from chatkv.weights import load_config, load_tokenizer, model_fingerprint
from chatkv.weights.loading import read_weights
from tests.support.tiny import make_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny") / "llama"
    make_model(d, "llama", seed=1)
    return d


@pytest.fixture
def model(good, tmp_path) -> Path:
    """A fresh copy of the good model, to damage."""
    d = tmp_path / "model"
    shutil.copytree(good, d)
    return d


def test_exported_names():
    assert sorted(chatkv.weights.__all__) == sorted(
        [
            "ensure_default_model",
            "packaged_gguf_path",
            "convert_gguf",
            "model_fingerprint",
            "load_config",
            "load_tokenizer",
        ]
    )
    for name in chatkv.weights.__all__:
        assert callable(getattr(chatkv.weights, name))


def test_good_directory_loads(good):
    cfg = load_config(good)
    assert cfg.model_type == "llama" and cfg.num_hidden_layers == 2
    tok = load_tokenizer(good)
    ids = tok.encode("Hello, how are you today?", add_special_tokens=False)
    assert tok.decode(ids) == "Hello, how are you today?"
    weights = read_weights(good)
    assert "embed_tokens.weight" in weights and not any(k.startswith("model.") for k in weights)
    m = LlamaModel.from_pretrained(good, dtype=torch.float32)  # the same signature as before the move
    assert m.num_layers == 2 and m.dtype == torch.float32


# ------------------------------------------------------------------ config.json


@pytest.mark.parametrize(
    "content, error, words",
    [
        (b"{bad json", ModelNotFound, ["not valid JSON", "line 1"]),
        (b"", ModelNotFound, ["not valid JSON"]),
        (b"\xff\xfe\x00garbage", ModelNotFound, ["cannot read"]),
        (b"[1, 2, 3]", ModelNotFound, ["JSON list", "not an object"]),
        (b'"llama"', ModelNotFound, ["JSON str"]),
        (b'{"hidden_size": 64}', UnsupportedModel, ["no model_type", "llama, qwen2, qwen3, mistral"]),
        (b'{"model_type": "gpt2"}', UnsupportedModel, ["model_type 'gpt2'", "llama, qwen2, qwen3, mistral"]),
        (b'{"model_type": 5}', UnsupportedModel, ["model_type '5'"]),
        (
            b'{"model_type": "llama", "num_hidden_layers": "two"}',
            ModelNotFound,
            ["not a usable llama config", "num_hidden_layers"],
        ),
    ],
)
def test_malformed_config_is_a_clear_error(model, content, error, words):
    (model / "config.json").write_bytes(content)
    with pytest.raises(error) as info:
        load_config(model)
    msg = str(info.value)
    assert "config.json" in msg or "model_type" in msg, msg
    for w in words:
        assert w in msg, msg
    assert "\n" not in msg, msg
    with pytest.raises(error):  # the model loader says the same, not a traceback of its own
        LlamaModel.from_pretrained(model)


def test_missing_config_or_directory(model, tmp_path):
    (model / "config.json").unlink()
    with pytest.raises(ModelNotFound, match="config.json"):
        load_config(model)
    for fn in (load_config, load_tokenizer, read_weights):
        with pytest.raises(ModelNotFound, match="nowhere"):
            fn(tmp_path / "nowhere")


# ------------------------------------------------------------------ weights


def test_missing_or_damaged_weights(model):
    st = model / "model.safetensors"
    blob = st.read_bytes()
    st.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ModelNotFound) as info:
        read_weights(model)
    assert str(st) in str(info.value) and "unreadable" in str(info.value)
    st.unlink()
    with pytest.raises(ModelNotFound, match="no \\*.safetensors"):
        LlamaModel.from_pretrained(model)


# ------------------------------------------------------------------ tokenizer


def test_weights_without_tokenizer(model):
    for name in TOKENIZER_FILES:
        (model / name).unlink(missing_ok=True)
    load_config(model)  # the rest of the model is fine
    with pytest.raises(ModelNotFound) as info:
        load_tokenizer(model)
    msg = str(info.value)
    assert str(model) in msg and "no tokenizer" in msg and "tokenizer.json" in msg, msg
    assert isinstance(info.value, ChatKVError) and info.value.__cause__ is not None


def test_only_tokenizer_config_left(model):
    (model / "tokenizer.json").unlink()
    with pytest.raises(ModelNotFound, match="no tokenizer in"):
        load_tokenizer(model)


def test_damaged_tokenizer(model):
    (model / "tokenizer.json").write_text("{garbage")
    with pytest.raises(ModelNotFound) as info:
        load_tokenizer(model)
    msg = str(info.value)
    assert str(model) in msg and "tokenizer.json" in msg and "cannot be loaded" in msg, msg
    assert "\n" not in msg


# ------------------------------------------------------------------ fingerprint


def test_fingerprint_cache_is_best_effort(good, tmp_path, monkeypatch):
    plain = model_fingerprint(good)
    cache = tmp_path / "cache"
    assert model_fingerprint(good, cache) == plain
    assert json.loads((cache / "fingerprints.json").read_text())  # digests kept for next time
    assert oct((cache / "fingerprints.json").stat().st_mode & 0o777) == oct(0o600)

    (cache / "fingerprints.json").write_text("[1, 2]")  # damaged: ignored and rewritten
    assert model_fingerprint(good, cache) == plain
    assert isinstance(json.loads((cache / "fingerprints.json").read_text()), dict)

    real_open = os.open

    def read_only(path, flags, *args, **kwargs):  # a read-only medium: no file can be created
        if str(path).startswith(str(tmp_path / "ro")) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(os, "open", read_only)
    assert model_fingerprint(good, tmp_path / "ro") == plain
    assert list((tmp_path / "ro").iterdir()) == []


def test_fingerprint_follows_every_file(good, model):
    base = model_fingerprint(good)
    assert model_fingerprint(model) == base  # a copy is the same model
    (model / "chat_template.jinja").write_text("{{ messages }}")
    assert model_fingerprint(model) != base


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_every_family_without_tokenizer_files_is_refused_at_load(family, tmp_path):
    """A directory without tokenizer files is refused, not loaded as a tokenizer of one token from
    config.json alone (which would make every prompt "empty")."""
    d = tmp_path / family
    make_model(d, family, seed=2)
    for name in (*TOKENIZER_FILES, "vocab.json", "merges.txt", "tokenizer.model"):
        (d / name).unlink(missing_ok=True)
    with pytest.raises(ModelNotFound) as info:
        load_tokenizer(d)
    msg = str(info.value)
    assert str(d) in msg and "no tokenizer" in msg and "tokenizer.json" in msg and "\n" not in msg, msg
    with pytest.raises(ModelNotFound, match="no tokenizer in"):
        Engine(d)


def test_a_vocabulary_that_makes_no_tokens_is_refused(model):
    """Tokenizer files that load but hold no vocabulary: refused, not a tokenizer of every prompt empty."""
    raw = json.loads((model / "tokenizer.json").read_text())
    raw["model"]["vocab"], raw["model"]["merges"], raw["added_tokens"] = {}, [], []
    (model / "tokenizer.json").write_text(json.dumps(raw))
    with pytest.raises(ModelNotFound, match="makes no tokens of text"):
        load_tokenizer(model)
