"""The conversation database (chatkv.storage), against real SQLite files and a real
PostgreSQL server (tests/support/pg.py): every test using the ``store`` fixture runs on both."""

from __future__ import annotations

import os
import stat
import threading
from datetime import datetime, timezone

import pytest
from sqlalchemy import create_engine, text

from chatkv.errors import ChatKVError, InvalidRequest, SessionError
from chatkv.storage import migrations, records
from chatkv.storage import repository as repo
from chatkv.storage.db import DB_FILENAME, make_engine
from chatkv.storage.models import Base
from chatkv.storage.records import ConversationInfo, MessageInfo, SnapshotInfo
from chatkv.storage.repository import Store
from tests.support.pg import backend_url


@pytest.fixture(params=["sqlite", "postgres"])
def store(request, tmp_path):
    url = backend_url(request, request.param)
    s = Store.open(url, data_dir=tmp_path)
    yield s
    s.close()


def _conv(store: Store, title: str = "chat", tenant: str = "") -> ConversationInfo:
    return store.create_conversation(title, "llama-test", "be brief", {"temperature": 0.7}, tenant=tenant)


def _snap(store: Store, conv_id: str, file: str, nbytes: int = 100) -> SnapshotInfo:
    return store.put_snapshot(conv_id, file, "fp-1", "bf16", 42, "hash-1", nbytes)


# ------------------------------------------------------------ conversations


def test_create_and_get_round_trip(store):
    c = store.create_conversation("Hello", "qwen3-0.6b", "You are terse.", {"temperature": 0.2, "stop": ["\n"]})
    assert ID_OK(c.id)
    got = store.get_conversation(c.id)
    assert got == c
    assert (got.title, got.model, got.system_prompt) == ("Hello", "qwen3-0.6b", "You are terse.")
    assert got.params == {"temperature": 0.2, "stop": ["\n"]}
    assert got.token_ids == () and got.token_count == 0 and got.tenant == "" and not got.archived
    assert got.created_at.tzinfo is not None and got.created_at.utcoffset().total_seconds() == 0
    assert abs((datetime.now(timezone.utc) - got.created_at).total_seconds()) < 60
    with pytest.raises(Exception):
        got.title = "x"  # frozen


def ID_OK(conv_id: str) -> bool:
    return records.ID_PATTERN.fullmatch(conv_id) is not None


def test_params_are_copied_not_shared(store):
    params = {"temperature": 0.5}
    c = store.create_conversation("t", "m", "", params)
    params["temperature"] = 9.0
    c.params["top_p"] = 0.1
    assert store.get_conversation(c.id).params == {"temperature": 0.5}


def test_list_orders_by_latest_activity(store):
    a, b, c = _conv(store, "a"), _conv(store, "b"), _conv(store, "c")
    assert [x.id for x in store.list_conversations()] == [c.id, b.id, a.id]
    store.add_message(a.id, "user", "hi")
    assert [x.id for x in store.list_conversations()] == [a.id, c.id, b.id]
    store.add_message(b.id, "user", "hi")
    assert [x.id for x in store.list_conversations()] == [b.id, a.id, c.id]
    assert all(x.token_ids is None for x in store.list_conversations())  # not loaded in listings


def test_same_instant_still_orders_by_insertion(store, monkeypatch):
    frozen = datetime(2030, 1, 1, tzinfo=timezone.utc)
    monkeypatch.setattr(repo.CLOCK, "wall", lambda: frozen)
    ids = [_conv(store, str(i)).id for i in range(5)]
    assert [x.id for x in store.list_conversations()] == ids[::-1]
    store.add_message(ids[2], "user", "zero")
    assert store.list_conversations()[0].id == ids[2]
    m1 = store.add_message(ids[0], "user", "one")
    m2 = store.add_message(ids[0], "assistant", "two")
    assert m1.created_at < m2.created_at
    assert store.list_conversations()[0].id == ids[0]


