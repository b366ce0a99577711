"""Conversation leases: which process may write a conversation's turns right now.

Several processes may share one store (a SQLite file in one data directory, or a
PostgreSQL database). A process holds a conversation's lease while it generates a turn,
from before the user message is stored until after the reply is stored, so two processes
never interleave a conversation's messages or write two diverging token histories.
Contracts:

- one ``conversation_leases`` row per leased conversation (deleted with it): the owner
  (``host/pid/nonce``, one ``Store`` in one process), the machine identity and pid (with
  the pid's start time), when it was taken and when it expires;
- ``acquire`` is one write transaction that first locks the conversation row (``SELECT ...
  FOR UPDATE`` on PostgreSQL; on SQLite every write transaction is ``BEGIN IMMEDIATE``,
  so they run one at a time). Another owner's live lease raises ``ConversationBusy`` at
  once (no waiting: the caller decides whether to retry, and a turn that waited silently
  would answer a history its user has not seen). A lease that expired, or whose process
  is provably dead on this machine (no such pid, a zombie, or the pid now belongs to a
  process started later), is broken and taken;
- while leases are held a daemon thread renews them every ``ttl_s / 3``, so a lease
  expires only when its process died, froze, or lost the database for ``ttl_s``;
- writes are fenced: ``Store.add_message`` (and ``delete_conversation``) call
  ``check_write`` in their own transaction, with the conversation row locked. A lease this
  owner took but lost refuses the write (``LeaseLost``); a write without a lease is refused
  while another owner's live lease exists (``ConversationBusy``), and breaks a dead one;
- released by ``release`` (the end of a turn), by ``Store.close`` and at interpreter exit;
- expiry compares the holder's wall clock plus ``ttl_s`` with the reader's wall clock:
  machines sharing a database need clocks that agree to well within ``ttl_s`` (NTP).

``acquire`` and ``release`` return a ``Mark``: where the stored history stands (token
count, last message), so a process can tell that another one added turns since it looked.
``with leases.hold(conversation_id) as held:`` is the two around a block of work: ``held.mark``
is the acquire's, ``held.released`` the release's (None when the release failed or the store
was closed meanwhile: a lease not given back expires within ``ttl_s``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import socket
import threading
import weakref
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Iterator, Optional

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session, defer, sessionmaker

from chatkv.errors import ConversationBusy, LeaseLost, SessionError
from chatkv.storage.models import Conversation, ConversationLease, Message
from chatkv.storage.records import check_conversation_id

__all__ = ["TTL_S", "Mark", "Held", "LeaseInfo", "Leases", "machine_id"]

log = logging.getLogger("chatkv.storage")

TTL_S = 30.0  # a lease not renewed for this long may be broken by another process


@dataclass(frozen=True)
class Mark:
    """Where a conversation's stored history stands: its token count and its current leaf (the
    last message of its current branch). Equal marks: no turn was stored and no branch switched
    to in between (message ids are never reused, and every stored message becomes the leaf)."""

    token_count: int
    last_message_id: Optional[int]
    last_role: Optional[str]


@dataclass
class Held:
    """A lease held by ``Leases.hold``: the stored state when it was taken and when it was given back."""

    conversation_id: str
    mark: Mark
    released: Optional[Mark] = None


@dataclass(frozen=True)
class LeaseInfo:
    conversation_id: str
    owner: str
    machine: str
    pid: int
    acquired_at: datetime
    expires_at: datetime

    def describe(self) -> str:
        return f"process {self.pid} on {self.machine.split('|')[0]}"


def _now() -> datetime:
    return datetime.now(timezone.utc)


def machine_id() -> str:
    """``hostname|boot id|pid namespace``: processes with the same value see the same pids.
    ``hostname|?`` where that cannot be told; then no lease is broken for a dead pid."""
    host = socket.gethostname()
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return f"{host}|?"
    return f"{host}|{boot}|{pidns}"


def _proc_stat(pid: int) -> Optional[tuple[str, int]]:
    """(state, start time in clock ticks since boot) of a process, from /proc; None if unreadable."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        fields = text[text.rindex(")") + 2 :].split()
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class _Identity:
    owner: str
    machine: str
    pid: int
    pid_start: Optional[int]


def _identity() -> _Identity:
    pid = os.getpid()
    stat = _proc_stat(pid)
    return _Identity(
        f"{socket.gethostname()}/{pid}/{secrets.token_hex(6)}", machine_id(), pid, stat[1] if stat else None
    )


_LIVE: "weakref.WeakSet[Leases]" = weakref.WeakSet()


@atexit.register
def _release_all() -> None:
    for leases in list(_LIVE):
        leases.close()


