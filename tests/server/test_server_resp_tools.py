"""Structured output and function tools on ``/v1/responses``, driven by the official
``openai`` client's ``client.responses`` against a real ``chatkv serve`` process: ``text.format``
json_schema (every output that ends by stop validates with jsonschema, stored and store=false,
streamed too) and json_object; function tools with each ``tool_choice``, ``function_call``
output items with call ids, streamed as OpenAI's function-call events, and their results sent
back as ``function_call_output`` items continuing the conversation from the cache; and
OpenAI-shaped 400s naming the path of the problem. The model: the tiny Qwen2-style model with a
tool-capable chat template (tests.support.tiny.QWEN2_TOOLS)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.support.serving import MODEL, raw, serve_process

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 10},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "score"],
    "additionalProperties": False,
}
FORMAT = {"format": {"type": "json_schema", "name": "rating", "schema": SCHEMA, "strict": True}}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CLOCK = {
    "type": "function",
    "name": "clock",
    "description": "The time.",
    "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
}


@pytest.fixture(scope="module")
def server(tool_model_dir, tmp_path_factory):
    proc, url = serve_process(tool_model_dir, tmp_path_factory.mktemp("data"), "--served-model-name", MODEL)
    yield url
    proc.terminate()
    assert proc.wait(30) == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_text_format_json_schema_stored_and_not(client):
    stopped = 0
    for seed, store in [(0, True), (1, False), (2, True), (3, False)]:
        r = client.responses.create(
            model=MODEL,
            input="Rate this",
            max_output_tokens=60,
            temperature=1.0,
            extra_body={"seed": seed},
            text=FORMAT,
            store=store,
        )
        assert r.text.format.type == "json_schema" and r.text.format.name == "rating"
        if r.status == "completed":
            stopped += 1
            jsonschema.validate(json.loads(r.output_text), SCHEMA)
        else:
            assert r.incomplete_details.reason == "max_output_tokens"
        if store:  # a stored response's chain goes on, constrained again
            nxt = client.responses.create(
                model=MODEL, input="Again", previous_response_id=r.id, max_output_tokens=60, temperature=0, text=FORMAT
            )
            if nxt.status == "completed":
                jsonschema.validate(json.loads(nxt.output_text), SCHEMA)
    assert stopped >= 1
    r = client.responses.create(
        model=MODEL, input="Hello", max_output_tokens=60, temperature=0, text={"format": {"type": "json_object"}}
    )
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)


def test_a_streamed_json_schema_response_validates(client):
    events = list(
        client.responses.create(
            model=MODEL, input="Rate it", max_output_tokens=60, temperature=0, text=FORMAT, stream=True
        )
    )
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text
    if events[-1].type == "response.completed":
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_forced_calls_are_function_call_items(client, choice):
    r = client.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        max_output_tokens=150,
        temperature=0,
        tools=[WEATHER, CLOCK],
        tool_choice=choice,
        store=False,
    )
    assert r.status == "completed", r
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and all(
        c.call_id.startswith("call_") and c.id.startswith("fc_") and c.status == "completed" for c in calls
    )
    for c in calls:
        params = {"get_weather": WEATHER, "clock": CLOCK}[c.name]["parameters"]
        jsonschema.validate(json.loads(c.arguments), params)
    if isinstance(choice, dict):
        assert {c.name for c in calls} == {"get_weather"}
    assert [t.name for t in r.tools] == ["get_weather", "clock"]


def test_tool_choice_none_and_auto_answer_in_text(client):
    for choice in ("none", "auto"):
        r = client.responses.create(
            model=MODEL,
            input="Hello",
            max_output_tokens=8,
            temperature=0,
            tools=[WEATHER],
            tool_choice=choice,
            store=False,
        )
        assert [o.type for o in r.output] == ["message"] and r.output_text


def test_streamed_calls_and_their_results_round_trip(client):
    events = list(
        client.responses.create(
            model=MODEL,
            input="Weather in Oslo?",
            max_output_tokens=150,
            temperature=0,
            tools=[WEATHER],
            tool_choice="required",
            store=False,
            stream=True,
        )
    )
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert "response.output_text.delta" not in types  # calls only: no message item
    n = types.count("response.function_call_arguments.done")
    assert (
        n >= 1
        and types[2:-1]
        == [
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
        ]
        * n
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added, delta, done, item_done = events[2:6]
    assert added.item.type == "function_call" and added.item.arguments == "" and added.item.status == "in_progress"
    assert delta.delta == done.arguments == item_done.item.arguments and delta.item_id == added.item.id == done.item_id
    final = events[-1].response
    call = final.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id == added.item.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # the call and its result go back as input items (store=false: the whole input); the conversation continues
    again = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temp": 12})},
    ]
    r = client.responses.create(
        model=MODEL, input=again, max_output_tokens=6, temperature=0, tools=[WEATHER], store=False
    )
    assert r.status in ("completed", "incomplete")
    # the question and its tool block were computed once: the second request found them cached
    assert r.usage.input_tokens_details.cached_tokens > 0.5 * r.usage.input_tokens


def _bad(url: str, body: dict) -> dict:
    status, out, _ = raw(url, "/v1/responses", {"model": MODEL, "max_output_tokens": 4, **body})
    assert status == 400, out
    return out["error"]


@pytest.mark.parametrize(
    "body, code, param",
    [
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strnig"}}}},
            "invalid_value",
            "text.format.schema",
        ),
        (
            {
                "text": {
                    "format": {"type": "json_schema", "name": "x", "schema": {"type": "array", "uniqueItems": True}}
                }
            },
            "unsupported_parameter",
            "text.format.schema",
        ),
        ({"text": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "missing_parameter", "text.format.name"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "missing_parameter", "text.format.schema"),
        ({"text": {"format": {"type": "yaml"}}}, "invalid_value", "text.format.type"),
        ({"text": {"style": "terse"}}, "unknown_parameter", "text.style"),
        ({"response_format": {"type": "json_object"}}, "unsupported_parameter", "response_format"),
        ({"tools": [WEATHER]}, "unsupported_parameter", "tools"),  # store defaults to true
        ({"store": False, "tools": [{"type": "function", "description": "no name"}]}, "invalid_value", "tools[0].name"),
        ({"store": False, "tools": [WEATHER, {"type": "web_search"}]}, "unsupported_parameter", "tools[1].type"),
        (
            {"store": False, "tools": [{"type": "function", "function": {"name": "f"}}]},
            "invalid_value",
            "tools[0].function",
        ),
        (
            {"store": False, "tools": [{**WEATHER, "parameters": {"type": "array", "uniqueItems": True}}]},
            "invalid_value",
            "tools[0].parameters",
        ),
        (
            {"store": False, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
            "invalid_value",
            "tool_choice.name",
        ),
        ({"store": False, "tool_choice": "required"}, "invalid_value", "tool_choice"),
        (
            {
                "store": False,
                "tools": [WEATHER],
                "tool_choice": "required",
                "text": {"format": {"type": "json_object"}},
            },
            "invalid_value",
            "tool_choice",
        ),
        (
            {
                "store": False,
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "function_call_output", "call_id": "call_unknown", "output": "1"},
                ],
            },
            "invalid_value",
            "input[1].call_id",
        ),
        (
            {
                "store": False,
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c1", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": "1"},
                ],
            },
            "invalid_value",
            "input[1].name",
        ),
        (
            {
                "store": False,
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{not json"},
                ],
            },
            "invalid_value",
            "input[1].arguments",
        ),
        (
            {
                "store": False,
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "[1, 2]"},
                ],
            },
            "invalid_value",
            "input[1].arguments",
        ),
        (
            {"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c1", "name": "f"}]},
            "unsupported_parameter",
            "input[1].type",
        ),
    ],
)
def test_bad_requests_are_openai_400s_naming_the_path(client, server, body, code, param):
    body = {"input": "hi", **body}
    err = _bad(server, body)
    assert (err["code"], err["param"], err["type"]) == (code, param, "invalid_request_error"), err
    with pytest.raises(openai.BadRequestError):
        client.responses.create(
            model=MODEL,
            max_output_tokens=4,
            **{k: v for k, v in body.items() if k != "response_format"},
            **({"extra_body": {"response_format": body["response_format"]}} if "response_format" in body else {}),
        )