def test_token_ids_round_trip(store):
    c = _conv(store)
    tokens = [0, 1, 151_643, 2**32 - 1] + list(range(1000))
    store.add_message(c.id, "user", "q", token_ids=tokens)
    got = store.get_conversation(c.id)
    assert list(got.token_ids) == tokens and got.token_count == len(tokens)
    store.add_message(c.id, "user", "q", token_ids=[])
    assert store.get_conversation(c.id).token_ids == ()
    for bad in ([-1], [2**32], [1.5], ["3"], 7):
        with pytest.raises(InvalidRequest):
            store.add_message(c.id, "user", "q", token_ids=bad)
    assert len(store.messages(c.id)) == 2  # a refused history writes no message either


def test_rename_and_archive(store):
    a, b = _conv(store, "a"), _conv(store, "b")
    store.rename(a.id, "renamed")
    assert store.get_conversation(a.id).title == "renamed"
    store.set_archived(b.id, True)
    assert [x.id for x in store.list_conversations()] == [a.id]
    assert {x.id for x in store.list_conversations(include_archived=True)} == {a.id, b.id}
    assert store.get_conversation(b.id).archived
    store.set_archived(b.id, False)
    assert {x.id for x in store.list_conversations()} == {a.id, b.id}


def test_delete_cascades_messages_and_snapshot(store):
    a, b = _conv(store, "a"), _conv(store, "b")
    store.add_message(a.id, "user", "hi")
    store.add_message(b.id, "user", "keep me")
    _snap(store, a.id, "a.safetensors")
    _snap(store, b.id, "b.safetensors")
    assert store.delete_conversation(a.id) == "a.safetensors"
    with pytest.raises(SessionError, match=a.id):
        store.get_conversation(a.id)
    assert store.get_snapshot(a.id) is None
    assert {x.file for x in store.snapshots_lru()} == {"b.safetensors"}
    with store.engine.connect() as conn:  # rows really gone, not just hidden
        assert conn.execute(text("SELECT count(*) FROM messages WHERE conversation_id = :c"), {"c": a.id}).scalar() == 0
        assert conn.execute(text("SELECT count(*) FROM messages")).scalar() == 1
    assert store.delete_conversation(b.id) == "b.safetensors"
    c = _conv(store)
    assert store.delete_conversation(c.id) is None  # no snapshot


def test_tenant_filtering(store):
    a = _conv(store, "a", tenant="alice")
    b = _conv(store, "b", tenant="bob")
    d = _conv(store, "default")
    assert [x.id for x in store.list_conversations(tenant="alice")] == [a.id]
    assert [x.id for x in store.list_conversations(tenant="")] == [d.id]
    assert {x.id for x in store.list_conversations()} == {a.id, b.id, d.id}
    assert store.get_conversation(a.id, tenant="alice").tenant == "alice"
    assert store.get_conversation(a.id).id == a.id
    with pytest.raises(SessionError, match="unknown conversation id"):
        store.get_conversation(a.id, tenant="bob")


# ------------------------------------------------------------ messages


def test_messages_chronology_and_stats(store):
    c = _conv(store)
    u = store.add_message(c.id, "user", "What is 2+2?")
    a = store.add_message(
        c.id,
        "assistant",
        "4",
        prompt_tokens=20,
        cached_tokens=12,
        restored_tokens=8,
        computed_tokens=8,
        generated_tokens=2,
        ttft_ms=12.5,
        tokens_per_s=88.25,
    )
    u2 = store.add_message(c.id, "user", "And 3+3?")
    msgs = store.messages(c.id)
    assert [m.id for m in msgs] == [u.id, a.id, u2.id]
    assert [m.content for m in msgs] == ["What is 2+2?", "4", "And 3+3?"]
    assert msgs[0].created_at < msgs[1].created_at < msgs[2].created_at
    got = msgs[1]
    assert isinstance(got, MessageInfo) and got == a
    assert (got.prompt_tokens, got.cached_tokens, got.restored_tokens, got.computed_tokens, got.generated_tokens) == (
        20,
        12,
        8,
        8,
        2,
    )
    assert got.ttft_ms == 12.5 and got.tokens_per_s == 88.25
    assert msgs[0].prompt_tokens is None and msgs[0].ttft_ms is None
    assert store.messages(_conv(store).id) == []


