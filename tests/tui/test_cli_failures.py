"""No raw traceback reaches a person.

Each case runs the real ``chatkv`` command as a subprocess, on a tiny model, with the real
failure: a closed stdin, a data directory that is a file or cannot be written, a reader that
leaves the pipe, stdout on /dev/full, a message row that is not UTF-8 in a real SQLite file,
and a real full disk (a tmpfs mounted for the test; that needs root). Each ends with one line
naming the problem and the fix and exit status 2, or 0 where the work was done, and nothing
half-stored."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.disks import fill, small_disk  # noqa: F401 (a fixture)

pytestmark = pytest.mark.tiny_model("qwen2", seed=4)

TIMEOUT = 300
BANNER = re.compile(r"^chatkv: (conversation [0-9a-f]+\.( |$)|Type a message)")  # line mode's, not errors


def _env(home: Path) -> dict:
    return dict(os.environ, CHATKV_HOME=str(home), OMP_NUM_THREADS="1")


def chatkv(model_dir, *args, home: Path, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, input=None):
    cmd = [sys.executable, "-m", "chatkv.cli", "--model", model_dir, "--max-tokens", "8", *args]
    return subprocess.run(
        cmd,
        input=input,
        stdin=None if input is not None else stdin,
        stdout=stdout,
        stderr=subprocess.PIPE,
        env=_env(home),
        timeout=TIMEOUT,
    )


def shell(command: str, model_dir, home: Path) -> subprocess.CompletedProcess:
    """``command`` in bash, with ``CHATKV`` the chatkv command line on the tiny model."""
    cli = f"{sys.executable} -m chatkv.cli --model {model_dir} --max-tokens 8"
    return subprocess.run(
        ["bash", "-c", command], capture_output=True, env={**_env(home), "CHATKV": cli}, timeout=TIMEOUT
    )


def one_error_line(err: bytes) -> str:
    """The stderr of a failed run: no traceback, exactly one 'chatkv: ' error line (banners aside)."""
    text = err.decode()
    assert "Traceback" not in text, text
    lines = [ln for ln in text.splitlines() if ln.startswith("chatkv: ") and not BANNER.match(ln)]
    assert len(lines) == 1, text
    return lines[0]


def conversations(home: Path) -> list[tuple[str, str]]:
    db = home / "chatkv.db"
    if not db.exists():
        return []
    c = sqlite3.connect(db)
    try:
        return c.execute("SELECT id, title FROM conversations").fetchall()
    finally:
        c.close()


def messages(home: Path, conv_id: str | None = None) -> list[tuple[str, str, str]]:
    c = sqlite3.connect(home / "chatkv.db")
    try:
        where, args = ("WHERE conversation_id = ?", (conv_id,)) if conv_id else ("", ())
        return c.execute(
            f"SELECT role, status, CAST(content AS BLOB) FROM messages {where} ORDER BY id", args
        ).fetchall()
    finally:
        c.close()


# ------------------------------------------------------------------ stdin


def test_closed_stdin_is_input_that_has_ended(model_dir, tmp_path):
    p = shell("$CHATKV <&-", model_dir, tmp_path)
    assert p.returncode == 0, p.stderr.decode()
    assert b"Traceback" not in p.stderr and b"isatty" not in p.stderr
    assert conversations(tmp_path) == []  # nothing was asked: nothing stored


def test_empty_input_leaves_no_empty_conversation(model_dir, tmp_path):
    for _ in range(2):
        p = chatkv(model_dir, home=tmp_path, stdin=subprocess.DEVNULL)
        assert p.returncode == 0 and b"Traceback" not in p.stderr, p.stderr.decode()
    assert conversations(tmp_path) == []
    p = chatkv(model_dir, home=tmp_path, input=b"Hello there\n")
    assert p.returncode == 0
    assert [t for _, t in conversations(tmp_path)] == ["Hello there"]


# ------------------------------------------------------------------ the data directory


def test_a_data_directory_that_is_a_file(model_dir, tmp_path):
    a_file = tmp_path / "passwd"  # stands in for /etc/passwd
    a_file.write_text("root:x:0:0:root:/root:/bin/bash\n")
    p = chatkv(model_dir, "--data-dir", str(a_file), "--list", home=tmp_path / "home")
    assert p.returncode == 2
    line = one_error_line(p.stderr)
    assert str(a_file) in line and "not a directory" in line and "--data-dir" in line
    assert a_file.read_text() == "root:x:0:0:root:/root:/bin/bash\n"


@pytest.mark.skipif(not os.path.isdir("/proc/1"), reason="needs Linux's /proc")
def test_a_data_directory_that_cannot_be_written(model_dir, tmp_path):
    p = chatkv(model_dir, "--data-dir", "/proc/1", "--list", home=tmp_path)
    assert p.returncode == 2
    line = one_error_line(p.stderr)
    assert "'/proc/1'" in line and "--data-dir" in line


# ------------------------------------------------------------------ stdout


def test_a_reader_that_leaves_ends_quietly_with_the_reply_stored(model_dir, tmp_path):
    """printf 'Tell me a story\\n' | chatkv | head -c1, and a pipe closed before the first byte."""
    p = shell("printf 'Tell me a story\\n' | $CHATKV | head -c1; exit ${PIPESTATUS[1]}", model_dir, tmp_path / "a")
    assert p.returncode == 0, p.stderr.decode()
    assert b"Traceback" not in p.stderr and b"BrokenPipe" not in p.stderr
    assert [(r, s) for r, s, _ in messages(tmp_path / "a")] == [("user", "complete"), ("assistant", "complete")]
    # the deterministic form: the read end is gone before chatkv writes anything
    r, w = os.pipe()
    os.close(r)
    try:
        p = chatkv(model_dir, home=tmp_path / "b", input=b"Tell me a story\n", stdout=w)
    finally:
        os.close(w)
    assert p.returncode == 0, p.stderr.decode()
    assert b"Traceback" not in p.stderr and b"Exception ignored" not in p.stderr
    [(role, status, reply)] = [m for m in messages(tmp_path / "b") if m[0] == "assistant"]
    assert status == "complete" and reply  # the whole reply was received and stored


def test_stdout_on_a_full_device_is_one_line_and_the_reply_is_stored(model_dir, tmp_path):
    with open("/dev/full", "wb") as full:
        p = chatkv(model_dir, home=tmp_path, input=b"Tell me a story\n", stdout=full)
    assert p.returncode == 2
    line = one_error_line(p.stderr)
    assert "cannot write to standard output" in line and "No space left on device" in line
    [(conv_id, _)] = conversations(tmp_path)
    assert f"--resume {conv_id}" in line
    assert [(r, s) for r, s, _ in messages(tmp_path)] == [("user", "complete"), ("assistant", "complete")]
    with open("/dev/full", "wb") as full:  # one-shot and --list too
        assert chatkv(model_dir, "a question", home=tmp_path, stdout=full).returncode == 2
        p = chatkv(model_dir, "--list", home=tmp_path, stdout=full)
    assert p.returncode == 2 and "No space left" in one_error_line(p.stderr)


# ------------------------------------------------------------------ the store


def test_a_message_that_is_not_utf8_names_its_conversation_and_the_rest_reads(model_dir, tmp_path):
    for text in (b"First chat\n", b"Second chat\n"):
        assert chatkv(model_dir, home=tmp_path, input=text).returncode == 0
    convs = dict((t, i) for i, t in conversations(tmp_path))
    bad, good = convs["First chat"], convs["Second chat"]
    c = sqlite3.connect(tmp_path / "chatkv.db")
    c.execute(
        "UPDATE messages SET content = CAST(x'48656c6cff6f' AS TEXT) "
        "WHERE id = (SELECT min(id) FROM messages WHERE conversation_id = ?)",
        (bad,),
    )
    c.commit()
    c.close()
    p = chatkv(model_dir, "--resume", bad, home=tmp_path, input=b"Are you there?\n")
    assert p.returncode == 2
    line = one_error_line(p.stderr)
    assert f"conversation {bad}" in line and "UTF-8" in line and "sqlite3" in line
    assert "OperationalError" not in line
    p = chatkv(model_dir, "--list", home=tmp_path)
    assert p.returncode == 0 and bad in p.stdout.decode() and good in p.stdout.decode()
    p = chatkv(model_dir, "--resume", good, home=tmp_path, input=b"And again\n")
    assert p.returncode == 0, p.stderr.decode()
    assert len(messages(tmp_path, good)) == 4 and len(messages(tmp_path, bad)) == 2  # nothing added to the bad one


def test_a_full_disk_under_the_database_is_one_line_and_nothing_half_stored(model_dir, small_disk):
    home = small_disk / "home"
    cmd = [sys.executable, "-m", "chatkv.cli", "--model", model_dir, "--max-tokens", "8"]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(home))
    try:
        child.stdin.write(b"hello\n")
        child.stdin.flush()
        deadline = time.monotonic() + TIMEOUT
        while len(_rows(home)) < 2:  # the first turn is stored: wait for it (a real read of the file)
            assert child.poll() is None and time.monotonic() < deadline, child.stderr.read().decode()
            time.sleep(0.1)
        filler = fill(small_disk)
        out, err = child.communicate(b"again\n", timeout=TIMEOUT)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 2
    line = one_error_line(err)
    assert "disk is full" in line and "free some space" in line and str(home / "chatkv.db") in line
    filler.unlink()
    # nothing of the failed turn was stored; the store works again once there is room
    assert [(r, s) for r, s, _ in _rows(home)] == [("user", "complete"), ("assistant", "complete")]
    [(conv_id, _)] = conversations(home)
    p = chatkv(model_dir, "--resume", conv_id, home=home, input=b"again\n")
    assert p.returncode == 0, p.stderr.decode()
    assert [r for r, _, _ in _rows(home)] == ["user", "assistant", "user", "assistant"]


def test_a_database_on_a_full_disk_at_start_is_one_line(model_dir, small_disk):
    home = small_disk / "home"
    assert chatkv(model_dir, home=home, input=b"hello\n").returncode == 0
    filler = fill(small_disk)
    p = chatkv(model_dir, "--resume", home=home, input=b"again\n")
    assert p.returncode == 2
    assert "disk is full" in one_error_line(p.stderr)
    filler.unlink()
    assert len(_rows(home)) == 2


def _rows(home: Path):
    if not (home / "chatkv.db").exists():  # connecting would create it
        return []
    try:
        return messages(home)
    except sqlite3.Error:
        return []


# ------------------------------------------------------------------ chatkv ingest / kb


def kb_cmd(*args, home: Path, stdout=subprocess.PIPE):
    return subprocess.run(
        [sys.executable, "-m", "chatkv.cli", *args],
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.PIPE,
        env=_env(home),
        timeout=TIMEOUT,
    )


def test_ingest_and_kb_output_and_data_directory_failures_are_one_line(tmp_path):
    doc = tmp_path / "kettle.md"
    doc.write_text("# Kettle\n\nThe kettle boils water in ninety seconds.\n")
    a_file = tmp_path / "passwd"
    a_file.write_text("x\n")
    p = kb_cmd("ingest", str(doc), "--kb", "t", "--data-dir", str(a_file), home=tmp_path / "home")
    assert p.returncode == 2 and "not a directory" in one_error_line(p.stderr)
    assert kb_cmd("ingest", str(doc), "--kb", "t", home=tmp_path / "home").returncode == 0
    with open("/dev/full", "wb") as full:
        p = kb_cmd("kb", "list", home=tmp_path / "home", stdout=full)
    assert p.returncode == 2 and "No space left on device" in one_error_line(p.stderr)
    r, w = os.pipe()
    os.close(r)  # the reader left before the first byte
    try:
        p = kb_cmd("kb", "info", "t", home=tmp_path / "home", stdout=w)
    finally:
        os.close(w)
    assert p.returncode == 0 and b"Traceback" not in p.stderr and p.stderr == b"", p.stderr.decode()
