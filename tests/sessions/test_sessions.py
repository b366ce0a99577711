"""Sessions that persist: restart, idle spill and restore, 100% prefix hits, bad input.

The oracle for every reply is transformers' greedy generate on the session's own prompt tokens.
"""

from __future__ import annotations

import pytest
import torch

from chatkv import InvalidRequest, SessionError, StorageError
from chatkv.config import EngineConfig
from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams
from tests.support.tiny import make_model, make_tokenizer

GREEDY = dict(max_tokens=6, temperature=0.0)
QUESTIONS = [
    "Hello, how are you today?",
    "What is the capital of France?",
    "The quick brown fox jumps over the lazy dog.",
    "Key-value caches keep attention state.",
    "You are a helpful assistant.",
]

THINKING_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and not loop.last %}{% set c = m['content'].split('</think>')[-1] %}"
    "{% else %}{% set c = m['content'] %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ c }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    # big enough that the reply depends on the history (a weaker model answers the same whatever the KV)
    return make_model(
        d,
        "llama",
        seed=7,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
    ), d


def engine_at(model_dir, data_dir, **kw) -> Engine:
    kw.setdefault("num_blocks", 128)  # 2048 tokens: the default 512 MiB pool costs more to allocate than a turn
    return Engine(model_dir, EngineConfig(data_dir=str(data_dir), **kw))


def hf_greedy(ref, ids: list[int], n: int) -> list[int]:
    out = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=2, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def check_against_oracle(ref, session, reply):
    """The reply's tokens are what transformers generates greedily from the turn's prompt."""
    prompt = session.tokens[: reply.usage.prompt_tokens]
    generated = session.tokens[reply.usage.prompt_tokens : reply.usage.prompt_tokens + reply.usage.generated_tokens]
    assert generated == hf_greedy(ref, prompt, GREEDY["max_tokens"])[: len(generated)]


def run_turns(session, questions):
    return [session.send(q) for q in questions]


def test_restart_restores_kv_from_disk_and_continues_exactly(model, tmp_path):
    ref, d = model
    # an uninterrupted run for comparison
    with engine_at(d, tmp_path / "a") as e:
        s = e.session(system="You are a helpful assistant.", params=GREEDY)
        straight = run_turns(s, QUESTIONS[:4])
    # 3 turns, a new Engine on the same data dir, a 4th turn
    with engine_at(d, tmp_path / "b") as e:
        s = e.session(system="You are a helpful assistant.", params=GREEDY)
        first3 = run_turns(s, QUESTIONS[:3])
        sid = s.id
        history_kv = first3[-1].usage.prompt_tokens + first3[-1].usage.generated_tokens - 1
    assert [r.text for r in first3] == [r.text for r in straight[:3]]
    e2 = engine_at(d, tmp_path / "b")
    s2 = e2.resume(sid)
    fourth = s2.send(QUESTIONS[3])
    assert fourth.text == straight[3].text
    assert fourth.usage.restored_tokens == history_kv  # the whole history came from disk
    assert fourth.usage.cached_tokens == 0
    assert fourth.usage.computed_tokens == fourth.usage.prompt_tokens - history_kv  # only the new turn
    check_against_oracle(ref, s2, fourth)
    assert [m.role for m in s2.messages()] == ["user", "assistant"] * 4
    e2.check_integrity()
    e2.close()


def test_idle_spill_releases_blocks_and_next_turn_restores(model, tmp_path):
    ref, d = model
    with engine_at(d, tmp_path / "ref") as e:
        straight = run_turns(e.session(params=GREEDY), QUESTIONS[:2])
    e = engine_at(d, tmp_path / "x", idle_spill_s=0.0)
    s = e.session(params=GREEDY)
    r1 = s.send(QUESTIONS[0])
    assert e.spill_idle() == 1
    e.kv.cache.evict(e.kv.pool.num_blocks)  # nothing of the session is pinned any more
    assert e.kv.pool.num_free == e.kv.pool.num_blocks
    e.check_integrity()
    r2 = s.send(QUESTIONS[1])
    assert [r1.text, r2.text] == [r.text for r in straight]
    # the history's full blocks went to the host tier when the session was spilled, its last
    # partial block to disk only: together they are the whole history, none of it recomputed
    history = r1.usage.prompt_tokens + r1.usage.generated_tokens - 1
    assert r2.usage.host_tokens + r2.usage.restored_tokens == history and r2.usage.host_tokens > 0
    check_against_oracle(ref, s, r2)
    e.check_integrity()
    e.close()


