"""The names and routes clients of other servers use, driven by the ``openai`` client where it is
the user: any model name, or none, reaches the served model (unless ``strict_model_names``),
aliases listed by /v1/models, a 404 that does not echo a 100 KB name, every route without its
``/v1`` prefix, and ``/tokenize`` / ``/detokenize`` in llama-server's and vLLM's shapes (chat
messages rendered as a chat completion renders them) with clear 400s."""

from __future__ import annotations

import openai
import pytest

from chatkv.server import create_app
from chatkv.server.cli import _parser
from tests.support.serving import MODEL, Running, client, engine, raw, server, user  # noqa: F401 - fixtures


@pytest.fixture(scope="module")
def strict(engine):
    run = Running(create_app(engine, model_name=MODEL, aliases=["gpt-4o-mini", "my-alias"], strict_model_names=True))
    yield run
    run.stop()


def test_any_model_name_reaches_the_served_model(client):
    r = client.chat.completions.create(model="gpt-3.5-turbo", messages=user("Hi"), max_tokens=4, temperature=0)
    same = client.chat.completions.create(model=MODEL, messages=user("Hi"), max_tokens=4, temperature=0)
    assert r.model == MODEL  # the reply names the model that answered
    assert r.choices[0].message.content == same.choices[0].message.content


NO_MODEL = [  # (path, body without a model, the reply's object)
    ("/v1/chat/completions", {"messages": user("Hi"), "max_tokens": 3, "temperature": 0}, "chat.completion"),
    ("/v1/completions", {"prompt": "Once", "max_tokens": 3, "temperature": 0}, "text_completion"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 3, "store": False}, "response"),
]


@pytest.mark.parametrize("path,body,obj", NO_MODEL, ids=[p for p, _, _ in NO_MODEL])
def test_a_request_without_a_model_is_answered_unless_names_are_strict(server, strict, path, body, obj):
    status, out, _ = raw(server.url, path, body)
    assert status == 200, out
    assert out["object"] == obj and out["model"] == MODEL  # answered by the served model, which it names
    status, err, _ = raw(strict.url, path, body)
    assert status == 400, err
    assert (err["error"]["code"], err["error"]["param"]) == ("missing_parameter", "model")
    assert raw(strict.url, path, {**body, "model": "my-alias"})[0] == 200


def test_embeddings_take_any_name_or_none_unless_names_are_strict(server, strict):
    """A client's own embedding model name (text-embedding-3-small) or none reaches the one
    embedding model, which the reply names; strict names want one of its names."""
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    theirs = c.embeddings.create(model="text-embedding-3-small", input=["a kettle", "a river"])
    status, none, _ = raw(server.url, "/v1/embeddings", {"input": ["a kettle", "a river"]})
    assert status == 200 and none["model"] == theirs.model == "all-MiniLM-L6-v2"
    assert [d["embedding"] for d in none["data"]] == [d.embedding for d in theirs.data]
    assert len(theirs.data[0].embedding) == 384
    status, err, _ = raw(strict.url, "/v1/embeddings", {"model": "text-embedding-3-small", "input": "x"})
    assert status == 404 and err["error"]["code"] == "model_not_found"
    assert raw(strict.url, "/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": "x"})[0] == 200


def test_embeddings_of_token_id_arrays_are_the_vectors_of_their_texts(server, client):
    """OpenAI's token-array input, in the embedding model's own ids: the ids its tokenizer makes
    of a text give that text's vector; one array alone too; an id outside the vocabulary, an
    empty array or a mixed list is a 400 naming ``input``."""
    from chatkv.retrieval import Embedder

    tok = Embedder().tokenizer
    texts = ["The kettle boils a litre in ninety seconds.", "A river runs through Paris."]
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    by_text = client.embeddings.create(model="x", input=texts)
    by_ids = client.embeddings.create(model="x", input=ids)
    one = client.embeddings.create(model="x", input=ids[0])
    for a, b in zip(by_text.data, by_ids.data):
        assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding)) < 1e-5
    assert max(abs(x - y) for x, y in zip(one.data[0].embedding, by_ids.data[0].embedding)) < 1e-5  # (padding)
    assert by_ids.usage.prompt_tokens == sum(len(i) for i in ids)
    for bad in ([[10**9]], [[]], [[1, 2], "text"], [1, "a"], [True, 2]):
        status, err, _ = raw(server.url, "/v1/embeddings", {"input": bad})
        assert status == 400 and err["error"]["param"] == "input", (bad, err)
    assert client.embeddings.create(model="x", input="still answering").data


