"""Fault injection: a write error at each point of spill, restore and
snapshot open, and an exception inside ``on_pressure``, admission, the forward and postprocess.

Two kinds of fault, two promises:

- **Snapshot faults** (ENOSPC, EROFS at the lowest call that does the I/O: ``os.open`` of the
  temp file, safetensors' writer, ``os.fsync`` of the file and of the directory, ``os.replace``,
  ``os.mkdir``, ``os.unlink``, the snapshot's database row): snapshots are a cache, so the
  turn, the spill and the close succeed, a warning is logged, and the replies are exactly
  those of a fault-free run.
- **Engine faults** (an exception raised once inside ``on_pressure``, ``KVManager.attach`` /
  ``reserve``, ``ModelRunner.forward``, the detokenizer): the exception reaches the caller,
  and afterwards the engine serves the same session, a new session and a batch correctly.

After every fault ``engine.check_integrity()`` passes (every block reference and radix lock is
owned by a live request, open session or pin), no committed message is lost, and every later
reply equals what a fresh engine computes greedily from the same prompt tokens (the oracle).
Every fault asserts that it actually fired, so no test passes by missing its target.

We run as root (chmod cannot make a directory read-only), so the medium's errors are injected
with monkeypatch at the lowest Python-level call, only for paths under the snapshot directory.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import stat
from pathlib import Path

import pytest
from safetensors import SafetensorError
from sqlalchemy.exc import OperationalError

from chatkv.config import EngineConfig
from chatkv.engine.core import Engine
from chatkv.engine.detokenize import TextStream
from chatkv.engine.model_runner import ModelRunner
from chatkv.engine.sampling import SamplingParams
from chatkv.errors import StorageError
from chatkv.kvcache.manager import KVManager
from chatkv.sessions.snapshots import Snapshots
from chatkv.storage import kv_store
from chatkv.storage.kv_store import KVStore
from chatkv.storage.repository import Store

pytestmark = pytest.mark.tiny_model("llama", seed=11)

MAX_TOKENS = 5
GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0.0)
QUESTIONS = [
    "Hello, how are you today?",
    "What is the capital of France?",
    "The quick brown fox jumps over the lazy dog.",
    "Key-value caches keep attention state.",
    "You are a helpful assistant.",
]
# distinct, ~60 tokens each: three of them do not fit in the small pool together
LONG = [" ".join(QUESTIONS[i:] + QUESTIONS[:i]) * 2 for i in range(4)]
ERRNOS = {"ENOSPC": errno.ENOSPC, "EROFS": errno.EROFS}


class Injected(Exception):
    """The exception an engine fault raises (not a RuntimeError, so nothing swallows it)."""


@pytest.fixture(scope="module")
def oracle(model_dir):
    """A fresh engine without prefix caching: greedy replies computed from scratch."""
    e = Engine(model_dir, EngineConfig(num_blocks=64, block_size=8, enable_prefix_caching=False))
    cache = {}

    def generate(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in cache:
            cache[key] = e.generate(list(prompt), SamplingParams(**GREEDY)).token_ids
        return cache[key]

    yield generate
    e.close()


def make_engine(model_dir, data_dir, **kw) -> Engine:
    # 24 blocks of 8 = 192 tokens: three ~60-token conversations cannot all stay resident;
    # max_batch_tokens 32: a long prompt is prefilled in chunks over several steps
    kw = dict(dict(num_blocks=24, block_size=8, max_batch_tokens=32), **kw)
    return Engine(model_dir, EngineConfig(data_dir=str(data_dir), **kw))


def reply_ids(session, reply) -> list[int]:
    """The token ids of ``reply``, read from the session's canonical history."""
    p = reply.usage.prompt_tokens
    return session.tokens[p : p + reply.usage.generated_tokens]


def check_oracle(oracle, session, reply) -> None:
    """The reply is what a fresh engine generates greedily from the turn's prompt tokens."""
    prompt = session.tokens[: reply.usage.prompt_tokens]
    assert reply.finish_reason in ("stop", "length")
    assert reply_ids(session, reply) == oracle(prompt)


