"""OpenAI's Responses API on ``chatkv serve``, driven by the official
``openai`` client's ``client.responses`` methods over loopback.

A stored response is a node of a conversation tree: chaining with ``previous_response_id``
continues it, two requests naming the same response make two branches, and every reply equals
the SDK's own session's reply on the same history (greedy). Also: retrieve and delete, the
stream's events in OpenAI's order, ``store=false``, another user's ids (unknown in the very
words of an id never used), a busy conversation, OpenAI-shaped 400s naming the field, and a
chain across a restart of ``chatkv serve`` (its own process) whose fourth turn finds at least
80% of its input cached (restored from disk).

One tiny random llama (tests/support/tiny.py) on one started engine for the in-process server
(uvicorn in a thread, tests/support/serving.py); the restart test runs ``chatkv serve`` twice.
"""

from __future__ import annotations

import json
import signal
import time
import uuid

import openai
import pytest

from chatkv.engine.sampling import SamplingParams
from chatkv.server import create_app
from chatkv.server.guards import Users
from tests.support.serving import BLOCK, MODEL, Running, engine, raw, serve_process, tiny_model  # noqa: F401 - fixtures

KEYS = {"alice": "ka-" + "3" * 24, "bob": "kb-" + "4" * 24}
SYSTEM = "You are a terse assistant. " + "Answer with care and keep to the facts you know. " * 12
GREEDY = dict(temperature=0, max_output_tokens=8)


@pytest.fixture(scope="module")
def server(engine):
    run = Running(create_app(engine, model_name=MODEL, users=Users({k: n for n, k in KEYS.items()})))
    yield run
    run.stop()


def client_of(url: str, who: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEYS[who], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def alice(server):
    return client_of(server.url, "alice")


@pytest.fixture(scope="module")
def bob(server):
    return client_of(server.url, "bob")


def sdk_replies(engine, questions: list[str], system: str | None = SYSTEM, max_tokens: int = 8) -> list[str]:
    """The SDK's own session's greedy replies to ``questions``, one turn each."""
    s = engine.session(system=system)
    try:
        return [s.send(q, SamplingParams(max_tokens=max_tokens, temperature=0)).text for q in questions]
    finally:
        s.delete()


def conv_of(response_id: str) -> str:
    return response_id.split("_")[1]


# ------------------------------------------------------------------ create, chain, retrieve


def test_create_is_a_stored_turn_equal_to_the_sdks(engine, alice):
    r = alice.responses.create(model=MODEL, instructions=SYSTEM, input="What is the capital of France?", **GREEDY)
    assert r.object == "response" and r.model == MODEL and r.status in ("completed", "incomplete")
    assert r.id.startswith("resp_") and r.store is True and r.previous_response_id is None
    assert r.instructions == SYSTEM
    assert r.output_text == sdk_replies(engine, ["What is the capital of France?"])[0]
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    u = r.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and 0 < u.output_tokens <= 8
    split = u.model_extra["chatkv"]
    assert (
        u.input_tokens_details.cached_tokens == split["cached_tokens"] + split["host_tokens"] + split["restored_tokens"]
    )
    got = alice.responses.retrieve(r.id)
    assert (got.id, got.output_text, got.instructions, got.previous_response_id) == (r.id, r.output_text, SYSTEM, None)
    assert abs(got.created_at - r.created_at) <= 1 and abs(got.created_at - time.time()) < 600
    assert got.usage.input_tokens == u.input_tokens and got.usage.output_tokens == u.output_tokens
    # a list of message items with input_text parts, and a developer message as the instructions, is the same turn
    items = [
        {"role": "developer", "content": SYSTEM},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "What is the capital of France?"}],
        },
    ]
    again = alice.responses.create(model=MODEL, input=items, **GREEDY)
    assert again.output_text == r.output_text and conv_of(again.id) != conv_of(r.id)


