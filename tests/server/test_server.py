"""chatkv serve over loopback, driven by the official ``openai`` client: plain and streamed chat
completions equal to the engine's own greedy replies, cached tokens in ``usage``, text
completions, embeddings, 8 concurrent streams, a stateless 10-turn chat that hits its whole
history, session continuity by header, and ``/metrics`` read with prometheus_client's parser.

One tiny random llama (tests/support/tiny.py) on one started engine; the server is uvicorn in a thread
on a free loopback port (tests/support/serving.py).
"""

from __future__ import annotations

import json
import math
import threading

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from chatkv.engine.metrics import engine_stats
from chatkv.engine.sampling import SamplingParams
from chatkv.server import create_app
from tests.support.serving import BLOCK, MODEL, Running, client, engine, raw, server, user  # noqa: F401 - fixtures

# a long system prompt, as a RAG client's documents would be: the new message is a small part of each turn
SYSTEM = ("You are a helpful assistant. " + "The quick brown fox jumps over the lazy dog. " * 36).strip()


def greedy(engine, messages, max_tokens):
    return engine.generate(engine.encode_chat(messages), SamplingParams(max_tokens=max_tokens, temperature=0))


# ------------------------------------------------------------------ completions


def test_plain_chat_completion_equals_the_engines_greedy_reply(engine, client):
    msgs = [{"role": "system", "content": "Be brief."}, *user("What is the capital of France?")]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    ref = greedy(engine, msgs, 12)
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(engine.encode_chat(msgs))
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_chat_matches_plain_and_reports_cached_tokens(engine, client):
    msgs = user("Tell me about key-value caches and attention state.")
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    usage = chunks[-1].usage
    # the same prompt again: every full block of it is a prefix-cache hit, reported as OpenAI does
    n = usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens >= (n - 1) // BLOCK * BLOCK > 0
    assert usage.completion_tokens == plain.usage.completion_tokens
    split = usage.model_extra["chatkv"]
    assert (
        split["cached_tokens"] + split["host_tokens"] + split["restored_tokens"]
        == usage.prompt_tokens_details.cached_tokens
    )
    assert split["computed_tokens"] == n - usage.prompt_tokens_details.cached_tokens
    assert 0 <= split["accepted_tokens"] <= split["proposed_tokens"]  # speculative decoding's, when it ran


