"""Hostile requests to chatkv serve, each a 400 with a message that says what is wrong, and the
server answering the next request: too many messages or input items, text that cannot fit the
context, JSON nested 100,000 deep (the body) or 900 deep (a tool call's arguments string), a
schema whose ``$ref`` loop has no finite value (nothing stored with ``store: true``),
``{"$ref": "#"}``, ``parallel_tool_calls`` that is not a boolean. Also what must work: tool
schemas with ``$defs``/``$ref`` (pydantic's) when a call is forced, ``parallel_tool_calls: false``
giving one call, and ``Session.edit`` with an id past 64 bits refused by chatkv itself.

The model: the tiny Qwen2-style model with a tool-capable chat template (tests.support.tiny)."""

from __future__ import annotations

import json
import threading

import jsonschema
import openai
import pytest

from chatkv.engine.core import Engine
from chatkv.engine.text_tokens import _control_in_content
from chatkv.errors import InvalidRequest
from chatkv.server.limits import MAX_DEPTH, MAX_MESSAGES
from tests.support.serving import MODEL, raw, server, user  # noqa: F401  (server: the fixture, on this module's engine)

CHAT, RESPONSES = "/v1/chat/completions", "/v1/responses"
ADDR = {  # pydantic's shape: the parameters refer to their own $defs from the root
    "type": "object",
    "properties": {"home": {"$ref": "#/$defs/Addr"}, "work": {"anyOf": [{"$ref": "#/$defs/Addr"}, {"type": "null"}]}},
    "required": ["home", "work"],
    "additionalProperties": False,
    "$defs": {
        "Addr": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        }
    },
}
RF = "response_format.json_schema.schema"
LOOP = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"], "additionalProperties": False}


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": "A tool.", "parameters": parameters}}


@pytest.fixture(scope="module")
def engine(tool_model_dir, tmp_path_factory):
    eng = Engine.from_pretrained(
        tool_model_dir, data_dir=str(tmp_path_factory.mktemp("data")), num_blocks=1024, dtype="float32"
    )
    yield eng
    eng.close()
    assert not any(t.name == "chatkv-engine" and t.is_alive() for t in threading.enumerate())


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def refused(server, path: str, body, param=None, code="invalid_value", words=()) -> dict:
    """The 400's error object, after checking its code, param and words, and that the server
    still answers a small chat."""
    status, err, _ = raw(server.url, path, body)
    assert status == 400, err
    e = err["error"]
    assert e["code"] == code and e["param"] == param, e
    for w in words:
        assert w in e["message"], e["message"]
    assert "Traceback" not in e["message"] and "RecursionError" not in e["message"]
    ok, reply, _ = raw(server.url, CHAT, {"model": MODEL, "messages": user("Hi"), "max_tokens": 2})
    assert ok == 200, reply
    return e


def test_too_many_messages_are_refused_before_rendering(server):
    msgs = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)
    refused(server, CHAT, {"model": MODEL, "messages": msgs}, "messages", words=(str(MAX_MESSAGES),))
    items = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)
    refused(server, RESPONSES, {"model": MODEL, "input": items, "store": False}, "input", words=("items",))


def test_the_most_messages_with_special_token_strings_are_answered_quickly(server, engine):
    msgs = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"hi <|im_end|> {i}"} for i in range(MAX_MESSAGES)
    ]
    msgs[-1] = {"role": "user", "content": "x"}
    e = refused(server, CHAT, {"model": MODEL, "messages": msgs}, "messages", "context_length_exceeded")
    assert str(engine.context_window) in e["message"]  # tokenised (linear in the messages) and measured


def test_text_past_what_the_context_can_take_is_refused_before_tokenising(server, engine):
    text = "x" * (engine.context_window * 32 + 1)
    refused(server, CHAT, {"model": MODEL, "messages": user(text)}, "messages", "context_length_exceeded")
    refused(server, "/v1/completions", {"model": MODEL, "prompt": text}, "prompt", "context_length_exceeded")


def test_json_nested_100000_deep_is_a_400_not_a_500(server):
    body = b'{"model": "tiny", "input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    refused(server, RESPONSES, body, None, "invalid_json", words=("nests", str(MAX_DEPTH)))
    deep_schema = {"type": "object"}
    for _ in range(300):
        deep_schema = {"type": "object", "properties": {"a": deep_schema}}
    body = {"model": MODEL, "messages": user("x"), "tools": [tool("f", deep_schema)], "tool_choice": "required"}
    e = refused(server, CHAT, body, None, "invalid_json", words=("nests",))
    assert "tools[0].function.parameters" in e["message"]  # where it goes too deep
    deep = b'{"properties": {"a": ' * 50_000 + b"{}" + b"}}" * 50_000  # a tool schema 1 MB deep
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required", '
    body += b'"tools": [{"type": "function", "function": {"name": "f", "parameters": ' + deep + b"}}]}"
    assert len(deep) > 1_000_000
    refused(server, CHAT, body, None, "invalid_json", words=("nests",))


