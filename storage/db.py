"""Engines and sessions for the conversation database.

``make_engine(url)`` returns an engine for any SQLAlchemy URL. For SQLite it
also:

- creates the database file private to the user, mode 0600 (and its missing
  folders, 0700; an existing folder is left as it is), before SQLite first
  opens it (SQLite gives its -wal/-shm files the same mode);
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

import errno
from pathlib import Path
from typing import Optional

from sqlalchemy import Engine, create_engine, event, make_url, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from chatkv.storage.files import create_private_file

DB_FILENAME = "chatkv.db"
BUSY_TIMEOUT_MS = 10_000
_BEGIN_OPTION = "chatkv_sqlite_begin"


def default_url(data_dir: Optional[Path] = None) -> str:
    """``sqlite:///<data_dir>/chatkv.db``; ``data_dir`` defaults to ``chatkv.storage.paths.data_dir()``."""
    if data_dir is None:
        from chatkv.storage.paths import data_dir as default_data_dir

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


def describe(url: str) -> str:
    """How messages name a database: its file path, or its URL without the password."""
    try:
        u = make_url(url)
        if u.get_backend_name() == "sqlite" and u.database and u.database != ":memory:":
            return u.database.removeprefix("file:").split("?")[0]  # a path, or a sqlite "file:" URI
        return u.render_as_string(hide_password=True)
    except Exception:  # an unparsable URL: it holds no password we could hide
        return url


_SQLITE_PROBLEMS = {
    "SQLITE_NOTADB": "the file is damaged or is not a SQLite database; move it aside to start a new one",
    "SQLITE_CORRUPT": "the file is damaged; move it aside to start a new one (sqlite3's .recover may rescue it)",
    "SQLITE_READONLY": "it is read-only (chatkv writes it, and its -wal and -shm files beside it)",
    "SQLITE_CANTOPEN": "SQLite cannot open it: check that its directory exists and is writable",
    "SQLITE_PERM": "permission denied",
    "SQLITE_FULL": "the disk is full; free some space and retry (nothing of the failed write was stored)",
    "SQLITE_BUSY": "another process holds it locked",
}
_OS_PROBLEMS = {
    errno.EROFS: "it is on a read-only file system",
    errno.EACCES: "permission denied: the file or its directory is not writable by this user",
    errno.EPERM: "permission denied: the file or its directory is not writable by this user",
    errno.ENOSPC: "the disk is full",
    errno.EISDIR: "it is a directory, not a file",
    errno.ENOTDIR: "a file is in the way of its directory",
    errno.EEXIST: "a file is in the way of its directory",
}


def explain(exc: BaseException, where: str = "") -> str:
    """What is wrong, in words, for an OSError, ImportError or SQLAlchemy error met
    opening the database ``where`` (a file it names other than ``where`` is shown)."""
    if isinstance(exc, ImportError):
        return f"its database driver is not installed ({exc})"
    if isinstance(exc, OSError):
        what = _OS_PROBLEMS.get(exc.errno, exc.strerror or str(exc))
        return f"{what} ({exc.filename})" if exc.filename and str(exc.filename) != where else what
    orig = exc.orig if isinstance(exc, DBAPIError) else None
    said = str(orig if orig is not None else exc).strip()
    if "Could not decode to UTF-8" in said:  # the sqlite3 module reading a row's text
        return f"a stored text is not valid UTF-8 (its row was changed outside chatkv): {said[:120]}"
    name = getattr(orig, "sqlite_errorname", "") or ""
    if name.startswith("SQLITE_IOERR") and _disk_full(where):  # WAL files that cannot grow: an I/O error
        name = "SQLITE_FULL"
    for code, what in _SQLITE_PROBLEMS.items():
        if name.startswith(code):
            return f"{what} (SQLite: {said})"
    return said


def _disk_full(where: str) -> bool:
    """Whether the file system holding the database file ``where`` has no space left."""
    import shutil

    try:
        return bool(where) and shutil.disk_usage(Path(where).parent).free < 64 * 1024
    except OSError:
        return False


def check_writable(engine: Engine) -> None:
    """Raise the driver's error now if SQLite cannot write the database (a read-only
    file, directory or medium), rather than at the first write. Writes nothing."""
    if engine.dialect.name != "sqlite":
        return
    with write_engine(engine).connect() as conn:
        trans = conn.begin()
        try:
            conn.execute(text("UPDATE alembic_version SET version_num = version_num"))
        finally:
            trans.rollback()


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
