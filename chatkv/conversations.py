"""``Conversations``: the saved conversations of a data directory, read without a model.

``Engine.sessions()`` and ``Engine.search()`` need an engine, so its weights; listing or
searching what is saved does not. ``chatkv --list`` and ``chatkv --search`` use this, and so
may any program that only browses the store::

    from chatkv import Conversations

    with Conversations() as saved:            # the default data directory
        for c in saved.list():
            print(c.id, c.title)
        for hit in saved.search("paris trip"):
            print(hit.conversation_id, hit.message.role, hit.snippet)

It reads the same database an ``Engine`` on that data directory (and ``db_url``, ``tenant``)
would, through the same ``Store``; it writes nothing.
"""

from __future__ import annotations

from pathlib import Path

from chatkv.errors import StorageError


class Conversations:
    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        db_url: str | None = None,
        tenant: str = "",
        user: str | None = None,
    ):
        from chatkv.storage.models import LOCAL_USER
        from chatkv.storage.paths import data_dir as resolve
        from chatkv.storage.repository import Store

        try:
            root = resolve(data_dir)
        except OSError as e:
            raise StorageError(f"the data directory cannot be created: {e.strerror or e} ({e.filename})") from e
        self._store = Store.open(db_url, root)
        self.tenant, self.user = tenant, user or LOCAL_USER

    def list(self, include_archived: bool = False):
        """Saved conversations of the user, newest activity first (``ConversationInfo``), as
        ``Engine.sessions()`` gives them."""
        return self._store.list_conversations(include_archived=include_archived, tenant=self.tenant, owner=self.user)

    def search(self, query: str, limit: int = 20):
        """Messages of the user's conversations, every branch, holding ``query``'s words, best
        first (``SearchHit``), as ``Engine.search()`` gives them."""
        return self._store.search(query, owner=self.user, tenant=self.tenant, limit=limit)

    def close(self) -> None:
        self._store.close()

    def __enter__(self) -> "Conversations":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
