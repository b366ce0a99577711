"""A real small file system for full-disk tests: a 4 MB tmpfs mounted for the test (root only)
and a filler that takes all of its room. Used by test_cli_failures (the store's database) and
test_chunk_kv (chunk KV files)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


@pytest.fixture
def small_disk(tmp_path):
    """A real 4 MB file system (tmpfs), mounted for the test: root only."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; the full-disk test runs where it can mount one")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(disk: Path) -> Path:
    """A file that takes every free byte of ``disk`` (writes until ENOSPC); remove it to free them."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError:  # ENOSPC: full
        pass
    finally:
        os.close(fd)
    return filler