@pytest.mark.parametrize("template", ["chatml", "thinking"])
def test_ten_turns_hit_the_whole_history(tmp_path, template):
    d = tmp_path / "m"
    ref = make_model(d, "qwen3", seed=5)
    if template == "thinking":
        tok = make_tokenizer(d)
        tok.chat_template = THINKING_TEMPLATE
        tok.save_pretrained(str(d))
    e = engine_at(d, tmp_path / "data")
    s = e.session(system="You are a helpful assistant.", params=dict(max_tokens=5, temperature=0.0))
    prev = None
    for i in range(10):
        r = s.send(QUESTIONS[i % len(QUESTIONS)] + f" ({i})")
        if prev is not None:
            history_kv = prev.usage.prompt_tokens + prev.usage.generated_tokens - 1
            assert r.usage.cached_tokens == history_kv, f"turn {i}: a prefix miss"
            assert r.usage.computed_tokens == r.usage.prompt_tokens - history_kv
        prev = r
    check_against_oracle(ref, s, r)
    e.check_integrity()
    e.close()


def test_session_api_lists_renames_archives_exports_deletes(model, tmp_path):
    _, d = model
    e = engine_at(d, tmp_path)
    a = e.session(title="first", params=GREEDY)
    b = e.session(title="second", params=GREEDY)
    a.send(QUESTIONS[0])
    assert [c.id for c in e.sessions()][:2] == [a.id, b.id]  # newest activity first
    a.rename("renamed")
    b.archive()
    assert [c.title for c in e.sessions()] == ["renamed"]
    assert len(e.sessions(include_archived=True)) == 2
    md = a.export("markdown")
    assert md.startswith("# renamed") and "### User" in md and QUESTIONS[0] in md
    assert '"role": "assistant"' in a.export("json")
    with pytest.raises(InvalidRequest, match="export format"):
        a.export("pdf")
    a.spill()
    assert e.session_manager.snapshots.path(a.id).exists()
    a.delete()
    assert not e.session_manager.snapshots.path(a.id).exists()
    with pytest.raises(SessionError, match="unknown conversation"):
        e.resume(a.id)
    e.close()


def test_delete_removes_the_snapshot_its_row_does_not_name_yet(model, tmp_path):
    """A turn's write-behind puts the snapshot's files on disk at once and its database row only at
    the next sync (spill, flush, close, ROW_SYNC_S): deleting the conversation before that removes
    the files too, not only what the row names (they stayed until the next open's sweep)."""
    _, d = model
    e = engine_at(d, tmp_path)
    a, b = e.session(params=GREEDY), e.session(params=GREEDY)
    a.send(QUESTIONS[0])
    b.send(QUESTIONS[1])
    snaps = e.session_manager.snapshots
    assert e.session_manager.store.get_snapshot(a.id) is None  # no row yet: the case
    a.delete()
    files = sorted(p.name for p in snaps.segments.root.iterdir())
    assert not [f for f in files if f.startswith(snaps.key(a.id))], files
    b.spill()  # the other conversation's snapshot is untouched
    assert snaps.path(b.id).exists() and len(snaps.segment_paths(b.id)) >= 1
    assert b.send(QUESTIONS[2]).usage.restored_tokens > 0
    e.close()


