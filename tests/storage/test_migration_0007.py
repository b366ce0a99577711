"""Migration 0007 (chunk KV reuse's counts on replies: messages.reused_tokens and
recomputed_tokens) on a database made by the migrations before it (0001-0006, through Alembic
itself), on SQLite and PostgreSQL: the messages already there read NULL for both, a new reply
stores and reads them back, and the downgrade drops them keeping every message."""

from __future__ import annotations

import uuid
from datetime import datetime

import pytest
from alembic import command
from sqlalchemy import text

from chatkv.errors import InvalidRequest
from chatkv.outputs import Usage
from chatkv.storage import migrations
from chatkv.storage.db import DB_FILENAME, make_engine
from chatkv.storage.repository import Store
from tests.support.pg import backend_url

NOW = datetime(2026, 12, 1, 22, 0, 0)


def _old_database(url: str) -> str:
    """A database at revision 0006 holding one conversation with a user message and a reply."""
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            command.upgrade(migrations.config(connection=conn), "0006")
        conv = uuid.uuid4().hex
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO conversations (id, tenant, owner, title, model, system_prompt, params, "
                    "token_ids, token_count, created_at, updated_at, archived) VALUES (:id, '', 'local', "
                    "'old', 'm', 'sys', '{}', :tok, 0, :now, :now, false)"
                ),
                {"id": conv, "tok": b"", "now": NOW},
            )
            parent = None
            for role, content in (("user", "Which kettle?"), ("assistant", "The Brewmaster [1].")):
                conn.execute(
                    text(
                        "INSERT INTO messages (conversation_id, role, content, created_at, status, "
                        "prompt_tokens, parent_id) VALUES (:c, :r, :t, :now, 'complete', 12, :p)"
                    ),
                    {"c": conv, "r": role, "t": content, "now": NOW, "p": parent},
                )
                parent = conn.execute(text("SELECT max(id) FROM messages")).scalar()
            conn.execute(text("UPDATE conversations SET current_leaf_id = :p WHERE id = :c"), {"p": parent, "c": conv})
        return conv
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_0007_upgrades_a_0006_database(backend, request, tmp_path):
    url = backend_url(request, backend, sqlite=f"sqlite:///{tmp_path / DB_FILENAME}")
    conv = _old_database(url)
    with Store.open(url, data_dir=tmp_path) as s:
        assert s.migrated and migrations.current_revisions(s.engine) == {migrations.HEAD}  # 0007, then those after it
        old = s.messages(conv)
        assert [(m.reused_tokens, m.recomputed_tokens) for m in old] == [(None, None)] * 2 and all(
            m.intact for m in old
        )
        assert Usage.from_message(old[1]).reused_tokens == 0  # NULL reads as none reused
        u = Usage(prompt_tokens=40, computed_tokens=9, reused_tokens=31, recomputed_tokens=4, ttft_s=0.25)
        new = s.add_message(conv, "assistant", "Descale monthly [2].", parent_id=old[1].id, **u.message_columns())
        back = Usage.from_message(next(m for m in s.messages(conv) if m.id == new.id))
        assert (back.reused_tokens, back.recomputed_tokens, back.computed_tokens) == (31, 4, 9)
        for bad in ({"reused_tokens": 1.5}, {"recomputed_tokens": "4"}):  # integers only, as every token count
            with pytest.raises((InvalidRequest, TypeError)):
                s.add_message(conv, "assistant", "x", parent_id=new.id, **bad)


def test_0007_downgrades_to_0006(tmp_path):
    url = f"sqlite:///{tmp_path / DB_FILENAME}"
    conv = _old_database(url)
    with Store.open(url, data_dir=tmp_path) as s:
        s.add_message(
            conv, "assistant", "again", parent_id=s.messages(conv)[-1].id, reused_tokens=5, recomputed_tokens=1
        )
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            command.downgrade(migrations.config(connection=conn), "0006")
            cols = {r[1] for r in conn.execute(text("PRAGMA table_info(messages)"))}
            assert not cols & {"reused_tokens", "recomputed_tokens"} and "accepted_tokens" in cols
            assert (
                conn.execute(text("SELECT count(*) FROM messages WHERE conversation_id = :c"), {"c": conv}).scalar()
                == 3
            )
    finally:
        engine.dispose()
