"""Migration 0005 (conversation owners, message integrity hashes) on a database made by the
migrations before it (0001-0004, through Alembic itself), on SQLite and PostgreSQL: the rows
already there become the local user's, every existing message gets its hash, nothing else
changes; and the store then keeps users apart (another user's id is unknown, in the very
words of an id never used)."""

from __future__ import annotations

import uuid
from datetime import datetime

import pytest
from alembic import command
from sqlalchemy import text

from chatkv.errors import InvalidRequest, SessionError
from chatkv.storage import migrations
from chatkv.storage.db import DB_FILENAME, make_engine
from chatkv.storage.models import LOCAL_USER, message_hash
from chatkv.storage.repository import Store
from tests.support.pg import backend_url

NOW = datetime(2026, 11, 30, 12, 0, 0)
ROWS = [("user", "Hello there"), ("assistant", "Hi! ¿Qué tal? 👋"), ("user", "")]


def _old_database(url: str) -> str:
    """A database at revision 0004 holding one conversation of three messages; its id."""
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            command.upgrade(migrations.config(connection=conn), "0004")
        assert migrations.current_revisions(engine) == {"0004"}
        conv = uuid.uuid4().hex
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO conversations (id, tenant, title, model, system_prompt, params, token_ids, "
                    "token_count, created_at, updated_at, archived) VALUES (:id, '', 'old chat', 'm', 'sys', "
                    "'{}', :tok, 2, :now, :now, false)"
                ),
                {"id": conv, "tok": b"\x01\x00\x00\x00\x02\x00\x00\x00", "now": NOW},
            )
            for role, content in ROWS:
                conn.execute(
                    text(
                        "INSERT INTO messages (conversation_id, role, content, created_at, status) "
                        "VALUES (:c, :r, :t, :now, 'complete')"
                    ),
                    {"c": conv, "r": role, "t": content, "now": NOW},
                )
        return conv
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_0005_upgrades_a_0004_database(backend, request, tmp_path):
    url = backend_url(request, backend, sqlite=f"sqlite:///{tmp_path / DB_FILENAME}")
    conv = _old_database(url)
    with Store.open(url, data_dir=tmp_path) as s:
        assert s.migrated and migrations.current_revisions(s.engine) == {migrations.HEAD}  # 0005, then those after it
        info = s.get_conversation(conv)
        assert (info.owner, info.title, info.system_prompt, info.token_ids) == (LOCAL_USER, "old chat", "sys", (1, 2))
        msgs = s.messages(conv)
        assert [(m.role, m.content) for m in msgs] == ROWS
        assert [m.content_hash for m in msgs] == [message_hash(r, t) for r, t in ROWS]
        assert all(m.intact for m in msgs)
        # the store keeps the local user's conversation from every other user
        with pytest.raises(SessionError) as unknown:
            s.get_conversation("0" * 32, owner="alice")
        with pytest.raises(SessionError) as other:
            s.get_conversation(conv, owner="alice")
        assert str(other.value).replace(conv, "0" * 32) == str(unknown.value)
        assert s.list_conversations(owner="alice") == [] and [c.id for c in s.list_conversations(owner=LOCAL_USER)] == [
            conv
        ]
        new = s.create_conversation("a", "m", "", {}, owner="alice")
        assert s.get_conversation(new.id, owner="alice").owner == "alice"
        assert [c.id for c in s.list_conversations(owner="alice")] == [new.id]
        assert s.add_message(new.id, "user", "x").content_hash == message_hash("user", "x")


def test_0005_downgrades_to_0004(tmp_path):
    url = f"sqlite:///{tmp_path / DB_FILENAME}"
    conv = _old_database(url)
    Store.open(url, data_dir=tmp_path).close()
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            command.downgrade(migrations.config(connection=conn), "0004")
            cols = {r[1] for r in conn.execute(text("PRAGMA table_info(messages)"))}
            assert "content_hash" not in cols
            assert (
                conn.execute(text("SELECT count(*) FROM messages WHERE conversation_id = :c"), {"c": conv}).scalar()
                == 3
            )
    finally:
        engine.dispose()


def test_owner_names_are_checked(tmp_path):
    with Store.open(data_dir=tmp_path) as s:
        for bad in ["", "a b", "x" * 65, "-lead", "é"]:
            with pytest.raises(InvalidRequest, match="invalid user name"):
                s.create_conversation("a", "m", "", {}, owner=bad)


def test_invalid_id_is_not_echoed_whole(tmp_path):
    """A 10 KB session id does not come back whole in the error."""
    with Store.open(data_dir=tmp_path) as s:
        with pytest.raises(SessionError) as e:
            s.get_conversation("A" * 10_000 + "!")
    assert len(str(e.value)) < 300 and "10001 characters" in str(e.value)
