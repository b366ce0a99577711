"""The conversation store: conversations, their messages and KV-snapshot records.

(Past ~400 lines on purpose: every read and write of a conversation goes through one
transaction helper that turns database failures into one StorageError naming the database,
and owners and message hashes are checked in the same queries; split by table, each part
would repeat that helper.)

``Store`` is the only way the rest of chatkv touches the database. Contracts:

- every method returns plain frozen dataclasses (``ConversationInfo``,
  ``MessageInfo``, ``SnapshotInfo``), never ORM objects, so nothing can hit a
  detached-instance error; their dict fields are copies;
- every write is one transaction, committed before the method returns;
- every conversation id is validated (``[A-Za-z0-9_-]{1,64}``) before use, so an
  id can never smuggle a path into a file name; a bad id or an unknown one
  raises ``SessionError`` naming it;
- timestamps are timezone-aware UTC with microseconds, and strictly increase
  within a process (see ``_Clock``), so activity order is exact even for two
  operations in the same microsecond;
- snapshot files are recorded by bare file name (relative to the snapshot dir,
  which this module knows nothing of); the caller owns the files;
- several processes may share one database: ``store.leases`` (``storage.leases``) says
  which one may write a conversation's turns, and ``add_message`` and
  ``delete_conversation`` are fenced by it (``ConversationBusy``, ``LeaseLost``).

A ``Store`` is safe to share between threads (one Session per call).
"""

from __future__ import annotations

import threading
import uuid
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Optional

from sqlalchemy import Engine, LargeBinary, func, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, defer

from chatkv.errors import InvalidRequest, SessionError, StorageError
from chatkv.storage import db, message_search
from chatkv.storage import message_tree as tree
from chatkv.storage.leases import Leases
from chatkv.storage.migrations import migrate
from chatkv.storage.models import LOCAL_USER, Conversation, KVSnapshot, Message, message_hash
from chatkv.storage.records import (
    ROLES,
    STATUSES,
    ConversationInfo,
    MessageInfo,
    SnapshotInfo,
    check_conversation_id,
    check_file_name,
    check_json,
    check_owner,
    check_stats,
    check_str,
    check_tokens,
    conversation_info,
    message_info,
    snapshot_info,
)

_CURRENT = object()  # add_message's default parent: the conversation's current leaf


class _Guarded:
    """A sessionmaker (for ``Leases``) whose sessions turn database errors into StorageError."""

    def __init__(self, maker, guard):
        self._maker, self._guard = maker, guard

    @contextmanager
    def __call__(self):
        with self._guard(), self._maker() as s:
            yield s

    @contextmanager
    def begin(self):
        with self._guard(), self._maker.begin() as s:
            yield s


# ---------------------------------------------------------------- clock


