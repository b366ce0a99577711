"""Where chatkv keeps its data: CHATKV_HOME, else the platform's user data dir; and whose it
is when no user is named (``LOCAL_USER``).

It lives in storage, the lowest layer that needs it (the database's default
location), so that storage never imports the engine package; the engine and
the weights import it from here.
"""

from __future__ import annotations

import os
from pathlib import Path

from chatkv.storage.files import make_private_dir

# the owner of the app's and the SDK's conversations (and of the prefix cache they share). Here,
# not in chatkv.storage.models (which re-exports it), so that the engine has it without importing
# SQLAlchemy: a one-shot chatkv "..." stores nothing and never imports it (start-up time)
LOCAL_USER = "local"


def data_dir(explicit: str | os.PathLike | None = None) -> Path:
    """Return the data directory (``explicit`` if given, else CHATKV_HOME, else the platform's
    user data dir), creating it (and missing parents) with mode 0700.

    An existing directory is used as it is: a shared one (e.g. mode 1777) is not
    chmod-ed; what chatkv creates inside it is private (directories 0700, files
    0600). Raises OSError if it cannot be created.
    """
    env = os.environ.get("CHATKV_HOME")
    if explicit is not None:
        path = Path(explicit).expanduser()
    elif env:
        path = Path(env).expanduser()
    else:
        from platformdirs import user_data_dir

        path = Path(user_data_dir("chatkv", appauthor=False))
    make_private_dir(path)
    return path


def cache_dir() -> Path:
    """The user's cache directory (``CHATKV_CACHE_DIR``, else the platform's user cache dir):
    the weight fingerprints, the self-check verdicts and the start-up cache live there. Not created
    here: each writer makes it private when it first writes."""
    base = os.environ.get("CHATKV_CACHE_DIR")
    if base:
        return Path(base)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("chatkv"))
