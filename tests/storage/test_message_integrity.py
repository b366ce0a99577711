"""A stored message whose text no longer matches the conversation's token
history (edited in the SQLite file behind chatkv's back, at the same length) is told at
resume: a warning names the conversation, the history is recomputed from the stored text and
its KV computed afresh, so the next reply is the one an uncached run of that text gives.
The edit is then the stored truth: the next resume is quiet and restores its KV from disk."""

from __future__ import annotations

import logging
import sqlite3

import pytest

from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams
from chatkv.storage.db import DB_FILENAME
from tests.support.tiny import make_model

GREEDY = dict(max_tokens=6, temperature=0.0)
ORIGINAL, EDITED = "Hello there, my good friend", "Jello there, my good fiend!"
assert len(ORIGINAL) == len(EDITED)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    make_model(d, "llama")
    return d


def _engine(model, data):
    return Engine.from_pretrained(str(model), data_dir=str(data), dtype="float32", block_size=4, num_blocks=512)


def _conversation(model, data) -> str:
    e = _engine(model, data)
    try:
        s = e.session(system="You are brief.")
        s.send(ORIGINAL, SamplingParams(**GREEDY))
        s.send("And the capital of France?", SamplingParams(**GREEDY))
        return s.id
    finally:
        e.close()


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "chatkv.sessions" and r.levelno >= logging.WARNING]


def test_an_unedited_conversation_resumes_quietly_from_its_snapshot(model, tmp_path, caplog):
    sid = _conversation(model, tmp_path)
    e = _engine(model, tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="chatkv.sessions"):
            s = e.resume(sid)
            assert s.send("Go on.", SamplingParams(**GREEDY)).usage.restored_tokens > 0
        assert not [w for w in _warnings(caplog) if "no longer matches" in w]
    finally:
        e.close()


def test_a_same_length_edit_in_the_database_is_detected_and_recomputed(model, tmp_path, caplog):
    sid = _conversation(model, tmp_path)
    db = sqlite3.connect(tmp_path / DB_FILENAME)  # the real file, as a person with sqlite3 would
    with db:
        n = db.execute(
            "UPDATE messages SET content = ? WHERE conversation_id = ? AND content = ?", (EDITED, sid, ORIGINAL)
        ).rowcount
    db.close()
    assert n == 1

    e = _engine(model, tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="chatkv.sessions"):
            s = e.resume(sid)
        warned = [w for w in _warnings(caplog) if sid in w and "no longer matches" in w]
        assert warned, _warnings(caplog)
        history = e.tokenizer.decode(s.tokens)
        assert EDITED in history and ORIGINAL not in history  # the history says what the stored text says
        turns = s.window.turns  # where each user turn starts, for the overflow policy to drop old ones
        assert len(turns) == 2 and s.window.prefix == turns[0] < turns[1] < len(s.tokens)
        assert e.tokenizer.decode(s.tokens[turns[0] : turns[1]]).count(EDITED) == 1
        assert "capital of France" in e.tokenizer.decode(s.tokens[turns[1] :])
        prompt = s.tokens + e.session_manager.renderer.user_turn("Go on.")
        reply = s.send("Go on.", SamplingParams(**GREEDY))
        assert reply.usage.restored_tokens == 0  # the old KV (of the old text) was not used
        assert reply.text == e.generate(prompt, SamplingParams(**GREEDY)).text  # an uncached run of the stored text
        assert [m.content for m in s.messages()][:1] == [EDITED]  # nothing stored was lost or rewritten
    finally:
        e.close()

    caplog.clear()
    e = _engine(model, tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="chatkv.sessions"):
            s = e.resume(sid)
            assert s.send("Still there?", SamplingParams(**GREEDY)).usage.restored_tokens > 0
        assert not [w for w in _warnings(caplog) if "no longer matches" in w]  # the rebuilt history is the stored one
    finally:
        e.close()


def test_an_edit_in_a_conversation_that_outgrew_its_window_is_recomputed_within_it(model, tmp_path, caplog):
    """The recomputed history is the whole stored conversation, longer than the window the KV
    held: its turns are known, so the next turn drops the oldest ones (truncate) and answers."""

    def small(data):
        return Engine.from_pretrained(
            str(model),
            data_dir=str(data),
            dtype="float32",
            block_size=4,
            num_blocks=512,
            context_window=160,
            overflow="truncate",
        )

    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    e = small(tmp_path)
    try:
        s = e.session(system="You are brief.")
        dropped = 0
        for i in range(12):
            dropped += s.send(f"{ORIGINAL} number {i}, tell me more about it", greedy).context.dropped_tokens
        assert dropped > 0  # the window moved: the stored history is longer than the KV's
        sid, n_msgs = s.id, len(s.messages())
    finally:
        e.close()
    db = sqlite3.connect(tmp_path / DB_FILENAME)
    with db:
        db.execute(
            "UPDATE messages SET content = replace(content, ?, ?) WHERE conversation_id = ? AND role = 'user'",
            (ORIGINAL, EDITED, sid),
        )
    db.close()
    e = small(tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="chatkv.sessions"):
            s = e.resume(sid)
        assert [w for w in _warnings(caplog) if sid in w and "no longer matches" in w]
        r = s.send("And now?", greedy)
        assert r.finish_reason == "length" and r.usage.prompt_tokens + 6 <= 160 and r.context.dropped_turns > 0
        assert len(s.messages()) == n_msgs + 2  # every stored message kept
        e.check_integrity()
    finally:
        e.close()
