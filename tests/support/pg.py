"""A real PostgreSQL server for tests, started from the binaries on this machine.

``postgres`` is a session-scoped pytest fixture of tests/conftest.py: one server for the
run, in a temporary directory, listening on a free loopback port, stopped and removed when
the run ends. ``postgres.database()`` creates a fresh empty database and returns its
SQLAlchemy URL (``postgresql+psycopg://...``), so tests never see each other's rows.
``backend_url(request, backend, sqlite)`` is that URL for a test parametrized over
``["sqlite", "postgres"]``, else the SQLite URL it is given.

The server refuses to run as root: as root, the data directory is given to the
``postgres`` user and ``initdb``/``pg_ctl`` run under ``runuser -u postgres``. The
binaries are looked for under ``/usr/lib/postgresql/<version>/bin`` (newest first), then
on PATH. Missing binaries (or, as root, no ``postgres`` user, or no driver) fail the
tests, saying what is missing: this machine and CI have them (``scripts/install.sh``
installs them), so a skip would only hide that the store went untested on PostgreSQL. A
server that is there but fails to start fails the tests too, with its log.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

START_TIMEOUT_S = 60


def find_bin_dir() -> Path | None:
    """The directory holding initdb and pg_ctl, or None."""
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin"),
        key=lambda p: int(Path(p).parent.name) if Path(p).parent.name.isdigit() else 0,
        reverse=True,
    )
    for d in candidates:
        if (Path(d) / "initdb").exists() and (Path(d) / "pg_ctl").exists():
            return Path(d)
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb and shutil.which("pg_ctl") else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """A throwaway PostgreSQL cluster; ``start()``, ``database()``, ``stop()``."""

    def __init__(self, bin_dir: Path):
        self.bin_dir = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="chatkv-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = 0
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self._as_user = ["runuser", "-u", "postgres", "--"]

    def _run(self, *cmd: str) -> None:
        out = subprocess.run([*self._as_user, *cmd], capture_output=True, text=True, timeout=START_TIMEOUT_S)
        if out.returncode != 0:
            log = self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}\n{log}")

    def start(self) -> "PostgresServer":
        self._run(
            str(self.bin_dir / "initdb"),
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-sync",
            "--locale=C",
        )
        for attempt in range(3):  # a free port can be taken by someone else before the server binds it
            self.port = _free_port()
            opts = (
                f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
            )
            try:
                self._run(
                    str(self.bin_dir / "pg_ctl"),
                    "-D",
                    str(self.data),
                    "-l",
                    str(self.log),
                    "-o",
                    opts,
                    "-w",
                    "-t",
                    str(START_TIMEOUT_S),
                    "start",
                )
                return self
            except RuntimeError:
                if attempt == 2 or "could not bind" not in self.log.read_text(errors="replace"):
                    raise
        return self

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def database(self) -> str:
        """A new empty database; its SQLAlchemy URL."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:16]
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        try:
            if self.data.exists():
                self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def backend_url(request, backend: str, sqlite: str | None = None) -> str | None:
    """The database URL of a test that runs on ``backend``: for "postgres" a fresh empty database
    of the run's server (the ``postgres`` fixture, started only once a test asks for it), for
    "sqlite" ``sqlite`` (None: the SQLite file the Store keeps in its data directory)."""
    if backend == "postgres":
        return request.getfixturevalue("postgres").database()
    assert backend == "sqlite", f"unknown database backend {backend!r}"
    return sqlite


def missing_reason() -> str | None:
    """Why PostgreSQL tests cannot run here, or None."""
    if find_bin_dir() is None:
        return "PostgreSQL server binaries (initdb, pg_ctl) not found under /usr/lib/postgresql/*/bin or on PATH"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run the server as"
        if shutil.which("runuser") is None:
            return "running as root and runuser is missing"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "the PostgreSQL driver psycopg is not installed (pip install -e '.[test]')"
    return None
