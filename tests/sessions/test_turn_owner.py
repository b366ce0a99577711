"""One turn, one owner: who holds a turn's KV at every moment, and who frees memory.

- a finishing request hands its retained KV to its session on the thread that steps, through
  the callback the scheduler calls at finish: by the time anything else on the loop thread
  sees the request finished, the session holds its KV (there is no KV "in transit");
- every field the engine sets on a Sequence is declared;
- memory pressure is a result of a scheduling pass ("needs N blocks"), resolved by the engine
  between two passes, never from inside the KV manager's ``reserve``;
- a user message that cannot be stored after its request already finished leaves the session
  as it was, with no KV leaked;
- ``store.leases.hold`` holds a conversation's lease around a block and gives it back after it.
"""

from __future__ import annotations

import dataclasses
import threading
import traceback

import pytest

from chatkv.config import EngineConfig
from chatkv.engine.core import Engine
from chatkv.engine.sequence import Sequence
from chatkv.sessions.manager import SessionManager

pytestmark = pytest.mark.tiny_model("llama", seed=7)

GREEDY = dict(max_tokens=6, temperature=0.0)
TEXTS = [
    "The quick brown fox jumps over the lazy dog while the cat watches from the window sill. " * 2,
    "Paris is the capital of France and Berlin is the capital of Germany, said the teacher. " * 2,
    "Seven ships sailed past the harbour lights before the storm reached the rocky coast. " * 2,
]


def test_a_finished_turn_hands_its_kv_to_the_session_on_the_loop_thread(model_dir, tmp_path):
    e = Engine(model_dir, EngineConfig(data_dir=str(tmp_path), num_blocks=128)).start()
    s = e.session(params=GREEDY)
    seen = []

    def at_finish(result, seq):  # the loop thread, right after the step that finished the request
        if seq.retain:
            seen.append(
                (
                    threading.current_thread().name,
                    s.kept is not None,
                    s.busy,
                    seq.retained is None,
                    s.tokens[: len(seq.token_ids)] == seq.token_ids,
                )
            )

    e.add_finish_listener(at_finish)
    s.send(TEXTS[0])
    s.send("And again?")
    assert seen == [("chatkv-engine", True, False, True, True)] * 2  # the session holds it already
    e.check_integrity()
    e.close()


def test_the_scheduler_keeps_no_hand_over_state_and_sequences_declare_their_fields(model_dir, tmp_path):
    e = Engine(model_dir, EngineConfig(data_dir=str(tmp_path), num_blocks=128)).start()
    assert not hasattr(e.scheduler, "_handing_over") and not hasattr(e.scheduler, "can_wait")
    declared = {f.name for f in dataclasses.fields(Sequence)}
    assert {"stream", "priority", "passed_over", "on_finish", "namespace"} <= declared
    seqs = []
    e.add_finish_listener(lambda result, seq: seqs.append(seq))
    e.generate(["one prompt", "two prompts"], None)
    s = e.session(params=GREEDY)
    s.send(TEXTS[1])
    assert len(seqs) == 3
    for seq in seqs:
        assert set(vars(seq)) == declared, set(vars(seq)) ^ declared  # nothing set ad hoc
    e.close()


@pytest.mark.parametrize("started", [False, True], ids=["inline", "loop"])
def test_memory_pressure_is_resolved_between_scheduling_passes_not_inside_reserve(
    model_dir, tmp_path, monkeypatch, started
):
    e = Engine(model_dir, EngineConfig(data_dir=str(tmp_path), num_blocks=24, block_size=8))
    if started:
        e.start()
    stacks = []
    real = SessionManager.relieve

    def relieve(self, missing):
        stacks.append([f.name for f in traceback.extract_stack()])
        return real(self, missing)

    monkeypatch.setattr(SessionManager, "relieve", relieve)
    sessions = [e.session(params=GREEDY) for _ in TEXTS]
    replies = [s.send(t) for s, t in zip(sessions, TEXTS)]  # they cannot all stay resident
    assert all(r.text for r in replies)
    assert any(s.kept is None for s in sessions), "an idle session was spilled to make room"
    from_steps = [st for st in stacks if "_schedule" in st]
    assert from_steps, "the engine's scheduling asked for room"
    for st in from_steps:
        assert "reserve" not in st and "make_room" not in st, st  # between passes, not from inside the KV manager
    assert e.kv.on_pressure is None  # no hook left installed
    again = sessions[0].send("And again?")  # restored from disk
    assert again.usage.restored_tokens > 0
    e.check_integrity()
    e.close()


