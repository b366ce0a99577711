"""``n`` > 1 over HTTP with the official ``openai`` client (chatkv.server.samples): greedy choices
equal the n=1 reply, seeded sampling reproducible with sample i on ``seed + i``, streamed chunks
joined per ``index`` equal to the plain choices, stop strings, logprobs, ``response_format`` and
tool calls (the tiny tool-capable model) per choice, usage counting the prompt once, the
prompt's whole blocks computed once and shared (each sample's cached prompt tokens, the tree's
block counts and ``check_integrity``), text completions with n, a client leaving mid-stream,
prefix caching off, and hostile ``n`` values refused with a 400 while the server keeps serving.

One tiny random llama on one started engine, as tests/server/test_server.py has it.
"""

from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest

from chatkv.engine.core import Engine
from chatkv.server import create_app
from chatkv.server.schemas import MAX_N
from tests.support.serving import (  # noqa: F401 - fixtures
    BLOCK,
    MODEL,
    WEATHER,
    Running,
    client,
    engine,
    raw,
    server,
    tiny_model,
    user,
)

CHAT = "/v1/chat/completions"


def _cached_per_choice(usage) -> list[int]:
    return [c["cached_tokens"] for c in usage.model_extra["chatkv"]["choices"]]


def test_greedy_choices_equal_the_n1_reply_and_share_the_prompts_blocks(engine, client):
    msgs = user("Describe a paged KV cache and why parallel samples share a prompt's blocks.")
    prompt_len = len(engine.encode_chat(msgs))
    before = engine.kv_stats()
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0, n=3)
    one = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [one.choices[0].message.content] * 3
    assert {c.finish_reason for c in r.choices} == {one.choices[0].finish_reason}
    # usage as OpenAI counts it: the prompt once, every choice's completion tokens
    assert r.usage.prompt_tokens == prompt_len
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # the prompt was computed once: each sample attached its whole blocks, computing only the partial last one
    whole = (prompt_len - 1) // BLOCK * BLOCK
    assert _cached_per_choice(r.usage) == [whole] * 3
    computed = [c["computed_tokens"] for c in r.usage.model_extra["chatkv"]["choices"]]
    assert computed == [prompt_len - whole] * 3
    first_hit = r.usage.prompt_tokens_details.cached_tokens  # what the one computing of the prompt found cached
    assert r.usage.model_extra["chatkv"]["computed_tokens"] == prompt_len - first_hit + 3 * (prompt_len - whole)
    # block accounting: the tree holds the prompt's blocks and the (equal) replies' once, not three times
    engine.check_integrity()
    after = engine.kv_stats()
    generated = one.usage.completion_tokens
    new_blocks = (prompt_len + generated - 1) // BLOCK - first_hit // BLOCK
    assert after["blocks_cached"] - before["blocks_cached"] == new_blocks
    assert after["blocks_free"] + after["blocks_cached"] == after["blocks_total"]  # idle: no block leaked


def test_seeded_samples_are_reproducible_distinct_and_sample_i_uses_seed_plus_i(engine, client):
    msgs = user("Write a short line about the sea.")
    ask = dict(model=MODEL, messages=msgs, max_tokens=12, temperature=1.0, seed=1234)
    a = client.chat.completions.create(**ask, n=4)
    b = client.chat.completions.create(**ask, n=4)
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1
    solo = client.chat.completions.create(**{**ask, "seed": 1234 + 2})
    assert solo.choices[0].message.content == texts[2]
    # without a seed each sample draws its own
    free = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=1.0, n=4)
    assert len({c.message.content for c in free.choices}) > 1
    engine.check_integrity()


def test_streamed_choices_join_per_index_to_the_plain_ones(engine, client):
    msgs = user("List three colours of autumn leaves.")
    ask = dict(model=MODEL, messages=msgs, max_tokens=14, temperature=0.9, seed=42, n=3)
    plain = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    texts, finishes, roles = ["", "", ""], [[], [], []], [0, 0, 0]
    for c in chunks[:-1]:
        assert len(c.choices) == 1 and c.usage is None and c.id == chunks[0].id
        ch = c.choices[0]
        texts[ch.index] += ch.delta.content or ""
        roles[ch.index] += ch.delta.role == "assistant"
        if ch.finish_reason:
            finishes[ch.index].append(ch.finish_reason)
    assert texts == [c.message.content for c in plain.choices]
    assert finishes == [[c.finish_reason] for c in plain.choices] and roles == [1, 1, 1]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == plain.usage.prompt_tokens
    assert usage.completion_tokens == plain.usage.completion_tokens
    engine.check_integrity()


def test_stop_strings_and_logprobs_apply_to_each_choice(engine, client):
    msgs = user("Say something about trains and stations.")
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0).choices[0]
    text = full.message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"no stop string to take from {text!r}"
    cut = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0, n=2, stop=stop)
    for c in cut.choices:
        assert c.message.content == text[: text.index(stop)] and c.finish_reason == "stop"
    lp = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8, temperature=0.8, seed=5, n=3, logprobs=True, top_logprobs=2
    )
    per_choice = lp.usage.model_extra["chatkv"]["choices"]
    for c, u in zip(lp.choices, per_choice):
        assert len(c.logprobs.content) == u["completion_tokens"]
        assert "".join(t.token for t in c.logprobs.content).startswith(c.message.content[:1])
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in c.logprobs.content)
    assert sum(u["completion_tokens"] for u in per_choice) == lp.usage.completion_tokens
    engine.check_integrity()