def test_a_chain_is_one_conversation_whose_history_stays_cached(engine, alice):
    questions = ["Name a prime number.", "And another one?", "Which is larger?"]
    chain = [alice.responses.create(model=MODEL, instructions=SYSTEM, input=questions[0], **GREEDY)]
    for q in questions[1:]:
        chain.append(alice.responses.create(model=MODEL, input=q, previous_response_id=chain[-1].id, **GREEDY))
    assert [r.output_text for r in chain] == sdk_replies(engine, questions)
    assert len({conv_of(r.id) for r in chain}) == 1
    assert [r.previous_response_id for r in chain] == [None, chain[0].id, chain[1].id]
    for before, r in zip(chain, chain[1:]):  # the history's KV stayed in memory between the requests
        history = before.usage.input_tokens + before.usage.output_tokens
        assert r.usage.input_tokens_details.cached_tokens >= history - BLOCK, (r.usage, history)
    got = alice.responses.retrieve(chain[2].id)
    assert got.previous_response_id == chain[1].id and got.output_text == chain[2].output_text
    stored = [(m.role, m.content) for m in engine.resume(conv_of(chain[0].id), user="alice").messages()]
    assert stored == [x for q, r in zip(questions, chain) for x in (("user", q), ("assistant", r.output_text))]


def test_two_responses_to_one_previous_response_are_two_branches(engine, alice):
    root = alice.responses.create(model=MODEL, instructions=SYSTEM, input="Pick a colour.", **GREEDY)
    a = alice.responses.create(model=MODEL, input="Why that one?", previous_response_id=root.id, **GREEDY)
    b = alice.responses.create(model=MODEL, input="Pick another.", previous_response_id=root.id, **GREEDY)
    assert conv_of(a.id) == conv_of(b.id) == conv_of(root.id) and len({a.id, b.id, root.id}) == 3
    assert a.output_text == sdk_replies(engine, ["Pick a colour.", "Why that one?"])[1]
    assert b.output_text == sdk_replies(engine, ["Pick a colour.", "Pick another."])[1]
    # the branch shares the root's KV: only its own question is computed
    history = root.usage.input_tokens + root.usage.output_tokens
    assert b.usage.input_tokens_details.cached_tokens >= history - BLOCK, b.usage
    # back to the first branch, one level deeper: its own history, not the other's
    a2 = alice.responses.create(model=MODEL, input="Say it again.", previous_response_id=a.id, **GREEDY)
    assert a2.output_text == sdk_replies(engine, ["Pick a colour.", "Why that one?", "Say it again."])[2]
    assert alice.responses.retrieve(b.id).output_text == b.output_text  # a branch off the current one is still there
    assert alice.responses.retrieve(a2.id).previous_response_id == a.id
    s = engine.resume(conv_of(root.id), user="alice")
    assert [m.content for m in s.messages()][-2:] == ["Say it again.", a2.output_text]
    assert len(s.tree()) == 8  # nothing was deleted by branching


# ------------------------------------------------------------------ stream