def _mark(s: Session, conv: Conversation) -> Mark:
    """The conversation's current leaf (migration 0006): every stored message becomes it, and
    a branch switch moves it, so another process's switch is seen as well as its turns."""
    leaf = conv.current_leaf_id
    role = s.scalar(select(Message.role).where(Message.id == leaf)) if leaf is not None else None
    return Mark(conv.token_count, leaf, role)


def _info(row: ConversationLease) -> LeaseInfo:
    return LeaseInfo(row.conversation_id, row.owner, row.machine, row.pid, row.acquired_at, row.expires_at)


class Leases:
    """The leases one ``Store`` takes (its owner id is per Store and per process)."""

    def __init__(self, read: sessionmaker, write: sessionmaker, ttl_s: float = TTL_S):
        self._read, self._write = read, write
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._held: set[str] = set()
        self._taking: set[str] = set()  # acquires in flight in this process (their transaction not done yet)
        self._me: Optional[_Identity] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        _LIVE.add(self)

    @property
    def me(self) -> _Identity:
        """This owner; a new one in a forked child (the parent's leases are not the child's).
        Made once under the lock: two threads asking first at once must not make two owners
        (the second would reset the first's held leases and then find them "taken")."""
        me = self._me
        if me is not None and me.pid == os.getpid():
            return me
        with self._lock:
            if self._me is None or self._me.pid != os.getpid():
                self._me, self._held, self._taking, self._thread = _identity(), set(), set(), None
            return self._me

    def holds(self, conv_id: str) -> bool:
        return conv_id in self._held and self._me is not None and self._me.pid == os.getpid()

    # ------------------------------------------------------------ take, give back

    def acquire(self, conv_id: str) -> Mark:
        """Take the conversation's lease; its stored state. ConversationBusy if another live
        owner holds it (or this one already does), SessionError if the conversation is unknown."""
        check_conversation_id(conv_id)
        me = self.me
        if self._closed:
            raise SessionError("the conversation store is closed")
        # checked and claimed at once: two threads of this process (two requests for one
        # conversation on one server) both passing the check would both find the row theirs
        with self._lock:
            if conv_id in self._held or conv_id in self._taking:
                raise ConversationBusy(
                    f"conversation '{conv_id}' is already generating a reply in this process", conv_id, "this process"
                )
            self._taking.add(conv_id)
        try:
            with self._write.begin() as s:
                conv = s.get(Conversation, conv_id, options=[defer(Conversation.token_ids)], with_for_update=True)
                if conv is None:
                    raise SessionError(f"unknown conversation id '{conv_id}'")
                now = _now()
                row = s.get(ConversationLease, conv_id)
                if row is None:
                    row = ConversationLease(conversation_id=conv_id)
                    s.add(row)
                elif row.owner != me.owner:
                    why = self._gone(row, now)
                    if why is None:
                        raise self._busy(conv_id, row)
                    log.warning("conversation %s: the lease of %s was broken (%s)", conv_id, _info(row).describe(), why)
                row.owner, row.machine, row.pid, row.pid_start = me.owner, me.machine, me.pid, me.pid_start
                row.acquired_at, row.expires_at = now, now + timedelta(seconds=self.ttl_s)
                s.flush()
                mark = _mark(s, conv)
            with self._lock:
                self._held.add(conv_id)
        finally:
            with self._lock:
                self._taking.discard(conv_id)
        self._keep_renewing()
        return mark

    def release(self, conv_id: str) -> Optional[Mark]:
        """Give the lease back (a no-op for one this owner no longer holds); the stored state
        after it, or None if the conversation is gone."""
        check_conversation_id(conv_id)
        me = self.me
        # the row goes before the claim: a thread of this process taking the lease in between
        # would get this owner's row and then lose it to this delete
        try:
            with self._write.begin() as s:
                s.execute(
                    delete(ConversationLease).where(
                        ConversationLease.conversation_id == conv_id, ConversationLease.owner == me.owner
                    )
                )
                conv = s.get(Conversation, conv_id, options=[defer(Conversation.token_ids)])
                return None if conv is None else _mark(s, conv)
        finally:
            with self._lock:
                self._held.discard(conv_id)

    @contextlib.contextmanager
    def hold(self, conv_id: str) -> Iterator[Held]:
        """The conversation's lease around a block of work (``acquire``'s errors at entry); given
        back at its end whatever happens in it. A release that fails is logged, not raised."""
        held = Held(conv_id, self.acquire(conv_id))
        try:
            yield held
        finally:
            if not self._closed:  # closing the store gave every lease back
                try:
                    held.released = self.release(conv_id)
                except Exception as e:  # the database went away: the lease expires by itself
                    log.warning(
                        "conversation %s: lease not released (%s: %s); it expires within %.0f s",
                        conv_id,
                        type(e).__name__,
                        e,
                        self.ttl_s,
                    )

    def holder(self, conv_id: str) -> Optional[LeaseInfo]:
        """The conversation's lease row (live, expired or dead), or None."""
        with self._read() as s:
            row = s.get(ConversationLease, check_conversation_id(conv_id))
            return None if row is None else _info(row)

    def check_write(self, s: Session, conv_id: str) -> None:
        """Fence a write to the conversation, inside the write transaction ``s`` that locked its
        row (see the module docstring)."""
        row = s.get(ConversationLease, conv_id)
        me = self.me
        if self.holds(conv_id):
            if row is None or row.owner != me.owner:
                taker = f" and taken by {_info(row).describe()}" if row is not None else ""
                raise LeaseLost(
                    f"conversation '{conv_id}': this process's lease was broken{taker} (it was not renewed within "
                    f"{self.ttl_s:.0f} s: the process was frozen or could not reach the database); the write was "
                    "refused and nothing of it was stored"
                )
            return
        if row is None or row.owner == me.owner:
            return
        why = self._gone(row, _now())
        if why is None:
            raise self._busy(conv_id, row)
        log.warning("conversation %s: the lease of %s was broken (%s)", conv_id, _info(row).describe(), why)
        s.delete(row)

    # ------------------------------------------------------------ liveness

    def _busy(self, conv_id: str, row: ConversationLease) -> ConversationBusy:
        who = _info(row).describe()
        return ConversationBusy(
            f"conversation '{conv_id}' is being generated by another process ({who}, since "
            f"{row.acquired_at:%H:%M:%S} UTC); nothing was stored: try again when its reply is done",
            conv_id,
            who,
        )

    def _gone(self, row: ConversationLease, now: datetime) -> Optional[str]:
        """Why another owner's lease may be broken, or None while its holder may be alive."""
        if row.expires_at <= now:
            return f"it expired at {row.expires_at:%H:%M:%S} UTC"
        me = self.me
        if row.machine != me.machine or row.machine.endswith("|?"):
            return None  # another machine's pid (or an unknown one) tells nothing here
        if row.pid == me.pid:
            # the other Leases of this process (this class's own instances): whose owner is still open
            live = {x._me.owner for x in list(_LIVE) if x._me is not None and not x._closed}
            return None if row.owner in live else "its store in this process was closed"
        try:
            os.kill(row.pid, 0)
        except ProcessLookupError:
            return f"process {row.pid} is dead"
        except OSError:
            pass  # EPERM: it exists, under another user
        stat = _proc_stat(row.pid)
        if stat is not None:
            if stat[0] in ("Z", "X"):
                return f"process {row.pid} is dead (a zombie)"
            if row.pid_start is not None and stat[1] != row.pid_start:
                return f"process {row.pid} is dead (its pid now belongs to a newer process)"
        return None

    # ------------------------------------------------------------ renewal, close

    def renew(self) -> int:
        """Push back the expiry of every lease held; how many were still this owner's."""
        with self._lock:
            held = sorted(self._held)
        if not held:
            return 0
        me = self.me
        with self._write.begin() as s:
            n = s.execute(
                update(ConversationLease)
                .where(ConversationLease.owner == me.owner, ConversationLease.conversation_id.in_(held))
                .values(expires_at=_now() + timedelta(seconds=self.ttl_s))
                .execution_options(synchronize_session=False)
            ).rowcount
        if n < len(held):
            log.warning(
                "%d of %d conversation lease(s) of this process were broken by other processes",
                len(held) - n,
                len(held),
            )
        return n

    def _keep_renewing(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="chatkv-lease-keeper", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.renew()
            except Exception as e:  # the database is unreachable: the fenced writes will tell
                log.warning("conversation leases not renewed (%s: %s)", type(e).__name__, e)

    def close(self) -> None:
        """Release every lease held and stop renewing. Never raises; idempotent."""
        self._stop.set()
        with self._lock:
            held, self._held = sorted(self._held), set()
            self._closed = True
            thread, self._thread = self._thread, None
        _LIVE.discard(self)
        if held and self._me is not None and self._me.pid == os.getpid():
            try:
                with self._write.begin() as s:
                    s.execute(
                        delete(ConversationLease).where(
                            ConversationLease.owner == self._me.owner, ConversationLease.conversation_id.in_(held)
                        )
                    )
            except Exception as e:  # they expire after ttl_s
                log.warning("%d conversation lease(s) not released (%s: %s)", len(held), type(e).__name__, e)
        if thread is not None and thread is not threading.current_thread():
            thread.join()
