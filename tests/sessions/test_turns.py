"""TurnRenderer (chatkv/sessions/template.py) with real tokenizers: the token deltas of a conversation."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from chatkv.errors import InvalidRequest
from chatkv.sessions.template import TurnRenderer
from tests.support.tiny import CHATML, make_tokenizer

IM_END = 2  # <|im_end|> in the tiny tokenizer, the model's stop token

# ChatML that shows earlier assistant turns differently once the conversation goes on
# (as templates that strip a past turn's thinking section do)
REWRITES = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}[earlier reply]{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Gemma-style: the template has no system role and raises for one
NO_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}" + CHATML
)
# Qwen3-style: a conversation without a user message is refused
NEEDS_USER = (
    "{% set ns = namespace(user=false) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.user = true %}{% endif %}{% endfor %}"
    "{% if not ns.user %}{{ raise_exception('No user query found in messages.') }}{% endif %}" + CHATML
)

SYSTEMS = ["You are a helpful assistant.", "Answer in French.\nBe brief.", "  spaced  system  "]
REPLIES = [
    "Paris is the capital of France.",
    "Line one\nline two  with  spaces\n",
    " leading space, and é日本 🙂",
    "",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    make_tokenizer(d)
    return d


def load(tok_dir, template: str | None = CHATML):
    tok = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load(tok_dir)


def encode(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def rendered(tok, messages) -> list[int]:
    """The conversation rendered and tokenised at once, as transformers does it."""
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


@pytest.mark.parametrize("system", [None] + SYSTEMS)
def test_first_is_apply_chat_template(tok, system):
    r = TurnRenderer(tok)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": "What is the capital of France?"}
    ]
    assert r.first(messages) == rendered(tok, messages)


@pytest.mark.parametrize("stopped", [True, False], ids=["stop-token", "cut-by-length"])
@pytest.mark.parametrize("system", [None, SYSTEMS[0]])
def test_deltas_equal_the_whole_conversation_rendered_at_once(tok, system, stopped):
    """For ChatML the token history built turn by turn is exactly the full render."""
    r = TurnRenderer(tok)
    conv = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": "Hello, how are you?"}
    ]
    tokens = r.first(conv)
    users = ["What is the capital of France?", "Thanks!\nAnd Italy?", "é 日本 🙂  two  spaces", "x" * 200]
    for reply, user in zip(REPLIES, users):
        generated = encode(tok, reply) + ([IM_END] if stopped else [])  # what the model produced
        tokens = tokens + generated + r.close_reply(generated) + r.user_turn(user)
        conv += [{"role": "assistant", "content": reply}, {"role": "user", "content": user}]
        assert tokens == rendered(tok, conv), conv


def test_close_reply_does_not_repeat_the_stop_token(tok):
    r = TurnRenderer(tok)
    closing = encode(tok, "<|im_end|>\n")
    assert closing[0] == IM_END and len(closing) == 2
    reply = encode(tok, "Paris.")
    assert r.close_reply(reply + [IM_END]) == closing[1:]
    assert r.close_reply(reply) == closing
    assert r.close_reply([]) == closing  # an interrupted, empty reply is still closed
    assert r.close_reply([IM_END]) == closing[1:]
    assert r.close_reply([IM_END, 5]) == closing  # only a final stop token counts
    # the result is a fresh list: callers may extend it
    r.close_reply(reply).append(99)
    assert r.close_reply(reply) == closing


def test_template_rewriting_earlier_turns_is_refused(tok_dir):
    r = TurnRenderer(load(tok_dir, REWRITES))
    r.first([{"role": "user", "content": "hi"}])  # the first turn has no earlier turn to rewrite
    with pytest.raises(InvalidRequest, match="rewrites earlier turns"):
        r.user_turn("and now?")


@pytest.mark.parametrize("template", [None, ""])
def test_tokenizer_without_chat_template(tok_dir, template):
    with pytest.raises(InvalidRequest, match="no chat template"):
        TurnRenderer(load(tok_dir, template))


@pytest.mark.parametrize("system", SYSTEMS)
def test_system_prefix_is_a_prefix_of_first(tok, system):
    r = TurnRenderer(tok)
    prefix = r.system_prefix(system)
    assert prefix == encode(tok, f"<|im_start|>system\n{system}<|im_end|>\n")
    for user in ["What is the capital of France?", " hi", "\n\nx"]:
        first = r.first([{"role": "system", "content": system}, {"role": "user", "content": user}])
        assert first[: len(prefix)] == prefix
    assert r.system_prefix(None) == [] and r.system_prefix("") == []


# ---------------------------------------------------------------- bad input and awkward templates


def test_text_that_is_not_unicode_is_an_invalid_request(tok):
    r = TurnRenderer(tok)
    lone = "a lone \ud800 surrogate"
    with pytest.raises(InvalidRequest, match="not valid Unicode"):
        r.user_turn(lone)
    with pytest.raises(InvalidRequest, match=r"message 1 \(user\).*not valid Unicode"):
        r.first([{"role": "system", "content": "ok"}, {"role": "user", "content": lone}])
    with pytest.raises(InvalidRequest, match=r"message 0 \(system\)"):
        r.first([{"role": "system", "content": lone}, {"role": "user", "content": "ok"}])
    with pytest.raises(InvalidRequest, match="system prompt"):
        r.system_prefix(lone)
    with pytest.raises(InvalidRequest, match="must be a str"):
        r.user_turn(None)
    # NUL and control characters are text like any other
    assert r.user_turn("nul\x00 bell\x07 esc\x1b") == r.user_turn("nul\x00 bell\x07 esc\x1b")


def test_template_without_system_role(tok_dir):
    tok = load(tok_dir, NO_SYSTEM)
    r = TurnRenderer(tok)  # must not raise jinja's TemplateError
    conv = [{"role": "user", "content": "Hello"}]
    tokens = r.first(conv)
    assert tokens == rendered(tok, conv)
    generated = encode(tok, "Hi there.") + [IM_END]
    tokens = tokens + generated + r.close_reply(generated) + r.user_turn("And then?")
    conv += [{"role": "assistant", "content": "Hi there."}, {"role": "user", "content": "And then?"}]
    assert tokens == rendered(tok, conv)
    with pytest.raises(InvalidRequest, match="System role not supported"):
        r.first([{"role": "system", "content": "S"}, {"role": "user", "content": "Hello"}])
    assert r.system_prefix("S") == []


def test_template_that_needs_a_user_message(tok_dir):
    tok = load(tok_dir, NEEDS_USER)
    r = TurnRenderer(tok)
    prefix = r.system_prefix(SYSTEMS[0])  # a system-only render raises here: must not escape as TemplateError
    first = r.first([{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": "Hello"}])
    assert prefix and first[: len(prefix)] == prefix
    assert len(prefix) >= len(encode(tok, f"<|im_start|>system\n{SYSTEMS[0]}<|im_end|>\n"))