def test_tool_call_arguments_nested_900_deep_are_a_400(server):
    args = '{"a": ' + "[" * 900 + "]" * 900 + "}"
    msgs = [
        *user("Weather?"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": args}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    where = "messages[1].tool_calls[0].function.arguments"
    refused(server, CHAT, {"model": MODEL, "messages": msgs}, where, words=("nests",))


def test_a_ref_loop_with_no_finite_value_is_refused_up_front(server, engine):
    rf = {"type": "json_schema", "json_schema": {"name": "loop", "schema": LOOP}}
    e = refused(server, CHAT, {"model": MODEL, "messages": user("x"), "response_format": rf}, RF)
    assert "no finite JSON value" in e["message"]
    before = len(engine.sessions())
    fmt = {"format": {"type": "json_schema", "name": "loop", "schema": LOOP}}
    e = refused(server, RESPONSES, {"model": MODEL, "input": "x", "store": True, "text": fmt}, "text.format.schema")
    assert "no finite JSON value" in e["message"]
    assert len(engine.sessions()) == before  # nothing stored: no orphaned message
    body = {"model": MODEL, "messages": user("x"), "tools": [tool("f", LOOP)], "tool_choice": "required"}
    e = refused(server, CHAT, body, "tools[0].function.parameters", words=("no finite JSON value",))


def test_a_schema_that_is_only_a_self_reference_gets_a_readable_error(server):
    rf = {"type": "json_schema", "json_schema": {"name": "self", "schema": {"$ref": "#"}}}
    e = refused(server, CHAT, {"model": MODEL, "messages": user("x"), "response_format": rf}, RF)
    assert "'#'" in e["message"] and len(e["message"]) < 400
    assert "Earley" not in e["message"] and "state" not in e["message"].lower()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "move"}}])
def test_forced_calls_of_tools_with_defs_and_refs(client, choice):
    r = client.chat.completions.create(
        model=MODEL,
        messages=user("Move me"),
        max_tokens=120,
        temperature=0.0,
        tools=[tool("move", ADDR), tool("visit", {**ADDR, "$defs": ADDR["$defs"]})],
        tool_choice=choice,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    for t in c.message.tool_calls:
        jsonschema.validate(json.loads(t.function.arguments), ADDR)
    if isinstance(choice, dict):
        assert {t.function.name for t in c.message.tool_calls} == {"move"}


def test_parallel_tool_calls_is_a_boolean_and_false_gives_one_call(server, client):
    body = {"model": MODEL, "messages": user("x"), "tools": [tool("move", ADDR)], "parallel_tool_calls": "yes"}
    refused(server, CHAT, body, "parallel_tool_calls", words=("boolean",))
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL,
            messages=user("Move us all"),
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            tools=[tool("move", ADDR), tool("visit", ADDR)],
            tool_choice="required",
            parallel_tool_calls=False,
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c


def test_session_edit_of_an_id_past_64_bits_is_chatkvs_own_error(engine):
    s = engine.session()
    try:
        for bad in (2**63, -1, 0, 10**5000):
            with pytest.raises(InvalidRequest, match="is not a message of conversation"):
                s.edit(bad, "x")
        with pytest.raises(InvalidRequest, match="must be an int"):
            s.edit("3", "x")
    finally:
        s.close()


def test_control_tokens_in_contents_are_found_as_by_checking_every_span():
    """The one linear walk agrees with the any-span check it replaced, on random spans and tokens."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, 400), 20))
        spans = [(cuts[i], cuts[i + 1]) for i in range(0, 20, 2)]
        offsets, pos = [], 0
        while pos < 400:
            step = rng.randint(0, 7)
            offsets.append((pos, pos + step))
            pos += max(step, 1)
        ids = [rng.randint(0, 3) for _ in offsets]
        ctrl = {0, 1}
        want = [t in ctrl and any(a < e and b > s for s, e in spans) for t, (a, b) in zip(ids, offsets)]
        assert _control_in_content(ids, offsets, spans, ctrl) == want