def test_streaming_and_interrupted_reply_is_kept(model, tmp_path):
    _, d = model
    e = engine_at(d, tmp_path)
    s = e.session(params=dict(max_tokens=40, temperature=0.0, ignore_eos=True))
    pieces = list(s.stream(QUESTIONS[1]))
    assert "".join(pieces[:-1]) == pieces[-1].text
    it = s.stream(QUESTIONS[2])
    next(it)
    it.close()  # the user stopped the reply
    msgs = s.messages()
    assert msgs[-1].role == "assistant" and msgs[-1].status == "interrupted"
    r = s.send(QUESTIONS[3])  # the conversation goes on
    assert r.usage.generated_tokens == 40
    e.check_integrity()
    e.close()


def test_bad_input_clear_errors_nothing_lost(model, tmp_path):
    _, d = model
    e = engine_at(d, tmp_path)
    s = e.session(params=GREEDY)
    s.send(QUESTIONS[0])
    with pytest.raises(InvalidRequest, match="message is empty"):
        s.send("   ")
    with pytest.raises(SessionError, match="unknown conversation id"):
        e.resume("0123456789abcdef")
    for bad in ["../etc/passwd", "a/b", "..", ""]:
        with pytest.raises(SessionError):
            e.resume(bad)
    with pytest.raises(InvalidRequest, match="temperature"):
        e.session(params=dict(temperature=-1))
    s.close()
    with pytest.raises(SessionError, match="closed"):
        s.send("hello")
    assert len(e.resume(s.id).messages()) == 2
    e.close()


def test_files_are_private(model, tmp_path):
    _, d = model
    data = tmp_path / "data"
    with engine_at(d, data) as e:
        s = e.session(params=GREEDY)
        s.send(QUESTIONS[0])
        s.spill()
        snap = e.session_manager.snapshots.path(s.id)
    assert (data.stat().st_mode & 0o777) == 0o700
    assert (snap.stat().st_mode & 0o777) == 0o600
    assert ((data / "chatkv.db").stat().st_mode & 0o777) == 0o600


def test_system_prompt_prefix_is_shared_and_pinned(model, tmp_path):
    _, d = model
    e = engine_at(d, tmp_path)
    system = "You are a helpful assistant. " * 6  # several full blocks
    a = e.session(system=system, params=GREEDY)
    a.send(QUESTIONS[0])
    b = e.session(system=system, params=GREEDY)
    rb = b.send(QUESTIONS[1])
    sys_len = len(e.session_manager.renderer.system_prefix(system)) // 16 * 16
    assert rb.usage.cached_tokens >= sys_len  # b's first turn reused a's system prompt
    a.spill()
    b.spill()
    e.kv.cache.evict(e.kv.pool.num_blocks)  # everything unpinned goes; the system prompt stays
    assert e.kv.cache.match(e.kv.namespace, a.tokens).num_tokens == sys_len
    a.close()
    b.close()
    e.kv.cache.evict(e.kv.pool.num_blocks)
    assert e.kv.pool.num_free == e.kv.pool.num_blocks
    e.check_integrity()
    e.close()


def test_memory_pressure_spills_idle_sessions_instead_of_failing(model, tmp_path):
    ref, d = model
    e = engine_at(d, tmp_path, num_blocks=24, block_size=8)  # 192 tokens of KV in all
    sessions = [e.session(params=GREEDY) for _ in range(4)]
    texts = [" ".join(QUESTIONS[i:] + QUESTIONS[:i]) * 2 for i in range(4)]  # distinct, ~60 tokens each
    assert all(len(e.tokenizer(t)["input_ids"]) > 50 for t in texts)
    first = [s.send(t) for s, t in zip(sessions, texts)]  # they cannot all stay resident
    assert any(s.kept is None for s in sessions), "some idle session was spilled to make room"
    again = [s.send(QUESTIONS[0]) for s in sessions]
    for s, r in zip(sessions, again):
        check_against_oracle(ref, s, r)
    assert sum(r.usage.restored_tokens for r in again) > 0
    assert all(r.text for r in first)
    e.check_integrity()
    e.close()


