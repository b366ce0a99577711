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


KILLED_CHILD = """
import os, signal, sys
from pathlib import Path
from chatkv.weights.gguf import convert_gguf
def die(done, total):
    if done == 3:  # a few tensors written into the temporary directory
        os.kill(os.getpid(), signal.SIGKILL)
convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]), progress=die)
"""

HOLDER_CHILD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(60)
"""


def test_a_conversion_killed_midway_leaves_a_directory_the_next_one_removes(tmp_path):
    """kill -9 while the tensors are written: the next conversion into the same place removes
    the dead run's temporary directory (its owner lock is free) and completes."""
    import subprocess
    import sys

    from chatkv.weights.gguf import MARKER, convert_gguf

    out = tmp_path / "models" / "m"
    out.parent.mkdir()
    child = subprocess.run([sys.executable, "-c", KILLED_CHILD, str(fixture("Q4_K_M")), str(out)])
    assert child.returncode == -9
    left = list(out.parent.glob(".m.tmp-*"))
    assert len(left) == 1 and any(left[0].iterdir()), left  # the dead run's partial work
    assert not out.exists()
    convert_gguf(fixture("Q4_K_M"), out, progress=False)
    assert (out / MARKER).is_file() and not (out / ".owner").exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["m"]  # nothing else beside it


def test_a_conversion_running_in_another_process_is_left_alone(tmp_path):
    """Another process's temporary directory, its lock held, survives a cleaning; once that
    process is gone (killed), the next cleaning removes it. A lockless one goes by its age."""
    import os
    import subprocess
    import sys
    import time

    from chatkv.weights.gguf import ABANDONED_S, OWNER, remove_abandoned

    out = tmp_path / "m"
    live = tmp_path / ".m.tmp-live"
    live.mkdir()
    (live / "model.safetensors").write_bytes(b"partial")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER_CHILD, str(live / OWNER)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert remove_abandoned(out) == [] and live.is_dir()
    finally:
        holder.kill()
        holder.wait()
    assert remove_abandoned(out) == [live] and not live.exists()
    young, old = tmp_path / ".m.tmp-young", tmp_path / ".m.tmp-old"
    young.mkdir()
    old.mkdir()
    past = time.time() - ABANDONED_S - 60
    os.utime(old, (past, past))
    # the age rule reads mtime and ctime (a rename sets the ctime); ctime cannot be set back, so
    # the old one's age is checked through the same rule with the clock moved forward instead
    assert remove_abandoned(out) == [] and young.is_dir() and old.is_dir()
    real = time.time
    try:
        time.time = lambda: real() + ABANDONED_S + 120
        assert sorted(remove_abandoned(out)) == sorted([young, old])
    finally:
        time.time = real
