"""Tools on a model whose chat template has none: the packaged default model (SmolLM2-135M,
whose template ignores ``tools``) gets chatkv.server.generic_tools' format, driven with the
official ``openai`` client over loopback. A forced call (``tool_choice`` "required" or a named
function, a pydantic-style ``$defs`` schema among them) parses and validates against its schema;
"auto" gives a well-formed call or text; a call streams as ``delta.tool_calls``; an agent loop
(a call, its ``tool`` result fed back, a text answer) completes. A template that renders tools
(the tiny Qwen2-style model's, tests.support.tiny.QWEN2_TOOLS) keeps its own format."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from chatkv.server import generic_tools
from tests.support.serving import MODEL, default_engine, raw, server  # noqa: F401  (server: the fixture, on this module's engine)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
BOOK = {  # the shape pydantic (and so LangChain) writes: a $defs entry reached by a root-relative $ref
    "type": "function",
    "function": {
        "name": "book_trip",
        "description": "Book a trip to an address.",
        "parameters": {
            "$defs": {
                "Addr": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 30}, "days": {"type": "integer"}},
                    "required": ["city", "days"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {"to": {"$ref": "#/$defs/Addr"}},
            "required": ["to"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, BOOK)}


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def engine(default_model_dir, tmp_path_factory):
    yield from default_engine(default_model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_default_template_is_generic_and_a_tool_template_is_not(engine):
    assert generic_tools.is_generic(engine.tokenizer.chat_template)
    from tests.support.tiny import QWEN2_TOOLS

    assert not generic_tools.is_generic(QWEN2_TOOLS) and not generic_tools.is_generic(None)


@pytest.mark.parametrize(
    "choice, name",
    [
        ("required", None),
        ({"type": "function", "function": {"name": "get_weather"}}, "get_weather"),
        ({"type": "function", "function": {"name": "book_trip"}}, "book_trip"),
    ],
)
def test_a_forced_call_parses_and_validates(client, choice, name):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ask("What is the weather in Paris?"),
        tools=[WEATHER, BOOK],
        tool_choice=choice,
        max_tokens=80,
        temperature=0.0,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.content is None and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_auto_gives_a_well_formed_call_or_text(client):
    """Either a call of a listed tool with valid arguments, or text that is not a call. (The 135M
    model almost always answers in text here; how often it calls is not what is tested.)"""
    kinds = []
    for i, q in enumerate(["What is the weather in Oslo?", "Hello, who are you?", "Is it raining in Rome?"]):
        r = client.chat.completions.create(
            model=MODEL, messages=ask(q), tools=[WEATHER], max_tokens=40, temperature=0.8, seed=i
        )
        c = r.choices[0]
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls" and c.message.content is None
            (call,) = c.message.tool_calls
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            kinds.append("call")
        else:
            assert c.finish_reason in ("stop", "length") and c.message.content.strip()
            assert not c.message.content.lstrip().startswith("{")  # the grammar: a "{" begins a call
            kinds.append("text")
    assert len(kinds) == 3


def test_a_forced_call_streams_as_delta_tool_calls_and_auto_text_streams(client):
    calls, finish = {}, None
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=ask("Weather in Oslo?"),
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=60,
        temperature=0.0,
        stream=True,
    ):
        ch = chunk.choices[0]
        assert not ch.delta.content  # a held call: no piece of its JSON as content
        for tc in ch.delta.tool_calls or ():
            calls[tc.index] = (tc.id, tc.function.name, tc.function.arguments)
        finish = ch.finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    cid, name, args = calls[0]
    assert cid.startswith("call_") and name == "get_weather"
    jsonschema.validate(json.loads(args), SCHEMAS["get_weather"])
    pieces = [
        c.choices[0].delta.content
        for c in client.chat.completions.create(
            model=MODEL, messages=ask("Hello!"), tools=[WEATHER], max_tokens=24, temperature=0.0, stream=True
        )
        if c.choices and c.choices[0].delta.content
    ]
    assert len(pieces) > 1  # text streams as it comes, not held to the end


def test_an_agent_loop_completes(client):
    msgs = ask("What is the weather in Paris?")
    tools = [WEATHER]
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=tools, tool_choice="required", max_tokens=60, temperature=0.0
    )
    (call,) = r.choices[0].message.tool_calls
    msgs += [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 12, "sky": "rain"})},
    ]
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=60, temperature=0.0)
    c = r2.choices[0]
    assert c.finish_reason in ("stop", "length") and not c.message.tool_calls, c
    assert c.message.content.strip()
    # the tools' system message and the question were computed once: the second request found them
    assert r2.usage.prompt_tokens_details.cached_tokens > 0.5 * r2.usage.prompt_tokens


def test_a_forced_call_on_the_responses_api_is_a_function_call_item(client):
    fn = WEATHER["function"]
    r = client.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        max_output_tokens=60,
        temperature=0,
        tools=[{"type": "function", **fn}],
        tool_choice="required",
        store=False,
    )
    assert r.status == "completed", r
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), fn["parameters"])


def test_the_history_is_rendered_as_plain_messages():
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {}}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    out = generic_tools.messages(msgs, [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n") and "get_weather" in out[0]["content"]
    assert out[2]["content"] == "I called get_weather with {}."
    assert out[3]["content"] == "Tool result (get_weather): sunny"
    assert generic_tools.messages(msgs[1:2], [WEATHER])[0]["role"] == "system"  # none of its own: one first


def test_a_schema_with_no_finite_value_is_a_400_under_auto(server):
    loop = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}
    status, out, _ = raw(server.url, "/v1/chat/completions", {"model": MODEL, "messages": ask("hi"), "tools": [loop]})
    assert status == 400 and out["error"]["param"].startswith("tools[0]"), out


def test_a_template_with_tools_keeps_its_own_format(tool_model_dir):
    """The tiny Qwen2-style model's template renders the tools itself, and its calls are Hermes
    ``<tool_call>`` markup: no generic system message, no generic grammar."""
    from transformers import AutoTokenizer

    from chatkv.engine.sampling import SamplingParams
    from chatkv.server import tool_calls
    from chatkv.server.history import HistoryTokens
    from chatkv.sessions.tools import tools_of

    tok = AutoTokenizer.from_pretrained(tool_model_dir)
    listed = tools_of([WEATHER])
    ids, _ = HistoryTokens(tok).prompt(ask("Weather?"), tools=tool_calls.specs(listed))
    text = tok.decode(ids)
    assert "<tools>" in text and "get_weather" in text and "You can call these tools" not in text
    forced = tool_calls.constrain(SamplingParams(), listed, "required", tok.chat_template)
    assert "<tool_call>" in forced.grammar and '"tool_call": ' not in forced.grammar
    assert tool_calls.constrain(SamplingParams(), listed, "auto", tok.chat_template).grammar is None
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = tool_calls.reply_calls(reply, listed, "auto", tok.chat_template)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Oslo"})]