ORDER = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def test_a_stream_has_openais_events_in_order(alice):
    plain = alice.responses.create(model=MODEL, instructions=SYSTEM, input="Tell me about key-value caches.", **GREEDY)
    events = list(
        alice.responses.create(
            model=MODEL, instructions=SYSTEM, input="Tell me about key-value caches.", stream=True, **GREEDY
        )
    )
    types = [e.type for e in events]
    n = types.count("response.output_text.delta")
    assert n >= 1 and types == ORDER + ["response.output_text.delta"] * n + CLOSING + [types[-1]]
    assert types[-1] == ("response.completed" if plain.status == "completed" else "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert text == plain.output_text == done.output_text == events[len(ORDER) + n].text
    assert events[0].response.id == done.id and events[0].response.status == "in_progress"
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")} | {events[2].item.id, events[-2].item.id}
    assert len(item_ids) == 1
    assert done.usage.output_tokens == plain.usage.output_tokens and done.usage.input_tokens == plain.usage.input_tokens
    assert alice.responses.retrieve(done.id).output_text == text  # a streamed response is stored too
    # the client's own stream helper accumulates the events into the same response (its last event's: a
    # reply cut by max_output_tokens ends with response.incomplete, which get_final_response() refuses)
    with alice.responses.stream(
        model=MODEL, instructions=SYSTEM, input="Tell me about key-value caches.", **GREEDY
    ) as helper:
        last = list(helper)[-1]
    assert last.type == types[-1] and last.response.output_text == text
    assert last.response.usage.output_tokens == plain.usage.output_tokens
    # a streamed chained turn
    chained = list(
        alice.responses.create(model=MODEL, input="More.", previous_response_id=done.id, stream=True, **GREEDY)
    )
    assert chained[-1].response.previous_response_id == done.id
    assert chained[-1].response.usage.input_tokens_details.cached_tokens >= (
        done.usage.input_tokens + done.usage.output_tokens - BLOCK
    )


# ------------------------------------------------------------------ store=false, delete


def test_store_false_is_answered_and_forgotten(engine, alice):
    stored = alice.responses.create(model=MODEL, instructions=SYSTEM, input="Count to three.", **GREEDY)
    r = alice.responses.create(model=MODEL, instructions=SYSTEM, input="Count to three.", store=False, **GREEDY)
    assert r.store is False and r.output_text == stored.output_text and r.id != stored.id
    before = len(engine.sessions(user="alice"))
    with pytest.raises(openai.NotFoundError) as e:
        alice.responses.retrieve(r.id)
    assert e.value.body["code"] == "response_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        alice.responses.create(model=MODEL, input="Go on.", previous_response_id=r.id, **GREEDY)
    assert (e.value.body["code"], e.value.body["param"]) == ("previous_response_not_found", "previous_response_id")
    # a whole history in the input, unstored; and an unstored turn after a stored response: the same
    # reply as a stored turn
    nxt = alice.responses.create(model=MODEL, input="And to four?", previous_response_id=stored.id, **GREEDY)
    history = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": stored.output_text},
        {"role": "user", "content": "And to four?"},
    ]
    assert alice.responses.create(model=MODEL, input=history, store=False, **GREEDY).output_text == nxt.output_text
    side = alice.responses.create(
        model=MODEL, input="And to four?", previous_response_id=stored.id, store=False, **GREEDY
    )
    assert side.output_text == nxt.output_text and side.previous_response_id == stored.id
    assert len(engine.sessions(user="alice")) == before  # nothing stored by any of them
    assert len(engine.resume(conv_of(stored.id), user="alice").tree()) == 4


def test_delete_removes_a_chain_from_its_first_response(engine, alice):
    first = alice.responses.create(model=MODEL, instructions=SYSTEM, input="Hello.", **GREEDY)
    second = alice.responses.create(model=MODEL, input="Again.", previous_response_id=first.id, **GREEDY)
    with pytest.raises(openai.BadRequestError) as e:  # a part of a tree is never deleted
        alice.responses.delete(second.id)
    assert e.value.body["param"] == "response_id"
    assert alice.responses.retrieve(second.id).output_text == second.output_text
    assert alice.responses.delete(first.id) is None  # the client returns nothing for a 200
    for rid in (first.id, second.id):
        with pytest.raises(openai.NotFoundError):
            alice.responses.retrieve(rid)
    with pytest.raises(openai.NotFoundError):
        alice.responses.delete(first.id)
    assert conv_of(first.id) not in [c.id for c in engine.sessions(user="alice")]


# ------------------------------------------------------------------ users, busy, errors


