"""Log probabilities, logit bias and presence/frequency penalties over HTTP, driven by the
official ``openai`` client against ``chatkv serve`` on a tiny random float32 llama.

- chat ``logprobs``/``top_logprobs``, plain and streamed, equal transformers' float32
  log-softmax of the reply's positions within 1e-3, in OpenAI's shape (token, logprob, bytes,
  top_logprobs); the streamed chunks' logprobs, joined, are the plain reply's;
- text completions' ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset), plain and
  streamed, equal the engine's own;
- ``logit_bias`` (string keys) and the penalties give the engine's replies with the same
  SamplingParams;
- hostile values (``top_logprobs=10**6``, a million ``logit_bias`` entries, non-integer keys,
  ids outside the vocabulary, NaN penalties) are each a 400 naming the field, and the server
  keeps answering.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch

from chatkv.engine.sampling import SamplingParams
from chatkv.server import create_app
from tests.support.serving import MODEL, Running, client, engine, raw, server, user  # noqa: F401 - fixtures


@pytest.fixture(scope="module")
def ref(engine):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=torch.float32).eval()


def hf_logprobs(ref, prompt: list[int], generated: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + generated])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)], dim=-1)


def test_chat_logprobs_equal_transformers_plain_and_streamed(engine, client, ref):
    msgs = user("What is the capital of France?")
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=10, temperature=0, logprobs=True, top_logprobs=4
    )
    ref_reply = engine.generate(engine.encode_chat(msgs), SamplingParams(max_tokens=10, temperature=0))
    content = r.choices[0].logprobs.content
    ids = ref_reply.token_ids
    if ref_reply.finish_reason == "stop":
        ids = ids[:-1]  # the stop token is not reported
    assert len(content) == len(ids) > 0
    want = hf_logprobs(ref, engine.encode_chat(msgs), ref_reply.token_ids)
    tok = engine.tokenizer
    for i, (c, t) in enumerate(zip(content, ids)):
        assert abs(c.logprob - float(want[i, t])) < 1e-3
        assert c.token == tok.decode([t])
        if "\ufffd" not in c.token:  # a whole token's bytes are its text's; part of a character: its own bytes
            assert bytes(c.bytes) == c.token.encode()
        assert len(c.top_logprobs) == 4 and c.top_logprobs[0].token == c.token  # greedy: the best first
        top = torch.topk(want[i], 4)
        assert [a.logprob for a in c.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-3)
        assert [a.token for a in c.top_logprobs] == [tok.decode([j]) for j in top.indices.tolist()]
    assert any("\ufffd" in c.token for c in content)  # this reply splits characters across tokens
    text = b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace")
    assert text.rstrip("\ufffd") == r.choices[0].message.content.rstrip("\ufffd")
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=10, temperature=0, logprobs=True, top_logprobs=4, stream=True
        )
    )
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob, [a.logprob for a in c.top_logprobs]) for c in streamed] == [
        (c.token, c.logprob, [a.logprob for a in c.top_logprobs]) for c in content
    ]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


def test_completion_logprobs_plain_and_streamed_equal_the_engines(engine, client):
    prompt = "The quick brown fox"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    mine = engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0, logprobs=3))
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e.logprob for e in mine.logprobs], abs=1e-6)
    tok = engine.tokenizer
    assert lp.tokens == [tok.decode([e.token_id]) for e in mine.logprobs]
    # a dict per token, as OpenAI's: alternatives whose text is the same (parts of characters) share a key
    assert lp.top_logprobs == [{tok.decode([t]): v for t, v in e.top} for e in mine.logprobs]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert "".join(lp.tokens) == r.choices[0].text
    chunks = list(
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3, stream=True)
    )
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [t for p in parts for t in p.token_logprobs] == lp.token_logprobs
    assert [t for p in parts for t in p.text_offset] == lp.text_offset


def test_logit_bias_and_penalties_reach_the_sampler(engine, client):
    msgs = user("Tell me about key-value caches.")
    ids = engine.encode_chat(msgs)
    forced = engine.tokenizer.encode(" fox")[0]
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=4, temperature=0, logit_bias={str(forced): 100}
    )
    assert r.choices[0].message.content == engine.tokenizer.decode([forced] * 4)
    kw = dict(max_tokens=16, temperature=0, presence_penalty=1.2, frequency_penalty=0.8)
    r = client.chat.completions.create(model=MODEL, messages=msgs, **kw)
    mine = engine.generate(ids, SamplingParams(**kw))
    assert r.choices[0].message.content == mine.text
    plain = engine.generate(ids, SamplingParams(max_tokens=16, temperature=0))
    assert mine.token_ids != plain.token_ids  # the penalties changed the reply
    c = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=6, temperature=0, logit_bias={"7": -100})
    assert (
        c.choices[0].text
        == engine.generate("Paris is", SamplingParams(max_tokens=6, temperature=0, logit_bias={7: -100})).text
    )


@pytest.mark.parametrize(
    "path,extra,param",
    [
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 10**6}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": 5}, "logprobs"),
        ("/v1/chat/completions", {"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"1.5": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"-3": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": [1]}, "logit_bias"),
        ("/v1/chat/completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/chat/completions", {"frequency_penalty": "1"}, "frequency_penalty"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ],
)
def test_hostile_values_are_400s_naming_the_field(server, path, extra, param):
    body = {"model": MODEL, "max_tokens": 2, **extra}
    body.update({"messages": user("hi")} if "chat" in path else {"prompt": "hi"})
    status, out, _ = raw(server.url, path, body)
    assert status == 400 and out["error"]["param"] == param, out
    assert raw(server.url, "/health")[0] == 200


def test_a_million_logit_bias_entries_is_a_400_where_the_body_limit_lets_them_in(engine):
    """The default 4 MiB body limit refuses such a body before it is read (413); past a raised
    limit, the entry count is refused before any entry is looked at."""
    big = Running(create_app(engine, model_name=MODEL, max_request_bytes=64 * 2**20))
    try:
        body = {"model": MODEL, "max_tokens": 2, "messages": user("hi")}
        body["logit_bias"] = {str(i): 1 for i in range(10**6)}
        status, out, _ = raw(big.url, "/v1/chat/completions", body)
        assert status == 400 and out["error"]["param"] == "logit_bias" and "at most 1024" in out["error"]["message"]
        body["logit_bias"] = {"5": 1}
        assert raw(big.url, "/v1/chat/completions", body)[0] == 200
    finally:
        big.stop()


def test_nan_penalties_and_ids_outside_the_vocabulary_are_400s(engine, server, client):
    for name in ("presence_penalty", "frequency_penalty"):
        body = b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "%s": NaN}' % (
            MODEL.encode(),
            name.encode(),
        )
        status, out, _ = raw(server.url, "/v1/chat/completions", body)
        assert status == 400 and out["error"]["param"] == name, out
    vocab = engine.model.embed.shape[0]
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2, logit_bias={str(vocab): 1})
    with pytest.raises(openai.BadRequestError, match="without a session"):
        client.chat.completions.create(
            model=MODEL, messages=user("hi"), max_tokens=2, logprobs=True, extra_headers={"X-Session-Id": "new"}
        )
    r = client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")  # still serving
    assert json.loads(json.dumps(r.model_dump()))["choices"][0]["logprobs"] is None
