"""Conversations as trees through the SDK: regenerate, edit, switch, branches, tree.

The oracle for every reply is transformers' greedy generate on the branch's own prompt tokens
(the session's history after the turn). A real engine on a small random llama, a real SQLite
store, real snapshots; a restart is a new Engine on the same data directory.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from chatkv import ConversationBusy, InvalidRequest, SessionError
from chatkv.config import EngineConfig
from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams
from chatkv.storage.repository import Store
from tests.support.tiny import make_model

GREEDY = dict(max_tokens=6, temperature=0.0)
SYSTEM = "You are a helpful assistant."
QUESTIONS = ["Hello, how are you today?", "What is the capital of France?", "Key-value caches keep attention state."]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    # big enough that the reply depends on the history (as in test_sessions)
    return make_model(
        d,
        "llama",
        seed=7,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
    ), d


def engine_at(model_dir, data_dir, **kw) -> Engine:
    kw.setdefault("num_blocks", 256)
    return Engine(model_dir, EngineConfig(data_dir=str(data_dir), **kw))


def hf_greedy(ref, ids: list[int], n: int) -> list[int]:
    out = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=2, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def check(ref, s, reply) -> None:
    """The reply is what transformers generates greedily from the branch's prompt."""
    prompt = s.tokens[: reply.usage.prompt_tokens]
    got = s.tokens[reply.usage.prompt_tokens : reply.usage.prompt_tokens + reply.usage.generated_tokens]
    assert got and got == hf_greedy(ref, prompt, GREEDY["max_tokens"])[: len(got)]


def chat(e: Engine):
    s = e.session(system=SYSTEM, params=GREEDY)
    return s, [s.send(q) for q in QUESTIONS]


def test_regenerate_answers_the_last_question_again_reusing_the_history(model, tmp_path):
    ref, d = model
    with engine_at(d, tmp_path) as e:
        s, replies = chat(e)
        before = s.tokens[: replies[-1].usage.prompt_tokens]
        again = s.regenerate()
        check(ref, s, again)
        assert again.text == replies[-1].text  # greedy: the same answer, as a new message
        assert s.tokens[: again.usage.prompt_tokens] == before and again.usage.prompt_tokens == len(before)
        # the history's KV is reused: at most the last partial block and the last token are computed
        assert again.usage.computed_tokens <= e.kv.block_size
        assert (
            again.usage.cached_tokens + again.usage.restored_tokens
            == again.usage.prompt_tokens - again.usage.computed_tokens
        )
        assert [m.id for m in s.branches(replies[-1].message_id)] == [replies[-1].message_id, again.message_id]
        assert [m.role for m in s.messages()] == ["user", "assistant"] * 3 and s.messages()[-1].id == again.message_id
        assert len(s.tree()) == 7  # nothing deleted
        # sampling: another answer, still a sibling; the next turn follows it
        other = s.regenerate(SamplingParams(max_tokens=6, temperature=1.5, seed=3))
        assert len(s.branches(replies[-1].message_id)) == 3
        nxt = s.send("And then?")
        check(ref, s, nxt)
        assert s.messages()[-3].id == other.message_id


def test_edit_computes_only_from_the_edited_message_on(model, tmp_path):
    ref, d = model
    with engine_at(d, tmp_path) as e:
        s, replies = chat(e)
        msgs = s.messages()
        q2 = msgs[2]
        start_of_q2 = replies[0].usage.prompt_tokens + replies[0].usage.generated_tokens  # history before message 2
        r = s.edit(q2.id, "What is the capital of Italy?")
        check(ref, s, r)
        assert r.usage.computed_tokens <= r.usage.prompt_tokens - start_of_q2 + e.kv.block_size
        now = s.messages()
        assert [m.content for m in now[:3]] == [QUESTIONS[0], msgs[1].content, "What is the capital of Italy?"]
        assert len(now) == 4 and [m.id for m in s.branches(q2.id)] == [q2.id, now[2].id]
        # the first message edited: a new root, the system prompt kept
        r0 = s.edit(msgs[0].id, "Good evening!")
        check(ref, s, r0)
        assert [m.content for m in s.messages()] == ["Good evening!", r0.text]
        assert len(s.branches(msgs[0].id)) == 2 and len(s.tree()) == 10


def test_switch_brings_a_branch_back_in_memory_and_after_a_restart(model, tmp_path):
    ref, d = model
    with engine_at(d, tmp_path) as e:
        s, replies = chat(e)
        old_tokens = list(s.tokens)
        q2 = s.messages()[2]
        edited = s.edit(q2.id, "What is the capital of Italy?")
        leaf = s.switch(q2.id)
        assert leaf.id == replies[-1].message_id and s.tokens == old_tokens  # the recorded history, not re-tokenised
        r = s.send("Thanks!")
        check(ref, s, r)
        assert r.usage.computed_tokens <= r.usage.prompt_tokens - len(old_tokens) + e.kv.block_size  # KV still cached
        sid, italy = s.id, s.branches(q2.id)[1].id
    e2 = engine_at(d, tmp_path)  # a restart
    try:
        s2 = e2.resume(sid)
        assert s2.messages()[-1].id == r.message_id
        s2.switch(italy)
        assert [m.content for m in s2.messages()][2] == "What is the capital of Italy?"
        r2 = s2.send("Is it far?")
        check(ref, s2, r2)
        # the branch left before the restart kept its KV on disk beside the other's (shared prefix
        # files): all of its KV comes back (a turn's last generated token has none), nothing recomputed
        assert r2.usage.restored_tokens == edited.usage.prompt_tokens + edited.usage.generated_tokens - 1
        assert r2.usage.cached_tokens + r2.usage.restored_tokens + r2.usage.computed_tokens == r2.usage.prompt_tokens
    finally:
        e2.close()


