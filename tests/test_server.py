"""chatkv serve over loopback, driven by the official ``openai`` client (and raw HTTP where a
client would not send what is tested: malformed JSON, a body too large).

One tiny random llama (tests/tiny.py) and one started engine serve two apps on free loopback
ports, each in a uvicorn thread: an open one, and one with an API key, a concurrency limit
of 1 and a 4 KiB body limit. Replies are compared with the engine's own greedy results.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")  # the test extra (scripts/install.sh installs it)
import uvicorn  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from chatkv.engine import Engine  # noqa: E402
from chatkv.sampling import SamplingParams  # noqa: E402
from chatkv.server import create_app  # noqa: E402
from tests.tiny import make_model  # noqa: E402

MODEL = "tiny"
KEY = "sekret-key"
BLOCK = 4
# a long system prompt, as a RAG client's documents would be: the new message is a small part of each turn
SYSTEM = ("You are a helpful assistant. " + "The quick brown fox jumps over the lazy dog. " * 36).strip()


class Running:
    """A uvicorn server in a thread on a free loopback port."""

    def __init__(self, app):
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("model")
    make_model(model_dir, "llama", max_position_embeddings=4096)
    eng = Engine.from_pretrained(str(model_dir), data_dir=str(tmp_path_factory.mktemp("data")), block_size=BLOCK,
                                 num_blocks=2048, dtype="float32")
    yield eng
    eng.check_integrity()
    eng.close()
    assert not any(t.name == "chatkv-engine" and t.is_alive() for t in threading.enumerate())


@pytest.fixture(scope="module")
def server(engine):
    run = Running(create_app(engine, model_name=MODEL))
    yield run
    run.stop()


@pytest.fixture(scope="module")
def guarded(engine):
    run = Running(create_app(engine, model_name=MODEL, api_key=KEY, max_concurrency=1, max_request_bytes=4096))
    yield run
    run.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def raw(url: str, path: str, body=None, headers=None, method=None) -> tuple[int, dict | str, dict]:
    """(status, JSON body or text, headers) of one HTTP request; ``body``: bytes or JSON-able."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, text, hdrs = r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as e:
        status, text, hdrs = e.code, e.read().decode(), e.headers
    hdrs = {k.lower(): v for k, v in hdrs.items()}
    try:
        return status, json.loads(text), hdrs
    except ValueError:
        return status, text, hdrs


def greedy(engine, messages, max_tokens):
    return engine.generate(engine.encode_chat(messages), SamplingParams(max_tokens=max_tokens, temperature=0))


def user(text):
    return [{"role": "user", "content": text}]


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
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
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
    assert split["cached_tokens"] + split["host_tokens"] + split["restored_tokens"] == usage.prompt_tokens_details.cached_tokens
    assert split["computed_tokens"] == n - usage.prompt_tokens_details.cached_tokens


def test_text_completions_models_health_and_embeddings(engine, server, client):
    prompt = "The quick brown fox"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    ref = engine.generate(prompt, SamplingParams(max_tokens=6, temperature=0))
    assert r.object == "text_completion" and r.choices[0].text == ref.text
    batch = client.completions.create(model=MODEL, prompt=[prompt, "Paris is"], max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == ref.text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True) if c.choices)
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
            stream = client.chat.completions.create(model=MODEL, messages=prompts[i], max_tokens=20, temperature=0,
                                                    stream=True)
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
    missed = [u.prompt_tokens_details.cached_tokens < p.prompt_tokens + p.completion_tokens - BLOCK
              for p, u in zip(usages, usages[1:])]
    assert sum(missed) >= 5, missed


# ------------------------------------------------------------------ sessions


