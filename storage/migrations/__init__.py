"""Schema migrations for the conversation database (Alembic, no alembic.ini).

:func:`migrate` brings a database to the newest revision and is run by
``Store.open``. On an up-to-date database it costs one SELECT and does not even
import Alembic: it compares ``alembic_version`` with :data:`HEAD`. Adding a
revision under ``versions/`` means bumping :data:`HEAD` (a test checks they
agree).

For development, ``config(url)`` gives a ready ``alembic.config.Config``::

    from alembic import command
    from chatkv.storage.migrations import config
    command.revision(config("sqlite:///dev.db"), "add x", autogenerate=True)
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError

from chatkv.errors import ChatKVError
from chatkv.storage.models import FTS_TABLE, MESSAGES_FTS

HEAD = "0007"
SCRIPT_LOCATION = Path(__file__).resolve().parent
# Alembic's `context`/`op` are process-global proxies: one migration at a time.
_ALEMBIC_LOCK = threading.Lock()
# PostgreSQL advisory lock id taken for a migration, so processes opening one new
# database at once migrate it one after another (their CREATE TABLEs would collide)
PG_MIGRATION_LOCK = 0x63686B76  # "chkv"


def config(url: Optional[str] = None, connection: Optional[Connection] = None):
    """An ``alembic.config.Config`` for these migrations, built in code.

    ``connection`` (an open one, in a transaction) is used as is by ``env.py``;
    otherwise ``env.py`` connects to ``url``.
    """
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(SCRIPT_LOCATION))
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def include_name(name: Optional[str], type_: str, parent_names: dict) -> bool:
    """Alembic's ``include_name`` hook: leave out of schema comparisons (autogenerate)
    the tables a migration makes outside the ORM models, i.e. the SQLite FTS5 tables
    ``kb_chunks_fts`` and ``messages_fts`` and their shadow tables."""
    if type_ == "table" and name is not None:
        return not any(name == t or name.startswith(t + "_") for t in (FTS_TABLE, MESSAGES_FTS))
    return True


def current_revisions(engine: Engine) -> set[str]:
    """The revisions recorded in the database (empty for a fresh one)."""
    try:
        with engine.connect() as conn:
            return {row[0] for row in conn.execute(text("SELECT version_num FROM alembic_version"))}
    except DBAPIError:  # no alembic_version table yet
        return set()


def migrate(engine: Engine) -> bool:
    """Upgrade the database behind ``engine`` to :data:`HEAD`, atomically.

    Returns True when a migration ran, False when the schema was already current.
    Raises ChatKVError when the database was written by a newer chatkv.
    """
    if current_revisions(engine) == {HEAD}:
        return False

    from alembic import command
    from alembic.script import ScriptDirectory
    from alembic.util.exc import CommandError

    from chatkv.storage.db import write_engine

    # One transaction (BEGIN IMMEDIATE on SQLite, an advisory lock on PostgreSQL), so
    # concurrent openers serialise and a crash mid-way leaves the old schema intact.
    with _ALEMBIC_LOCK, write_engine(engine).begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_MIGRATION_LOCK})
        before = _revisions_in(conn)
        if before == {HEAD}:
            return False
        script = ScriptDirectory.from_config(config())
        for rev in before:
            try:
                script.get_revision(rev)
            except CommandError:
                raise ChatKVError(
                    f"database {engine.url.render_as_string(hide_password=True)} has schema revision "
                    f"{rev!r}, unknown to this chatkv (newest known: {HEAD!r}); "
                    "it was written by a newer chatkv, so upgrade chatkv"
                ) from None
        command.upgrade(config(connection=conn), "head")
    return True


def _revisions_in(conn: Connection) -> set[str]:
    from sqlalchemy import inspect

    if not inspect(conn).has_table("alembic_version"):
        return set()
    return {row[0] for row in conn.execute(text("SELECT version_num FROM alembic_version"))}
