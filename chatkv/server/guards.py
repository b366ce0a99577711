"""What a request must pass before it reaches the engine: the API key (which says whose request
it is), the body's size, and the number of requests already running.

- ``--api-key KEY`` (repeatable) / ``--api-keys FILE``: every ``/v1/...`` route needs
  ``Authorization: Bearer <key>``; ``/health`` and ``/metrics`` stay open, as in vLLM, so
  probes and scrapers need no secret. A missing or wrong key is a 401 with code
  ``invalid_api_key``. The key is compared with every configured key in constant time (each
  comparison ``hmac.compare_digest``, all of them made whichever matches), so the time taken
  says nothing of which key, or how much of one, was right.
- Users (``Users``): each key is a user, who owns their conversations, their stateless
  history map entries and their prefix-cache namespace. With no key the server has one user,
  the local one (the app's and the SDK's conversations); so does one ``--api-key`` alone (the
  server as it was before users). A key file holds ``name:key`` lines (``#`` comments, blank
  lines); its names are the users' names (``local``: the local user). Several ``--api-key``
  values are users ``key-<first 12 hex digits of the key's sha256>``. A key file that group or
  others may read is refused (``chmod 600 FILE``), and so is one with a bad line, a duplicate
  name or a duplicate key. ``reload()`` (SIGHUP) re-reads the file; a bad file then keeps the
  keys in force and logs why.
- ``--max-request-bytes``: a ``Content-Length`` over the limit is refused before reading;
  a body without one (chunked) is read only up to the limit. Either way a 413.
- ``--max-concurrency``: generation and embedding requests running at once (a streamed
  response counts until its last chunk is sent or the client goes away). One more is a 429
  at once, not queued: a client retries with backoff, and the server's memory stays bounded.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import stat
from pathlib import Path

from starlette.requests import Request

from chatkv import LOCAL_USER
from chatkv.server.errors import APIError

log = logging.getLogger("chatkv.server")
USER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")


class KeyFileError(ValueError):
    """A key file that cannot be used; the message names the file and what is wrong."""


def read_key_file(path: str | Path) -> dict[str, str]:
    """``{key: user name}`` from a file of ``name:key`` lines. Refuses (KeyFileError) a file that
    group or others may read, a line that is not ``name:key``, a bad name, and a name or a key
    given twice."""
    path = Path(path)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"the API key file {path} is not a regular file")
        if st.st_mode & 0o077:
            raise KeyFileError(
                f"the API key file {path} may be read by others (mode {stat.S_IMODE(st.st_mode):o}); "
                f"run: chmod 600 {path}"
            )
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise KeyFileError(f"the API key file {path} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise KeyFileError(f"the API key file {path} is not UTF-8 text") from None
    keys: dict[str, str] = {}
    names: set[str] = set()
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, key = line.partition(":")
        name, key = name.strip(), key.strip()
        if not sep or not key:
            raise KeyFileError(f"{path}:{n}: expected 'name:key'")  # the line itself may hold a key: not shown
        if not USER_NAME.fullmatch(name):
            raise KeyFileError(
                f"{path}:{n}: a user name is 1-64 characters of A-Z, a-z, 0-9, '_', '.', '@' or '-', "
                "starting with a letter or digit"
            )
        if name in names:
            raise KeyFileError(f"{path}:{n}: user {name!r} is named twice")
        if key in keys:
            raise KeyFileError(f"{path}:{n}: this key is already user {keys[key]!r}'s")
        names.add(name)
        keys[key] = name
    if not keys:
        raise KeyFileError(f"the API key file {path} holds no 'name:key' line")
    return keys


def bare_key_user(key: str) -> str:
    """The user name of a key given with ``--api-key`` among several."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