def test_session_continuity_by_header(engine, client, server):
    params = dict(max_tokens=12, temperature=0)
    first = user("Name a prime number.")
    raw_r = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "system", "content": "Be terse."}, *first], extra_headers={"X-Session-Id": "new"},
        **params)
    sid = raw_r.headers["x-session-id"]
    r1 = raw_r.parse()
    assert r1.model_extra["session_id"] == sid
    r2 = client.chat.completions.create(model=MODEL, messages=user("And another?"), extra_headers={"X-Session-Id": sid},
                                        **params)
    # the same two turns through the SDK's own session give the same replies
    ref = engine.session(system="Be terse.", params=params)
    assert [ref.send("Name a prime number.").text, ref.send("And another?").text] == [
        r1.choices[0].message.content, r2.choices[0].message.content]
    ref.close()
    # the history's KV stayed in memory between the two requests
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens + r1.usage.completion_tokens - BLOCK
    a1, a2 = r1.choices[0].message.content, r2.choices[0].message.content
    stored = [(m.role, m.content) for m in engine.resume(sid).messages()]
    assert stored == [("user", "Name a prime number."), ("assistant", a1), ("user", "And another?"), ("assistant", a2)]

    # the whole conversation sent back as stored, by the body field, streamed: accepted
    history = [{"role": "system", "content": "Be terse."}, *first, {"role": "assistant", "content": a1},
               *user("And another?"), {"role": "assistant", "content": a2}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=history + user("Thanks."), stream=True,
                                                 extra_body={"session_id": sid}, **params))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(engine.resume(sid).messages()) == 6
    # a history that disagrees with the stored one: 409, nothing stored
    wrong = [*first, {"role": "assistant", "content": "something else"}, *user("Hm?")]
    status, body, _ = raw(server.url, "/v1/chat/completions", {"model": MODEL, "messages": wrong, **params},
                          {"X-Session-Id": sid})
    assert status == 409 and body["error"]["code"] == "session_history_mismatch"
    assert len(engine.resume(sid).messages()) == 6
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model=MODEL, messages=user("Hi"), extra_headers={"X-Session-Id": "0" * 32},
                                       **params)
    assert e.value.body["code"] == "session_not_found"


# ------------------------------------------------------------------ refusals