def test_text_completions_models_health_and_embeddings(engine, server, client):
    prompt = "The quick brown fox"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    ref = engine.generate(prompt, SamplingParams(max_tokens=6, temperature=0))
    assert r.object == "text_completion" and r.choices[0].text == ref.text
    batch = client.completions.create(model=MODEL, prompt=[prompt, "Paris is"], max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == ref.text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True)
        if c.choices
    )
    assert streamed == ref.text
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == MODEL and "all-MiniLM-L6-v2" in ids
    status, body, _ = raw(server.url, "/health")
    assert status == 200 and body["status"] == "ok"
    e = client.embeddings.create(model="all-MiniLM-L6-v2", input=["a cat sat", "a cat sat", "tax law"])  # base64
    vecs = [d.embedding for d in e.data]
    assert len(vecs) == 3 and len(vecs[0]) == 384 and vecs[0] == vecs[1] and e.usage.prompt_tokens > 0
    dot = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731
    assert math.isclose(dot(vecs[0], vecs[0]), 1.0, rel_tol=1e-4) and dot(vecs[0], vecs[2]) < 0.9
    floats = client.embeddings.create(model="all-MiniLM-L6-v2", input="a cat sat", encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(vecs[0], abs=1e-6)


def test_eight_concurrent_streams_each_equal_their_solo_reply(engine, client):
    prompts = [user(f"Question number {i}: what is {i} plus {i}?") for i in range(8)]
    solo = [greedy(engine, m, 20).text for m in prompts]
    got: dict[int, str] = {}
    errors = []
    start = threading.Barrier(8)

    def run(i):
        try:
            start.wait(10)
            stream = client.chat.completions.create(
                model=MODEL, messages=prompts[i], max_tokens=20, temperature=0, stream=True
            )
            got[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and [got.get(i) for i in range(8)] == solo
    engine.check_integrity()


# ------------------------------------------------------------------ the history's KV


def ten_turns(url: str, system: str) -> list:
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    msgs = [{"role": "system", "content": system}, *user("Hello, how are you today?")]
    usages = []
    for turn in range(10):
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
        usages.append(r.usage)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, *user(f"Tell me more about {turn}.")]
    return usages


def test_stateless_ten_turn_chat_hits_its_whole_history(engine, server):
    """The client re-sends everything each turn; the replies' text does not re-tokenise to the ids the
    model produced (a random model's bytes come back as U+FFFD), yet every turn after the first finds
    its whole history in the prefix cache, because the server maps the messages back to those ids."""
    usages = ten_turns(server.url, SYSTEM)
    for prev, u in zip(usages, usages[1:]):
        history = prev.prompt_tokens + prev.completion_tokens  # the previous prompt and its reply
        cached = u.prompt_tokens_details.cached_tokens
        assert cached >= history - BLOCK, (cached, history)  # all but the last, partial block
        assert cached >= 0.9 * u.prompt_tokens, (cached, u.prompt_tokens)
    assert server.app.state.chatkv.history.hits >= 9

    # the same chat without the map (another server on the same engine, another system prompt):
    # the re-tokenised replies miss, which is what the map is for
    bare = Running(create_app(engine, model_name=MODEL, history_tokens=0))
    try:
        usages = ten_turns(bare.url, SYSTEM + " Once more.")
    finally:
        bare.stop()
    missed = [
        u.prompt_tokens_details.cached_tokens < p.prompt_tokens + p.completion_tokens - BLOCK
        for p, u in zip(usages, usages[1:])
    ]
    assert sum(missed) >= 5, missed


# ------------------------------------------------------------------ sessions


def test_session_continuity_by_header(engine, client, server):
    params = dict(max_tokens=12, temperature=0)
    first = user("Name a prime number.")
    raw_r = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be terse."}, *first],
        extra_headers={"X-Session-Id": "new"},
        **params,
    )
    sid = raw_r.headers["x-session-id"]
    r1 = raw_r.parse()
    assert r1.model_extra["session_id"] == sid
    r2 = client.chat.completions.create(
        model=MODEL, messages=user("And another?"), extra_headers={"X-Session-Id": sid}, **params
    )
    # the same two turns through the SDK's own session give the same replies
    ref = engine.session(system="Be terse.", params=params)
    assert [ref.send("Name a prime number.").text, ref.send("And another?").text] == [
        r1.choices[0].message.content,
        r2.choices[0].message.content,
    ]
    ref.close()
    # the history's KV stayed in memory between the two requests
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens + r1.usage.completion_tokens - BLOCK
    a1, a2 = r1.choices[0].message.content, r2.choices[0].message.content
    stored = [(m.role, m.content) for m in engine.resume(sid).messages()]
    assert stored == [("user", "Name a prime number."), ("assistant", a1), ("user", "And another?"), ("assistant", a2)]

    # the whole conversation sent back as stored, by the body field, streamed: accepted
    history = [
        {"role": "system", "content": "Be terse."},
        *first,
        {"role": "assistant", "content": a1},
        *user("And another?"),
        {"role": "assistant", "content": a2},
    ]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=history + user("Thanks."), stream=True, extra_body={"session_id": sid}, **params
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(engine.resume(sid).messages()) == 6
    # a history that disagrees with the stored one: 409, nothing stored
    wrong = [*first, {"role": "assistant", "content": "something else"}, *user("Hm?")]
    status, body, _ = raw(
        server.url, "/v1/chat/completions", {"model": MODEL, "messages": wrong, **params}, {"X-Session-Id": sid}
    )
    assert status == 409 and body["error"]["code"] == "session_history_mismatch"
    assert len(engine.resume(sid).messages()) == 6
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(
            model=MODEL, messages=user("Hi"), extra_headers={"X-Session-Id": "0" * 32}, **params
        )
    assert e.value.body["code"] == "session_not_found"
    # while the conversation answers someone else (here the SDK, mid-reply): 409, nothing stored
    turn = engine.resume(sid).stream("Busy?", SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    next(turn)
    try:
        with pytest.raises(openai.ConflictError) as e:
            client.chat.completions.create(
                model=MODEL, messages=user("Me too?"), extra_headers={"X-Session-Id": sid}, **params
            )
        assert e.value.body["code"] == "session_busy"
    finally:
        turn.close()  # the SDK's reply stops there, kept as interrupted
    assert [m.content for m in engine.resume(sid).messages()].count("Me too?") == 0


# ------------------------------------------------------------------ metrics


def scrape(url: str) -> dict:
    status, text, headers = raw(url, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = (
                family.type,
                s.value,
            )
    return out


def value(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), (None, 0.0))[1]


def test_metrics_parse_and_count_what_the_requests_report(server, client):
    before = scrape(server.url)
    msgs = user("Count these tokens, please.")
    r1 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=9, temperature=0)
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=9, temperature=0)
    after = scrape(server.url)
    types = {name: t for (name, _), (t, _) in after.items()}
    for name, kind in [
        ("chatkv:kv_cache_usage_perc", "gauge"),
        ("chatkv:num_requests_running", "gauge"),
        ("chatkv:num_requests_waiting", "gauge"),
        ("chatkv:prompt_tokens_total", "counter"),
        ("chatkv:generation_tokens_total", "counter"),
        ("chatkv:prefix_cache_queries_total", "counter"),
        ("chatkv:prefix_cache_hits_total", "counter"),
        ("chatkv:prompt_tokens_cached_total", "counter"),
        ("chatkv:prompt_tokens_computed_total", "counter"),
        ("chatkv:time_to_first_token_seconds_bucket", "histogram"),
        ("chatkv:inter_token_latency_seconds_count", "histogram"),
        ("chatkv:e2e_request_latency_seconds_sum", "histogram"),
    ]:
        assert types.get(name) == kind, name
    delta = lambda name, **lab: value(after, name, **lab) - value(before, name, **lab)  # noqa: E731
    us = [r1.usage, r2.usage]
    assert delta("chatkv:generation_tokens_total") == sum(u.completion_tokens for u in us)
    assert (
        delta("chatkv:prompt_tokens_total")
        == delta("chatkv:prefix_cache_queries_total")
        == sum(u.prompt_tokens for u in us)
    )
    assert delta("chatkv:prefix_cache_hits_total") == sum(u.prompt_tokens_details.cached_tokens for u in us) > 0
    assert delta("chatkv:prompt_tokens_computed_total") == sum(u.model_extra["chatkv"]["computed_tokens"] for u in us)
    assert delta("chatkv:time_to_first_token_seconds_count") == 2
    assert delta("chatkv:e2e_request_latency_seconds_count") == 2
    assert delta("chatkv:inter_token_latency_seconds_count") == sum(u.completion_tokens - 1 for u in us)
    assert delta("chatkv:request_success_total", finished_reason=r1.choices[0].finish_reason) == 2
    assert 0 <= value(after, "chatkv:kv_cache_usage_perc") <= 1
    assert value(after, "chatkv:num_requests_running") == value(after, "chatkv:num_requests_waiting") == 0
    assert value(after, "chatkv:server_requests_in_flight") == 0
    assert value(after, "chatkv:server_history_hits_total") == server.app.state.chatkv.history.hits


def test_a_client_that_goes_away_mid_stream_frees_its_request(engine, server):
    """The connection closed after the first chunk of a 3,000-token reply: the request is
    cancelled, its blocks freed and its concurrency slot returned (waited for, not timed)."""
    import http.client
    import time

    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=30)
    body = {"model": MODEL, "messages": user("Go on forever."), "max_tokens": 3000, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.sock.shutdown(2)
    conn.close()
    state = server.app.state.chatkv
    deadline = time.monotonic() + 30
    while state.limit.running or engine_stats(engine)["num_running"]:
        assert time.monotonic() < deadline, "the abandoned request is still running"
        time.sleep(0.05)
    engine.check_integrity()
    m = scrape(server.url)
    assert value(m, "chatkv:request_success_total", finished_reason="aborted") >= 1
