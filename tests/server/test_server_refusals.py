"""chatkv serve's refusals, each an OpenAI-style JSON error with the right status (malformed
JSON, too long, bad or unsupported parameters, unknown paths; an unknown or missing model under
``strict_model_names``), the API key, the body size and concurrency limits, and the ``chatkv
serve`` command itself: a process that answers, then shuts down gracefully on SIGTERM, its
conversation restorable afterwards.
"""

from __future__ import annotations

import http.client
import json
import signal

import openai
import pytest

from chatkv.engine.core import Engine
from chatkv.server import create_app
from tests.support.serving import KEY, MODEL, Running, client, engine, raw, serve_process, server, tiny_model, user  # noqa: F401 - fixtures


@pytest.fixture(scope="module")
def strict(engine):
    run = Running(create_app(engine, model_name=MODEL, strict_model_names=True))
    yield run
    run.stop()


@pytest.fixture(scope="module")
def guarded(engine):
    run = Running(create_app(engine, model_name=MODEL, api_key=KEY, max_concurrency=1, max_request_bytes=4096))
    yield run
    run.stop()


# ------------------------------------------------------------------ refusals

OK = {"model": MODEL, "messages": user("Hi"), "max_tokens": 4}
CHAT = "/v1/chat/completions"
BAD = [  # (what, path, body, status, code, param)
    ("malformed JSON", CHAT, b'{"model": "tiny", "messages": [', 400, "invalid_json", None),
    ("not an object", CHAT, b"[1, 2]", 400, "invalid_json", None),
    ("no messages", CHAT, {**OK, "messages": []}, 400, "invalid_value", "messages"),
    (
        "ends with the assistant",
        CHAT,
        {**OK, "messages": [{"role": "assistant", "content": "x"}]},
        400,
        "invalid_value",
        "messages",
    ),
    (
        "unknown role",
        CHAT,
        {**OK, "messages": [{"role": "robot", "content": "x"}]},
        400,
        "invalid_value",
        "messages[0].role",
    ),
    (
        "an image",
        CHAT,
        {**OK, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "unsupported_parameter",
        "messages[0].content",
    ),
    ("n past its bound", CHAT, {**OK, "n": 10**9}, 400, "invalid_value", "n"),
    (
        "temperature NaN",
        CHAT,
        b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}',
        400,
        "invalid_value",
        "temperature",
    ),
    ("temperature 3", CHAT, {**OK, "temperature": 3}, 400, "invalid_value", "temperature"),
    ("temperature a string", CHAT, {**OK, "temperature": "0.5"}, 400, "invalid_value", "temperature"),
    ("top_p 0", CHAT, {**OK, "top_p": 0}, 400, "invalid_value", "top_p"),
    ("max_tokens 0", CHAT, {**OK, "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    ("max_tokens true", CHAT, {**OK, "max_tokens": True}, 400, "invalid_value", "max_tokens"),
    ("five stop strings", CHAT, {**OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value", "stop"),
    ("seed negative", CHAT, {**OK, "seed": -1}, 400, "invalid_value", "seed"),
    ("top_logprobs 21", CHAT, {**OK, "logprobs": True, "top_logprobs": 21}, 400, "invalid_value", "top_logprobs"),
    (
        "functions (deprecated; tools are taken now: test_server_tools)",
        CHAT,
        {**OK, "functions": [{"name": "f"}]},
        400,
        "unsupported_parameter",
        "functions",
    ),
    ("presence penalty 3", CHAT, {**OK, "presence_penalty": 3}, 400, "invalid_value", "presence_penalty"),
    ("an unknown field", CHAT, {**OK, "frobnicate": 1}, 400, "unknown_parameter", "frobnicate"),
    (
        "stream_options without stream",
        CHAT,
        {**OK, "stream_options": {"include_usage": True}},
        400,
        "invalid_value",
        "stream_options",
    ),
    ("too long", CHAT, {**OK, "messages": user("fox " * 5000)}, 400, "context_length_exceeded", "messages"),
    ("too long with max_tokens", CHAT, {**OK, "max_tokens": 4090}, 400, "context_length_exceeded", "messages"),
    (
        "a lone surrogate",
        CHAT,
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        "invalid_value",
        None,
    ),
    ("completion without prompt", "/v1/completions", {"model": MODEL}, 400, "missing_parameter", "prompt"),
    (
        "token id outside the vocabulary",
        "/v1/completions",
        {"model": MODEL, "prompt": [1, 99999]},
        400,
        "invalid_value",
        None,
    ),
    ("echo", "/v1/completions", {"model": MODEL, "prompt": "x", "echo": True}, 400, "unsupported_parameter", "echo"),
    ("no embedding input", "/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": []}, 400, "invalid_value", "input"),
    ("unknown path", "/v1/engines", {}, 404, "not_found", None),
    ("GET a POST route", CHAT, None, 405, "method_not_allowed", None),
]


# what a server made with strict_model_names=True refuses (by default any name, or none, reaches
# the served model: test_server_names_routes.py)
STRICT_BAD = [
    ("unknown model", CHAT, {**OK, "model": "gpt-4o"}, 404, "model_not_found", "model"),
    ("no model", CHAT, {"messages": user("Hi")}, 400, "missing_parameter", "model"),
    ("no model for completions", "/v1/completions", {"prompt": "x"}, 400, "missing_parameter", "model"),
    ("chat model for embeddings", "/v1/embeddings", {"model": MODEL, "input": "x"}, 404, "model_not_found", "model"),
    ("no model for embeddings", "/v1/embeddings", {"input": "x"}, 400, "missing_parameter", "model"),
    (
        "unknown model for responses",
        "/v1/responses",
        {"model": "gpt-4o", "input": "x"},
        404,
        "model_not_found",
        "model",
    ),
]


def _openai_error(url, path, body, status, code, param) -> None:
    got, err, _ = raw(url, path, body)
    assert got == status, err
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
    e = err["error"]
    assert e["code"] == code and e["param"] == param and e["type"] == "invalid_request_error"
    assert isinstance(e["message"], str) and len(e["message"]) > 10


@pytest.mark.parametrize("what,path,body,status,code,param", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_errors(server, what, path, body, status, code, param):
    _openai_error(server.url, path, body, status, code, param)


@pytest.mark.parametrize("what,path,body,status,code,param", STRICT_BAD, ids=[b[0] for b in STRICT_BAD])
def test_strict_model_names_refusals_get_openai_errors(strict, what, path, body, status, code, param):
    _openai_error(strict.url, path, body, status, code, param)


def test_the_openai_client_raises_its_own_errors(client, strict):
    strict_client = openai.OpenAI(base_url=strict.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError) as e:
        strict_client.chat.completions.create(model="gpt-4o", messages=user("Hi"))
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=user("Hi"), n=10**9)
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
    conn = http.client.HTTPConnection(guarded.url.removeprefix("http://"), timeout=30)
    payload = json.dumps(big).encode()
    conn.request(
        "POST",
        CHAT,
        body=iter([payload[i : i + 1000] for i in range(0, len(payload), 1000)]),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        encode_chunked=True,
    )
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


# ------------------------------------------------------------------ the command


def test_chatkv_serve_answers_then_shuts_down_gracefully(tmp_path_factory):
    """``chatkv serve`` in its own process: SIGTERM while a reply streams lets it finish, exits 0,
    and the conversation it served resumes in a new engine with its KV restored from disk (int8
    KV, as ``--kv-dtype`` asked: an engine of another kv dtype would recompute it)."""
    model_dir, data = tiny_model(tmp_path_factory), tmp_path_factory.mktemp("served")
    proc, url = serve_process(
        model_dir,
        data,
        "--api-key",
        KEY,
        "--log-level",
        "warning",
        "--dtype",
        "float32",
        "--kv-dtype",
        "int8",
        "--graceful-timeout",
        "120",
    )
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        r = c.chat.completions.with_raw_response.create(
            model=model_dir.name,
            messages=user("Remember me."),
            max_tokens=8,
            temperature=0,
            extra_headers={"X-Session-Id": "new"},
        )
        sid, first = r.headers["x-session-id"], r.parse()
        stream = c.chat.completions.create(
            model=model_dir.name,
            messages=user("A long answer, please."),
            max_tokens=400,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True},
        )
        chunks = [next(iter(stream))]
        proc.send_signal(signal.SIGTERM)  # with the reply in flight
        chunks += list(stream)
        assert chunks[-1].usage.completion_tokens == 400
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [
            "length"
        ]
        assert proc.wait(150) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    eng = Engine.from_pretrained(str(model_dir), data_dir=str(data), dtype="float32", kv_dtype="int8")
    try:
        s = eng.resume(sid)
        assert [(m.role, m.content) for m in s.messages()] == [
            ("user", "Remember me."),
            ("assistant", first.choices[0].message.content),
        ]
        reply = s.send("Still there?")
        assert reply.usage.restored_tokens > 0  # the KV the server wrote to disk
    finally:
        eng.close()


def test_an_engine_closed_under_the_server_answers_503_shutting_down(tmp_path_factory):
    """EngineClosed (chatkv.engine.closing) reaching a route is the server stopping: 503 ``shutting_down``,
    not a 500 internal error."""
    eng = Engine.from_pretrained(
        str(tiny_model(tmp_path_factory)),
        data_dir=str(tmp_path_factory.mktemp("data")),
        block_size=4,
        num_blocks=256,
        dtype="float32",
    )
    run = Running(create_app(eng, model_name=MODEL))
    try:
        assert raw(run.url, "/v1/chat/completions", OK)[0] == 200
        eng.close()
        for body in (OK, {**OK, "stream": True}, {"model": MODEL, "prompt": "Hi", "max_tokens": 2}):
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            status, got, _ = raw(run.url, path, body)
            assert status == 503 and got["error"]["code"] == "shutting_down", (body, status, got)
    finally:
        run.stop()