def test_meta_json_round_trip(store):
    c = _conv(store)
    meta = {"sources": [{"doc": "a.pdf", "chunk": 3, "score": 0.91}], "note": "ünïcødé", "n": None}
    m = store.add_message(c.id, "assistant", "see [1]", meta=meta)
    assert store.messages(c.id)[0].meta == meta == m.meta
    assert store.add_message(c.id, "user", "x").meta is None
    with pytest.raises(InvalidRequest, match="meta"):
        store.add_message(c.id, "user", "x", meta={"bad": object()})


def test_message_validation(store):
    c = _conv(store)
    with pytest.raises(InvalidRequest, match="role"):
        store.add_message(c.id, "wizard", "x")
    with pytest.raises(InvalidRequest, match="status"):
        store.add_message(c.id, "user", "x", status="done")
    with pytest.raises(TypeError, match="prompt_tokenz"):
        store.add_message(c.id, "user", "x", prompt_tokenz=3)
    with pytest.raises(InvalidRequest, match="ttft_ms"):
        store.add_message(c.id, "user", "x", ttft_ms="fast")
    assert store.messages(c.id) == []  # nothing half-written


# ------------------------------------------------------------ snapshots


def test_snapshot_upsert_lru_and_bytes(store):
    a, b, c = _conv(store, "a"), _conv(store, "b"), _conv(store, "c")
    assert store.get_snapshot(a.id) is None and store.snapshots_lru() == []
    assert store.total_snapshot_bytes() == 0
    _snap(store, a.id, "a1.safetensors", 100)
    _snap(store, b.id, "b.safetensors", 200)
    _snap(store, c.id, "c.safetensors", 300)
    assert [s.conversation_id for s in store.snapshots_lru()] == [a.id, b.id, c.id]
    store.touch_snapshot(a.id)
    assert [s.conversation_id for s in store.snapshots_lru()] == [b.id, c.id, a.id]

    new = store.put_snapshot(a.id, "a2.safetensors", "fp-2", "fp8", 50, "hash-2", 150)  # replaces
    got = store.get_snapshot(a.id)
    assert got == new
    assert (got.file, got.model_fingerprint, got.kv_dtype, got.token_count, got.token_hash, got.nbytes) == (
        "a2.safetensors",
        "fp-2",
        "fp8",
        50,
        "hash-2",
        150,
    )
    assert got.last_used_at.tzinfo is not None
    assert len(store.snapshots_lru()) == 3
    assert store.total_snapshot_bytes() == 150 + 200 + 300
    assert {x.file for x in store.snapshots_lru()} == {"a2.safetensors", "b.safetensors", "c.safetensors"}

    store.touch_snapshot(b.id)
    assert [s.conversation_id for s in store.snapshots_lru()] == [c.id, a.id, b.id]
    assert store.delete_snapshot(c.id) == "c.safetensors"
    assert store.delete_snapshot(c.id) is None
    store.touch_snapshot(c.id)  # no snapshot: no-op
    assert store.total_snapshot_bytes() == 350
    assert store.get_conversation(c.id).id == c.id  # the conversation stays


def test_snapshot_validation(store):
    c = _conv(store)
    for bad in ("../x.safetensors", "a/b", "", "..", "/abs"):
        with pytest.raises(InvalidRequest):
            store.put_snapshot(c.id, bad, "fp", "bf16", 1, "h", 1)
    with pytest.raises(InvalidRequest, match="nbytes"):
        store.put_snapshot(c.id, "x", "fp", "bf16", 1, "h", -1)
    with pytest.raises(SessionError, match="unknown conversation id 'nope'"):
        store.put_snapshot("nope", "x", "fp", "bf16", 1, "h", 1)
    assert store.snapshots_lru() == []