def test_text_completions_take_n_per_prompt(engine, client):
    prompts = ["The quick brown fox jumps over the lazy dog and", "Paris is the capital of"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    solo = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    assert [c.text for c in r.choices] == [solo[0].choices[0].text] * 2 + [solo[1].choices[0].text] * 2
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in solo)
    assert r.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in solo)
    ask = dict(model=MODEL, prompt=prompts[0], max_tokens=8, temperature=1.0, seed=9, n=3)
    plain = client.completions.create(**ask)
    texts = ["", "", ""]
    chunks = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == [c.text for c in plain.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    engine.check_integrity()


@pytest.mark.parametrize("n", [10**9, 0, -1, True, 2.5, "3", MAX_N + 1, [3]])
def test_hostile_n_is_a_400_naming_n_and_the_server_keeps_serving(server, client, n):
    status, body, _ = raw(server.url, CHAT, {"model": MODEL, "messages": user("Hi"), "max_tokens": 2, "n": n})
    assert status == 400 and body["error"]["param"] == "n", body
    status, body, _ = raw(
        server.url, "/v1/completions", {"model": MODEL, "prompt": ["a"] * 40, "max_tokens": 2, "n": 2}
    )
    assert status == 400 and body["error"]["param"] == "n", body
    with pytest.raises(openai.BadRequestError) as e:  # a session stores one reply a turn
        client.chat.completions.create(
            model=MODEL, messages=user("Hi"), n=2, max_tokens=2, extra_headers={"X-Session-Id": "new"}
        )
    assert e.value.body["param"] == "n"
    ok = client.chat.completions.create(model=MODEL, messages=user("Hi"), max_tokens=2, temperature=0, n=MAX_N)
    assert len(ok.choices) == MAX_N and len({c.message.content for c in ok.choices}) == 1


SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 6},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "score"],
    "additionalProperties": False,
}


def test_response_format_constrains_each_choice(engine, client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=user("Rate this answer."),
        max_tokens=60,
        temperature=1.0,
        seed=11,
        n=3,
        response_format={"type": "json_schema", "json_schema": {"name": "rating", "schema": SCHEMA}},
    )
    stopped = [c.message.content for c in r.choices if c.finish_reason == "stop"]
    assert stopped, [c.message.content for c in r.choices]
    for text in stopped:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({c.message.content for c in r.choices}) > 1
    engine.check_integrity()


def _until_idle(engine) -> None:
    deadline = time.monotonic() + 20
    while not engine.idle:
        assert time.monotonic() < deadline, "the samples were not stopped"
        time.sleep(0.02)


def test_a_client_leaving_mid_stream_stops_every_sample(engine, client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=user("Tell a long story."),
        max_tokens=400,
        temperature=1.0,
        n=4,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = set()
    for c in stream:
        seen.update(ch.index for ch in c.choices if ch.delta.content)
        if len(seen) == 4:
            break
    assert len(seen) == 4  # every sample was under way, none finished, as the client left
    stream.close()
    _until_idle(engine)
    engine.check_integrity()
    stats = engine.kv_stats()
    assert stats["blocks_free"] + stats["blocks_cached"] == stats["blocks_total"]


def test_without_prefix_caching_each_sample_computes_its_prompt(tmp_path_factory):
    eng = Engine.from_pretrained(
        str(tiny_model(tmp_path_factory)),
        data_dir=str(tmp_path_factory.mktemp("data")),
        block_size=BLOCK,
        num_blocks=256,
        dtype="float32",
        enable_prefix_caching=False,
    )
    run = Running(create_app(eng, model_name=MODEL))
    try:
        c = openai.OpenAI(base_url=run.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        msgs = user("Explain what a prefix cache is for.")
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, n=3)
        one = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
        assert [ch.message.content for ch in r.choices] == [one.choices[0].message.content] * 3
        assert _cached_per_choice(r.usage) == [0, 0, 0]
        assert r.usage.model_extra["chatkv"]["computed_tokens"] == 3 * r.usage.prompt_tokens
        eng.check_integrity()
    finally:
        run.stop()
        eng.close()


def test_tool_calls_are_parsed_for_each_choice(tool_model_dir, tmp_path_factory):
    eng = Engine.from_pretrained(
        tool_model_dir, data_dir=str(tmp_path_factory.mktemp("data")), num_blocks=512, dtype="float32"
    )
    run = Running(create_app(eng, model_name=MODEL))
    try:
        c = openai.OpenAI(base_url=run.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        ask = dict(
            model=MODEL,
            messages=user("Weather in Paris?"),
            max_tokens=150,
            temperature=1.0,
            seed=3,
            n=3,
            tools=[WEATHER],
            tool_choice="required",
        )
        r = c.chat.completions.create(**ask)
        for ch in r.choices:
            assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch
            for t in ch.message.tool_calls:
                assert t.function.name == "get_weather"
                jsonschema.validate(json.loads(t.function.arguments), WEATHER["function"]["parameters"])
        streamed: dict[int, list] = {0: [], 1: [], 2: []}
        finishes: dict[int, list] = {0: [], 1: [], 2: []}
        for chunk in c.chat.completions.create(**ask, stream=True):
            for ch in chunk.choices:
                streamed[ch.index] += [t.function.arguments for t in ch.delta.tool_calls or []]
                if ch.finish_reason:
                    finishes[ch.index].append(ch.finish_reason)
        assert finishes == {i: ["tool_calls"] for i in range(3)}
        assert [streamed[i] for i in range(3)] == [
            [t.function.arguments for t in ch.message.tool_calls] for ch in r.choices
        ]
        eng.check_integrity()
    finally:
        run.stop()
        eng.close()
