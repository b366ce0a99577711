"""Storage faults: a full disk, a read-only directory or medium, a damaged database.

Snapshots are a cache: ``KVStore(root)`` never raises, a failed ``save`` raises
OSError and leaves the previous snapshot intact. The database is not a cache:
``Store.open`` on a damaged or unusable file raises one StorageError naming the
file and what is wrong, and leaves the file exactly as it was.

We run as root, which chmod cannot stop, so a read-only or full medium is
simulated by making the lowest-level call (``os.mkdir``, ``os.open``,
``os.replace``, ``os.fsync``, safetensors' writer) fail with the errno the
kernel would give; one test gets a real EFBIG from the kernel (RLIMIT_FSIZE).
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import signal
import stat
import time
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from sqlalchemy.exc import DBAPIError

from chatkv.errors import StorageError
from chatkv.storage import files, kv_store
from chatkv.storage.db import DB_FILENAME
from chatkv.storage.kv_store import KVStore
from chatkv.storage.paths import data_dir
from chatkv.storage.repository import Store

FP = "fp-faults"
LAYERS, HEADS, HEAD_DIM = 2, 2, 8


def kv(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda: torch.randn(n, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)  # noqa: E731
    return [mk() for _ in range(LAYERS)], [mk() for _ in range(LAYERS)]


def load_args(ids):
    return dict(
        token_ids=ids,
        model_fingerprint=FP,
        kv_dtype="bfloat16",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
    )


def save(store: KVStore, key: str, n: int, seed: int = 0):
    k, v = kv(n, seed)
    return store.save(key, list(range(seed, seed + n)), k, v, model_fingerprint=FP, kv_dtype="bfloat16")


def fail_under(monkeypatch, name: str, code: int, root: Path) -> None:
    """Make ``os.<name>(path, ...)`` raise OSError(code) for paths under ``root``."""
    real = getattr(os, name)

    def fake(path, *args, **kwargs):
        if str(path).startswith(str(root)):
            raise OSError(code, os.strerror(code), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, name, fake)


# ------------------------------------------------------------------ KVStore


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES, errno.ENOSPC])
def test_kv_store_whose_dir_cannot_be_created_never_raises(tmp_path, monkeypatch, caplog, code):
    root = tmp_path / "data" / "kv"
    fail_under(monkeypatch, "mkdir", code, tmp_path / "data")
    with caplog.at_level(logging.WARNING, logger="chatkv.storage"):
        store = KVStore(root)  # a new chat must still be possible
    assert any(str(root) in r.getMessage() for r in caplog.records)
    assert store.keys() == set() and store.cleanup_temp() == 0
    with pytest.raises(OSError) as info:
        save(store, "a", 4)
    assert info.value.errno == code
    monkeypatch.undo()  # the medium becomes writable again: the next save works
    save(store, "a", 4)
    assert store.load("a", **load_args(list(range(4))))[2] == 4


def test_kv_store_with_a_file_in_the_way_never_raises(tmp_path):
    root = tmp_path / "kv"
    root.write_bytes(b"not a directory")
    store = KVStore(root)
    assert store.keys() == set()
    with pytest.raises(OSError):
        save(store, "a", 4)
    assert root.read_bytes() == b"not a directory"


def write_faults(monkeypatch, root: Path, where: str, code: int) -> None:
    """Make one step of a save fail as a read-only or full medium would."""
    if where == "create":
        fail_under(monkeypatch, "open", code, root)
    elif where == "write":  # safetensors' Rust writer reports I/O errors as SafetensorError

        def full(tensors, path, metadata=None):
            raise SafetensorError(f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})")

        monkeypatch.setattr(kv_store, "save_file", full)
    elif where == "fsync":

        def no_fsync(fd):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(os, "fsync", no_fsync)
    elif where == "rename":
        fail_under(monkeypatch, "replace", code, root)
    else:
        raise AssertionError(where)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
@pytest.mark.parametrize("where", ["create", "write", "fsync", "rename"])
def test_failed_save_is_an_oserror_and_keeps_the_old_snapshot(tmp_path, monkeypatch, where, code):
    store = KVStore(tmp_path / "kv")
    save(store, "a", 6)
    before = store.path("a").read_bytes()
    write_faults(monkeypatch, store.root, where, code)
    with pytest.raises(OSError) as info:
        save(store, "a", 9, seed=5)
    assert info.value.errno == code
    monkeypatch.undo()
    assert sorted(p.name for p in store.root.iterdir()) == ["a.safetensors"]  # no temp file left
    assert store.path("a").read_bytes() == before
    assert store.load("a", **load_args(list(range(6))))[2] == 6
    save(store, "a", 9, seed=5)  # and the store still works
    assert store.load("a", **load_args(list(range(5, 14))))[2] == 9


def test_real_file_size_limit_is_an_oserror(tmp_path):
    """The kernel refuses the write (EFBIG, as ENOSPC would be refused): safetensors'
    error comes out as OSError with that errno, and nothing is left behind."""
    store = KVStore(tmp_path / "kv")
    save(store, "a", 4)
    k, v = kv(512, seed=1)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, hard))
    try:
        with pytest.raises(OSError) as info:
            store.save("a", list(range(512)), k, v, model_fingerprint=FP, kv_dtype="bfloat16")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert info.value.errno == errno.EFBIG
    assert isinstance(info.value.__cause__, SafetensorError)
    assert sorted(p.name for p in store.root.iterdir()) == ["a.safetensors"]
    assert store.load("a", **load_args(list(range(4))))[2] == 4


def test_load_from_a_read_only_dir_still_refuses_damage(tmp_path, monkeypatch):
    """A damaged snapshot that cannot be deleted (read-only medium) is still refused."""
    store = KVStore(tmp_path / "kv")
    save(store, "a", 6)
    store.path("a").write_bytes(store.path("a").read_bytes()[:-3])
    fail_under(monkeypatch, "unlink", errno.EROFS, store.root)
    with pytest.raises(kv_store.SnapshotInvalid):
        store.load("a", **load_args(list(range(6))))
    assert store.path("a").exists()


def test_stale_safetensors_temp_files_are_removed(tmp_path):
    """safetensors writes its own ``.tmpXXXXXX`` and renames it; a writer killed
    meanwhile leaves it behind. With no pid to check, it goes once an hour old."""
    root = tmp_path / "kv"
    root.mkdir()
    old, fresh = root / ".tmpAb12Cd", root / ".tmpZz99Yy"
    for p in (old, fresh):
        p.write_bytes(b"partial")
    past = time.time() - 2 * 3600
    os.utime(old, (past, past))
    KVStore(root)
    assert sorted(p.name for p in root.iterdir()) == [fresh.name]


# ------------------------------------------------------------------ the database


def assert_clear(err: StorageError, path: Path, *words: str) -> None:
    msg = str(err)
    assert str(path) in msg, msg
    for w in words:
        assert w in msg, msg
    assert "sqlalche.me" not in msg and "[SQL:" not in msg and "\n" not in msg, msg


@pytest.mark.parametrize("damage", ["garbage", "truncated", "zeroed_header"])
def test_damaged_db_is_one_clear_error_and_left_as_is(tmp_path, damage):
    path = tmp_path / DB_FILENAME
    if damage == "garbage":
        path.write_bytes(os.urandom(20_000))
    else:
        with Store.open(data_dir=tmp_path) as s:
            for i in range(50):
                c = s.create_conversation(f"chat {i}", "m", "be brief " * 50, {})
                s.add_message(c.id, "user", "hello " * 200)
        for side in tmp_path.glob(DB_FILENAME + "-*"):
            side.unlink()  # closed cleanly: the WAL was checkpointed into the file
        blob = path.read_bytes()
        blob = blob[: len(blob) // 2] if damage == "truncated" else bytes(100) + blob[100:]
        path.write_bytes(blob)
    before = path.read_bytes()
    with pytest.raises(StorageError) as info:
        Store.open(data_dir=tmp_path)
    assert_clear(info.value, path, "damaged")
    assert isinstance(info.value.__cause__, DBAPIError)  # the driver's error is chained, not shown
    assert path.read_bytes() == before  # nothing saved is lost: the file is untouched


def test_read_only_database_is_refused_at_open(tmp_path):
    """A database SQLite can only read (here opened with mode=ro) is refused when
    opened, not at the first reply the user waits for."""
    with Store.open(data_dir=tmp_path) as s:
        s.create_conversation("kept", "m", "", {})
    path = tmp_path / DB_FILENAME
    with pytest.raises(StorageError) as info:
        Store.open(url=f"sqlite:///file:{path}?mode=ro&uri=true")
    assert_clear(info.value, path, "read-only")
    with Store.open(data_dir=tmp_path) as s:
        assert [c.title for c in s.list_conversations()] == ["kept"]


@pytest.mark.parametrize(
    "code, words",
    [
        (errno.EROFS, "read-only file system"),
        (errno.EACCES, "permission denied"),
        (errno.ENOSPC, "disk is full"),
    ],
)
def test_db_file_that_cannot_be_opened(tmp_path, monkeypatch, code, words):
    path = tmp_path / DB_FILENAME
    fail_under(monkeypatch, "open", code, path)
    with pytest.raises(StorageError) as info:
        Store.open(data_dir=tmp_path)
    assert_clear(info.value, path, words)
    assert isinstance(info.value.__cause__, OSError)


def test_db_dir_that_cannot_be_created(tmp_path, monkeypatch):
    data = tmp_path / "new" / "data"
    fail_under(monkeypatch, "mkdir", errno.EACCES, tmp_path / "new")
    with pytest.raises(StorageError) as info:
        Store.open(data_dir=data)
    assert_clear(info.value, data / DB_FILENAME, "permission denied", str(tmp_path / "new"))


def test_directory_in_place_of_the_db(tmp_path):
    (tmp_path / DB_FILENAME).mkdir()
    with pytest.raises(StorageError) as info:
        Store.open(data_dir=tmp_path)
    assert_clear(info.value, tmp_path / DB_FILENAME, "directory")


def test_chatkv_home_that_cannot_be_created(tmp_path, monkeypatch):
    home = tmp_path / "ro" / "home"
    monkeypatch.setenv("CHATKV_HOME", str(home))
    fail_under(monkeypatch, "mkdir", errno.EROFS, tmp_path / "ro")
    with pytest.raises(StorageError) as info:
        Store.open()
    assert "read-only file system" in str(info.value) and str(tmp_path / "ro") in str(info.value)


# ------------------------------------------------------------------ modes: only what chatkv creates


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_existing_shared_chatkv_home_is_left_alone(tmp_path, monkeypatch):
    home = tmp_path / "shared"
    home.mkdir()
    os.chmod(home, 0o1777)
    monkeypatch.setenv("CHATKV_HOME", str(home))
    assert data_dir() == home
    assert mode(home) == 0o1777
    with Store.open() as s:
        s.create_conversation("c", "m", "", {})
    store = KVStore(home / "kv")
    save(store, "a", 3)
    assert mode(home) == 0o1777  # still shared
    assert mode(home / DB_FILENAME) == 0o600
    assert mode(home / "kv") == 0o700 and mode(store.path("a")) == 0o600


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_created_chatkv_home_is_private(tmp_path, monkeypatch, umask):
    parent = tmp_path / "existing"
    parent.mkdir()
    os.chmod(parent, 0o755)
    home = parent / "a" / "b"
    monkeypatch.setenv("CHATKV_HOME", str(home))
    old = os.umask(umask)
    try:
        assert data_dir() == home
        with Store.open() as s:
            s.create_conversation("c", "m", "", {})
    finally:
        os.umask(old)
    assert mode(parent) == 0o755  # not ours: untouched
    assert mode(parent / "a") == mode(home) == 0o700  # ours: private
    assert mode(home / DB_FILENAME) == 0o600


def test_make_private_dir_reports_what_it_created(tmp_path):
    assert files.make_private_dir(tmp_path / "x" / "y") is True
    assert files.make_private_dir(tmp_path / "x" / "y") is False
    assert files.make_private_dir(tmp_path) is False
    (tmp_path / "f").write_text("")
    with pytest.raises(OSError):
        files.make_private_dir(tmp_path / "f" / "sub")


def test_atomic_write_failure_leaves_the_old_file(tmp_path):
    target = tmp_path / "t.json"
    files.atomic_write(target, lambda p: p.write_text("old"))
    assert target.read_text() == "old" and mode(target) == 0o600

    def half(p: Path):
        p.write_text("partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        files.atomic_write(target, half)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]


def test_no_copy_of_the_helpers_elsewhere():
    """The directory fsync and the private-file helpers exist once, in storage/files.py."""
    root = Path(__file__).resolve().parents[2]
    sources = [p for d in ("chatkv", "storage", "kernels", "retrieval", "tui") for p in (root / d).rglob("*.py")]
    for p in sources:
        if p == root / "storage" / "files.py":
            continue
        text = p.read_text()
        for name in ("def _fsync_dir", "def fsync_dir", "def create_private_file", "def _private_tree"):
            assert name not in text, f"{p.relative_to(root)} defines {name[4:]} again"