def snapshot_root(e: Engine) -> Path:
    return Path(e.config.data_dir) / "kv"


def under(path, root: Path) -> bool:
    try:
        p = os.path.abspath(os.fsdecode(path))
    except TypeError:  # an fd
        return False
    return p == str(root) or p.startswith(str(root) + os.sep)


def fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def os_error(code: int, what: str = "") -> OSError:
    return OSError(code, os.strerror(code), what or None)


def db_error(code: int) -> OperationalError:
    """What SQLAlchemy raises when SQLite cannot write: a full disk or a read-only medium."""
    msg = "database or disk is full" if code == errno.ENOSPC else "attempt to write a readonly database"
    return OperationalError("UPDATE kv_snapshots ...", {}, sqlite3.OperationalError(msg))


class Fault:
    """A fault that fires while armed (``once``: only the first time); counts its hits."""

    def __init__(self, once: bool = False, skip: int = 0):
        self.armed = False
        self.once = once
        self.skip = skip  # let this many armed calls through first
        self.hits = 0

    def fire(self) -> bool:
        if not self.armed:
            return False
        if self.skip > 0:
            self.skip -= 1
            return False
        self.hits += 1
        if self.once:
            self.armed = False
        return True


def warned(caplog, *needles: str) -> bool:
    return any(r.levelno >= logging.WARNING and any(n in r.getMessage() for n in needles) for r in caplog.records)


def inject(monkeypatch, owner, name: str, fault: Fault, error, when=lambda *a: True, after: bool = False) -> None:
    """Patch ``owner.name`` so that a call whose arguments pass ``when`` raises ``error(*args)`` if
    ``fault.fire()``: before the real call, or after it (``after``); every other call goes through.
    ``when`` is asked first, so the fault counts only the calls it targets. The arguments are the
    call's positional ones, ``self`` first for a method patched on its class."""
    real = getattr(owner, name)

    def fake(*a, **kw):
        if not after and when(*a) and fault.fire():
            raise error(*a)
        out = real(*a, **kw)
        if after and when(*a) and fault.fire():
            raise error(*a)
        return out

    monkeypatch.setattr(owner, name, fake)


def path_fault(monkeypatch, owner, name: str, fault: Fault, code: int, root: Path) -> None:
    """``owner.name(path, ...)`` fails with ``code`` for a path under ``root``."""
    inject(
        monkeypatch, owner, name, fault, lambda path, *_: os_error(code, path), when=lambda path, *_: under(path, root)
    )


# -- snapshot write faults ----------------------------------------------------------------------


def install_write_fault(point: str, code: int, root: Path, fault: Fault, monkeypatch) -> None:
    """Make the snapshot write fail at ``point`` with ``code`` while ``fault`` is armed."""
    if point == "tmp_create":  # atomic_write's exclusive create of the temp file
        inject(
            monkeypatch,
            os,
            "open",
            fault,
            lambda path, *_: os_error(code, path),
            when=lambda path, flags, *_: flags & os.O_CREAT and under(path, root),
        )
    elif point == "safetensors_write":  # the library's own writer, failing as it does (a SafetensorError)
        msg = f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})"
        inject(
            monkeypatch,
            kv_store,
            "save_file",
            fault,
            lambda *_: SafetensorError(msg),
            when=lambda tensors, path, *_: under(path, root),
        )
    elif point in ("file_fsync", "dir_fsync"):
        want = stat.S_ISDIR if point == "dir_fsync" else stat.S_ISREG
        inject(
            monkeypatch,
            os,
            "fsync",
            fault,
            lambda fd: os_error(code),
            when=lambda fd: want(os.fstat(fd).st_mode) and under(fd_path(fd), root),
        )
    elif point == "rename":
        inject(
            monkeypatch,
            os,
            "replace",
            fault,
            lambda src, dst, *_: os_error(code, dst),
            when=lambda src, dst, *_: under(dst, root),
        )
    elif point == "mkdir":  # the snapshot directory went away and cannot be made again
        path_fault(monkeypatch, os, "mkdir", fault, code, root)
    elif point == "db_row":  # the snapshot's database row
        inject(monkeypatch, Store, "put_snapshot", fault, lambda *_: db_error(code))
    else:
        raise AssertionError(point)


