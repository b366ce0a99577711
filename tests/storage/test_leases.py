"""Conversation leases (chatkv.storage.leases) on real databases: a SQLite file and a real
PostgreSQL server (tests/support/pg.py). Two ``Store`` objects on one database are two owners, as two
processes are; dead and expired holders are real rows (another machine's, a reaped process's),
not mocks. The processes themselves are in tests/sessions/test_multiprocess.py."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import update

from chatkv.errors import ConversationBusy, LeaseLost, SessionError
from chatkv.storage.leases import Mark
from chatkv.storage.models import ConversationLease
from chatkv.storage.repository import Store
from tests.support.pg import backend_url


@pytest.fixture(params=["sqlite", "postgres"])
def url(request, tmp_path):
    return backend_url(request, request.param, sqlite=f"sqlite:///{tmp_path / 'chatkv.db'}")


@pytest.fixture
def stores(url):
    opened: list[Store] = []

    def open_store() -> Store:
        opened.append(Store.open(url))
        return opened[-1]

    yield open_store
    for s in opened:
        s.close()


def _conv(store: Store) -> str:
    return store.create_conversation("chat", "m", "", {}).id


def _forge(store: Store, conv: str, **values) -> None:
    """Write a lease row as another process (another machine, a dead pid) would have left it."""
    now = datetime.now(timezone.utc)
    row = dict(
        owner="elsewhere/1/x",
        machine="elsewhere|boot|1",
        pid=1,
        pid_start=None,
        acquired_at=now,
        expires_at=now + timedelta(seconds=60),
    )
    row.update(values)
    with store._write.begin() as s:
        lease = s.get(ConversationLease, conv)
        if lease is None:
            s.add(ConversationLease(conversation_id=conv, **row))
        else:
            for k, v in row.items():
                setattr(lease, k, v)


def test_acquire_write_release_and_marks(stores):
    a = stores()
    conv = _conv(a)
    assert a.leases.acquire(conv) == Mark(0, None, None)
    held = a.leases.holder(conv)
    assert held.pid == os.getpid() and held.expires_at > datetime.now(timezone.utc)
    m = a.add_message(conv, "user", "hi", token_ids=[1, 2, 3])
    assert a.leases.release(conv) == Mark(3, m.id, "user")
    assert a.leases.holder(conv) is None
    assert a.leases.release(conv) == Mark(3, m.id, "user")  # twice: nothing to give back


def test_another_owner_is_refused_and_nothing_is_stored(stores):
    a, b = stores(), stores()
    conv = _conv(a)
    a.leases.acquire(conv)
    with pytest.raises(ConversationBusy) as e:
        b.leases.acquire(conv)
    assert f"conversation '{conv}'" in str(e.value) and f"process {os.getpid()} " in str(e.value)
    assert e.value.conversation_id == conv
    with pytest.raises(ConversationBusy):
        b.add_message(conv, "user", "from b", token_ids=[9])
    with pytest.raises(ConversationBusy):
        b.delete_conversation(conv)
    assert b.messages(conv) == [] and b.get_conversation(conv).token_count == 0
    with pytest.raises(ConversationBusy, match="this process"):
        a.leases.acquire(conv)  # one turn at a time in this owner too
    a.leases.release(conv)
    b.leases.acquire(conv)
    b.add_message(conv, "user", "from b")
    b.leases.release(conv)
    with pytest.raises(SessionError, match="unknown conversation"):
        a.leases.acquire("nosuchconversation")


def test_expired_leases_are_broken_live_ones_elsewhere_are_not(stores):
    a = stores()
    conv = _conv(a)
    _forge(a, conv)  # another machine's live lease: its pid means nothing here
    with pytest.raises(ConversationBusy, match="process 1 on elsewhere"):
        a.leases.acquire(conv)
    _forge(a, conv, expires_at=datetime.now(timezone.utc) - timedelta(seconds=1))
    a.leases.acquire(conv)
    assert a.leases.holder(conv).pid == os.getpid()


def test_a_dead_process_on_this_machine_loses_its_lease_at_once(stores):
    a = stores()
    conv = _conv(a)
    me = a.leases.me
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _forge(a, conv, machine=me.machine, pid=int(dead.stdout))  # unexpired, but the process is gone
    a.leases.acquire(conv)
    a.leases.release(conv)

    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        with open(f"/proc/{live.pid}/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19])
        _forge(a, conv, machine=me.machine, pid=live.pid, pid_start=start)
        with pytest.raises(ConversationBusy):  # alive: kept
            a.leases.acquire(conv)
        _forge(a, conv, machine=me.machine, pid=live.pid, pid_start=start - 1)
        a.leases.acquire(conv)  # that pid now belongs to a newer process: the holder is dead
    finally:
        live.stdin.close()
        live.wait()


def test_a_broken_lease_refuses_its_holders_writes(stores):
    a, b = stores(), stores()
    conv = _conv(a)
    a.leases.acquire(conv)
    a.add_message(conv, "user", "a's question", token_ids=[1])
    with a._write.begin() as s:  # a froze for longer than the TTL
        s.execute(update(ConversationLease).values(expires_at=datetime.now(timezone.utc) - timedelta(seconds=1)))
    b.leases.acquire(conv)  # broken and taken
    b.add_message(conv, "assistant", "", status="interrupted", token_ids=[1, 2])
    with pytest.raises(LeaseLost, match=f"conversation '{conv}'"):
        a.add_message(conv, "assistant", "a's late reply", token_ids=[1, 5])
    assert a.leases.renew() == 0
    assert [m.content for m in b.messages(conv)] == ["a's question", ""]
    assert list(b.get_conversation(conv).token_ids) == [1, 2]
    b.leases.release(conv)
    a.leases.release(conv)  # the late holder's release touches nobody's lease
    assert b.leases.holder(conv) is None


def test_a_write_without_a_lease_breaks_a_dead_one(stores):
    a = stores()
    conv = _conv(a)
    _forge(a, conv, expires_at=datetime.now(timezone.utc) - timedelta(seconds=1))
    a.add_message(conv, "user", "hi")
    assert a.leases.holder(conv) is None  # the dead holder can never write after this


def test_racing_acquires_have_one_winner(stores):
    owners = [stores() for _ in range(6)]
    conv = _conv(owners[0])
    for _ in range(3):
        start = threading.Barrier(len(owners))
        won, busy, errors = [], [], []

        def take(st: Store) -> None:
            start.wait()
            try:
                st.leases.acquire(conv)
                won.append(st)
            except ConversationBusy:
                busy.append(st)
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=take, args=(st,)) for st in owners]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and len(won) == 1 and len(busy) == len(owners) - 1, (errors, len(won))
        assert owners[0].leases.holder(conv).owner == won[0].leases.me.owner
        won[0].leases.release(conv)


def test_renewal_close_and_cascade(stores):
    a, b = stores(), stores()
    conv, other = _conv(a), _conv(a)
    a.leases.acquire(conv)
    a.leases.acquire(other)
    before = a.leases.holder(conv).expires_at
    assert a.leases.renew() == 2 and a.leases.holder(conv).expires_at > before
    keeper = a.leases._thread
    assert keeper.name == "chatkv-lease-keeper" and keeper.is_alive()  # renews while leases are held
    a.delete_conversation(other)  # the holder may delete it; its lease row goes with it
    assert a.leases.holder(other) is None
    a.close()  # gives back what it holds, and stops renewing
    assert b.leases.holder(conv) is None
    assert not keeper.is_alive()
    b.leases.acquire(conv)
