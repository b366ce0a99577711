"""The packaged default model (SmolLM2-135M-Instruct from its GGUF) end to end."""

from __future__ import annotations

import pytest

from chatkv.engine import Engine
from chatkv.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("CHATKV_HOME", str(tmp_path_factory.mktemp("home")))
    return Engine.from_pretrained()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_capital_of_france_is_paris(engine):
    ids = engine.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    result = engine.generate(ids, SamplingParams(max_tokens=24, temperature=0))
    assert "Paris" in result.text, result.text
    assert result.finish_reason in ("stop", "length")


def test_multi_turn_prefix_is_reused(engine):
    first = [{"role": "user", "content": "Name three colours of the French flag."}]
    reply = engine.generate(engine.encode_chat(first), SamplingParams(max_tokens=24, temperature=0))
    second = first + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "And Italy's?"}]
    again = engine.generate(engine.encode_chat(second), SamplingParams(max_tokens=8, temperature=0))
    # the first turn's full blocks are reused: only the tail of the history and the new message are computed
    assert again.usage.cached_tokens >= (reply.usage.prompt_tokens // 16) * 16
    engine.check_integrity()