WRITE_POINTS = ["tmp_create", "safetensors_write", "file_fsync", "rename", "dir_fsync", "mkdir", "db_row"]


def pressure_scenario(e: Engine, arm, after_arm=lambda: None):
    """Memory pressure: three long conversations in a pool that holds two, so admitting
    one spills another (inside admission); then close them all (spill), reopen one, start a new
    one. ``arm`` is called before the first turn. Returns the replies' token ids, in order."""
    out = []
    snaps = e.session_manager.snapshots
    real_relieve, relieved = snaps.relieve, []

    def relieve(sessions, missing):  # count the spills asked for from inside admission
        relieved.append(missing)
        return real_relieve(sessions, missing)

    snaps.relieve = relieve
    arm()
    after_arm()
    sessions = [e.session(params=GREEDY) for _ in range(3)]
    for s, text in zip(sessions, LONG):
        r = s.send(text)
        out.append(reply_ids(s, r))
        e.check_integrity()
    r = sessions[0].send(QUESTIONS[1])  # its KV was spilled (or dropped) under pressure
    out.append(reply_ids(sessions[0], r))
    e.check_integrity()
    for s in sessions:
        s.close()  # spills: the write fails again, the close must not
        e.check_integrity()
    assert relieved, "memory pressure spilled a session during admission"
    return sessions, out


@pytest.fixture(scope="module")
def pressure_reference(model_dir, tmp_path_factory):
    """The pressure scenario without faults, then resume: what every faulty run must reproduce."""
    data = tmp_path_factory.mktemp("ref-data")
    e = make_engine(model_dir, data)
    sessions, out = pressure_scenario(e, lambda: None)
    assert e.session_manager.store.snapshots_lru(), "the scenario spills: some snapshot was written"
    s = e.resume(sessions[1].id)
    r = s.send(QUESTIONS[2])
    assert r.usage.restored_tokens > 0, "the fault-free run restores the history from disk"
    out.append(reply_ids(s, r))
    n = e.session(params=GREEDY)
    out.append(reply_ids(n, n.send(QUESTIONS[3])))
    e.close()
    return out