class _Clock:
    """UTC now, made strictly increasing (by at least 1 µs per call) within the process.

    Seeded from the database on open, so order also survives a restart whose
    wall clock stepped back a little.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = datetime.min.replace(tzinfo=timezone.utc)

    def wall(self) -> datetime:  # separate, so tests can freeze the wall clock
        return datetime.now(timezone.utc)

    def now(self) -> datetime:
        with self._lock:
            t = max(self.wall(), self._last + timedelta(microseconds=1))
            self._last = t
            return t

    def seed(self, t: Optional[datetime]) -> None:
        if t is not None:
            with self._lock:
                self._last = max(self._last, t)


CLOCK = _Clock()


# ---------------------------------------------------------------- the store


class Store:
    """The conversation database. Open with ``Store.open()``; close with ``close()``."""

    def __init__(self, engine: Engine, migrated: bool = False) -> None:
        self.engine = engine
        self.migrated = migrated  # whether open() had to run a migration
        self._read = db.read_sessions(engine)
        self._write = db.write_sessions(engine)
        self._closed = False
        self.leases = Leases(
            _Guarded(self._read, self._as_storage_error), _Guarded(self._write, self._as_storage_error)
        )
        with self._read() as s:
            CLOCK.seed(s.scalar(select(func.max(Conversation.updated_at))))
            CLOCK.seed(s.scalar(select(func.max(KVSnapshot.last_used_at))))

    @classmethod
    def open(cls, url: Optional[str] = None, data_dir: Optional[Path] = None) -> Store:
        """Open (creating and migrating as needed) the database at ``url``.

        ``url`` defaults to ``sqlite:///<data_dir>/chatkv.db``, ``data_dir`` to
        ``chatkv.storage.paths.data_dir()``. A SQLite file is created with mode 0600.
        A database that cannot be used (damaged or not a database, read-only,
        unreachable, its directory not creatable) raises StorageError naming
        the file (or URL) and what is wrong, the driver's error chained.
        """
        where = db.describe(url) if url is not None else ""
        try:
            if url is None:
                url = db.default_url(data_dir)
                where = db.describe(url)
            engine = db.make_engine(url)
        except (OSError, ImportError, SQLAlchemyError) as e:
            if where:
                place = f"the conversation database {where}"
            else:
                place = f"the data directory {data_dir}" if data_dir is not None else "the chatkv data directory"
            raise StorageError(f"cannot use {place}: {db.explain(e, where)}") from e
        try:
            migrated = migrate(engine)
            db.check_writable(engine)
            return cls(engine, migrated)
        except (OSError, SQLAlchemyError) as e:
            engine.dispose()
            raise StorageError(f"cannot use the conversation database {where}: {db.explain(e, where)}") from e
        except BaseException:
            engine.dispose()
            raise

    def close(self) -> None:
        """Release every lease and connection. The Store is unusable afterwards."""
        self._closed = True
        self.leases.close()
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------- sessions

    @contextmanager
    def _reading(self, conv_id: Optional[str] = None):
        """``with``: a read Session. A database error (a full disk, an I/O error, a stored text
        that is not UTF-8) comes out as one StorageError naming the database (and ``conv_id``)."""
        if self._closed:
            raise SessionError("the conversation store is closed")
        with self._as_storage_error(conv_id), self._read() as s:
            yield s

    @contextmanager
    def _writing(self):
        """``with``: a write Session in one transaction, committed on success; rolled back (nothing
        of it stored) on any error, a database error coming out as one StorageError."""
        if self._closed:
            raise SessionError("the conversation store is closed")
        with self._as_storage_error(), self._write.begin() as s:
            yield s

    @contextmanager
    def _as_storage_error(self, conv_id: Optional[str] = None):
        try:
            yield
        except IntegrityError:
            raise
        except SQLAlchemyError as e:
            where = db.describe(self.engine.url.render_as_string(hide_password=False))
            about = f" (conversation {conv_id})" if conv_id else ""
            raise StorageError(f"the conversation database {where}{about}: {db.explain(e, where)}") from e

    def _undecodable(self, conv_id: str) -> StorageError:
        """The error for a conversation holding text that is not UTF-8, naming its rows."""
        bad = []
        try:
            with self._read() as s:
                rows = s.execute(
                    select(Message.id, func.cast(Message.content, LargeBinary)).where(
                        Message.conversation_id == conv_id
                    )
                ).all()
            for mid, raw in rows:
                try:
                    bytes(raw or b"").decode("utf-8")
                except UnicodeDecodeError:
                    bad.append(mid)
        except SQLAlchemyError:
            pass
        rows = f" (messages.id {', '.join(map(str, bad[:5]))})" if bad else ""
        return StorageError(
            f"conversation {conv_id} cannot be read: a stored message{rows} is not valid UTF-8 text (its row was "
            f"changed outside chatkv); the other conversations are unaffected. Repair or delete that row "
            f"with sqlite3, or delete the conversation"
        )

    @staticmethod
    def _conversation(
        s: Session,
        conv_id: str,
        tenant: Optional[str] = None,
        tokens: bool = False,
        lock: bool = False,
        owner: Optional[str] = None,
    ) -> Conversation:
        """The row, or SessionError. Its token history is loaded only if ``tokens``; ``lock``:
        locked for this transaction (FOR UPDATE; SQLite's write transactions are exclusive).
        With ``tenant`` or ``owner``, a conversation of another is unknown: the same error, word
        for word, as an id that does not exist."""
        options = [] if tokens else [defer(Conversation.token_ids)]
        conv = s.get(Conversation, check_conversation_id(conv_id), options=options, with_for_update=lock)
        if (
            conv is None
            or (tenant is not None and conv.tenant != tenant)
            or (owner is not None and conv.owner != owner)
        ):
            raise SessionError(f"unknown conversation id '{conv_id}'")
        return conv

    # -------------------------------------------------------- conversations

    def create_conversation(
        self, title: str, model: str, system_prompt: str, params: dict, tenant: str = "", owner: str = LOCAL_USER
    ) -> ConversationInfo:
        """Create an empty conversation with a fresh id (uuid4 hex), belonging to ``owner``."""
        check_owner(owner)
        check_str("title", title)
        check_str("model", model)
        check_str("system_prompt", system_prompt)
        check_str("tenant", tenant, 255)
        if not isinstance(params, dict):
            raise InvalidRequest(f"params must be a dict, got {type(params).__name__}")
        params = check_json("params", params)
        with self._writing() as s:
            now = CLOCK.now()  # taken under the write lock, so commit order == time order
            conv = Conversation(
                id=uuid.uuid4().hex,
                tenant=tenant,
                owner=owner,
                title=title,
                model=model,
                system_prompt=system_prompt,
                params=params,
                token_ids=[],
                token_count=0,
                created_at=now,
                updated_at=now,
                archived=False,
            )
            s.add(conv)
            s.flush()
            return conversation_info(conv)

    def get_conversation(
        self, conv_id: str, tenant: Optional[str] = None, owner: Optional[str] = None
    ) -> ConversationInfo:
        """The conversation, token history included. With ``tenant`` (``owner``), one of another
        tenant (user) is reported as unknown."""
        with self._reading(conv_id) as s:
            return conversation_info(self._conversation(s, conv_id, tenant, tokens=True, owner=owner))

    def list_conversations(
        self, include_archived: bool = False, tenant: Optional[str] = None, owner: Optional[str] = None
    ) -> list[ConversationInfo]:
        """Conversations (of ``tenant`` and ``owner``, when given), most recent activity first
        (``token_ids`` not loaded: None)."""
        q = select(Conversation).options(defer(Conversation.token_ids))
        if not include_archived:
            q = q.where(Conversation.archived.is_(False))
        if tenant is not None:
            q = q.where(Conversation.tenant == tenant)
        if owner is not None:
            q = q.where(Conversation.owner == owner)
        q = q.order_by(Conversation.updated_at.desc(), Conversation.created_at.desc(), Conversation.id.desc())
        with self._reading() as s:
            return [conversation_info(c, with_tokens=False) for c in s.scalars(q)]

    def rename(self, conv_id: str, title: str) -> None:
        check_str("title", title)
        with self._writing() as s:
            self._conversation(s, conv_id).title = title

    def set_params(self, conv_id: str, params: dict) -> None:
        """Replace the conversation's stored settings (a JSON object)."""
        if not isinstance(params, dict):
            raise InvalidRequest(f"params must be a dict, got {type(params).__name__}")
        params = check_json("params", params)
        with self._writing() as s:
            self._conversation(s, conv_id).params = params

    def set_archived(self, conv_id: str, archived: bool) -> None:
        """Archive (hide from the default listing) or unarchive."""
        with self._writing() as s:
            self._conversation(s, conv_id).archived = bool(archived)

    def delete_conversation(self, conv_id: str) -> Optional[str]:
        """Delete the conversation, its messages and snapshot row. Returns the snapshot
        file name the caller should now delete, or None."""
        with self._writing() as s:
            conv = self._conversation(s, conv_id, lock=True)
            self.leases.check_write(s, conv.id)  # not while another process generates it
            file = s.scalar(select(KVSnapshot.file).where(KVSnapshot.conversation_id == conv.id))
            s.delete(conv)  # messages and snapshot go by ON DELETE CASCADE
            return file

    # -------------------------------------------------------- messages

    def add_message(
        self,
        conv_id: str,
        role: str,
        content: str,
        status: str = "complete",
        meta: Optional[dict] = None,
        token_ids: Optional[list[int]] = None,
        context: Any = ...,
        parent_id: Any = _CURRENT,
        **stats: Any,
    ) -> MessageInfo:
        """Append a message (stats: prompt_tokens, cached_tokens, restored_tokens,
        computed_tokens, generated_tokens, ttft_ms, tokens_per_s) and bump the
        conversation's activity time. ``token_ids``, when given, replaces the
        conversation's canonical token history in the same transaction, so the
        messages and the tokens never disagree after a crash. Fenced by the conversation's
        lease: ``LeaseLost`` if this store's lease on it was broken, ``ConversationBusy`` if
        another process holds a live one (``storage.leases``). ``context`` (a JSON object, or
        None), when given, replaces the conversation's KV-window state in that same
        transaction (it describes ``token_ids``).

        The message follows ``parent_id`` (default: the conversation's current leaf; None: a
        first message), a message of this conversation, and becomes the current leaf: a parent
        other than the current leaf starts a branch (a sibling of the parent's other children),
        and the conversation's token history becomes that branch's. ``token_ids`` is recorded
        on the message too (``storage.message_tree``), so any branch's history comes back later
        without re-tokenising."""
        if role not in ROLES:
            raise InvalidRequest(f"unknown message role {role!r}; expected one of {sorted(ROLES)}")
        check_str("content", content)
        if status not in STATUSES:
            raise InvalidRequest(f"unknown message status {status!r}; expected one of {sorted(STATUSES)}")
        meta = None if meta is None else check_json("meta", meta)
        if context is not ... and context is not None:
            context = check_json("context", context)
        check_stats(stats, "add_message")
        with self._writing() as s:
            conv = self._conversation(s, conv_id, lock=True)
            self.leases.check_write(s, conv.id)  # under this process's lease, or no live one
            tokens = None if token_ids is None else check_tokens(token_ids)
            # an append to the current leaf (a plain turn) replays only the token histories; a
            # named parent may start a branch, which reads the windows' states too
            nodes = self._nodes(s, conv.id, contexts=parent_id is not _CURRENT)
            parent = conv.current_leaf_id if parent_id is _CURRENT else self._node_id(nodes, conv.id, parent_id, True)
            if parent != conv.current_leaf_id:  # a new branch: the current one's history is kept first
                self._seal(s, conv, nodes)
                before, before_context = tree.history(tree.chain(nodes, parent)) if parent is not None else ([], None)
                conv.token_ids, conv.token_count, conv.context = before or [], len(before or []), before_context
            now = CLOCK.now()
            msg = Message(
                conversation_id=conv.id,
                role=role,
                content=content,
                status=status,
                meta=meta,
                created_at=now,
                content_hash=message_hash(role, content),
                parent_id=parent,
                **stats,
            )
            if tokens is not None:
                replay = tree.history(tree.chain(nodes, parent))[0] if parent is not None else []
                msg.token_base, msg.token_tail = tree.delta(replay, tokens) if replay is not None else (0, tokens)
                msg.context = conv.context if context is ... else context
            s.add(msg)
            s.flush()  # the INSERT, for the message's id; the conversation row is then written in one UPDATE
            if tokens is not None:
                conv.token_ids, conv.token_count = tokens, len(tokens)
            if context is not ...:
                conv.context = context
            conv.updated_at, conv.current_leaf_id = now, msg.id
            return message_info(msg)

    # -------------------------------------------------------- the tree (migration 0006)

    @staticmethod
    def _nodes(s: Session, conv_id: str, contexts: bool = True) -> dict[int, tree.Node]:
        """The conversation's messages as tree nodes (``contexts=False``: without the windows'
        states, which only a branch change reads)."""
        cols = [Message.id, Message.parent_id, Message.token_base, Message.token_tail] + (
            [Message.context] if contexts else []
        )
        return {r[0]: tree.Node(*r) for r in s.execute(select(*cols).where(Message.conversation_id == conv_id))}

    @staticmethod
    def _node_id(nodes: dict[int, tree.Node], conv_id: str, message_id: Any, none_ok: bool = False) -> Optional[int]:
        """``message_id`` if it is a message of this conversation, else InvalidRequest naming it."""
        if message_id is None and none_ok:
            return None
        if isinstance(message_id, bool) or not isinstance(message_id, int):
            raise InvalidRequest(f"a message id must be an int, got {type(message_id).__name__} {message_id!r}"[:200])
        if message_id not in nodes:
            raise InvalidRequest(f"message {message_id} is not a message of conversation {conv_id}")
        return message_id

    def _seal(self, s: Session, conv: Conversation, nodes: dict[int, tree.Node]) -> None:
        """Record the conversation's current history on its current leaf, where replaying the
        branch would not give it back (a branch from before 0006), before the branch changes."""
        leaf = conv.current_leaf_id
        if leaf is None or leaf not in nodes:
            return
        replay = tree.history(tree.chain(nodes, leaf))[0]
        current = list(conv.token_ids or [])
        if replay == current:
            return
        parent = nodes[leaf].parent_id
        before = tree.history(tree.chain(nodes, parent))[0] if parent is not None else []
        base, tail = tree.delta(before, current) if before is not None else (0, current)
        row = s.get(Message, leaf)
        row.token_base, row.token_tail, row.context = base, tail, conv.context
        nodes[leaf] = tree.Node(leaf, parent, base, tail, conv.context)

    def get_message(self, conv_id: str, message_id: int) -> MessageInfo:
        """One message of the conversation (any branch); InvalidRequest naming it if it is not one."""
        with self._reading(conv_id) as s:
            conv = self._conversation(s, conv_id)
            m = s.get(Message, message_id) if isinstance(message_id, int) and not isinstance(message_id, bool) else None
            if m is None or m.conversation_id != conv.id:
                self._node_id({}, conv.id, message_id)  # raises the error, naming it
            return message_info(m)

    def message_tree(self, conv_id: str) -> list[MessageInfo]:
        """Every message of the conversation, every branch, oldest first (each names its parent)."""
        with self._reading(conv_id) as s:
            conv = self._conversation(s, conv_id)
            q = select(Message).where(Message.conversation_id == conv.id).order_by(Message.id)
            return [message_info(m) for m in s.scalars(q)]

    def branches(self, conv_id: str, message_id: int) -> list[MessageInfo]:
        """The siblings of ``message_id`` (the messages sharing its parent), itself included,
        oldest first."""
        with self._reading(conv_id) as s:
            conv = self._conversation(s, conv_id)
            nodes = self._nodes(s, conv.id)
            ids = tree.siblings(nodes, self._node_id(nodes, conv.id, message_id))
            return [message_info(m) for m in s.scalars(select(Message).where(Message.id.in_(ids)).order_by(Message.id))]

    def switch_branch(self, conv_id: str, message_id: Optional[int], descend: bool = True) -> Optional[MessageInfo]:
        """Make the branch through ``message_id`` current, down to its most recent leaf (without
        ``descend``: ending at ``message_id`` itself, so the next message follows it; None
        without ``descend``: before the first message, so the next one starts a new root); the
        conversation's token history (and KV-window state) become that branch's, from what its
        messages recorded (empty when none did: it is recomputed from the text). Returns the
        leaf. Fenced by the lease, as ``add_message`` is. Nothing is deleted."""
        with self._writing() as s:
            conv = self._conversation(s, conv_id, lock=True)
            self.leases.check_write(s, conv.id)
            nodes = self._nodes(s, conv.id)
            leaf = self._node_id(nodes, conv.id, message_id, none_ok=not descend)
            leaf = tree.newest_leaf(nodes, leaf) if descend else leaf
            if leaf != conv.current_leaf_id:
                self._seal(s, conv, nodes)
                tokens, context = tree.history(tree.chain(nodes, leaf)) if leaf is not None else ([], None)
                conv.token_ids, conv.token_count, conv.context = tokens or [], len(tokens or []), context
                conv.current_leaf_id = leaf
                conv.updated_at = CLOCK.now()
            return message_info(s.get(Message, leaf)) if leaf is not None else None

    def messages(self, conv_id: str) -> list[MessageInfo]:
        """The conversation's current branch, oldest first (``message_tree`` has every branch).
        StorageError naming the conversation (and the rows) when one holds text that is not
        UTF-8; the store stays usable."""
        try:
            with self._reading() as s:
                conv = self._conversation(s, conv_id)
                if conv.current_leaf_id is None:  # no message yet, or a branch switched to before the first
                    return []
                rows = s.execute(select(Message.id, Message.parent_id).where(Message.conversation_id == conv.id))
                ids = [n.id for n in tree.chain({r[0]: tree.Node(r[0], r[1]) for r in rows}, conv.current_leaf_id)]
                q = select(Message).where(Message.id.in_(ids)).order_by(Message.id)
                return [message_info(m) for m in s.scalars(q)]
        except StorageError as e:
            if "Could not decode to UTF-8" in str(e.__cause__ or ""):
                raise self._undecodable(conv_id) from e.__cause__
            raise

    def search(
        self, query: str, owner: str = LOCAL_USER, tenant: Optional[str] = None, limit: int = 20
    ) -> list[message_search.SearchHit]:
        """Messages of ``owner``'s conversations (every branch) whose text holds ``query``'s
        words, best first (``storage.message_search``: FTS5 on SQLite, LIKE elsewhere)."""
        check_str("query", query, 10_000)
        check_owner(owner)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
            raise InvalidRequest(f"limit must be an int in [1, 1000], got {limit!r}")
        with self._reading() as s:
            return message_search.search(s, query, owner, tenant, limit)

    def rebuild_history(self, conv_id: str, token_ids: list[int], context: Optional[dict] = None) -> None:
        """After the stored text was found changed (a message no longer matches its hash): make
        ``token_ids`` (the history recomputed from that text) the conversation's, with ``context``
        its KV window's state (None: unknown), and record every message's current hash, in one
        transaction. Fenced by the lease, as ``add_message`` is."""
        tokens = check_tokens(token_ids)
        context = None if context is None else check_json("context", context)
        with self._writing() as s:
            conv = self._conversation(s, conv_id, lock=True)
            self.leases.check_write(s, conv.id)
            conv.token_ids, conv.token_count, conv.context = tokens, len(tokens), context
            for m in s.scalars(select(Message).where(Message.conversation_id == conv.id)):
                m.content_hash = message_hash(m.role, m.content)

    # -------------------------------------------------------- KV snapshots

    def put_snapshot(
        self,
        conv_id: str,
        file: str,
        model_fingerprint: str,
        kv_dtype: str,
        token_count: int,
        token_hash: str,
        nbytes: int,
    ) -> SnapshotInfo:
        """Record the conversation's current snapshot, replacing any previous row.

        The caller deletes a replaced file itself (compare with ``get_snapshot``
        first, or sweep with ``snapshots_lru``)."""
        check_file_name(file)
        check_str("model_fingerprint", model_fingerprint, 128)
        check_str("kv_dtype", kv_dtype, 32)
        check_str("token_hash", token_hash, 128)
        for what, n in (("token_count", token_count), ("nbytes", nbytes)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise InvalidRequest(f"{what} must be a non-negative int, got {n!r}")
        with self._writing() as s:
            conv = self._conversation(s, conv_id, lock=True)  # two processes' upserts: one at a time
            now = CLOCK.now()
            snap = s.scalar(select(KVSnapshot).where(KVSnapshot.conversation_id == conv.id))
            if snap is None:
                snap = KVSnapshot(conversation_id=conv.id)
                s.add(snap)
            snap.file = file
            snap.model_fingerprint = model_fingerprint
            snap.kv_dtype = kv_dtype
            snap.token_count = token_count
            snap.token_hash = token_hash
            snap.nbytes = nbytes
            snap.created_at = now
            snap.last_used_at = now
            s.flush()
            return snapshot_info(snap)

    def get_snapshot(self, conv_id: str) -> Optional[SnapshotInfo]:
        """The conversation's snapshot record, or None if it has none."""
        check_conversation_id(conv_id)
        with self._reading() as s:
            snap = s.scalar(select(KVSnapshot).where(KVSnapshot.conversation_id == conv_id))
            return None if snap is None else snapshot_info(snap)

    def delete_snapshot(self, conv_id: str) -> Optional[str]:
        """Forget the conversation's snapshot; returns its file name (for the caller to
        delete), or None if there was none."""
        check_conversation_id(conv_id)
        with self._writing() as s:
            snap = s.scalar(select(KVSnapshot).where(KVSnapshot.conversation_id == conv_id))
            if snap is None:
                return None
            s.delete(snap)
            return snap.file

    def touch_snapshot(self, conv_id: str) -> None:
        """Mark the snapshot used now (LRU). No-op if the conversation has none."""
        check_conversation_id(conv_id)
        with self._writing() as s:
            snap = s.scalar(select(KVSnapshot).where(KVSnapshot.conversation_id == conv_id))
            if snap is not None:
                snap.last_used_at = CLOCK.now()

    def snapshots_lru(self) -> list[SnapshotInfo]:
        """Every snapshot record, least recently used first."""
        with self._reading() as s:
            q = select(KVSnapshot).order_by(KVSnapshot.last_used_at, KVSnapshot.id)
            return [snapshot_info(x) for x in s.scalars(q)]

    def total_snapshot_bytes(self) -> int:
        with self._reading() as s:
            return int(s.scalar(select(func.coalesce(func.sum(KVSnapshot.nbytes), 0))) or 0)
