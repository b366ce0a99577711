"""A GGUF file is a model: ``Engine.from_pretrained("X.gguf")`` and ``chatkv --model X.gguf``.

The file is prepared once into the data directory (chatkv.weights.prepared), keyed by its
content; a later start with the same bytes prepares nothing. Files that are not a model get one
clear error naming them and leave nothing behind. The files are llama.cpp's own tiny K-quant
GGUFs (tests/support/kquant_fixtures.py), copied into each test's directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from chatkv import Engine, ModelNotFound, SamplingParams, StorageError, UnsupportedModel
from chatkv.weights import convert_gguf
from chatkv.weights import prepared as prep
from chatkv.weights.gguf import MARKER
from tests.support.disks import fill, small_disk  # noqa: F401 (a fixture)
from tests.support.kquant_fixtures import fixture, prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _copy(kind: str, where: Path, name: str = "model.gguf") -> Path:
    where.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(fixture(kind), where / name))


def _prepared(data: Path) -> list[Path]:
    """Everything under the data directory's prepared GGUF models (temporary siblings included)."""
    root = data / "models" / "gguf"
    return sorted(root.iterdir()) if root.is_dir() else []


def _tokens(engine: Engine) -> list[list[int]]:
    try:
        return [r.token_ids for r in engine.generate(prompts()[:2], GREEDY)]
    finally:
        engine.close()


def test_a_gguf_file_answers_as_its_converted_directory_does(tmp_path):
    gguf = _copy("Q4_K_M", tmp_path / "downloads")
    data = tmp_path / "data"
    engine = Engine.from_pretrained(str(gguf), data_dir=str(data))
    assert engine.model_dir.parent == data / "models" / "gguf"
    assert engine.model_dir.name.startswith("model-") and engine.model_dir.name.endswith("-bf16")
    got = _tokens(engine)
    reference = convert_gguf(fixture("Q4_K_M"), tmp_path / "by-hand", progress=False)
    assert got == _tokens(Engine.from_pretrained(str(reference), data_dir=str(tmp_path / "data2")))
    marker = json.loads((engine.model_dir / MARKER).read_text())
    assert marker["source_sha256"] == prep.full_sha256(gguf) and marker["source_size"] == gguf.stat().st_size


def test_a_second_start_prepares_nothing_and_a_touched_file_is_hashed_not_converted(tmp_path, monkeypatch):
    gguf = _copy("Q4_K_M", tmp_path)
    data = tmp_path / "data"
    first = prep.ensure_gguf_model(gguf, data, progress=False)

    def no_conversion(*a, **k):
        raise AssertionError("prepared again")

    monkeypatch.setattr(prep, "convert_gguf", no_conversion)
    hashed = []
    real_hash = prep.full_sha256
    monkeypatch.setattr(prep, "full_sha256", lambda p: hashed.append(p) or real_hash(p))
    assert prep.ensure_gguf_model(gguf, data, progress=False) == first
    assert hashed == []  # same size and mtime: not even read whole
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))  # copied or touched: same bytes
    assert prep.ensure_gguf_model(gguf, data, progress=False) == first
    assert hashed == [gguf]
    assert json.loads((first / MARKER).read_text())["source_mtime_ns"] == gguf.stat().st_mtime_ns
    assert prep.ensure_gguf_model(gguf, data, progress=False) == first and hashed == [gguf]  # the new mtime kept
    assert _prepared(data) == [first]


def test_a_first_preparation_reports_each_tensor_to_a_progress_function(tmp_path):
    """What the app's loading bar shows: ``fn(done, total)`` from 0 to every tensor, in order."""
    seen: list[tuple[int, int]] = []
    prep.ensure_gguf_model(_copy("Q4_K_M", tmp_path), tmp_path / "data", progress=lambda d, t: seen.append((d, t)))
    total = seen[0][1]
    assert total > 1 and seen == [(i, total) for i in range(total + 1)]


def test_another_file_under_the_same_name_gets_its_own_directory(tmp_path):
    data = tmp_path / "data"
    a = prep.ensure_gguf_model(_copy("Q4_K_M", tmp_path / "a"), data, progress=False)
    b = prep.ensure_gguf_model(_copy("Q6_K", tmp_path / "b"), data, progress=False)
    assert a != b and _prepared(data) == sorted([a, b])


def test_the_same_bytes_elsewhere_find_the_same_directory(tmp_path):
    data = tmp_path / "data"
    a = prep.ensure_gguf_model(_copy("Q4_K_M", tmp_path / "a"), data, progress=False)
    assert prep.ensure_gguf_model(_copy("Q4_K_M", tmp_path / "b"), data, progress=False) == a