# ------------------------------------------------------------ ids


BAD_IDS = ["a/b", "../etc", "..", "", "x" * 65, "a b", "a\\b", "é", "a\0", None, 5]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_bad_ids_rejected_everywhere(store, bad):
    calls = [
        lambda: store.get_conversation(bad),
        lambda: store.rename(bad, "t"),
        lambda: store.set_archived(bad, True),
        lambda: store.delete_conversation(bad),
        lambda: store.add_message(bad, "user", "x"),
        lambda: store.add_message(bad, "user", "x", token_ids=[1]),
        lambda: store.messages(bad),
        lambda: _snap(store, bad, "f"),
        lambda: store.get_snapshot(bad),
        lambda: store.delete_snapshot(bad),
        lambda: store.touch_snapshot(bad),
    ]
    for call in calls:
        with pytest.raises(SessionError, match="invalid conversation id") as info:
            call()
        assert repr(bad) in str(info.value)


def test_longest_valid_id_is_only_unknown(store):
    with pytest.raises(SessionError, match="unknown conversation id"):
        store.get_conversation("x" * 64)
    with pytest.raises(SessionError, match="unknown conversation id 'abc-DEF_123'"):
        store.messages("abc-DEF_123")
    with pytest.raises(SessionError, match="unknown conversation id"):
        store.delete_conversation("missing")
    with pytest.raises(SessionError, match="unknown conversation id"):
        store.add_message("missing", "user", "x")


# ------------------------------------------------------------ the file, restarts, migrations


def test_restart_sees_everything(tmp_path):
    s1 = Store.open(data_dir=tmp_path)
    c = _conv(s1, "persisted", tenant="t1")
    s1.add_message(c.id, "user", "q", meta={"sources": ["d1"]}, token_ids=[5, 6, 7])
    s1.add_message(c.id, "assistant", "a", generated_tokens=1, ttft_ms=3.0)
    archived = _conv(s1, "old")
    s1.set_archived(archived.id, True)
    _snap(s1, c.id, "c.safetensors", 1234)
    before = (
        s1.get_conversation(c.id),
        s1.messages(c.id),
        s1.get_snapshot(c.id),
        s1.list_conversations(include_archived=True),
    )
    s1.close()
    with pytest.raises(SessionError, match="closed"):
        s1.list_conversations()

    s2 = Store.open(url=f"sqlite:///{tmp_path / DB_FILENAME}")
    try:
        after = (
            s2.get_conversation(c.id),
            s2.messages(c.id),
            s2.get_snapshot(c.id),
            s2.list_conversations(include_archived=True),
        )
        assert after == before
        assert s2.get_conversation(archived.id).archived
        # activity after a restart still sorts after everything before it
        s2.add_message(archived.id, "user", "back")
        assert s2.list_conversations(include_archived=True)[0].id == archived.id
    finally:
        s2.close()


def test_db_file_private_and_wal(tmp_path):
    data = tmp_path / "nested" / "data"
    s = Store.open(data_dir=data)
    try:
        _conv(s)
        path = data / DB_FILENAME
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        for side in (data / (DB_FILENAME + "-wal"), data / (DB_FILENAME + "-shm")):
            if side.exists():
                assert stat.S_IMODE(os.stat(side).st_mode) & 0o077 == 0
        with s.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() > 0
    finally:
        s.close()


def test_existing_loose_file_is_tightened(tmp_path):
    path = tmp_path / DB_FILENAME
    path.touch()
    os.chmod(path, 0o644)
    Store.open(data_dir=tmp_path).close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_default_location_is_chatkv_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATKV_HOME", str(tmp_path / "home"))
    Store.open().close()
    assert (tmp_path / "home" / DB_FILENAME).exists()


