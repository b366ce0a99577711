"""chatkv serve's structured output and tool calls, driven by the official ``openai``
client over loopback: ``response_format`` json_object and json_schema (every reply that stops
validates with jsonschema), ``tools`` with each ``tool_choice``, ``message.tool_calls`` with ids,
streamed delta tool calls, ``role: "tool"`` results continuing the conversation from the cache,
and OpenAI-shaped 400s naming the path of the problem. The model: the tiny Qwen2-style model
with a tool-capable chat template (tests.support.tiny.QWEN2_TOOLS)."""

from __future__ import annotations

import json
import threading

import jsonschema
import openai
import pytest

from chatkv.engine.core import Engine
from tests.support.serving import MODEL, WEATHER, raw, server, user  # noqa: F401  (server: the fixture, on this module's engine)

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 10},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "score"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "clock",
        "description": "The time.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


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


def test_response_format_json_schema_and_json_object(client):
    stopped = 0
    for seed in range(4):
        r = client.chat.completions.create(
            model=MODEL,
            messages=user("Rate this"),
            max_tokens=60,
            temperature=1.0,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "rating", "schema": SCHEMA, "strict": True},
            },
        )
        choice = r.choices[0]
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert stopped >= 1
    r = client.chat.completions.create(
        model=MODEL, messages=user("Hello"), max_tokens=60, temperature=0.0, response_format={"type": "json_object"}
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_streamed_json_schema_reply_validates(client):
    pieces, finish = [], None
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=user("Rate it"),
        max_tokens=60,
        temperature=0.0,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
    ):
        d = chunk.choices[0].delta
        pieces.append(d.content or "")
        finish = chunk.choices[0].finish_reason or finish
    if finish == "stop":
        jsonschema.validate(json.loads("".join(pieces)), SCHEMA)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_parse_with_ids(client, choice):
    r = client.chat.completions.create(
        model=MODEL,
        messages=user("Weather in Paris?"),
        max_tokens=150,
        temperature=0.0,
        tools=[WEATHER, CLOCK],
        tool_choice=choice,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    calls = c.message.tool_calls
    assert calls and all(t.id.startswith("call_") and t.type == "function" for t in calls)
    for t in calls:
        schema = {"get_weather": WEATHER, "clock": CLOCK}[t.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(t.function.arguments), schema)
    if isinstance(choice, dict):
        assert {t.function.name for t in calls} == {"get_weather"}


def test_tool_choice_none_and_auto_answer_in_text(client):
    for choice in ("none", "auto"):
        r = client.chat.completions.create(
            model=MODEL, messages=user("Hello"), max_tokens=8, temperature=0.0, tools=[WEATHER], tool_choice=choice
        )
        assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_and_a_tool_result_round_trip(client, choice):
    msgs = user("Weather in Oslo?")
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=150,
        temperature=0.0,
        tools=[WEATHER, CLOCK],
        tool_choice=choice,
        stream=True,
    ):
        ch = chunk.choices[0]
        for tc in ch.delta.tool_calls or ():
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.id or slot["id"]
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
        finish = ch.finish_reason or finish
    assert finish == "tool_calls" and calls
    call = calls[0]
    assert all(c["id"].startswith("call_") for c in calls.values()) and len({c["id"] for c in calls.values()}) == len(
        calls
    )
    if isinstance(choice, dict):
        assert {c["name"] for c in calls.values()} == {"get_weather"}
    call = next((c for c in calls.values() if c["name"] == "get_weather"), call)
    args = json.loads(call["arguments"])
    jsonschema.validate(args, {"get_weather": WEATHER, "clock": CLOCK}[call["name"]]["function"]["parameters"])
    # the result goes back as a tool message; the conversation continues
    msgs = msgs + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temp": 12})},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, temperature=0.0, tools=[WEATHER, CLOCK]
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the question and its tool block were computed once: the second request found them cached
    assert r.usage.prompt_tokens_details.cached_tokens > 0.5 * r.usage.prompt_tokens