@pytest.mark.parametrize("code", list(ERRNOS.values()), ids=list(ERRNOS))
@pytest.mark.parametrize("point", WRITE_POINTS)
def test_spill_write_fault_never_fails_a_turn(
    model_dir, tmp_path, monkeypatch, caplog, oracle, pressure_reference, point, code
):
    """Snapshots on a full (or read-only) disk, spills forced by memory pressure during
    admission: no raw SafetensorError escapes admission and no turn fails with OutOfBlocks;
    every turn, spill and close completes, with a warning."""
    caplog.set_level(logging.WARNING)
    e = make_engine(model_dir, tmp_path / "data")
    fault = Fault()
    root = snapshot_root(e)
    install_write_fault(point, code, root, fault, monkeypatch)

    def arm():
        fault.armed = True

    e.session_manager  # opens the store and the snapshot directory, fault-free

    def remove_root():
        if point == "mkdir":  # the directory is gone: save() must make it again, and cannot
            (root / ".lock").unlink(missing_ok=True)  # the directory's lock file, left empty by every writer
            os.rmdir(root)

    sessions, out = pressure_scenario(e, arm, remove_root)
    e.session_manager.snapshots.flush()  # the background writer has met the fault
    assert fault.hits > 0, f"the {point} fault never fired"
    if point == "db_row":  # the files are written; only the row (bookkeeping) lags, fixed at the next open
        assert warned(caplog, "not recorded"), "a failed snapshot row is logged"
    else:
        assert warned(caplog, "not saved to disk"), "a failed snapshot write is logged"
    assert out == pressure_reference[: len(out)], "a failed snapshot changes no reply"
    left = (
        sorted(p.name for p in root.iterdir() if p.name != ".lock") if root.exists() else []
    )  # the directory's lock file stays
    assert not [n for n in left if n.endswith(".tmp") or ".tmp" in n], f"a failed write left a temp file: {left}"
    if point not in ("dir_fsync", "db_row"):  # those fail after the file is complete and in place
        assert not left, f"a failed write left {left}"
    for s in sessions:  # nothing committed was lost
        roles = [m.role for m in e.resume(s.id).messages()]
        assert roles == ["user", "assistant"] * (2 if s is sessions[0] else 1)
        assert all(m.status == "complete" for m in s.messages())
    fault.armed = False
    # the medium is fine again: the same conversations and a new one go on exactly
    s = e.resume(sessions[1].id)
    r = s.send(QUESTIONS[2])
    if point != "db_row":  # there the manifest (the authority) was written and restores
        assert r.usage.restored_tokens == 0  # nothing reached the disk: recomputed
    check_oracle(oracle, s, r)
    n = e.session(params=GREEDY)
    rn = n.send(QUESTIONS[3])
    check_oracle(oracle, n, rn)
    assert out + [reply_ids(s, r), reply_ids(n, rn)] == pressure_reference
    e.check_integrity()
    e.close()  # no traceback at exit
    # on the next open rows follow the manifests, and files no manifest lists are swept
    e = make_engine(model_dir, tmp_path / "data")
    snaps = e.session_manager.snapshots
    rows = {snap.file for snap in e.session_manager.store.snapshots_lru()}
    assert {p.name for p in root.glob("*.json")} == rows
    listed = {
        p.name for snap in e.session_manager.store.snapshots_lru() for p in snaps.segment_paths(snap.conversation_id)
    }
    assert {p.name for p in root.glob("*.safetensors")} == listed
    e.close()


@pytest.mark.parametrize("code", list(ERRNOS.values()), ids=list(ERRNOS))
@pytest.mark.parametrize("point", WRITE_POINTS)
def test_idle_spill_write_fault_never_fails_a_turn(model_dir, tmp_path, monkeypatch, caplog, oracle, point, code):
    """The other spill trigger: a turn first spills every other idle session (idle_spill_s=0).
    The disk fails from a's first turn on, so its write-behind fails, and the spill that
    releases a's KV finds nothing on disk: it queues the KV again, which fails again."""
    caplog.set_level(logging.WARNING)
    e = make_engine(model_dir, tmp_path / "data", idle_spill_s=0.0)
    root = snapshot_root(e)
    e.session_manager
    fault = Fault()
    install_write_fault(point, code, root, fault, monkeypatch)
    a, b = e.session(params=GREEDY), e.session(params=GREEDY)
    fault.armed = True
    if point == "mkdir":
        (root / ".lock").unlink(missing_ok=True)
        os.rmdir(root)
    check_oracle(oracle, a, a.send(QUESTIONS[0]))
    e.session_manager.snapshots.flush()
    check_oracle(oracle, b, b.send(QUESTIONS[1]))  # spills a first: the write fails, the turn goes on
    e.session_manager.snapshots.flush()
    assert fault.hits > 0, f"the {point} fault never fired"
    assert warned(caplog, "not recorded" if point == "db_row" else "not saved to disk")
    assert a.kept is None, "a's KV was released even though it could not be saved"
    e.check_integrity()
    r = a.send(QUESTIONS[2])
    if point != "db_row":  # there the manifest (the authority) was written and restores
        assert r.usage.restored_tokens == 0
    check_oracle(oracle, a, r)
    for s in (a, b):
        assert [m.role for m in s.messages()] == ["user", "assistant"] * (2 if s is a else 1)
    e.check_integrity()
    e.close()