def test_fresh_db_gets_head_and_reopen_does_not_migrate(tmp_path, monkeypatch):
    s = Store.open(data_dir=tmp_path)
    assert s.migrated
    s.close()
    engine = make_engine(f"sqlite:///{tmp_path / DB_FILENAME}")
    assert migrations.current_revisions(engine) == {migrations.HEAD}
    engine.dispose()

    import alembic.command

    def boom(*a, **k):
        raise AssertionError("alembic upgrade must not run on an up-to-date database")

    monkeypatch.setattr(alembic.command, "upgrade", boom)
    s = Store.open(data_dir=tmp_path)  # boom() proves no migration runs; how long it takes is not a test
    s.close()
    assert not s.migrated


def test_head_constant_matches_alembic_scripts():
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(migrations.config())
    assert script.get_heads() == [migrations.HEAD]


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_migrated_schema_matches_models(backend, request, tmp_path):
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    url = backend_url(request, backend)
    s = Store.open(url, data_dir=tmp_path)
    try:
        with s.engine.connect() as conn:
            opts = {"compare_type": True, "include_name": migrations.include_name}  # the FTS5 index is no model
            diff = compare_metadata(MigrationContext.configure(conn, opts=opts), Base.metadata)
        assert diff == []
    finally:
        s.close()


def test_newer_schema_is_refused_clearly(tmp_path):
    Store.open(data_dir=tmp_path).close()
    engine = create_engine(f"sqlite:///{tmp_path / DB_FILENAME}")
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999_future'"))
    engine.dispose()
    with pytest.raises(ChatKVError, match="9999_future"):
        Store.open(data_dir=tmp_path)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_concurrent_openers_and_writers(backend, request, tmp_path):
    """Two processes' worth of Stores on one database: first open (and migration) races, then
    writes from several threads; nothing fails with 'database is locked' or a duplicate row."""
    url = backend_url(request, backend)
    errors: list[BaseException] = []
    stores: list[Store] = []
    lock = threading.Lock()

    def opener():
        try:
            st = Store.open(url, data_dir=tmp_path)
            with lock:
                stores.append(st)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=opener) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    conv = _conv(stores[0])
    start = threading.Barrier(len(stores))  # every writer's first snapshot upsert at once

    def writer(st: Store, n: int):
        try:
            start.wait()
            for i in range(15):
                st.add_message(conv.id, "user", f"{n}-{i}")
                _snap(st, conv.id, f"{n}-{i}.safetensors")
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(st, n)) for n, st in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(stores[1].messages(conv.id)) == 45
    assert len(stores[2].snapshots_lru()) == 1
    for st in stores:
        st.close()


FIRST_OPEN = """
import os, sys, time
from pathlib import Path
from chatkv.storage.repository import Store
url, go, data, me = sys.argv[1:5]
Path(data, "ready-" + me).touch()
while not os.path.exists(go):
    time.sleep(0.002)
Store.open(None if url == "-" else url, data_dir=data).close()
"""


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_concurrent_first_open_from_processes(backend, request, tmp_path):
    """Processes opening one new database at once (replicas starting together) migrate it one
    after another: every one opens it, none fails on another's CREATE TABLE."""
    import subprocess
    import sys
    import time

    url = backend_url(request, backend, sqlite="-")
    go, n = tmp_path / "go", 4
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", FIRST_OPEN, url, str(go), str(tmp_path), str(i)], stderr=subprocess.PIPE, text=True
        )
        for i in range(n)
    ]
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("ready-*"))) < n and all(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "the openers never got ready"
            time.sleep(0.01)
        go.touch()  # all open at once
        results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [code for code, _ in results] == [0] * n, [err.strip().splitlines()[-1:] for _, err in results]
    with Store.open(None if url == "-" else url, data_dir=tmp_path) as s:
        assert migrations.current_revisions(s.engine) == {migrations.HEAD}
