"""File-system helpers shared by the database, the snapshot store and the weights.

Contracts:

- Directories chatkv *creates* are private to the user (mode 0700); an existing
  directory is never chmod-ed (it may be a shared one, e.g. mode 1777).
- Files chatkv creates are 0600, whatever the umask.
- ``atomic_write`` replaces a file all-or-nothing: a reader, or a crash at any
  moment, sees the old file or the new one, never a half-written one; a failed
  write leaves no temporary file behind.
- Errors are ``OSError`` and propagate (the caller decides whether a failure is
  fatal); only a file system that cannot fsync a directory at all is tolerated.

This module imports nothing from chatkv, so every layer may use it.
"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path
from typing import Callable

__all__ = [
    "make_private_dir",
    "create_private_file",
    "atomic_write",
    "fsync_file",
    "fsync_dir",
    "fsync_tree",
    "chmod_tree_private",
]

# fsync on a directory fails with these where the file system does not support it at all
_NO_DIR_FSYNC = (errno.EINVAL, errno.ENOTSUP, errno.EBADF)


def make_private_dir(path: str | os.PathLike) -> bool:
    """Create ``path`` and any missing parents, each new one with mode 0700.

    Existing directories are left exactly as they are. Returns True if ``path``
    itself was created. Raises OSError (e.g. EROFS, EACCES, or ENOTDIR when a
    file is in the way).
    """
    path = Path(path)
    if path.is_dir():
        return False
    missing = []
    p = path
    while not p.is_dir():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    created = False
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            if not d.is_dir():
                raise
            continue  # made meanwhile by someone else: theirs, left alone
        os.chmod(d, 0o700)  # mkdir's mode is masked by the umask
        created = d == path
    return created


def create_private_file(path: str | os.PathLike) -> None:
    """Create ``path`` as an empty 0600 file (missing parents as ``make_private_dir``),
    or tighten an existing file to 0600. Raises OSError."""
    path = Path(path)
    make_private_dir(path.parent)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a file's data to disk (opened by name, read-only). Raises OSError."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (a new file, a rename) to disk.

    Raises OSError if the directory cannot be opened or synced, except where the
    file system does not support syncing a directory, which is ignored.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _NO_DIR_FSYNC:
            raise
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file under ``root``, then every directory, deepest first. Raises OSError."""
    dirs = []
    for dirpath, _dirnames, filenames in os.walk(root):
        dirs.append(dirpath)
        for f in filenames:
            fsync_file(os.path.join(dirpath, f))
    for d in reversed(dirs):
        fsync_dir(d)


def chmod_tree_private(root: str | os.PathLike) -> None:
    """Make a tree chatkv has just built private: directories 0700, files 0600."""
    os.chmod(root, 0o700)
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o700)
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), 0o600)


def atomic_write(
    path: str | os.PathLike,
    write: Callable[[Path], None],
    *,
    tmp: str | os.PathLike | None = None,
    durable: bool = True,
) -> None:
    """Replace ``path`` all-or-nothing with what ``write(tmp)`` writes.

    ``tmp`` (default ``.<name>.<pid>.<random>.tmp`` beside ``path``; it must be
    in the same directory) is created exclusively with mode 0600 before
    ``write`` is called; ``write`` writes it by name (it may even replace it).
    The file is 0600 before it is renamed. With ``durable`` the data is fsynced
    before the rename and the directory after it. On any failure ``tmp`` is
    removed, ``path`` is untouched and the error propagates (OSError for I/O
    failures).
    """
    path = Path(path)
    tmp = Path(tmp) if tmp is not None else path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    if tmp.parent != path.parent:
        raise ValueError(f"temporary file {tmp} must be in the directory of {path}")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    try:
        write(tmp)
        # by name, not through the fd above: write() may have replaced the file (safetensors'
        # save_file writes a temp file of its own and renames it over ``tmp``)
        os.chmod(tmp, 0o600)
        if durable:
            fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise
    if durable:
        fsync_dir(path.parent)