def test_full_disk_pressure_spill_then_every_session_keeps_going(model_dir, tmp_path, monkeypatch, caplog, oracle):
    """A full disk as a user would meet it: four chats on a full disk in a pool that holds
    two; every turn of every chat completes (none fails with OutOfBlocks), the pool is consistent
    after each, and each reply is the oracle's."""
    caplog.set_level(logging.WARNING)
    e = make_engine(model_dir, tmp_path / "data")
    fault = Fault()
    fault.armed = True
    install_write_fault("safetensors_write", errno.ENOSPC, snapshot_root(e), fault, monkeypatch)
    sessions = [e.session(params=GREEDY) for _ in range(4)]
    for round_ in range(2):
        for i, s in enumerate(sessions):
            r = s.send(LONG[i] if round_ == 0 else QUESTIONS[i])
            check_oracle(oracle, s, r)
            e.check_integrity()
    e.session_manager.snapshots.flush()  # the background writer has met the full disk
    assert fault.hits > 0 and warned(caplog, "not saved to disk")
    stats = e.kv_stats()
    assert stats["retained"] <= len(sessions)
    for s in sessions:
        assert [m.role for m in s.messages()] == ["user", "assistant"] * 2
        s.close()
    e.check_integrity()
    e.kv.clear()
    assert e.kv_stats()["blocks_free"] == e.kv_stats()["blocks_total"], "nothing is held once every chat closed"
    e.close()


# -- restore faults ---------------------------------------------------------------------------


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])
    path.write_bytes(bytes(data))


RESTORE_POINTS = ["read", "load", "discard_unlink", "touch", "delete_row"]


def install_restore_fault(point, code, e: Engine, sid: str, fault: Fault, monkeypatch) -> None:
    root = snapshot_root(e)
    if point == "read":  # the file cannot be read (safetensors' open fails with an OSError)
        path_fault(monkeypatch, kv_store, "safe_open", fault, code, root)
    elif point == "load":  # the store's load itself raises an OSError
        inject(monkeypatch, KVStore, "load", fault, lambda *_: os_error(code))
    elif point == "discard_unlink":  # a damaged snapshot on a read-only medium: it cannot be removed
        corrupt(e.session_manager.snapshots.path(sid))
        path_fault(monkeypatch, os, "unlink", fault, code, root)
    elif point == "touch":  # the LRU time cannot be recorded
        inject(monkeypatch, Store, "touch_snapshot", fault, lambda *_: db_error(code))
    elif point == "delete_row":  # a damaged snapshot whose row cannot be deleted
        corrupt(e.session_manager.snapshots.path(sid))
        inject(monkeypatch, Store, "delete_snapshot", fault, lambda *_: db_error(code))
    else:
        raise AssertionError(point)


@pytest.fixture(scope="module")
def restore_reference(model_dir, tmp_path_factory):
    e = make_engine(model_dir, tmp_path_factory.mktemp("ref-restore"))
    s = e.session(params=GREEDY)
    out = [reply_ids(s, s.send(QUESTIONS[0]))]
    s.spill()
    e.kv.cache.evict(e.kv.pool.num_blocks)
    r = s.send(QUESTIONS[1])
    assert r.usage.restored_tokens > 0
    out.append(reply_ids(s, r))
    out.append(reply_ids(s, s.send(QUESTIONS[2])))
    n = e.session(params=GREEDY)
    out.append(reply_ids(n, n.send(QUESTIONS[3])))
    e.close()
    return out


