"""Where chatkv keeps its data: CHATKV_HOME, else the platform's user data dir."""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    """Return the data directory, created private to the user (mode 0700)."""
    env = os.environ.get("CHATKV_HOME")
    if env:
        path = Path(env).expanduser()
    else:
        from platformdirs import user_data_dir

        path = Path(user_data_dir("chatkv", appauthor=False))
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path