@pytest.mark.parametrize(
    "damage, error, says",
    [
        ("not gguf", ModelNotFound, "is not a GGUF file"),
        ("empty", ModelNotFound, "is not a GGUF file"),
        ("truncated", ModelNotFound, "is not a readable GGUF file"),
        ("magic only", ModelNotFound, "is not a readable GGUF file"),
    ],
)
def test_a_file_that_is_not_a_whole_gguf_is_one_clear_error_and_leaves_nothing(tmp_path, damage, error, says):
    good = fixture("Q4_K_M").read_bytes()
    body = {
        "not gguf": b"<html>404 Not Found</html>\n",
        "empty": b"",
        "truncated": good[: len(good) // 2],
        "magic only": good[:4],
    }[damage]
    bad = tmp_path / "model.gguf"
    bad.write_bytes(body)
    data = tmp_path / "data"
    with pytest.raises(error) as e:
        Engine.from_pretrained(str(bad), data_dir=str(data))
    assert says in str(e.value) and str(bad) in str(e.value)
    assert _prepared(data) == []


def test_an_unknown_architecture_is_refused_by_name(tmp_path):
    """A GGUF whose ``general.architecture`` the converter does not know: UnsupportedModel naming it."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", __import__("numpy").zeros((4, 4), dtype="float32"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = tmp_path / "data"
    with pytest.raises((UnsupportedModel, ModelNotFound)) as e:
        prep.ensure_gguf_model(path, data, progress=False)
    assert "mamba" in str(e.value)
    assert _prepared(data) == []


def test_a_file_replaced_while_it_is_prepared_is_refused_and_its_directory_removed(tmp_path, monkeypatch):
    gguf = _copy("Q4_K_M", tmp_path)
    data = tmp_path / "data"
    real = prep.convert_gguf

    def convert_then_replace(path, out_dir, **kw):
        done = real(path, out_dir, **kw)
        replacement = tmp_path / "replacement.gguf"
        shutil.copy(fixture("Q6_K"), replacement)
        os.replace(replacement, path)  # another download lands on the same name mid-preparation
        return done

    monkeypatch.setattr(prep, "convert_gguf", convert_then_replace)
    with pytest.raises(ModelNotFound, match="changed while it was being prepared"):
        prep.ensure_gguf_model(gguf, data, progress=False)
    assert _prepared(data) == []


def test_a_full_disk_under_the_data_directory_is_a_storage_error_and_leaves_nothing(tmp_path, small_disk):
    """The file fits nowhere: a StorageError naming it; the disk holds only what it held before."""
    gguf = _copy("Q4_K_M", tmp_path)
    data = small_disk / "data"
    data.mkdir()
    filler = fill(small_disk)
    with pytest.raises(StorageError, match="could not be prepared") as e:
        prep.ensure_gguf_model(gguf, data, progress=False)
    assert str(gguf) in str(e.value)
    assert _prepared(data) == []
    filler.unlink()  # room again: the same call prepares it
    assert prep.ensure_gguf_model(gguf, data, progress=False) in _prepared(data)


def test_a_missing_path_and_a_directory_keep_their_errors(tmp_path):
    with pytest.raises(ModelNotFound, match="does not exist"):
        Engine.from_pretrained(str(tmp_path / "nope.gguf"), data_dir=str(tmp_path / "data"))
    with pytest.raises(ModelNotFound, match="not a file or directory"):
        prep.ensure_gguf_model(tmp_path / "nope.gguf", tmp_path / "data")


def test_chatkv_model_takes_a_gguf_file(tmp_path):
    """The command line as a user types it: a one-shot answer from the downloaded file."""
    gguf = _copy("Q4_K_M", tmp_path / "downloads", "tiny-Q4_K_M.gguf")
    env = dict(os.environ, CHATKV_HOME=str(tmp_path / "home"))
    p = subprocess.run(
        [sys.executable, "-m", "chatkv.cli", "--model", str(gguf), "--max-tokens", "4", "Hello"],
        capture_output=True,
        env=env,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0, p.stderr.decode()
    assert p.stdout.decode().strip() and b"Traceback" not in p.stderr
    assert len(_prepared(tmp_path / "home")) == 1


def test_chatkv_serve_takes_a_gguf_file_and_logs_its_preparation(tmp_path):
    """``chatkv serve --model X.gguf``: log lines of the preparation (a server has no bar), then it
    answers; the same file at the next start is not prepared again."""
    from tests.support.serving import raw, serve_process, user

    gguf = _copy("Q4_K_M", tmp_path / "downloads")
    data = tmp_path / "data"
    for start in ("first", "second"):
        proc, url = serve_process(gguf, data)
        try:
            model = raw(url, "/v1/models")[1]["data"][0]["id"]
            body = {"model": model, "messages": user("Hello"), "max_tokens": 3}
            status, reply, _ = raw(url, "/v1/chat/completions", body)
            assert status == 200 and reply["usage"]["completion_tokens"] == 3, reply
        finally:
            proc.terminate()
            err = proc.communicate(timeout=60)[1]
        said = [line for line in err.splitlines() if "preparing the model" in line]
        if start == "first":
            first, last = (
                re.fullmatch(r"chatkv serve: preparing the model: (\d+)% \((\d+) of (\d+) tensors\)", x)
                for x in (said[0], said[-1])
            )
            assert first and last, err
            assert first.groups()[:2] == ("0", "0") and last.group(1) == "100" and last.group(2) == last.group(3)
            assert len(said) == 11, err  # one line each 10%
        else:
            assert said == [], err
    assert len(_prepared(data)) == 1