@pytest.mark.parametrize("code", list(ERRNOS.values()), ids=list(ERRNOS))
@pytest.mark.parametrize("point", RESTORE_POINTS)
def test_restore_fault_recomputes(model_dir, tmp_path, monkeypatch, caplog, oracle, restore_reference, point, code):
    """A snapshot that cannot be read, removed or marked used costs a recompute (or only the
    LRU time), never the turn."""
    caplog.set_level(logging.WARNING)
    e = make_engine(model_dir, tmp_path / "data")
    s = e.session(params=GREEDY)
    out = [reply_ids(s, s.send(QUESTIONS[0]))]
    assert s.spill()
    e.kv.cache.evict(e.kv.pool.num_blocks)  # the history is on disk only
    assert e.kv_stats()["blocks_free"] == e.kv_stats()["blocks_total"]
    fault = Fault()
    install_restore_fault(point, code, e, s.id, fault, monkeypatch)
    fault.armed = True
    r = s.send(QUESTIONS[1])
    assert fault.hits > 0, f"the {point} fault never fired"
    check_oracle(oracle, s, r)
    out.append(reply_ids(s, r))
    if point == "touch":
        assert r.usage.restored_tokens > 0  # only the LRU time was lost
        assert warned(caplog, "last use not recorded")
    else:
        assert r.usage.restored_tokens == 0
        assert warned(caplog, "recomputing", "unreadable", "cannot")
    e.check_integrity()
    r = s.send(QUESTIONS[2])  # the fault may still be armed: the turn goes on regardless
    check_oracle(oracle, s, r)
    out.append(reply_ids(s, r))
    fault.armed = False
    n = e.session(params=GREEDY)
    out.append(reply_ids(n, n.send(QUESTIONS[3])))
    assert out == restore_reference
    assert [m.role for m in s.messages()] == ["user", "assistant"] * 3
    e.check_integrity()
    e.close()


# -- snapshot directory open faults -------------------------------------------------------------

OPEN_POINTS = ["mkdir", "cleanup_unlink", "orphan_unlink"]


@pytest.mark.parametrize("code", list(ERRNOS.values()), ids=list(ERRNOS))
@pytest.mark.parametrize("point", OPEN_POINTS)
def test_snapshot_open_fault_keeps_chats_working(model_dir, tmp_path, monkeypatch, caplog, oracle, point, code):
    """A snapshot directory that cannot be created, or whose leftovers cannot be removed:
    new chats still work (KVStore.__init__ never raises), spills log a warning."""
    caplog.set_level(logging.WARNING)
    data = tmp_path / "data"
    root = data / "kv"
    fault = Fault()
    if point == "mkdir":
        path_fault(monkeypatch, os, "mkdir", fault, code, root)
    else:
        root.mkdir(parents=True)
        if point == "cleanup_unlink":  # a temp file of a writer long dead
            (root / f".abc-x.{2**22 + 17}.{'0' * 16}.{'0' * 8}.tmp").write_bytes(b"x")
        else:  # a snapshot file with no database row
            salt = __import__("hashlib").sha256(b"").hexdigest()[:8]
            (root / f"deadbeef-{salt}.safetensors").write_bytes(b"x")
        path_fault(monkeypatch, os, "unlink", fault, code, root)
    fault.armed = True
    e = make_engine(model_dir, data)
    s = e.session(params=GREEDY)  # opens the store and the snapshot directory
    assert fault.hits > 0, f"the {point} fault never fired"
    if point != "cleanup_unlink":  # a temp file that cannot be removed is left quietly (KVStore.cleanup_temp)
        assert warned(caplog, "unusable", "cannot remove")
    r1 = s.send(QUESTIONS[0])
    check_oracle(oracle, s, r1)
    assert s.spill()  # with no directory the write fails: logged, the KV dropped
    if point == "mkdir":
        assert warned(caplog, "not saved to disk")
    r2 = s.send(QUESTIONS[1])
    check_oracle(oracle, s, r2)
    e.check_integrity()
    s.close()
    fault.armed = False
    s = e.resume(s.id)
    check_oracle(oracle, s, s.send(QUESTIONS[2]))
    assert [m.role for m in s.messages()] == ["user", "assistant"] * 3
    e.check_integrity()
    e.close()