def test_a_stream_opens_with_a_role_chunk_whose_content_is_null(client):
    """As llama-server and vLLM send it (a stream helper that rejects an empty content delta,
    llama.cpp's own tests' among them, reads it), the text following in later chunks."""
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=user("Hi"), max_tokens=4, temperature=0, stream=True)
    )
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content is None
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_aliases_are_listed_and_answered_and_strict_mode_refuses_others(strict):
    c = openai.OpenAI(base_url=strict.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    ids = [m.id for m in c.models.list().data]
    assert ids[:3] == [MODEL, "gpt-4o-mini", "my-alias"]
    r = c.chat.completions.create(model="my-alias", messages=user("Hi"), max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-3.5-turbo", messages=user("Hi"), max_tokens=3)
    assert e.value.body["code"] == "model_not_found" and "gpt-3.5-turbo" in e.value.body["message"]


def test_a_100_kb_model_name_is_not_echoed_whole(strict):
    name = "m" * 100_000
    status, err, _ = raw(strict.url, "/v1/chat/completions", {"model": name, "messages": user("Hi")})
    assert status == 404 and err["error"]["code"] == "model_not_found"
    msg = err["error"]["message"]
    assert len(msg) < 300 and "100000 characters" in msg
    assert raw(strict.url, "/v1/models")[0] == 200  # still serving


def test_every_route_answers_without_v1(server):
    bare = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    r = bare.chat.completions.create(model=MODEL, messages=user("Hi"), max_tokens=3, temperature=0)
    assert r.object == "chat.completion"
    c = bare.completions.create(model=MODEL, prompt="Once", max_tokens=3, temperature=0)
    assert c.object == "text_completion"
    assert MODEL in [m.id for m in bare.models.list().data]
    resp = bare.responses.create(model=MODEL, input="Hi", max_output_tokens=3, store=False)
    assert resp.object == "response"


@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_tokenize_and_detokenize_round_trip(engine, server, prefix):
    text = "What is the capital of France?"
    status, out, _ = raw(server.url, prefix + "/tokenize", {"content": text})
    assert status == 200, out
    ids = out["tokens"]
    assert ids == list(engine.tokenizer(text, add_special_tokens=False)["input_ids"]) and out["count"] == len(ids)
    status, back, _ = raw(server.url, prefix + "/detokenize", {"tokens": ids})
    assert status == 200 and back["content"] == text and back["prompt"] == text


def test_tokenize_takes_vllms_prompt_and_llama_servers_pieces(engine, server):
    status, out, _ = raw(server.url, "/tokenize", {"model": MODEL, "prompt": "Hello there"})
    assert status == 200 and out["tokens"] == list(engine.tokenizer("Hello there")["input_ids"])
    assert out["max_model_len"] == engine.context_window
    status, out, _ = raw(server.url, "/tokenize", {"content": "Hello there", "with_pieces": True})
    assert status == 200
    assert "".join(t["piece"] for t in out["tokens"]) == "Hello there"
    assert all(isinstance(t["id"], int) for t in out["tokens"])


def test_tokenize_renders_vllms_chat_messages_as_a_chat_completion_does(engine, server, client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    status, out, _ = raw(server.url, "/tokenize", {"model": MODEL, "messages": msgs, "return_token_strs": True})
    assert status == 200, out
    assert out["tokens"] == engine.encode_chat(msgs) and out["count"] == len(out["tokens"])
    assert "".join(out["token_strs"]) == engine.tokenizer.decode(out["tokens"])
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == out["count"]  # the count is what the chat completion's prompt costs
    status, bare, _ = raw(server.url, "/v1/tokenize", {"messages": msgs, "add_generation_prompt": False})
    assert status == 200 and bare["tokens"] == engine.encode_chat(msgs, add_generation_prompt=False)
    assert bare["count"] < out["count"] and out["tokens"][: bare["count"]] == bare["tokens"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]}]
    status, same, _ = raw(server.url, "/tokenize", {"messages": parts})
    assert status == 200 and same["tokens"] == engine.encode_chat(msgs[1:])


BAD = [  # (what, path, body, param, words in the message)
    ("an id that is a string", "/detokenize", {"tokens": [1, "2"]}, "tokens[1]", "integer"),
    ("an id that is a float", "/detokenize", {"tokens": [1.5]}, "tokens[0]", "integer"),
    ("an id that is a bool", "/detokenize", {"tokens": [True]}, "tokens[0]", "integer"),
    ("an id outside the vocabulary", "/detokenize", {"tokens": [3, 10**12]}, "tokens[1]", "not a token id"),
    ("a negative id", "/detokenize", {"tokens": [-1]}, "tokens[0]", "not a token id"),
    ("a huge list", "/detokenize", {"tokens": [1] * 200_000}, "tokens", "at most"),
    ("tokens not a list", "/detokenize", {"tokens": "1 2 3"}, "tokens", "list"),
    ("no tokens", "/detokenize", {}, "tokens", "tokens is required"),
    ("no content", "/tokenize", {}, "prompt", "content"),
    ("content not a string", "/tokenize", {"content": [1, 2]}, "content", "string"),
    ("add_special not a bool", "/tokenize", {"content": "x", "add_special": "yes"}, "add_special", "boolean"),
    ("an unknown field", "/tokenize", {"content": "x", "frob": 1}, "frob", "frob"),
    ("messages not a list", "/tokenize", {"messages": "Hi"}, "messages", "non-empty array"),
    ("an unknown role", "/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "one of"),
    (
        "an image part",
        "/tokenize",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0].content",
        "text parts",
    ),
    ("messages and content", "/tokenize", {"messages": user("x"), "content": "x"}, "messages", "not both"),
    (
        "add_generation_prompt without messages",
        "/tokenize",
        {"content": "x", "add_generation_prompt": True},
        "add_generation_prompt",
        "messages",
    ),
]


@pytest.mark.parametrize("what,path,body,param,words", BAD, ids=[b[0] for b in BAD])
def test_bad_tokenize_requests_are_clear_400s(server, what, path, body, param, words):
    status, err, _ = raw(server.url, path, body)
    assert status == 400, err
    assert err["error"]["param"] == param and words in err["error"]["message"]
    assert raw(server.url, "/tokenize", {"content": "still here"})[0] == 200


def test_serve_takes_aliases_and_strict_names():
    args = _parser().parse_args(
        ["--served-model-name", "a", "--served-model-name", "b", "--strict-model-names", "--port", "0"]
    )
    assert args.served_model_name == ["a", "b"] and args.strict_model_names
    assert not _parser().parse_args([]).strict_model_names