@pytest.mark.parametrize(
    "extra, code, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
            "invalid_value",
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "unsupported_parameter",
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "yaml"}}, "invalid_value", "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "invalid_value", "response_format.json_schema"),
        (
            {"tools": [{"type": "function", "function": {"description": "no name"}}]},
            "invalid_value",
            "tools[0].function.name",
        ),
        (
            {"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}]},
            "invalid_value",
            "tools[1].function.parameters",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}},
                    }
                ]
            },
            "invalid_value",
            "tools[0].function.parameters",
        ),
        ({"tools": [WEATHER, WEATHER]}, "invalid_value", "tools[1].name"),
        ({"tools": [{"type": "retrieval"}]}, "invalid_value", "tools[0].type"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "invalid_value",
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "invalid_value", "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "invalid_value",
            "tool_choice",
        ),
        (
            {"messages": user("hi") + [{"role": "tool", "tool_call_id": "call_unknown", "content": "1"}]},
            "invalid_value",
            "messages[1].tool_call_id",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "a", "type": "function", "function": {}}],
                    },
                    {"role": "tool", "tool_call_id": "a", "content": "1"},
                ]
            },
            "invalid_value",
            "messages[1].tool_calls[0].function.name",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "a",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": "{not json"},
                            }
                        ],
                    },
                ]
            },
            "invalid_value",
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": "[1, 2]"}}
                        ],
                    },
                ]
            },
            "invalid_value",
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_requests_are_openai_400s_naming_the_path(client, server, extra, code, param):
    body = {"model": MODEL, "messages": user("hi"), "max_tokens": 4, **extra}
    status, out, _ = raw(server.url, "/v1/chat/completions", body)
    assert status == 400, out
    assert out["error"]["code"] == code and out["error"]["param"] == param, out
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**body)


def test_an_auto_reply_streams_its_text_before_any_call(client):
    chunks = [
        c.choices[0].delta.content
        for c in client.chat.completions.create(
            model=MODEL, messages=user("Hello"), max_tokens=12, temperature=0.0, tools=[WEATHER], stream=True
        )
        if c.choices and c.choices[0].delta.content
    ]
    assert len(chunks) > 1  # not held to the end: no call began


def test_the_call_stream_splits_text_from_calls():
    from chatkv.server.tool_calls import CallStream, reply_calls
    from chatkv.sessions.tools import tools_of

    listed = tools_of([WEATHER])
    split = CallStream("... <tool_call> ...")
    sent = [
        split.feed(p)
        for p in ["Sure", ". <tool", '_call>\n{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}\n</tool_call>']
    ]
    assert "".join(sent) == "Sure. " and sent[1] == ". "
    rest, found = split.finish(lambda t: reply_calls(t, listed, "auto", "<tool_call>"))
    assert rest == "" and [(c.name, c.arguments) for c in found] == [("get_weather", {"city": "Oslo"})]
    plain = CallStream("<tool_call>")
    assert plain.feed("a <tool") == "a " and plain.feed("box>") == "<toolbox>"
    assert plain.finish(lambda t: reply_calls(t, listed, "auto", "<tool_call>")) == ("", [])


def test_response_format_on_a_session_turn(client, server):
    r = client.chat.completions.create(
        model=MODEL,
        messages=user("Rate it"),
        max_tokens=60,
        temperature=0.0,
        extra_headers={"X-Session-Id": "new"},
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
    )
    if r.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    status, out, _ = raw(
        server.url,
        "/v1/chat/completions",
        {"model": MODEL, "messages": user("x"), "tools": [WEATHER], "session_id": "new"},
    )
    assert status == 400 and out["error"]["param"] == "tools"


def test_a_real_chatkv_serve_process(tool_model_dir, tmp_path):
    """``chatkv serve`` in its own process: a json_schema reply and a forced tool call."""
    from tests.support.serving import serve_process

    proc, url = serve_process(tool_model_dir, tmp_path / "data", "--served-model-name", MODEL)
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = c.chat.completions.create(
            model=MODEL,
            messages=user("Rate it"),
            max_tokens=60,
            temperature=0.0,
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
        )
        if r.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        r = c.chat.completions.create(
            model=MODEL,
            messages=user("Weather?"),
            max_tokens=150,
            temperature=0.0,
            tools=[WEATHER],
            tool_choice="required",
        )
        assert r.choices[0].finish_reason == "tool_calls"
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    finally:
        proc.terminate()
        proc.wait(30)