def test_another_users_response_is_unknown_exactly_as_an_unknown_one(server, alice, bob):
    mine = alice.responses.create(model=MODEL, instructions=SYSTEM, input="My PIN is 4411.", **GREEDY)
    fresh = f"resp_{uuid.uuid4().hex}_{int(mine.id.split('_')[2]) + 10**9}"
    headers = {"Authorization": f"Bearer {KEYS['bob']}"}

    def answers(rid: str):
        body = {"model": MODEL, "input": "What is my PIN?", "previous_response_id": rid, "max_output_tokens": 4}
        got = [
            raw(server.url, "/v1/responses", body, headers),
            raw(server.url, f"/v1/responses/{rid}", None, headers),
            raw(server.url, f"/v1/responses/{rid}", None, headers, method="DELETE"),
        ]
        return [(status, json.loads(json.dumps(b).replace(rid, "ID"))) for status, b, _ in got]

    theirs, unknown = answers(mine.id), answers(fresh)
    assert theirs == unknown
    assert [s for s, _ in theirs] == [400, 404, 404]
    assert theirs[0][1]["error"]["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(mine.id)
    got = alice.responses.retrieve(mine.id)  # still alice's, untouched
    assert got.output_text == mine.output_text and got.previous_response_id is None


def test_a_busy_conversation_is_a_409(engine, alice):
    r = alice.responses.create(model=MODEL, instructions=SYSTEM, input="Hi.", **GREEDY)
    turn = engine.resume(conv_of(r.id), user="alice").stream(
        "Busy?", SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    )
    next(turn)
    try:
        with pytest.raises(openai.ConflictError) as e:
            alice.responses.create(model=MODEL, input="Me too?", previous_response_id=r.id, **GREEDY)
        assert e.value.body["code"] == "session_busy"
        with pytest.raises(openai.ConflictError) as e:  # nor deleted under it
            alice.responses.delete(r.id)
        assert (e.value.body["code"], e.value.body["param"]) == ("session_busy", "response_id")
    finally:
        turn.close()
    # another process's turn (its lease: here a second Store, as another process has): ConversationBusy, a 409
    from chatkv.storage.repository import Store

    with Store.open(data_dir=engine.config.data_dir) as other, other.leases.hold(conv_of(r.id)):
        with pytest.raises(openai.ConflictError) as e:
            alice.responses.create(model=MODEL, input="Me too?", previous_response_id=r.id, **GREEDY)
        assert (e.value.body["code"], e.value.body["param"]) == ("session_busy", "previous_response_id")
    assert "Me too?" not in [m.content for m in engine.resume(conv_of(r.id), user="alice").tree()]
    assert alice.responses.create(model=MODEL, input="Now?", previous_response_id=r.id, **GREEDY).output_text


def test_an_answered_response_leaves_its_conversation_free(engine, alice):
    """The turn ends (its lease given back) before its response is answered: a turn at once after
    it, here the SDK's in this process, never finds the conversation busy (it did, now and then)."""
    r = alice.responses.create(model=MODEL, instructions=SYSTEM, input="Hi.", **GREEDY)
    s = engine.resume(conv_of(r.id), user="alice")
    for i in range(4):
        r = alice.responses.create(model=MODEL, input=f"Step {i}.", previous_response_id=r.id, **GREEDY)
        s.send(f"And step {i}?", SamplingParams(max_tokens=2, temperature=0))  # a sibling branch, at once
    assert len(s.tree()) == 2 + 4 * 4


def _successes(server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = raw(server.url, "/metrics")[1]
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "chatkv:request_success_total"
    )


def test_responses_are_counted_in_the_metrics(server, alice):
    before = _successes(server)
    r = alice.responses.create(model=MODEL, instructions=SYSTEM, input="Count me.", **GREEDY)
    list(alice.responses.create(model=MODEL, input="And me.", previous_response_id=r.id, stream=True, **GREEDY))
    alice.responses.create(model=MODEL, input="Me too.", store=False, **GREEDY)
    assert _successes(server) >= before + 3


def test_a_new_chain_that_cannot_be_asked_leaves_no_conversation(engine, alice):
    before = {c.id for c in engine.sessions(user="alice")}
    with pytest.raises(openai.BadRequestError) as e:
        alice.responses.create(model=MODEL, instructions=SYSTEM, input="word " * 6000, **GREEDY)
    assert e.value.body["code"] == "context_length_exceeded"
    assert {c.id for c in engine.sessions(user="alice")} == before


def _bad(server, body: dict, status: int = 400):
    got, out, _ = raw(
        server.url,
        "/v1/responses",
        {"model": MODEL, "max_output_tokens": 2, **body},
        {"Authorization": f"Bearer {KEYS['alice']}"},
    )
    assert got == status, out
    return out["error"]


@pytest.mark.parametrize(
    "body,code,param",
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "unsupported_parameter",
            "input[0].content[0]",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "invalid_value", "input[0].role"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "unsupported_parameter", "input[0].type"),
        ({"input": [{"role": "user", "content": 5}]}, "invalid_value", "input[0].content"),
        ({"input": ["hi"]}, "invalid_value", "input[0]"),
        (
            {"input": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
            "invalid_value",
            "input",
        ),
        (
            {
                "input": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "c"},
                ]
            },
            "unsupported_parameter",
            "input",
        ),
        ({"input": []}, "invalid_value", "input"),
        ({"input": "   "}, "invalid_value", "input"),
        ({}, "missing_parameter", "input"),
        ({"input": "hi", "store": "yes"}, "invalid_value", "store"),
        ({"input": "hi", "stream": 1}, "invalid_value", "stream"),
        ({"input": "hi", "temperature": "hot"}, "invalid_value", "temperature"),
        ({"input": "hi", "max_output_tokens": 0}, "invalid_value", "max_output_tokens"),
        ({"input": "hi", "instructions": 3}, "invalid_value", "instructions"),
        ({"input": "hi", "metadata": {"k": 1}}, "invalid_value", "metadata"),
        ({"input": "hi", "tools": [{"type": "function", "name": "f"}]}, "unsupported_parameter", "tools"),
        ({"input": "hi", "frequency_penalty": 1}, "unknown_parameter", "frequency_penalty"),
        ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_not_found", "previous_response_id"),
        (
            {"input": "hi", "previous_response_id": "resp_" + "0" * 32 + "_1"},
            "previous_response_not_found",
            "previous_response_id",
        ),
        ({"input": "hi", "previous_response_id": 7}, "invalid_value", "previous_response_id"),
    ],
)
def test_bad_requests_are_openai_400s_naming_the_field(server, body, code, param):
    err = _bad(server, body)
    assert (err["code"], err["param"], err["type"]) == (code, param, "invalid_request_error"), err