@pytest.mark.parametrize("code", list(ERRNOS.values()), ids=list(ERRNOS))
def test_unusable_data_dir_is_a_storage_error(model_dir, tmp_path, monkeypatch, code, oracle):
    """A data directory that cannot be created: opening sessions raises StorageError (a chatkv
    error naming the directory), and the engine still answers plain requests and, once the medium
    is fine, opens sessions."""
    data = tmp_path / "data"
    fault = Fault()
    path_fault(monkeypatch, os, "mkdir", fault, code, data)
    fault.armed = True
    e = make_engine(model_dir, data)
    with pytest.raises(StorageError, match=str(data)):
        e.session(params=GREEDY)
    assert fault.hits > 0
    ids = e.encode_chat([{"role": "user", "content": QUESTIONS[0]}])
    assert e.generate(ids, SamplingParams(**GREEDY)).token_ids == oracle(ids)
    fault.armed = False
    s = e.session(params=GREEDY)
    check_oracle(oracle, s, s.send(QUESTIONS[0]))
    e.check_integrity()
    e.close()


# -- engine faults: an exception raised once inside a step -------------------------------------


def install_raise(point: str, fault: Fault, monkeypatch) -> None:
    owner, name, after, when = RAISES[point]
    what = f"{owner.__name__}.{name} failed" + (" after doing its work" if after else "")
    inject(monkeypatch, owner, name, fault, lambda *_: Injected(what), when=when, after=after)


def _any(*a) -> bool:
    return True


def _decoding(kv, table, num_tokens, *a) -> bool:
    """A decode step's reserve: one new token for a table that already holds KV (reserve takes the
    request's BlockTable, not the request; a prefill chunk of these tests' prompts is never one
    token, and a step reserves a decoding sequence's one token before any speculative draft)."""
    return num_tokens == 1 and table.num_computed > 0


def _decode_batch(runner, batch) -> bool:  # one new token per sequence, each with logits
    return len(batch.input_ids) == len(batch.logits_rows)


def _prefill_batch(runner, batch) -> bool:
    return len(batch.input_ids) > len(batch.logits_rows)


# point: (class, method, raise after the real call, when to raise: given self and the call's arguments)
RAISES = {
    "on_pressure": (Snapshots, "relieve", False, _any),
    "on_pressure_after_spill": (Snapshots, "relieve", True, _any),
    "admission_attach": (KVManager, "attach", False, _any),
    "admission_reserve": (KVManager, "reserve", False, _any),
    "decode_reserve": (KVManager, "reserve", False, _decoding),
    "forward_prefill": (ModelRunner, "forward", False, _any),
    "forward_prefill_chunk": (ModelRunner, "forward", False, _prefill_batch),
    "forward_decode": (ModelRunner, "forward", False, _decode_batch),
    "detokenize": (TextStream, "add", False, _any),
    "detokenize_finish": (TextStream, "finish", False, _any),
}
# armed calls let through before the one that raises
SKIPS = {"forward_prefill_chunk": 1, "detokenize": 1}
RAISE_POINTS = list(RAISES)


def held_by_sessions(e: Engine) -> int:
    return sum(1 for h in e.session_manager.held_kv() if h is not None)


@pytest.mark.parametrize("point", RAISE_POINTS)
def test_exception_in_a_turn_propagates_and_the_engine_goes_on(model_dir, tmp_path, oracle, monkeypatch, point):
    e = make_engine(model_dir, tmp_path / "data")
    fault = Fault(once=True, skip=SKIPS.get(point, 0))
    install_raise(point, fault, monkeypatch)
    a, b = e.session(params=GREEDY), e.session(params=GREEDY)
    check_oracle(oracle, a, a.send(LONG[0]))
    check_oracle(oracle, b, b.send(LONG[1]))
    e.check_integrity()
    if point.startswith("on_pressure"):
        victim = e.session(params=GREEDY)  # its first turn needs blocks a and b hold: on_pressure runs
        text = LONG[2]
    else:
        victim = a  # a second turn: the session's retained KV is handed to the request
        text = " ".join(QUESTIONS[2:])  # longer than one chunk
    before = len(victim.messages())
    fault.armed = True
    with pytest.raises(Injected):
        victim.send(text)
    assert fault.hits == 1, f"the {point} fault never fired"
    e.check_integrity()
    assert e.kv_stats()["retained"] == held_by_sessions(e), "no retained KV without an owner"
    msgs = victim.messages()
    # the user message was committed before generation; the cut reply is kept, marked interrupted
    assert len(msgs) == before + 2 and msgs[-2].role == "user" and msgs[-2].content == text
    assert msgs[-1].role == "assistant" and msgs[-1].status == "interrupted"
    assert [m.role for m in b.messages()] == ["user", "assistant"]
    # the same session, the other session and a new one go on, exactly
    for s, q in ((victim, QUESTIONS[1]), (b, QUESTIONS[2])):
        check_oracle(oracle, s, s.send(q))
        e.check_integrity()
    n = e.session(params=GREEDY)
    check_oracle(oracle, n, n.send(QUESTIONS[3]))
    assert [m.role for m in a.messages()][:2] == ["user", "assistant"]
    e.check_integrity()
    e.close()


