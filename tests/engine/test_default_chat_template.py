"""A model without a chat template (a base model, many GGUFs) is rendered as ChatML, as
llama-server falls back to, with one warning naming the model: sessions, the SDK's chat
encoding and the HTTP server all run on it."""

from __future__ import annotations

import json
import logging

import pytest

from chatkv import Engine, SamplingParams
from chatkv.config import EngineConfig
from chatkv.server import create_app
from chatkv.weights.loading import DEFAULT_CHAT_TEMPLATE
from tests.support.tiny import make_model

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _without_template(d):
    """Remove every place transformers keeps a chat template in a saved tokenizer."""
    (d / "chat_template.jinja").unlink(missing_ok=True)
    (d / "chat_template.json").unlink(missing_ok=True)
    conf = d / "tokenizer_config.json"
    c = json.loads(conf.read_text())
    c.pop("chat_template", None)
    conf.write_text(json.dumps(c))


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("bare")
    make_model(d)
    _without_template(d)
    return d


def test_no_template_is_chatml_with_one_warning(bare_model, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="chatkv.weights"):
        engine = Engine(bare_model, EngineConfig(data_dir=str(tmp_path)))
    try:
        said = [r.getMessage() for r in caplog.records if "no chat template" in r.getMessage()]
        assert len(said) == 1 and str(bare_model) in said[0] and "ChatML" in said[0]
        assert engine.default_chat_template and engine.tokenizer.chat_template == DEFAULT_CHAT_TEMPLATE
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text == (
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
        )
        assert engine.encode_chat(messages) == engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        # a conversation of two turns: the second hits the first's KV
        s = engine.session(system="Be brief.")
        s.send("Hello", GREEDY)
        second = s.send("And again?", GREEDY)
        assert second.usage.cached_tokens > 0
        create_app(engine)  # the server's history renderer takes the template too
    finally:
        engine.close()


def test_a_model_with_its_own_template_keeps_it_and_no_warning(tmp_path, caplog):
    d = tmp_path / "model"
    make_model(d)
    with caplog.at_level(logging.WARNING, logger="chatkv.weights"):
        engine = Engine(d, EngineConfig(data_dir=str(tmp_path / "data")))
    try:
        assert not engine.default_chat_template and engine.tokenizer.chat_template != DEFAULT_CHAT_TEMPLATE
        assert not [r for r in caplog.records if "no chat template" in r.getMessage()]
    finally:
        engine.close()
