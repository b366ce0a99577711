"""RAG turns through sessions on a tiny model and a real knowledge base (MiniLM, FAISS, FTS5):
sources in the prompt and the reply, pinned documents shared through the radix tree,
context fitting, follow-up queries, persistence of the settings, and the CLI."""

from __future__ import annotations

import pytest

from chatkv import Engine, InvalidRequest
from chatkv.config import EngineConfig
from chatkv.rag import context as rag_context

pytestmark = pytest.mark.tiny_model("llama", seed=21, max_position_embeddings=1024)

GREEDY = dict(max_tokens=4, temperature=0.0)
DOCS = {
    "kettles.md": "# Kettles\n\nThe Brewmaster kettle boils a litre of water in ninety seconds. "
    "Its base must be descaled monthly with citric acid.\n\n## Safety\n\n"
    "Never run it dry; the sensor cuts power at 120 C.",
    "telescopes.md": "# Telescopes\n\nA refractor uses lenses, a reflector uses mirrors. "
    "Collimate a reflector before each observing night.\n\n## Eyepieces\n\n"
    "Short focal lengths give high magnification.",
    "bread.md": "# Bread\n\nSourdough rises with a starter of wild yeast. "
    "Proof the dough overnight in a cool place.\n\n"
    "## Baking\n\nBake at 230 C with steam for the first twenty minutes.",
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    for name, text in DOCS.items():
        (d / name).write_text(text)
    return d


def engine_at(model_dir, data_dir, **kw) -> Engine:
    kw.setdefault("num_blocks", 160)
    return Engine(model_dir, EngineConfig(data_dir=str(data_dir), **kw))


@pytest.fixture
def engine(model_dir, corpus, tmp_path):
    e = engine_at(model_dir, tmp_path)
    report = e.knowledge_base("docs").add([str(corpus)])
    assert len(report.added) == 3 and not report.skipped
    yield e
    e.close()


def test_a_rag_turn_puts_numbered_sources_in_the_prompt_and_lists_them(engine):
    kb = engine.knowledge_base("docs")
    s = engine.session(knowledge=kb, top_k=2, params=GREEDY)
    r = s.send("How often should the kettle be descaled?")
    assert 1 <= len(r.sources) <= 2
    assert [x.number for x in r.sources] == list(range(1, len(r.sources) + 1))
    assert any("kettles.md" in x.source for x in r.sources)
    prompt = engine.tokenizer.decode(s.tokens)
    assert "Sources:\n[1] (" in prompt and "cite them as [n]" in prompt and "Question: How often" in prompt
    stored = s.messages()
    assert stored[-1].meta["sources"][0]["number"] == 1  # the reply's sources are saved with it
    assert stored[-2].content == "How often should the kettle be descaled?"  # the user's words, not the prompt
    engine.check_integrity()


def test_history_stays_a_prefix_and_is_fully_cached_on_the_next_turn(engine):
    kb = engine.knowledge_base("docs")
    s = engine.session(knowledge=kb, top_k=2, params=GREEDY)
    s.send("How do I collimate a reflector telescope?")
    before = list(s.tokens)
    r = s.send("And which eyepiece gives high magnification?")
    assert s.tokens[: len(before)] == before
    assert (
        r.usage.cached_tokens >= len(before) - 1 - engine.kv.block_size
    )  # the whole history, bar the last partial block
    engine.check_integrity()


def test_follow_up_is_searched_with_the_previous_question():
    assert rag_context.standalone_query("and its default?", "What is the kettle's power?") == (
        "What is the kettle's power? and its default?"
    )
    long = "Explain in detail how sourdough bread is proofed overnight at home"
    assert rag_context.standalone_query(long, "What is the kettle's power?") == long
    assert rag_context.standalone_query("and its default?", None) == "and its default?"


def test_pinned_documents_are_shared_between_sessions_and_survive_a_restart(model_dir, corpus, tmp_path):
    """Prefix caching alone (chunk KV reuse off): the pinned prefix is the radix tree's, shared."""
    e = engine_at(model_dir, tmp_path, rag_kv_reuse="off")
    kb = e.knowledge_base("docs")
    kb.add([str(corpus)])
    pinned = [str(corpus / "bread.md")]
    a = e.session(system="Answer briefly.", knowledge=kb, documents=pinned, params=GREEDY)
    ra = a.send("What temperature for baking?")
    assert "Sourdough rises" in e.tokenizer.decode(a.tokens)  # the document follows the system prompt
    b = e.session(system="Answer briefly.", knowledge=kb, documents=pinned, params=GREEDY)
    rb = b.send("How long do I proof it?")
    doc_prefix = len(e.session_manager.renderer.system_prefix(a.system_content)) // 16 * 16
    assert doc_prefix > 32
    assert rb.usage.cached_tokens >= doc_prefix  # b's first turn reused a's documents
    assert ra.usage.cached_tokens == 0
    e.kv.cache.evict(e.kv.pool.num_blocks)  # the pinned prefix survives eviction while sessions are open
    assert e.kv.cache.match(e.kv.namespace, a.tokens).num_tokens >= doc_prefix
    a_id = a.id
    e.close()

    e2 = engine_at(model_dir, tmp_path, rag_kv_reuse="off")
    a2 = e2.resume(a_id)
    assert a2.knowledge is not None and a2.documents == pinned and a2.top_k == 4
    r = a2.send("And the steam?")
    assert r.usage.restored_tokens >= doc_prefix  # documents and history came back from the snapshot
    assert r.sources
    e2.check_integrity()
    e2.close()


@pytest.mark.parametrize("mode", ["off", "edge", "blend"])
def test_a_second_session_finds_the_system_prompt_and_pinned_documents_cached_in_every_mode(
    model_dir, corpus, tmp_path, mode
):
    """The shared prefix first: with the sources' chunk KV stored (``precompute_kv``), the first
    session's first turn places its sources, yet the system prompt and pinned document before
    them are computed into the shared tree, so a second session with the same ones finds every
    whole block of them cached (and places its sources after them). After a restart the
    conversation comes back from disk."""
    e = engine_at(model_dir, tmp_path, rag_kv_reuse=mode, rag_edge_tokens=2)
    kb = e.knowledge_base("docs")
    kb.add([str(corpus)], precompute_kv=mode != "off")
    pinned = [str(corpus / "bread.md")]
    a = e.session(system="Answer briefly.", knowledge=kb, documents=pinned, params=GREEDY, top_k=2)
    ra = a.send("What temperature for baking?")
    doc_prefix = len(e.session_manager.renderer.system_prefix(a.system_content)) // 16 * 16
    assert doc_prefix > 32 and ra.usage.cached_tokens == 0
    assert (ra.usage.reused_tokens > 0) == (mode != "off")  # the sources were placed from their chunk KV
    shared = e.kv.cache.match(e.kv.namespace, a.tokens)
    assert shared.num_tokens >= doc_prefix  # in the shared tree although the conversation's KV is private
    assert (shared.num_tokens < len(a.tokens) - 16) == (mode != "off")  # placed KV is the conversation's own
    b = e.session(system="Answer briefly.", knowledge=kb, documents=pinned, params=GREEDY, top_k=2)
    rb = b.send("How long do I proof the dough?")
    u = rb.usage
    assert u.cached_tokens >= doc_prefix, u  # every whole block of the system prompt and the document
    assert (u.reused_tokens > 0) == (mode != "off")
    assert u.prompt_tokens == u.cached_tokens + u.host_tokens + u.restored_tokens + u.computed_tokens + u.reused_tokens
    e.check_integrity()
    a_id, kv_len = a.id, len(a.tokens) - 1
    e.close()

    e2 = engine_at(model_dir, tmp_path, rag_kv_reuse=mode, rag_edge_tokens=2)
    r = e2.resume(a_id).send("And the steam?")
    assert r.usage.restored_tokens >= kv_len // 16 * 16 and r.sources  # within the context: no window moved
    e2.check_integrity()
    e2.close()


@pytest.mark.parametrize("mode", ["edge", "blend"])
def test_a_first_seen_chunk_costs_no_more_than_off_and_is_placed_once_made_in_the_background(
    model_dir, corpus, tmp_path, mode
):
    """Never more than ``off``: without stored chunk KV a turn computes exactly the tokens an
    ``off`` engine computes for the same conversation (nothing placed, the KV stays shared);
    the chunks' KV is made while the engine is idle, and the next turn with those sources
    (after another system prompt, so the shared tree has no prefix of them) places them,
    computing fewer tokens than ``off`` does for it."""
    from chatkv.rag import background

    def run(engine, wait):
        kb = engine.knowledge_base("docs")
        kb.add([str(corpus)])
        a = engine.session(knowledge=kb, params=GREEDY, top_k=2)
        first = a.send("How often should the kettle be descaled?")
        if wait:
            assert background.settle(engine, timeout=120)
        b = engine.session(system="You are a kettle expert.", knowledge=kb, params=GREEDY, top_k=2)
        second = b.send("How often should the kettle be descaled?")
        assert [x.chunk_id for x in second.sources] == [x.chunk_id for x in first.sources]
        return first.usage, second.usage

    off = engine_at(model_dir, tmp_path / "off", rag_kv_reuse="off")
    off_first, off_second = run(off, False)
    off.close()
    e = engine_at(model_dir, tmp_path / mode, rag_kv_reuse=mode, rag_edge_tokens=2)
    first, second = run(e, True)
    assert first.reused_tokens == 0 and first.recomputed_tokens == 0
    assert first.computed_tokens == off_first.computed_tokens and first.cached_tokens == off_first.cached_tokens
    assert e.kv.stats()["chunk_computed"] == 2  # made off the turn, by the background filler
    assert second.reused_tokens > 0 and second.computed_tokens < off_second.computed_tokens
    assert second.prompt_tokens == off_second.prompt_tokens
    e.check_integrity()
    e.close()


def test_sources_are_cut_to_fit_the_context(model_dir, tmp_path):
    e = engine_at(model_dir, tmp_path)
    kb = e.knowledge_base("big")
    kb.add_texts(
        [("Filler sentence about kettles and water. " * 60 + str(i)) for i in range(6)],
        sources=[f"big-{i}" for i in range(6)],
    )
    s = e.session(knowledge=kb, top_k=6, params=dict(max_tokens=4, temperature=0.0))
    for q in ["kettles and water?", "more about water", "and kettles again?"]:
        r = s.send(q)
        assert len(s.tokens) < e.max_context  # never overflowing the context
        assert r.usage.prompt_tokens + 4 <= e.max_context
    assert len(r.sources) < 6  # some were dropped to fit
    e.close()


def test_bad_rag_settings_are_clear_errors(engine, corpus):
    kb = engine.knowledge_base("docs")
    with pytest.raises(InvalidRequest, match="top_k"):
        engine.session(knowledge=kb, top_k=0)
    with pytest.raises(InvalidRequest, match="knowledge="):
        engine.session(documents=["x.md"])
    with pytest.raises(InvalidRequest, match="KnowledgeBase"):
        engine.session(knowledge="docs")
    with pytest.raises(InvalidRequest, match="not in the knowledge base"):
        engine.session(knowledge=kb, documents=[str(corpus / "missing.md")])
    assert engine.sessions() == []  # nothing half-created


def test_cli_ingest_kb_commands_and_chat_over_a_kb(model_dir, corpus, tmp_path, monkeypatch, capsys):
    from chatkv.cli import main  # the console script: ingest and kb are its subcommands

    monkeypatch.setenv("CHATKV_HOME", str(tmp_path))
    (corpus.parent / "bad").mkdir(exist_ok=True)
    (corpus.parent / "bad" / "blob.md").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    assert main(["ingest", str(corpus), str(corpus.parent / "bad"), "--kb", "docs"]) == 0
    out = capsys.readouterr()
    assert "3 added" in out.out and "1 skipped" in out.out and "blob.md: binary file" in out.err
    assert main(["kb", "list"]) == 0 and capsys.readouterr().out.split() == ["docs"]
    assert main(["kb", "info", "docs"]) == 0 and "kettles.md" in capsys.readouterr().out
    assert main(["kb", "search", "docs", "descale the kettle", "-k", "1"]) == 0
    assert "kettles.md" in capsys.readouterr().out
    assert main(["kb", "search", "missing", "x"]) == 2  # never created by a search
    assert "no knowledge base 'missing'" in capsys.readouterr().err
    assert main(["--model", str(model_dir), "--kb", "docs", "--max-tokens", "3", "How do I proof sourdough?"]) == 0
    assert "bread.md" in capsys.readouterr().err  # the reply's sources are listed
    assert main(["kb", "remove", "docs", str(corpus / "bread.md")]) == 0
    assert main(["kb", "remove", "docs", str(corpus / "bread.md")]) == 1
    capsys.readouterr()
    assert main(["kb", "list"]) == 0 and capsys.readouterr().out.split() == ["docs"]


def test_blend_placement_from_two_threads_at_once_and_a_read_only_chunk_kv_dir(model_dir, corpus, tmp_path):
    """Hostile tries of blend: two threads send RAG turns at once over the same chunks (placement
    runs on the engine's loop, one at a time), first computing them as ``off`` would, then, once
    the background made their KV, placing it; then the chunk KV directory turns read-only (root:
    a real tmpfs there, remounted read-only; else its mode): new chunks' KV is made and placed
    from memory, and the files already written stay as they were."""
    import os
    import subprocess
    import threading

    from chatkv.rag import background

    chunk_dir = tmp_path / "chunk_kv"
    root = os.geteuid() == 0
    if root:  # the mode bits do not stop root: a file system that is read-only does
        chunk_dir.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(chunk_dir)], check=True)
    e = engine_at(model_dir, tmp_path, rag_kv_reuse="blend")
    e.start()
    try:
        kb = e.knowledge_base("docs")
        kb.add([str(corpus)])

        def both(system: str, question: str) -> dict:
            """Each of two threads sends ``question`` in a new session (its own system prompt, so
            the shared tree holds no prefix of the sources)."""
            replies, errors = {}, []

            def chat(name):
                try:
                    s = e.session(system=f"{system} {name}.", knowledge=kb, top_k=2, params=GREEDY)
                    replies[name] = s.send(question)
                except Exception as err:  # noqa: BLE001 - reported below
                    errors.append(err)

            threads = [threading.Thread(target=chat, args=(n,)) for n in "ab"]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not errors and not any(t.is_alive() for t in threads), errors
            assert sorted(replies) == ["a", "b"]
            return replies

        kettle = "How often should the kettle be descaled?"
        assert all(r.usage.reused_tokens == 0 and r.sources for r in both("First", kettle).values())
        assert background.settle(e, timeout=120)
        assert all(r.usage.reused_tokens > 0 for r in both("Second", kettle).values())
        e.check_integrity()

        before = {p.name: p.read_bytes() for p in chunk_dir.iterdir()}
        assert before
        if root:
            subprocess.run(["mount", "-o", "remount,ro", str(chunk_dir)], check=True)
        else:
            os.chmod(chunk_dir, 0o500)
        assert not os.access(chunk_dir, os.W_OK)
        computed = e.kv.stats()["chunk_computed"]
        eyepiece = "Which eyepiece gives high magnification?"
        e.session(system="Third.", knowledge=kb, top_k=2, params=GREEDY).send(eyepiece)
        assert background.settle(e, timeout=120)
        assert e.kv.stats()["chunk_computed"] > computed  # new chunks: computed, kept in memory, not written
        r = e.session(system="Fourth.", knowledge=kb, top_k=2, params=GREEDY).send(eyepiece)
        assert r.sources and r.usage.reused_tokens > 0
        assert {p.name: p.read_bytes() for p in chunk_dir.iterdir()} == before
        e.check_integrity()
    finally:
        e.close()
        if root:
            subprocess.run(["umount", "-l", str(chunk_dir)], check=False)
        elif chunk_dir.exists():
            os.chmod(chunk_dir, 0o700)