@pytest.mark.parametrize("point", [p for p in RAISE_POINTS if not p.startswith("on_pressure")])
def test_exception_in_a_batch_propagates_and_the_engine_goes_on(model_dir, tmp_path, oracle, monkeypatch, point):
    e = make_engine(model_dir, tmp_path / "data", enable_prefix_caching=True)
    fault = Fault(once=True, skip=SKIPS.get(point, 0))
    install_raise(point, fault, monkeypatch)
    prompts = [e.encode_chat([{"role": "user", "content": t}]) for t in (LONG[0], QUESTIONS[0], QUESTIONS[1])]
    params = SamplingParams(**GREEDY)
    expected = [oracle(p) for p in prompts]
    fault.armed = True  # the first run: nothing is cached, every prompt is prefilled
    with pytest.raises(Injected):
        e.generate(prompts, params)
    assert fault.hits == 1, f"the {point} fault never fired"
    e.check_integrity()
    assert not e.scheduler.has_work(), "every request of the failed batch was ended"
    assert [r.token_ids for r in e.generate(prompts, params)] == expected
    e.check_integrity()
    e.kv.clear()
    assert e.kv_stats()["blocks_free"] == e.kv_stats()["blocks_total"]
    e.close()


@pytest.mark.parametrize("point", ["detokenize", "detokenize_finish", "forward_decode", "decode_reserve"])
def test_a_failure_of_one_request_leaves_the_others_in_its_batch_exact(model_dir, tmp_path, oracle, monkeypatch, point):
    """Two requests in one batch (as with two open streams); one of them fails. Its driver gets
    the exception; the other request goes on and its reply is still the oracle's."""
    e = make_engine(model_dir, tmp_path / "data", num_blocks=64, max_batch_tokens=512)
    pa = e.encode_chat([{"role": "user", "content": QUESTIONS[0]}])
    pb = e.encode_chat([{"role": "user", "content": QUESTIONS[1]}])
    b = e.add_request(pb, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    a = e.add_request(pa, SamplingParams(**GREEDY))
    e.step()  # both prefilled and sampled once, b first in the batch
    assert a.num_generated == b.num_generated == 1
    fault = Fault(once=True)
    if point.startswith("detokenize"):  # b's own text stream fails (e.g. its tokenizer)
        name = "add" if point == "detokenize" else "finish"
        inject(monkeypatch, b.out, name, fault, lambda *_: Injected(f"b's TextStream.{name} failed"))
    else:
        install_raise(point, fault, monkeypatch)
    fault.armed = True
    with pytest.raises(Injected):
        for _ in e.drive(b):
            pass
    assert fault.hits == 1
    e.abort(b)  # what generate() and a turn do with their own request
    e.check_integrity()
    for _ in e.drive(a):
        pass
    assert a.result().token_ids == oracle(pa)
    assert a.finish_reason in ("stop", "length")
    e.check_integrity()
    e.kv.clear()
    assert e.kv_stats()["blocks_free"] == e.kv_stats()["blocks_total"]
    e.close()