OK = {"model": MODEL, "messages": user("Hi"), "max_tokens": 4}
CHAT = "/v1/chat/completions"
BAD = [  # (what, path, body, status, code, param)
    ("malformed JSON", CHAT, b'{"model": "tiny", "messages": [', 400, "invalid_json", None),
    ("not an object", CHAT, b"[1, 2]", 400, "invalid_json", None),
    ("unknown model", CHAT, {**OK, "model": "gpt-4o"}, 404, "model_not_found", "model"),
    ("no model", CHAT, {"messages": user("Hi")}, 400, "missing_parameter", "model"),
    ("no messages", CHAT, {**OK, "messages": []}, 400, "invalid_value", "messages"),
    ("ends with the assistant", CHAT, {**OK, "messages": [{"role": "assistant", "content": "x"}]}, 400,
     "invalid_value", "messages"),
    ("unknown role", CHAT, {**OK, "messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_value",
     "messages[0].role"),
    ("an image", CHAT, {**OK, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "unsupported_parameter", "messages[0].content"),
    ("n > 1", CHAT, {**OK, "n": 2}, 400, "unsupported_parameter", "n"),
    ("temperature NaN", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}',
     400, "invalid_value", "temperature"),
    ("temperature 3", CHAT, {**OK, "temperature": 3}, 400, "invalid_value", "temperature"),
    ("temperature a string", CHAT, {**OK, "temperature": "0.5"}, 400, "invalid_value", "temperature"),
    ("top_p 0", CHAT, {**OK, "top_p": 0}, 400, "invalid_value", "top_p"),
    ("max_tokens 0", CHAT, {**OK, "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    ("max_tokens true", CHAT, {**OK, "max_tokens": True}, 400, "invalid_value", "max_tokens"),
    ("five stop strings", CHAT, {**OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value", "stop"),
    ("seed negative", CHAT, {**OK, "seed": -1}, 400, "invalid_value", "seed"),
    ("logprobs", CHAT, {**OK, "logprobs": True}, 400, "unsupported_parameter", "logprobs"),
    ("tools", CHAT, {**OK, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "unsupported_parameter",
     "tools"),
    ("presence penalty", CHAT, {**OK, "presence_penalty": 0.5}, 400, "unsupported_parameter", "presence_penalty"),
    ("an unknown field", CHAT, {**OK, "frobnicate": 1}, 400, "unknown_parameter", "frobnicate"),
    ("stream_options without stream", CHAT, {**OK, "stream_options": {"include_usage": True}}, 400, "invalid_value",
     "stream_options"),
    ("too long", CHAT, {**OK, "messages": user("fox " * 5000)}, 400, "context_length_exceeded", "messages"),
    ("too long with max_tokens", CHAT, {**OK, "max_tokens": 4090}, 400, "context_length_exceeded", "messages"),
    ("a lone surrogate", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     "invalid_value", None),
    ("completion without prompt", "/v1/completions", {"model": MODEL}, 400, "missing_parameter", "prompt"),
    ("token id outside the vocabulary", "/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, 400,
     "invalid_value", None),
    ("echo", "/v1/completions", {"model": MODEL, "prompt": "x", "echo": True}, 400, "unsupported_parameter", "echo"),
    ("no embedding input", "/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": []}, 400, "invalid_value", "input"),
    ("chat model for embeddings", "/v1/embeddings", {"model": MODEL, "input": "x"}, 404, "model_not_found", "model"),
    ("unknown path", "/v1/engines", {}, 404, "not_found", None),
    ("GET a POST route", CHAT, None, 405, "method_not_allowed", None),
]


@pytest.mark.parametrize("what,path,body,status,code,param", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_errors(server, what, path, body, status, code, param):
    got, err, _ = raw(server.url, path, body)
    assert got == status, err
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
    e = err["error"]
    assert e["code"] == code and e["param"] == param and e["type"] == "invalid_request_error"
    assert isinstance(e["message"], str) and len(e["message"]) > 10


def test_the_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=user("Hi"))
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=user("Hi"), n=3)
    assert e.value.body["param"] == "n"


def test_api_key_body_size_and_concurrency_limits(guarded):
    status, body, _ = raw(guarded.url, CHAT, OK)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body, _ = raw(guarded.url, CHAT, OK, {"Authorization": "Bearer wrong"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert raw(guarded.url, "/health")[0] == 200 and raw(guarded.url, "/metrics")[0] == 200  # probes need no key
    c = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert c.chat.completions.create(**OK).choices[0].message.content is not None

    big = {**OK, "messages": user("x" * 5000)}
    status, body, _ = raw(guarded.url, CHAT, big, {"Authorization": f"Bearer {KEY}"})
    assert status == 413 and body["error"]["code"] == "request_too_large"
    # without a Content-Length (chunked): read up to the limit only
    import http.client

    conn = http.client.HTTPConnection(guarded.url.removeprefix("http://"), timeout=30)
    payload = json.dumps(big).encode()
    conn.request("POST", CHAT, body=iter([payload[i:i + 1000] for i in range(0, len(payload), 1000)]),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "request_too_large"
    conn.close()

    # the one slot taken (as a running request holds it): the next request is refused at once
    slot = guarded.app.state.chatkv.limit.acquire()
    try:
        with pytest.raises(openai.RateLimitError) as e:
            c.chat.completions.create(**OK)
        assert e.value.status_code == 429 and e.value.body["code"] == "rate_limit_exceeded"
    finally:
        slot.release()
    assert c.chat.completions.create(**OK).choices[0].finish_reason in ("stop", "length")
    assert guarded.app.state.chatkv.limit.running == 0


# ------------------------------------------------------------------ metrics


def scrape(url: str) -> dict:
    status, text, headers = raw(url, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = (family.type, s.value)
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
    for name, kind in [("chatkv:kv_cache_usage_perc", "gauge"), ("chatkv:num_requests_running", "gauge"),
                       ("chatkv:num_requests_waiting", "gauge"), ("chatkv:prompt_tokens_total", "counter"),
                       ("chatkv:generation_tokens_total", "counter"), ("chatkv:prefix_cache_queries_total", "counter"),
                       ("chatkv:prefix_cache_hits_total", "counter"), ("chatkv:prompt_tokens_cached_total", "counter"),
                       ("chatkv:prompt_tokens_computed_total", "counter"),
                       ("chatkv:time_to_first_token_seconds_bucket", "histogram"),
                       ("chatkv:inter_token_latency_seconds_count", "histogram"),
                       ("chatkv:e2e_request_latency_seconds_sum", "histogram")]:
        assert types.get(name) == kind, name
    delta = lambda name, **lab: value(after, name, **lab) - value(before, name, **lab)  # noqa: E731
    us = [r1.usage, r2.usage]
    assert delta("chatkv:generation_tokens_total") == sum(u.completion_tokens for u in us)
    assert delta("chatkv:prompt_tokens_total") == delta("chatkv:prefix_cache_queries_total") == sum(
        u.prompt_tokens for u in us)
    assert delta("chatkv:prefix_cache_hits_total") == sum(u.prompt_tokens_details.cached_tokens for u in us) > 0
    assert delta("chatkv:prompt_tokens_computed_total") == sum(u.model_extra["chatkv"]["computed_tokens"] for u in us)
    assert delta("chatkv:time_to_first_token_seconds_count") == 2
    assert delta("chatkv:e2e_request_latency_seconds_count") == 2
    assert delta("chatkv:inter_token_latency_seconds_count") == sum(u.completion_tokens - 1 for u in us)
    assert delta("chatkv:request_success_total", finished_reason=r1.choices[0].finish_reason) == 2
    assert 0 <= value(after, "chatkv:kv_cache_usage_perc") <= 1
    assert value(after, "chatkv:num_requests_running") == value(after, "chatkv:num_requests_waiting") == 0
