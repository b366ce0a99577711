"""Conversations as trees in the store (migration 0006).

Messages name their parent, a conversation its current leaf. A message added under an earlier
one starts a branch; switching brings a branch back with the token history its messages
recorded (never re-tokenised); nothing is deleted by branching. Migration 0006 turns every
linear history made by the migrations before it into a parent chain, on SQLite and PostgreSQL.
Real databases throughout: SQLite files and a PostgreSQL server started by the tests.
"""

from __future__ import annotations

import random
import uuid
from datetime import datetime

import pytest
from alembic import command
from sqlalchemy import text

from chatkv.errors import ConversationBusy, InvalidRequest, SessionError
from chatkv.storage import message_tree as tree
from chatkv.storage import migrations
from chatkv.storage.db import DB_FILENAME, make_engine
from chatkv.storage.repository import Store
from tests.support.pg import backend_url

NOW = datetime(2026, 12, 1, 12, 0, 0)
OLD = [
    ("user", "Hello there"),
    ("assistant", "Hi! How can I help?"),
    ("user", "Tell me a joke"),
    ("assistant", "Why did the cache miss? It was evicted."),
]
OLD_TOKENS = list(range(1, 41))


@pytest.fixture(params=["sqlite", "postgres"])
def url(request, tmp_path):
    return backend_url(request, request.param, sqlite=f"sqlite:///{tmp_path / DB_FILENAME}")


