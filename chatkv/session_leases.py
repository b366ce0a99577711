"""Sessions under conversation leases: several processes, one store.

``SessionManager`` runs a turn, a resume's clean-up and a spill through these functions,
so that a process writes a conversation only while it holds its lease
(``chatkv.storage.leases``) and never on top of a history it has not seen:

- ``turn``: take the lease (``ConversationBusy`` at once while another process generates
  the conversation: nothing is stored, the caller may retry), bring the session up to
  date (``sync``), run the turn, give the lease back when the turn ends (success, error,
  interruption: the generator's ``finally``);
- ``sync``, under the lease: a session behind the stored conversation (another process
  stored turns since this one last looked; told by the ``Mark`` the lease returns, else by
  comparing the token history) is reloaded: tokens, window state, title, settings. Its KV
  in memory for the old history is dropped, so the turn's restore reads the snapshot the
  other process wrote when it matches the history (its tokens are verified). A turn left
  without its reply (its process died and its lease was broken) is closed as an
  interrupted empty reply, exactly once: the close is itself a stored message, written
  under the lease;
- ``settle`` (``resume``): the same, but only when no live process holds the lease; while
  one does, its turn is in progress and is left alone;
- ``spill`` (close, ``Session.spill``): the snapshot is written only under the lease and
  only when the session is current; otherwise the KV is only dropped, so a process that
  fell behind never writes its older history's KV over the newer one. (Idle and pressure
  spills go straight to ``chatkv.snapshots`` without a lease: the write-behind of the
  session's last turn, queued under its lease, already made its snapshot current, so they
  write nothing.)

The manager keeps, per conversation, the ``Mark`` it last saw (``manager.marks``; None:
unknown, compare the tokens).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Hashable, Iterator, Protocol

from chatkv.errors import ConversationBusy

if TYPE_CHECKING:
    from chatkv.context_window import ContextState
    from chatkv.kv_manager import KVManager
    from chatkv.session import Session
    from chatkv.snapshots import Snapshots
    from chatkv.storage.leases import Mark
    from chatkv.storage.records import ConversationInfo
    from chatkv.storage.repository import Store
    from chatkv.turns import TurnRenderer

log = logging.getLogger("chatkv.sessions")


class _Loop(Protocol):
    def on_loop(self, fn: Callable): ...


class Manager(Protocol):
    """What these functions use of the session manager (``chatkv.session_manager.SessionManager``
    is one); this module names them, never the SessionManager class, so the two modules do
    not import each other."""

    closed: bool
    store: Store
    marks: dict[str, Mark | None]
    engine: _Loop
    kv: KVManager
    renderer: TurnRenderer
    snapshots: Snapshots

    def stored_settings(self, info: ConversationInfo) -> tuple[dict, str | None]: ...

    def stored_window(self, s: Session, info: ConversationInfo, overflow: str | None) -> ContextState: ...

    def _namespace(self, conv_id: str, st: ContextState) -> Hashable | None: ...


def turn(m: Manager, s: "Session", inner: Iterator) -> Iterator:
    """Run the turn generator ``inner`` (not started yet) under the conversation's lease."""
    mark = m.store.leases.acquire(s.id)
    done = False
    try:
        sync(m, s, mark)
        yield from inner
        done = True
    finally:
        release(m, s, done)


def release(m: Manager, s: "Session", current: bool) -> None:
    """Give the lease back; remember the stored state if the session is known to match it."""
    if m.closed:  # engine.close() closed the store, which gave every lease back
        return
    try:
        mark = m.store.leases.release(s.id)
    except Exception as e:  # the database went away: the lease expires by itself
        log.warning("conversation %s: lease not released (%s: %s); it expires within %.0f s",
                    s.id, type(e).__name__, e, m.store.leases.ttl_s)
        mark = None
    m.marks[s.id] = mark if current else None


def behind(m: Manager, s: "Session", mark: "Mark") -> "ConversationInfo | None":
    """Under the lease: the stored conversation if the session's history differs from it, else None."""
    if m.marks.get(s.id) == mark and len(s.tokens) == mark.token_count:
        return None
    info = m.store.get_conversation(s.id)
    if list(info.token_ids or ()) == s.tokens:
        m.marks[s.id] = mark
        return None
    return info


def sync(m: Manager, s: "Session", mark: "Mark") -> None:
    """Under the lease: reload a session that is behind; close a turn left without its reply."""
    info = behind(m, s, mark)
    if info is not None:
        reload(m, s, info)
    if mark.last_role == "user" and s.tokens:
        # its process died while replying (a live one would still hold the lease)
        s.tokens = s.tokens + m.renderer.close_reply([])
        m.store.add_message(s.id, "assistant", "", status="interrupted", token_ids=s.tokens)
        log.info("conversation %s: a turn left without its reply was closed as interrupted", s.id)


def reload(m: Manager, s: "Session", info: "ConversationInfo") -> None:
    """Make ``s`` the stored conversation ``info``; its KV in memory (the old history's) is dropped."""
    log.info("conversation %s: another process stored turns since this one looked (%d -> %d tokens); reloading",
             s.id, len(s.tokens), info.token_count)
    old_ns = m._namespace(s.id, s.window) if s.window is not None else None
    m.engine.on_loop(lambda: _drop(m, s))
    s.params, overflow = m.stored_settings(info)
    s.tokens = list(info.token_ids or ())
    s.window = m.stored_window(s, info, overflow)
    if old_ns is not None and old_ns != m._namespace(s.id, s.window):
        m.engine.on_loop(lambda: m.kv.drop_namespace(old_ns))  # a moved sink window's re-rotated keys match nothing now
    s.title = info.title
    if s.knowledge is not None:
        users = [x.content for x in m.store.messages(s.id) if x.role == "user"]
        s.last_question = users[-1] if users else None


def settle(m: Manager, s: "Session") -> None:
    """At resume, for a stored turn without its reply: close it as interrupted, unless a live
    process holds the conversation (it is generating that reply now)."""
    try:
        mark = m.store.leases.acquire(s.id)
    except ConversationBusy:
        return
    done = False
    try:
        sync(m, s, mark)
        done = True
    finally:
        release(m, s, done)


def _drop(m: Manager, s: "Session") -> None:
    m.kv.drop(s.kept)
    s.kept = None


def spill(m: Manager, s: "Session") -> bool:
    """Release the session's KV, writing its snapshot first only under the lease and only if
    the session is current. True if it had KV in memory."""
    if s.kept is None:
        return False
    try:
        mark = m.store.leases.acquire(s.id)
    except Exception as e:  # busy elsewhere, deleted, or no database: the snapshot is not ours to write
        log.info("conversation %s: KV released without a snapshot write (%s: %s)", s.id, type(e).__name__, e)
        m.engine.on_loop(lambda: _drop(m, s))
        return True
    current = False
    try:
        current = behind(m, s, mark) is None
        if current:
            return m.engine.on_loop(lambda: m.snapshots.spill(s))
        log.info("conversation %s: behind the stored conversation; KV released without a snapshot write", s.id)
        return True
    finally:
        if not current:
            m.engine.on_loop(lambda: _drop(m, s))
        release(m, s, current)