def test_a_chained_request_keeps_the_conversations_instructions(server, alice):
    r = alice.responses.create(model=MODEL, instructions=SYSTEM, input="Hi.", **GREEDY)
    err = _bad(server, {"input": "x", "previous_response_id": r.id, "instructions": "Be rude."})
    assert (err["code"], err["param"]) == ("unsupported_parameter", "instructions")
    err = _bad(
        server,
        {
            "input": [{"role": "system", "content": "New rules."}, {"role": "user", "content": "x"}],
            "previous_response_id": r.id,
        },
    )
    assert err["param"] == "input"
    same = alice.responses.create(model=MODEL, instructions=SYSTEM, input="Again.", previous_response_id=r.id, **GREEDY)
    assert same.previous_response_id == r.id
    status, body, _ = raw(server.url, "/v1/responses/resp_x", None, {"Authorization": f"Bearer {KEYS['alice']}"})
    assert status == 404 and body["error"]["code"] == "response_not_found"
    status, body, _ = raw(server.url, "/v1/responses/" + r.id, None, {"Authorization": "Bearer wrong"})
    assert status == 401


# ------------------------------------------------------------------ restart


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_chain_survives_a_restart_and_its_kv_is_restored(tmp_path_factory, stop):
    """Three chained turns, ``chatkv serve`` stopped (or killed: the write-behind segments are
    on disk already) and started again on the same data directory, then turn 4: it continues
    the stored chain, and its history's KV comes back from the snapshot on disk (at least 80%
    of its input is cached, most of it restored)."""
    model_dir, data = tiny_model(tmp_path_factory), tmp_path_factory.mktemp("served")
    args = ("--dtype", "float32")
    proc, url = serve_process(model_dir, data, *args)
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        chain = [c.responses.create(model=model_dir.name, instructions=SYSTEM, input="Turn one.", **GREEDY)]
        for q in ("Turn two.", "Turn three."):
            chain.append(c.responses.create(model=model_dir.name, input=q, previous_response_id=chain[-1].id, **GREEDY))
        proc.send_signal(stop)
        assert proc.wait(60) == (0 if stop == signal.SIGTERM else -signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    proc, url = serve_process(model_dir, data, *args)
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert c.responses.retrieve(chain[2].id).output_text == chain[2].output_text
        four = c.responses.create(model=model_dir.name, input="Turn four.", previous_response_id=chain[2].id, **GREEDY)
        u = four.usage
        assert u.input_tokens_details.cached_tokens >= 0.8 * u.input_tokens, u
        assert u.model_extra["chatkv"]["restored_tokens"] >= 0.5 * u.input_tokens, u
        assert four.previous_response_id == chain[2].id and conv_of(four.id) == conv_of(chain[0].id)
    finally:
        proc.terminate()
        proc.wait(60)
