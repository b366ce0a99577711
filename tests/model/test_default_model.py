"""The packaged default model (SmolLM2-135M-Instruct from its GGUF) end to end."""

from __future__ import annotations

import pytest

from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory, monkeypatch_module, default_model_home):
    # a home holding the run's converted model (conftest): the conversion is test_gguf_convert's
    monkeypatch_module.setenv("CHATKV_HOME", str(default_model_home(tmp_path_factory.mktemp("home"))))
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


MANUAL = """# Brewmaster 3000 kettle

## Descaling
Descale the Brewmaster 3000 every four weeks with a sachet of citric acid dissolved in half a litre of water.
Boil it twice, then rinse the jug three times.

## Power
The kettle draws 2200 watts and boils a full litre in about ninety seconds. The base switches off at 120 C
if the jug runs dry.
"""


def test_rag_on_the_default_model_sources_shared_documents_and_restart(tmp_path, monkeypatch, default_model_home):
    """A RAG reply carries its sources; a second session with the same system prompt and pinned
    document finds every whole block of them cached (the shared prefix, in every
    ``rag_kv_reuse`` mode); after a restart the conversation's KV comes back restored from
    disk, not recomputed."""
    monkeypatch.setenv("CHATKV_HOME", str(default_model_home(tmp_path)))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "kettle.md").write_text(MANUAL)
    greedy = dict(max_tokens=24, temperature=0.0)
    e = Engine.from_pretrained()
    kb = e.knowledge_base("manuals")
    assert len(kb.add([str(tmp_path / "docs")]).added) == 1
    a = e.session(system="Answer from the documents.", knowledge=kb, documents=["kettle.md"], params=greedy)
    ra = a.send("How often should I descale the kettle?")
    assert ra.sources and all("kettle.md" in s.source for s in ra.sources)
    b = e.session(system="Answer from the documents.", knowledge=kb, documents=["kettle.md"], params=greedy)
    assert e.config.rag_kv_reuse == "off"
    rb = b.send("How many watts does it draw?")
    doc_tokens = len(e.session_manager.renderer.system_prefix(a.system_content))
    assert doc_tokens > 100
    u = rb.usage
    assert u.cached_tokens >= doc_tokens // 16 * 16, u
    assert u.prompt_tokens == u.cached_tokens + u.host_tokens + u.restored_tokens + u.computed_tokens + u.reused_tokens
    a_id = a.id
    e.close()

    e2 = Engine.from_pretrained()
    r = e2.resume(a_id).send("And what happens if it runs dry?")
    assert r.usage.restored_tokens >= doc_tokens // 16 * 16 and r.usage.cached_tokens == 0
    assert r.sources
    e2.check_integrity()
    e2.close()