class Users:
    """Who a request is, by its bearer key. ``keys``: ``{key: user name}``; empty: no key is
    needed and every request is the local user's. ``key_file``: re-read by ``reload()``."""

    def __init__(
        self, keys: dict[str, str] | None = None, key_file: str | Path | None = None, bare_keys: list[str] | None = None
    ):
        self._bare = list(bare_keys or [])
        self.key_file = Path(key_file) if key_file is not None else None
        self._keys: dict[bytes, str] = {}
        self._set(dict(keys or {}), read_key_file(self.key_file) if self.key_file is not None else {})

    @classmethod
    def from_options(cls, api_keys: list[str] | None, key_file: str | Path | None) -> "Users":
        """The users of ``--api-key`` values and ``--api-keys FILE`` (KeyFileError, ValueError)."""
        return cls(key_file=key_file, bare_keys=[k for k in (api_keys or []) if k])

    def _set(self, keys: dict[str, str], from_file: dict[str, str]) -> None:
        bare = self._bare
        if len(bare) != len(set(bare)):
            raise ValueError("the same --api-key is given twice")
        merged = dict(keys)
        if len(bare) == 1 and not from_file and not keys:
            merged[bare[0]] = LOCAL_USER  # one key alone: the one user the server always had
        else:
            for k in bare:
                merged[k] = bare_key_user(k)
        for k, name in from_file.items():
            if k in merged:
                raise KeyFileError(f"a key of user {name!r} in {self.key_file} is also given with --api-key")
            merged[k] = name
        names = list(merged.values())
        if len(names) != len(set(names)):
            raise KeyFileError("two keys are one user: give each user one key")
        self._keys = {k.encode(): name for k, name in merged.items()}

    def reload(self) -> bool:
        """Re-read the key file (SIGHUP). A file that cannot be used keeps the keys in force."""
        if self.key_file is None:
            return False
        try:
            self._set({}, read_key_file(self.key_file))
        except (KeyFileError, ValueError) as e:
            log.error("chatkv serve: keeping the API keys in force: %s", e)
            return False
        log.warning("chatkv serve: API keys re-read from %s: %d user(s)", self.key_file, len(self._keys))
        return True

    @property
    def required(self) -> bool:
        return bool(self._keys)

    @property
    def names(self) -> set[str]:
        return set(self._keys.values()) or {LOCAL_USER}

    def user_of(self, request: Request) -> str:
        """The request's user, or a 401 when a key is needed and it gave none or a wrong one."""
        keys = self._keys  # one consistent set, even while reload() swaps it
        if not keys:
            return LOCAL_USER
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip().encode()
        found = None
        for key, name in keys.items():  # every key compared, whichever matches: no early exit
            if hmac.compare_digest(given, key) and scheme.lower() == "bearer":
                found = name
        if found is None:
            raise APIError(
                401,
                "Incorrect API key provided."
                if header
                else "You didn't provide an API key: send 'Authorization: Bearer <key>'.",
                "invalid_api_key",
                type="invalid_request_error",
            )
        return found


def check_api_key(request: Request, users: Users) -> str:
    """The request's user (see ``Users.user_of``)."""
    return users.user_of(request)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 if it is larger than ``limit`` bytes."""
    length = request.headers.get("content-length")
    too_large = APIError(
        413,
        f"the request body is larger than the server's limit of {limit} bytes (chatkv serve --max-request-bytes)",
        "request_too_large",
    )
    if length is not None:
        try:
            if int(length) > limit:
                raise too_large
        except ValueError:
            raise APIError(400, f"bad Content-Length header {length!r}", "invalid_request") from None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


class ConcurrencyLimit:
    """A count of running requests, checked and changed on the event loop's thread only."""

    def __init__(self, limit: int):
        self.limit = limit
        self.running = 0

    def acquire(self) -> "Slot":
        if self.running >= self.limit:
            raise APIError(
                429,
                f"the server is already running {self.limit} requests (chatkv serve --max-concurrency); retry shortly",
                "rate_limit_exceeded",
            )
        self.running += 1
        return Slot(self)


class Slot:
    """One running request's place; ``release()`` is idempotent."""

    def __init__(self, limit: ConcurrencyLimit):
        self._limit = limit
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._limit.running -= 1