def _old_database(url: str) -> str:
    """A database at revision 0005 holding one linear conversation (OLD) and an empty one."""
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            command.upgrade(migrations.config(connection=conn), "0005")
        conv = uuid.uuid4().hex
        tok = b"".join(t.to_bytes(4, "little") for t in OLD_TOKENS)
        with engine.begin() as conn:
            for cid, tokens in ((conv, tok), (uuid.uuid4().hex, b"")):
                conn.execute(
                    text(
                        "INSERT INTO conversations (id, tenant, owner, title, model, system_prompt, params, "
                        "token_ids, token_count, created_at, updated_at, archived) VALUES (:id, '', 'local', "
                        "'old', 'm', 'sys', '{}', :tok, :n, :now, :now, false)"
                    ),
                    {"id": cid, "tok": tokens, "n": len(tokens) // 4, "now": NOW},
                )
            for role, content in OLD:
                conn.execute(
                    text(
                        "INSERT INTO messages (conversation_id, role, content, created_at, status) "
                        "VALUES (:c, :r, :t, :now, 'complete')"
                    ),
                    {"c": conv, "r": role, "t": content, "now": NOW},
                )
        return conv
    finally:
        engine.dispose()


def test_0006_turns_a_linear_history_into_a_parent_chain(url, tmp_path):
    conv = _old_database(url)
    with Store.open(url, data_dir=tmp_path) as s:
        assert s.migrated and migrations.current_revisions(s.engine) == {migrations.HEAD}  # 0006, then those after it
        msgs = s.messages(conv)
        assert [(m.role, m.content) for m in msgs] == OLD and all(m.intact for m in msgs)
        assert [m.parent_id for m in msgs] == [None] + [m.id for m in msgs[:-1]]
        info = s.get_conversation(conv)
        assert info.current_leaf_id == msgs[-1].id and list(info.token_ids) == OLD_TOKENS
        assert s.message_tree(conv) == msgs
        # the old history is kept when a branch leaves it: edit the second question...
        q2 = msgs[2]
        edited = s.add_message(conv, "user", "Tell me a fact", parent_id=q2.parent_id, token_ids=OLD_TOKENS[:20] + [99])
        assert [m.id for m in s.branches(conv, q2.id)] == [q2.id, edited.id]
        assert [m.content for m in s.messages(conv)] == ["Hello there", "Hi! How can I help?", "Tell me a fact"]
        # ...and switching back gives the old branch its exact tokens, with no tokenizer in sight
        leaf = s.switch_branch(conv, q2.id)
        assert leaf.id == msgs[-1].id and list(s.get_conversation(conv).token_ids) == OLD_TOKENS
        assert [(m.role, m.content) for m in s.messages(conv)] == OLD
        assert len(s.message_tree(conv)) == len(OLD) + 1  # nothing deleted


def test_0006_downgrades_to_0005(tmp_path):
    url = f"sqlite:///{tmp_path / DB_FILENAME}"
    conv = _old_database(url)
    with Store.open(url, data_dir=tmp_path) as s:
        s.add_message(conv, "user", "a branch", parent_id=None, token_ids=[7])
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            command.downgrade(migrations.config(connection=conn), "0005")
            cols = {r[1] for r in conn.execute(text("PRAGMA table_info(messages)"))}
            assert not cols & {"parent_id", "token_base", "token_tail", "context"}
            # every message of every branch is still there, as one flat list
            assert (
                conn.execute(text("SELECT count(*) FROM messages WHERE conversation_id = :c"), {"c": conv}).scalar()
                == 5
            )
    finally:
        engine.dispose()


def _turn(s: Store, conv: str, history: list[int], question: str, parent=...) -> tuple[list[int], list[int]]:
    """One turn: the user message (its history: the template's tokens appended) and the reply."""
    asked = history + [len(question)] * 3
    kw = {} if parent is ... else {"parent_id": parent}
    u = s.add_message(conv, "user", question, token_ids=asked, context={"turns": len(asked)}, **kw)
    answered = asked + [7, 8]
    a = s.add_message(conv, "assistant", f"re: {question}", token_ids=answered, context={"turns": len(answered)})
    return answered, [u.id, a.id]


def test_branches_edit_regenerate_and_switch(url, tmp_path):
    with Store.open(url, data_dir=tmp_path) as s:
        conv = s.create_conversation("t", "m", "", {}).id
        h, ids1 = _turn(s, conv, [1, 2], "first")
        h2, ids2 = _turn(s, conv, h, "second")
        # regenerate the second reply: a sibling of it, under the same question
        again = s.add_message(conv, "assistant", "another take", parent_id=ids2[0], token_ids=h2[:-2] + [5, 5, 5])
        assert [m.id for m in s.branches(conv, ids2[1])] == [ids2[1], again.id]
        assert [m.content for m in s.messages(conv)][-1] == "another take"
        assert list(s.get_conversation(conv).token_ids) == h2[:-2] + [5, 5, 5]
        # edit the first question: a new root branch, history from the system prefix on
        h3, ids3 = _turn(s, conv, [1, 2], "first, edited", parent=None)
        assert [m.content for m in s.messages(conv)] == ["first, edited", "re: first, edited"]
        assert [m.id for m in s.branches(conv, ids1[0])] == [ids1[0], ids3[0]]
        # switching to the old first question goes down to its most recent leaf (the regenerated reply)
        assert s.switch_branch(conv, ids1[0]).id == again.id
        info = s.get_conversation(conv)
        assert list(info.token_ids) == h2[:-2] + [5, 5, 5] and info.current_leaf_id == again.id
        assert s.switch_branch(conv, ids2[1]).id == ids2[1]
        info = s.get_conversation(conv)
        assert list(info.token_ids) == h2 and info.context == {"turns": len(h2)}
        assert [m.id for m in s.messages(conv)] == ids1 + ids2
        assert len(s.message_tree(conv)) == 7
        # a turn on the switched-to branch appends to it
        h4, ids4 = _turn(s, conv, h2, "third")
        assert [m.id for m in s.messages(conv)] == ids1 + ids2 + ids4
        assert s.switch_branch(conv, ids3[1]).id == ids3[1] and list(s.get_conversation(conv).token_ids) == h3
        # without descending: the branch ends at that message, and the next one follows it
        assert s.switch_branch(conv, ids1[1], descend=False).id == ids1[1]
        assert list(s.get_conversation(conv).token_ids) == h and [m.id for m in s.messages(conv)] == ids1
        h5, ids5 = _turn(s, conv, h, "second, again")
        assert [m.id for m in s.branches(conv, ids2[0])] == [ids2[0], ids5[0]]


def test_a_window_that_dropped_turns_is_recorded_and_replayed(tmp_path):
    """A history that is not an append (a context window dropped old turns) is kept as the
    common prefix plus its own tail, and replays exactly."""
    with Store.open(data_dir=tmp_path) as s:
        conv = s.create_conversation("t", "m", "", {}).id
        s.add_message(conv, "user", "a", token_ids=list(range(100)))
        s.add_message(conv, "assistant", "b", token_ids=list(range(110)))
        dropped = list(range(10)) + list(range(60, 110)) + [500, 501]
        q = s.add_message(conv, "user", "c", token_ids=dropped)
        s.add_message(conv, "assistant", "d", token_ids=dropped + [9])
        first = s.messages(conv)[0]
        s.add_message(conv, "user", "a2", parent_id=None, token_ids=[3])
        assert s.switch_branch(conv, first.id).parent_id == q.id
        assert list(s.get_conversation(conv).token_ids) == dropped + [9]


def test_bad_ids_give_a_clear_error_and_change_nothing(url, tmp_path):
    with Store.open(url, data_dir=tmp_path) as s:
        a = s.create_conversation("a", "m", "", {}).id
        b = s.create_conversation("b", "m", "", {}).id
        _, ids_a = _turn(s, a, [1], "in a")
        _, ids_b = _turn(s, b, [1], "in b")
        before = (s.message_tree(a), s.get_conversation(a))
        for bad in (ids_b[0], 10**9, -1):
            for call in (
                lambda: s.switch_branch(a, bad),
                lambda: s.branches(a, bad),
                lambda: s.add_message(a, "user", "x", parent_id=bad),
            ):
                with pytest.raises(InvalidRequest, match=f"message {bad} is not a message of conversation {a}"):
                    call()
        for bad in ("1", True, 1.0, None):
            with pytest.raises(InvalidRequest, match="a message id must be an int"):
                s.switch_branch(a, bad)
        with pytest.raises(SessionError, match="unknown conversation"):
            s.switch_branch("0" * 32, ids_a[0])
        assert (s.message_tree(a), s.get_conversation(a)) == before


def test_a_switch_is_fenced_by_the_lease(url, tmp_path):
    with Store.open(url, data_dir=tmp_path) as a, Store.open(url, data_dir=tmp_path) as b:
        conv = a.create_conversation("t", "m", "", {}).id
        _, ids = _turn(a, conv, [1], "q")
        a.add_message(conv, "user", "q2", parent_id=None, token_ids=[2])
        a.leases.acquire(conv)
        with pytest.raises(ConversationBusy):
            b.switch_branch(conv, ids[0])
        assert b.get_conversation(conv).current_leaf_id != ids[1]
        a.leases.release(conv)
        assert b.switch_branch(conv, ids[0]).id == ids[1]


def test_delta_and_history_replay_any_chain_of_histories():
    rng = random.Random(0)
    for _ in range(200):
        nodes, hist, parent = {}, [], None
        for i in range(1, rng.randint(2, 12)):
            if rng.random() < 0.2:  # carries no history: the parent's holds
                nodes[i] = tree.Node(i, parent)
            else:
                keep = hist[: rng.randint(0, len(hist))] if rng.random() < 0.3 else hist
                new = keep + [rng.randrange(50) for _ in range(rng.randint(0, 6))]
                base, tail = tree.delta(tree.history(tree.chain(nodes, parent))[0] or [] if parent else [], new)
                nodes[i] = tree.Node(i, parent, base, tail, {"n": len(new)})
                hist = new
            parent = i
        tokens, _ = tree.history(tree.chain(nodes, parent))
        assert (tokens or []) == hist


def test_a_damaged_parent_cycle_ends_the_walk():
    nodes = {1: tree.Node(1, 2), 2: tree.Node(2, 1)}
    assert [n.id for n in tree.chain(nodes, 1)] == [2, 1]
    assert tree.newest_leaf(nodes, 1) == 2


# -- search across conversations (FTS5 on SQLite, LIKE on PostgreSQL) ---------------------------------------


def test_search_finds_messages_of_every_branch_of_the_owners_conversations_only(url, tmp_path):
    with Store.open(url, data_dir=tmp_path) as s:
        a = s.create_conversation("cooking", "m", "", {}).id
        b = s.create_conversation("caches", "m", "", {}).id
        other = s.create_conversation("alice's", "m", "", {}, owner="alice").id
        s.add_message(a, "user", "How long should I boil an egg?")
        s.add_message(a, "assistant", "About seven minutes for a firm yolk.")
        q = s.add_message(b, "user", "Why does the KV cache make turn 20 cheap?")
        s.add_message(b, "assistant", "Because the history's attention state is kept.")
        edited = s.add_message(b, "user", "Explain paged KV blocks", parent_id=q.parent_id)
        s.add_message(other, "user", "my KV cache notes")
        hits = s.search("kv cache")
        assert {h.message.id for h in hits} == {q.id, edited.id}  # both branches; not alice's
        assert all(h.conversation_id == b and h.title == "caches" for h in hits)
        assert "KV" in hits[0].snippet
        assert [h.message.content for h in s.search("boil EGG")] == ["How long should I boil an egg?"]
        assert [h.conversation_id for h in s.search("kv", owner="alice")] == [other]
        assert s.search("nothing like this anywhere") == [] and s.search("   ") == []
        if url.startswith("sqlite"):  # BM25 over stems: another form of the word matches
            assert [h.message.id for h in s.search("caching")] == [q.id]
        s.delete_conversation(b)
        assert s.search("kv cache") == []


def test_search_reads_nothing_typed_as_query_syntax(url, tmp_path):
    with Store.open(url, data_dir=tmp_path) as s:
        c = s.create_conversation("t", "m", "", {}).id
        m = s.add_message(c, "user", '100% sure that a_b is not a*b (or NEAR) "quoted"')
        for hostile in ['"', "*", "a*b", "NEAR(", "content:x", "100%", "a_b", "')--", "\\", "(or NEAR)", "\x00"]:
            hits = s.search(hostile)
            assert all(h.message.id == m.id for h in hits), hostile
        assert [h.message.id for h in s.search("100%")] == [m.id]
        assert s.search("%") == [] and s.search("_") == []  # no word: nothing, never "match everything"
        for bad in (0, -1, 10**6, True, "5"):
            with pytest.raises(InvalidRequest, match="limit must be"):
                s.search("x", limit=bad)
        with pytest.raises(InvalidRequest, match="query is"):
            s.search("x" * 10_001)


def test_0006_indexes_the_messages_already_there(tmp_path):
    url = f"sqlite:///{tmp_path / DB_FILENAME}"
    conv = _old_database(url)
    with Store.open(url, data_dir=tmp_path) as s:
        assert [h.message.content for h in s.search("joke")] == ["Tell me a joke"]
        assert {h.conversation_id for h in s.search("evicted cache")} == {conv}


def test_a_switch_before_the_first_message_starts_a_new_root(tmp_path):
    with Store.open(data_dir=tmp_path) as s:
        conv = s.create_conversation("t", "m", "", {}).id
        _, ids = _turn(s, conv, [1, 2], "first")
        assert s.switch_branch(conv, None, descend=False) is None
        info = s.get_conversation(conv)
        assert info.current_leaf_id is None and info.token_ids == () and s.messages(conv) == []
        root2 = s.add_message(conv, "user", "another first", token_ids=[1, 2, 3])
        assert root2.parent_id is None and [m.id for m in s.branches(conv, ids[0])] == [ids[0], root2.id]
        assert s.switch_branch(conv, ids[0]).id == ids[1] and [m.id for m in s.messages(conv)] == ids
        with pytest.raises(InvalidRequest, match="a message id must be an int"):
            s.switch_branch(conv, None)  # descending from nothing is no branch
        assert s.get_message(conv, ids[1]).role == "assistant"
        with pytest.raises(InvalidRequest, match=f"message 999 is not a message of conversation {conv}"):
            s.get_message(conv, 999)