def test_branch_calls_reject_bad_ids_and_change_nothing(model, tmp_path):
    _, d = model
    with engine_at(d, tmp_path) as e:
        s, replies = chat(e)
        other, _ = chat(e)
        before = (s.tree(), list(s.tokens))
        with pytest.raises(InvalidRequest, match="only a user message can be edited"):
            s.edit(replies[0].message_id, "x")
        foreign = other.messages()[0].id
        for call in (
            lambda: s.edit(foreign, "x"),
            lambda: s.switch(foreign),
            lambda: s.branches(foreign),
            lambda: s.edit(10**9, "x"),
        ):
            with pytest.raises(InvalidRequest, match=f"is not a message of conversation {s.id}"):
                call()
        for bad in ("1", None, 2.0, True):
            with pytest.raises(InvalidRequest, match="a message id must be an int"):
                s.switch(bad)
        with pytest.raises(InvalidRequest, match="message is empty"):
            s.edit(s.messages()[0].id, "   ")
        assert (s.tree(), list(s.tokens)) == before
        empty = e.session()
        with pytest.raises(InvalidRequest, match="nothing to regenerate"):
            empty.regenerate()
        assert empty.tree() == []


def test_a_branch_turn_that_fails_goes_back_to_the_branch_it_left(model, tmp_path):
    _, d = model
    with engine_at(d, tmp_path, context_window=512, overflow="error") as e:
        s, replies = chat(e)
        before = (s.messages(), list(s.tokens))
        q2 = s.messages()[2]
        with pytest.raises(Exception) as err:
            s.edit(q2.id, "word " * 2000)  # does not fit the window: refused before anything is stored
        assert "context" in str(err.value).lower()
        assert (s.messages(), list(s.tokens)) == before
        assert s.send("Still here?").finish_reason in ("stop", "length")


def test_a_branch_op_racing_another_process_is_refused(model, tmp_path):
    _, d = model
    with engine_at(d, tmp_path) as e:
        s, replies = chat(e)
        q2 = s.messages()[2]
        with Store.open(data_dir=tmp_path) as other:  # another process's store holds the lease
            other.leases.acquire(s.id)
            before = s.tree()
            for call in (lambda: s.switch(q2.id), lambda: s.edit(q2.id, "x"), lambda: s.regenerate()):
                with pytest.raises(ConversationBusy):
                    call()
            assert s.tree() == before
            other.leases.release(s.id)
        assert s.regenerate().text == replies[-1].text


def test_async_forms_and_a_busy_session(model, tmp_path):
    ref, d = model
    with engine_at(d, tmp_path) as e:
        s, replies = chat(e)

        async def go():
            a = await s.aregenerate()
            b = await s.aedit(s.messages()[0].id, "Hi!")
            return a, b

        a, b = asyncio.run(go())
        assert a.text == replies[-1].text
        check(ref, s, b)
        g = s.stream("One more?")
        next(g)
        with pytest.raises(SessionError, match="already generating"):
            s.regenerate()
        with pytest.raises(SessionError, match="generating a reply"):
            s.switch(s.messages()[0].id)
        g.close()


def test_export_writes_the_current_branch_or_the_whole_tree(model, tmp_path):
    _, d = model
    with engine_at(d, tmp_path) as e:
        s, replies = chat(e)
        q2 = s.messages()[2]
        s.edit(q2.id, "What is the capital of Italy?")
        md = s.export("markdown")
        assert "capital of Italy" in md and "capital of France" not in md
        tree_md = s.export("markdown", tree=True)
        assert "capital of Italy" in tree_md and "capital of France" in tree_md and f"#{q2.id}" in tree_md
        data = json.loads(s.export("json", tree=True))
        assert len(data["messages"]) == 8 and {m["parent_id"] for m in data["messages"]} >= {None, q2.parent_id}
        assert len(json.loads(s.export("json"))["messages"]) == 4


def test_engine_search_finds_a_message_on_another_branch_and_switch_opens_it(model, tmp_path):
    _, d = model
    with engine_at(d, tmp_path) as e:
        s, replies = chat(e)
        q2 = s.messages()[2]
        s.edit(q2.id, "What is the capital of Italy?")
        hits = e.search("capital France")
        assert [h.message.id for h in hits][:1] == [q2.id] and hits[0].conversation_id == s.id
        assert "France" in hits[0].snippet and e.search("capital", user="alice") == []
        s.switch(hits[0].message.id)
        assert s.messages()[2].id == q2.id
        with pytest.raises(InvalidRequest, match="limit must be"):
            e.search("x", limit=0)
