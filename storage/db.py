"""Engines and sessions for the conversation database.

``make_engine(url)`` returns an engine for any SQLAlchemy URL. For SQLite it
also:

- creates the database file (and its folder) private to the user, mode 0600,
  before SQLite first opens it (SQLite gives its -wal/-shm files the same mode);
- sets, on every new connection: ``journal_mode=WAL``, ``foreign_keys=ON``
  (needed for ``ON DELETE CASCADE``), ``synchronous=NORMAL`` and a busy timeout;
- takes transaction control away from the sqlite3 module (whose legacy mode
  neither begins a transaction before a SELECT nor before DDL) and emits its own
  ``BEGIN``, so every Session is one real transaction and migrations are atomic.
  A write session (``write_sessions``) begins with ``BEGIN IMMEDIATE``, taking
  the write lock up front: a read-then-write can then never fail half-way with
  SQLITE_BUSY because another process wrote in between; it waits up to the busy
  timeout instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from sqlalchemy import Engine, create_engine, event, make_url
from sqlalchemy.orm import Session, sessionmaker

DB_FILENAME = "chatkv.db"
BUSY_TIMEOUT_MS = 10_000
_BEGIN_OPTION = "chatkv_sqlite_begin"


def default_url(data_dir: Optional[Path] = None) -> str:
    """``sqlite:///<data_dir>/chatkv.db``; ``data_dir`` defaults to ``chatkv.paths.data_dir()``."""
    if data_dir is None:
        from chatkv.paths import data_dir as default_data_dir

        data_dir = default_data_dir()
    return f"sqlite:///{Path(data_dir).expanduser().resolve() / DB_FILENAME}"


def sqlite_file(url: str) -> Optional[Path]:
    """The file a SQLite URL names, or None (not SQLite, or an in-memory database)."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite":
        return None
    db = u.database or ""
    if db in ("", ":memory:") or db.startswith("file:") or u.query.get("mode") == "memory":
        return None
    return Path(db)


def create_private_file(path: Path) -> None:
    """Create ``path`` (and missing parent folders, 0700) as an empty 0600 file, or
    tighten an existing one to 0600."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)
    os.chmod(path, 0o600)


def make_engine(url: str, **engine_kwargs) -> Engine:
    """An engine for ``url`` configured as the module docstring says."""
    path = sqlite_file(url)
    if path is not None:
        create_private_file(path)
    if make_url(url).get_backend_name() != "sqlite":
        engine_kwargs.setdefault("pool_pre_ping", True)
        return create_engine(url, **engine_kwargs)

    engine = create_engine(url, **engine_kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves (see on_begin)
        cur = dbapi_conn.cursor()
        try:
            cur.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            cur.execute("PRAGMA journal_mode = WAL")
            cur.execute("PRAGMA synchronous = NORMAL")
            cur.execute("PRAGMA foreign_keys = ON")
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:
        mode = conn.get_execution_options().get(_BEGIN_OPTION, "")
        conn.exec_driver_sql(f"BEGIN {mode}".strip())

    return engine


def write_engine(engine: Engine) -> Engine:
    """A view of ``engine`` (same pool) whose SQLite transactions begin IMMEDIATE."""
    if engine.dialect.name != "sqlite":
        return engine
    return engine.execution_options(**{_BEGIN_OPTION: "IMMEDIATE"})


def read_sessions(engine: Engine) -> sessionmaker[Session]:
    """Sessions for reading (plain deferred BEGIN on SQLite)."""
    return sessionmaker(engine, expire_on_commit=False)


def write_sessions(engine: Engine) -> sessionmaker[Session]:
    """Sessions for writing (BEGIN IMMEDIATE on SQLite)."""
    return sessionmaker(write_engine(engine), expire_on_commit=False)
