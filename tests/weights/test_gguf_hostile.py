"""Hostile GGUF files given as the model: each is one clear error naming the file and what is wrong,
and leaves nothing behind in the data directory.

Each file is a whole small GGUF (tests/data/tiny-Q4_K_M.gguf, made by llama.cpp's llama-quantize)
with one field changed in place through gguf's own reader (opened for writing): a tensor's data
offset past the end, a tensor type no GGML build defines, a vocabulary array claiming 2^40 entries,
a tensor's dimensions claiming more elements than the file holds.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from chatkv.engine.core import Engine
from chatkv.errors import ModelNotFound
from tests.support.kquant_fixtures import fixture


def _damaged(tmp_path: Path, change) -> Path:
    from gguf import GGUFReader

    path = tmp_path / "model.gguf"
    shutil.copyfile(fixture("Q4_K_M"), path)
    reader = GGUFReader(str(path), "r+")
    change(reader)
    reader.data.flush()
    del reader
    return path


def _tensor_part(reader, name: str, index: int):
    """Tensor ``name``'s info field parts: [name length, name, dims count, dims, type, offset]."""
    tensor = next(t for t in reader.tensors if t.name == name)
    return tensor.field.parts[index]


def _offset_past_end(reader) -> None:
    _tensor_part(reader, "blk.1.ffn_down.weight", -1)[0] = 1 << 40


def _unknown_type(reader) -> None:
    _tensor_part(reader, "blk.0.attn_q.weight", -2)[0] = 250


def _absurd_vocab(reader) -> None:
    field = reader.fields["tokenizer.ggml.tokens"]
    field.parts[4][0] = 1 << 40  # [key length, key, value type, item type, item count, items...]


def _absurd_dims(reader) -> None:
    _tensor_part(reader, "blk.1.ffn_up.weight", 3)[1] = 1 << 30  # rows


@pytest.mark.parametrize(
    "change",
    [_offset_past_end, _unknown_type, _absurd_vocab, _absurd_dims],
    ids=["offset past the end", "unknown tensor type", "vocabulary of 2^40", "dims past the end"],
)
def test_a_damaged_gguf_is_one_clear_error_and_leaves_nothing(tmp_path, change):
    bad = _damaged(tmp_path, change)
    data = tmp_path / "data"
    with pytest.raises(ModelNotFound) as e:
        Engine.from_pretrained(str(bad), data_dir=str(data), progress=False)
    message = str(e.value)
    assert str(bad) in message, message
    assert len(message) < 600, message  # one line, not a dump
    models = data / "models"
    left = [p for p in models.rglob("*")] if models.exists() else []
    assert [p for p in left if p.is_file()] == [], left