def test_a_user_message_not_stored_after_its_request_finished_leaves_the_session_as_it_was(model_dir, tmp_path):
    e = Engine(model_dir, EngineConfig(data_dir=str(tmp_path), num_blocks=128)).start()
    s = e.session(params=GREEDY)
    s.send(TEXTS[2])
    before_tokens, before_msgs = list(s.tokens), len(s.messages())
    finished = threading.Event()
    e.add_finish_listener(lambda result, seq: finished.set())
    store = e.session_manager.store
    real_add = store.add_message

    def add_message(conv_id, role, *a, **kw):
        if role == "user":
            assert finished.wait(30), "the request never finished"  # it finished before its user message
            raise OSError(28, "No space left on device")
        return real_add(conv_id, role, *a, **kw)

    store.add_message = add_message
    with pytest.raises(OSError):
        s.send("This one is not stored.")
    store.add_message = real_add
    assert s.tokens == before_tokens and not s.busy
    assert len(s.messages()) == before_msgs
    assert e.kv_stats()["retained"] == sum(x is not None for x in e.session_manager.held_kv())  # nothing leaked
    e.check_integrity()
    r = s.send("And now?")
    assert r.text is not None and len(s.messages()) == before_msgs + 2
    e.check_integrity()
    e.close()


def test_a_request_that_finishes_before_its_user_message_is_stored_names_the_chat_and_keeps_the_history(
    model_dir, tmp_path
):
    e = Engine(model_dir, EngineConfig(data_dir=str(tmp_path), num_blocks=128)).start()
    s = e.session(params=GREEDY)
    finished = threading.Event()
    e.add_finish_listener(lambda result, seq: finished.set())
    store = e.session_manager.store
    real_add = store.add_message

    def add_message(conv_id, role, *a, **kw):
        if role == "user":
            assert finished.wait(30), "the request never finished"
        return real_add(conv_id, role, *a, **kw)

    store.add_message = add_message
    r = s.send("Name this chat after me")
    store.add_message = real_add
    assert s.title == "Name this chat after me" and store.get_conversation(s.id).title == s.title
    assert s.tokens == list(store.get_conversation(s.id).token_ids)  # the history with the reply, as stored
    assert r.usage.generated_tokens > 0 and len(s.tokens) > r.usage.prompt_tokens + r.usage.generated_tokens - 1
    assert s.kept is not None and s.kept.kv_len <= len(s.tokens) and not s.busy
    e.check_integrity()
    e.close()


def test_a_lease_is_held_around_a_block_and_given_back_after_it(model_dir, tmp_path):
    e = Engine(model_dir, EngineConfig(data_dir=str(tmp_path), num_blocks=64))
    s = e.session(params=GREEDY)
    leases = e.session_manager.store.leases
    with leases.hold(s.id) as held:
        assert leases.holds(s.id) and held.mark.token_count == 0 and held.released is None
        e.session_manager.store.add_message(s.id, "user", "hello", token_ids=[1, 2, 3])
    assert not leases.holds(s.id) and held.released is not None and held.released.token_count == 3
    assert held.released.last_role == "user" and held.released != held.mark
    with pytest.raises(RuntimeError):
        with leases.hold(s.id):
            raise RuntimeError("the work failed")
    assert not leases.holds(s.id)  # given back all the same
    e.close()