def test_snapshot_disk_budget_deletes_least_recently_used(model, tmp_path):
    _, d = model
    e = engine_at(d, tmp_path)
    a, b = e.session(params=GREEDY), e.session(params=GREEDY)
    a.send(QUESTIONS[0])
    a.spill()
    one = e.session_manager.store.total_snapshot_bytes()
    e.session_manager.snapshots.budget = int(one * 1.5)  # room for one snapshot, not two
    b.send(QUESTIONS[1])
    b.spill()
    mgr = e.session_manager
    assert mgr.store.get_snapshot(a.id) is None and not mgr.snapshots.path(a.id).exists()
    assert mgr.store.get_snapshot(b.id) is not None
    r = a.send(QUESTIONS[2])  # a's KV is gone from disk: recomputed, still correct
    assert r.usage.restored_tokens == 0
    e.close()


def test_tenants_never_share_sessions_or_kv(model, tmp_path):
    _, d = model
    ea = engine_at(d, tmp_path, tenant="alice")
    s = ea.session(params=GREEDY)
    s.send(QUESTIONS[0])
    key_a = ea.session_manager.snapshots.key(s.id)  # (a closed engine opens no store again)
    ea.close()
    eb = engine_at(d, tmp_path, tenant="bob")
    assert eb.sessions() == []
    with pytest.raises(SessionError):
        eb.resume(s.id)
    assert eb.kv.namespace != ea.kv.namespace
    assert eb.session_manager.snapshots.key(s.id) != key_a
    eb.close()
    ea2 = engine_at(d, tmp_path, tenant="alice")
    assert [c.id for c in ea2.sessions()] == [s.id]
    assert ea2.resume(s.id).send(QUESTIONS[1]).usage.restored_tokens > 0
    ea2.close()


def test_data_dir_that_cannot_be_created_is_one_clear_error(model, tmp_path):
    _, d = model
    (tmp_path / "a-file").write_text("not a directory")
    e = engine_at(d, tmp_path / "a-file" / "data")
    with pytest.raises(StorageError, match="data directory cannot be created"):
        e.session()
    assert e.generate([5, 6, 7], SamplingParams(max_tokens=2, temperature=0)).usage.generated_tokens == 2


def test_unlistable_snapshot_directory_does_not_stop_a_chat(model, tmp_path, monkeypatch, caplog):
    """scandir of kv/ failing (EACCES, EIO) at open: one warning, and the chat works."""
    import errno
    import os

    _, d = model
    real = os.scandir

    def scandir(path="."):
        if str(path).endswith("kv"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    e = engine_at(d, tmp_path)
    with caplog.at_level("WARNING", logger="chatkv"):
        s = e.session(params=GREEDY)
    assert "cannot be listed" in caplog.text
    assert s.send(QUESTIONS[0]).usage.generated_tokens > 0
    e.check_integrity()
    e.close()


def test_update_params_is_validated_saved_and_resumed(model, tmp_path):
    _, d = model
    e = engine_at(d, tmp_path)
    s = e.session(params=GREEDY)
    assert s.update_params(max_tokens=3)["max_tokens"] == 3
    with pytest.raises(InvalidRequest, match="temperature"):
        s.update_params(temperature=float("nan"))
    assert s.params["max_tokens"] == 3 and s.params["temperature"] == GREEDY["temperature"]  # unchanged by the error
    assert s.send(QUESTIONS[0]).usage.generated_tokens <= 3
    conv = s.id
    e.close()
    e2 = engine_at(d, tmp_path)
    assert e2.resume(conv).params["max_tokens"] == 3
    e2.close()


def test_threads_resuming_one_conversation_share_one_session(model, tmp_path):
    """A server's first requests for a stored conversation arrive together: one Session, one KV."""
    import threading

    _, d = model
    e = engine_at(d, tmp_path / "data")
    s = e.session(params={"max_tokens": 4, "temperature": 0})
    s.send("hello there")
    conv = s.id
    e.close()
    e = engine_at(d, tmp_path / "data")
    got, barrier = [], threading.Barrier(4)

    def resume():
        barrier.wait()
        got.append(e.resume(conv))

    threads = [threading.Thread(target=resume) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(got) == 4 and all(x is got[0] for x in got)
    assert list(e.session_manager.live) == [conv]
    e.close()
