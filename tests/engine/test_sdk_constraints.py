"""Constrained output through sessions (the SDK): ``session.send(json_schema=...)`` returns
``reply.parsed``, every reply that ends by stop validates (jsonschema), one that ends by length
is ``parsed=None``; constrained and free session turns share the engine's batches (asend
together), the free ones unchanged; the history and its KV go on as for any turn; the errors."""

from __future__ import annotations

import asyncio

import jsonschema
import pytest

from chatkv.config import EngineConfig
from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams
from chatkv.errors import InvalidRequest
from tests.support.tiny import make_model

SCHEMAS = [
    {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": -50, "maximum": 50}, "b": {"enum": ["x", "y"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "maxLength": 12},
            "sources": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
        },
        "required": ["answer", "sources"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["ok"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    make_model(d, "llama", seed=0)
    e = Engine(str(d), EngineConfig(data_dir=str(tmp_path_factory.mktemp("data")), num_blocks=256))
    yield e
    e.close()


def test_json_schema_replies_parse_and_validate(engine):
    stopped = 0
    for i, schema in enumerate(SCHEMAS):
        for seed in range(3):
            with engine.session() as s:
                r = s.send(
                    "The quick brown fox", SamplingParams(max_tokens=80, temperature=1.0, seed=seed), json_schema=schema
                )
                assert r.finish_reason in ("stop", "length")
                if r.finish_reason == "stop":
                    stopped += 1
                    jsonschema.validate(r.parsed, schema)
                else:
                    assert r.parsed is None
                assert s.messages()[-1].content == r.text
    assert stopped >= len(SCHEMAS)


def test_length_first_is_not_parsed(engine):
    with engine.session() as s:
        r = s.send("Hello", SamplingParams(max_tokens=3, temperature=0.0), json_schema=SCHEMAS[0])
        assert r.finish_reason == "length" and r.parsed is None and r.text.startswith("{")


def test_a_json_object_in_params_is_parsed_too(engine):
    with engine.session() as s:
        r = s.send(
            "Hello", SamplingParams(max_tokens=60, temperature=0.0, json_object=True), json_schema=None, tools=None
        )
        assert r.parsed is None  # no options: the plain turn, as before
        r = s.send("Hello", SamplingParams(max_tokens=60, temperature=0.0), json_schema={"type": "object"})
        if r.finish_reason == "stop":
            assert isinstance(r.parsed, dict)


def test_constrained_turns_go_on_with_the_conversation(engine):
    """A constrained turn is a turn: the next (free) one continues its history from the cache."""
    with engine.session() as s:
        r1 = s.send("What is the capital", SamplingParams(max_tokens=60, temperature=0.0), json_schema=SCHEMAS[2])
        n = len(s.tokens)
        r2 = s.send("Hello", SamplingParams(max_tokens=5, temperature=0.0))
        assert r2.parsed is None and r2.tool_calls == []
        assert r2.usage.cached_tokens >= (n // 16) * 16 - 16
        assert [m.role for m in s.messages()] == ["user", "assistant", "user", "assistant"]
        assert r1.finish_reason in ("stop", "length")


def test_a_batch_mixes_constrained_and_free_session_turns(engine):
    """Free and constrained turns of different sessions run together (asend, one engine loop):
    each free reply is what it is alone, each constrained one that stops validates."""
    free = SamplingParams(max_tokens=10, temperature=0.0)
    with engine.session() as a:
        alone = a.send("Hello, how are you", free).text

    async def together():
        sessions = [engine.session() for _ in range(5)]
        try:
            jobs = [sessions[0].asend("Hello, how are you", free)]
            jobs += [
                sessions[i + 1].asend(
                    "Key-value caches keep",
                    SamplingParams(max_tokens=80, temperature=1.0, seed=i),
                    json_schema=SCHEMAS[i],
                )
                for i in range(4)
            ]
            return await asyncio.gather(*jobs)
        finally:
            for s in sessions:
                s.close()

    replies = asyncio.run(together())
    assert replies[0].text == alone and replies[0].parsed is None
    for schema, r in zip(SCHEMAS, replies[1:]):
        if r.finish_reason == "stop":
            jsonschema.validate(r.parsed, schema)
        else:
            assert r.finish_reason == "length" and r.parsed is None


def test_stream_yields_pieces_then_the_parsed_reply(engine):
    with engine.session() as s:
        pieces = list(s.stream("Hello", SamplingParams(max_tokens=60, temperature=0.0), json_schema=SCHEMAS[0]))
        reply = pieces[-1]
        assert "".join(p for p in pieces[:-1]) == reply.text
        if reply.finish_reason == "stop":
            jsonschema.validate(reply.parsed, SCHEMAS[0])


@pytest.mark.parametrize(
    "kwargs, says",
    [
        (dict(json_schema={"type": "array", "uniqueItems": True}), 'Unimplemented keys: ["uniqueItems"]'),
        (dict(json_schema={"type": "strnig"}), "Invalid type: strnig"),
        (dict(json_schema=[1]), "json_schema must be a JSON schema object"),
        (dict(json_schema={"type": "object"}, params=SamplingParams(regex="a+")), "params already carry a constraint"),
    ],
)
def test_bad_schemas_are_invalid_requests_and_store_nothing(engine, kwargs, says):
    params = kwargs.pop("params", SamplingParams(max_tokens=4))
    with engine.session() as s:
        with pytest.raises(InvalidRequest) as err:
            s.send("Hello", params, **kwargs)
        assert says in str(err.value)
        assert s.messages() == []
