"""Write-behind snapshots: every turn's new KV reaches the disk on its own.

- A conversation whose process exits without ``engine.close()``, or is SIGKILLed one second
  after its third reply, resumes in a new process with its whole history's KV restored from
  disk, computes only the new turn, and its fourth reply equals an uninterrupted run's.
- 40 SIGKILLs at random moments (inside turns, inside the background writes): what is on
  disk is always the old manifest or the new one with every listed segment complete, it
  loads without a single failed check, every committed message is in the database, and the
  next reply is transformers' greedy.
- 20 turns: the bytes written per turn follow the turn's new tokens, not the history.
- Spilling a session whose snapshot is current writes nothing; a history that is no longer a
  prefix of what is stored (truncation, a moved sink window) starts a new epoch; compaction
  merges segments and a damaged segment found by a merge is cut, never copied; a failed
  manifest write leaves the old manifest; the database is used from the caller's thread only.

Real parts throughout: tiny seeded models on disk, real safetensors files, real SQLite.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from chatkv.config import EngineConfig
from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams
from chatkv.storage.repository import Store
from tests.sessions.test_session_durability import (
    MODEL,
    _read_events,
    _snapshot_on_disk,
    _wait_for,
    fork_server,  # noqa: F401  (the same fork server of the same model)
)
from tests.support import write_behind_child as child
from tests.support.processes import one_torch_thread
from tests.support.tiny import make_model

GREEDY = child.GREEDY
QUESTIONS = child.QUESTIONS
CHILD = Path(__file__).resolve().parents[1] / "support" / "write_behind_child.py"
ROOT = Path(__file__).resolve().parents[2]


def engine_at(model_dir, data_dir, **kw) -> Engine:
    kw.setdefault("num_blocks", child.NUM_BLOCKS)
    return Engine(model_dir, EngineConfig(data_dir=str(data_dir), **kw))


def hf_greedy(ref, ids: list[int], n: int) -> list[int]:
    out = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=2, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def turn_tokens(session, reply) -> tuple[list[int], list[int]]:
    p, g = reply.usage.prompt_tokens, reply.usage.generated_tokens
    return session.tokens[:p], session.tokens[p : p + g]


def kv_len(reply) -> int:
    """Tokens of KV a finished turn leaves (its last generated token is never computed)."""
    return reply.usage.prompt_tokens + reply.usage.generated_tokens - 1


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("wb-model") / "model"
    return make_model(d, "llama", seed=7, **MODEL), d


@pytest.fixture(scope="module")
def straight(model, tmp_path_factory):
    """The uninterrupted run: four turns in one engine, never spilled."""
    with engine_at(model[1], tmp_path_factory.mktemp("straight")) as e:
        s = e.session(system=child.SYSTEM, params=GREEDY)
        replies = [s.send(q) for q in QUESTIONS]
        return replies, turn_tokens(s, replies[3])


# ------------------------------------------------------- a process that never closes


def _child_env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")


def _resume_fourth_turn(model, straight, data: Path, events: list[dict]) -> None:
    """A new process (this one) resumes the child's conversation: the history's KV comes from
    disk, only the new turn is computed, and the fourth reply is the uninterrupted one."""
    ref, model_dir = model
    replies, (prompt4, gen4) = straight
    assert [ev["text"] for ev in events] == [r.text for r in replies[:3]]
    with engine_at(model_dir, data) as e:
        s = e.resume(events[0]["conv"])
        history = len(s.tokens)
        assert history == events[-1]["tokens"]
        r = s.send(QUESTIONS[3])
        prompt, gen = turn_tokens(s, r)
        e.check_integrity()
    kv3 = events[-1]["prompt_tokens"] + events[-1]["generated_tokens"] - 1  # all the KV the child had
    assert r.usage.restored_tokens == kv3 >= 0.95 * history, "the history's KV was not restored from disk"
    assert r.usage.cached_tokens == 0
    assert r.usage.computed_tokens == r.usage.prompt_tokens - kv3  # only the new turn (and the reply's closing tokens)
    assert r.usage.computed_tokens <= r.usage.prompt_tokens - history + 3
    assert prompt == prompt4 and gen == gen4 and r.text == replies[3].text
    assert gen == hf_greedy(ref, prompt, GREEDY["max_tokens"])[: len(gen)]


def test_interpreter_exit_without_close_keeps_the_kv(model, straight, tmp_path):
    data = tmp_path / "data"
    out = subprocess.run(
        [sys.executable, str(CHILD), str(model[1]), str(data), "exit"],
        capture_output=True,
        text=True,
        timeout=300,
        env=_child_env(),
    )
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(events) == 3
    _resume_fourth_turn(model, straight, data, events)


def test_sigkill_one_second_after_the_third_reply_keeps_the_kv(model, straight, tmp_path):
    data = tmp_path / "data"
    p = subprocess.Popen(
        [sys.executable, str(CHILD), str(model[1]), str(data), "hang"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_child_env(),
    )
    try:
        events = []
        for line in p.stdout:
            if line.strip() == "done":
                break
            events.append(json.loads(line))
        time.sleep(1.0)
    finally:
        p.kill()
        p.wait(timeout=30)
    assert len(events) == 3, p.stderr.read()
    assert p.returncode == -9
    _resume_fourth_turn(model, straight, data, events)


# ------------------------------------------------------- 40 kills at random moments

KILL_TRIALS = 40
TRIALS_PER_DIR = 8  # a fresh conversation every few trials, so histories stay short
KILL_PARAMS = dict(max_tokens=4, temperature=0.0)
KILL_BLOCKS = 160
BAD_LOAD = ("discarding", "unusable", "restoring its first", "not repaired")


def test_kill_9_at_random_moments_never_loads_garbage_nor_loses_a_message(model, fork_server, tmp_path, caplog):
    """Workers only send turns (no spill, no close): the disk gets the KV by write-behind alone."""
    ref, model_dir = model
    rng = random.Random(20250901)
    stats = Counter()
    turn_s: list[float] = []
    since_reply: list[float] = []  # from the last reply to the kill: its write-behind runs in the first ms
    started = time.monotonic()
    conv = None
    for trial in range(KILL_TRIALS):
        if trial % TRIALS_PER_DIR == 0:
            data, conv = tmp_path / f"data{trial // TRIALS_PER_DIR}", None
        log = tmp_path / f"worker{trial}.log"
        err = Path(str(log) + ".err")
        pid = fork_server.go("behind", model_dir, data, conv, log, f"t{trial}")
        try:
            _wait_for(log, lambda ev: any(e["ev"] == "ready" for e in ev), 30, "ready", err)
            k = rng.randint(1, 3)
            _wait_for(log, lambda ev: sum(e["ev"] == "committed" for e in ev) >= k, 30, f"reply {k}", err)
            typical = statistics.median(turn_s) if turn_s else 0.05
            time.sleep(rng.uniform(0, 1.5 * typical))  # inside the next turn, or the writes after this one
        finally:
            killed_at = time.monotonic()
            fork_server.kill(pid, err)
        events = _read_events(log)
        conv = events[0]["conv"]
        turn_s += [b["t"] - a["t"] for a, b in zip(events, events[1:]) if a["ev"] == "turn" and b["ev"] == "committed"]
        since_reply.append(killed_at - [ev["t"] for ev in events if ev["ev"] == "committed"][-1])
        stats["turns_by_workers"] += sum(e["ev"] == "committed" for e in events)

        # what the kill left, before anything cleans up: the old manifest or the new one,
        # every segment it lists complete
        kv = data / "kv"
        stats["mid_write_temp_file"] += any(p.name.endswith(".tmp") for p in kv.iterdir()) if kv.exists() else 0
        on_disk = _snapshot_on_disk(kv)
        with Store.open(None, data) as store:
            row = store.get_snapshot(conv)
        stats["manifest_ahead_of_row"] += on_disk is not None and (row is None or row.token_count != on_disk)

        caplog.clear()
        caplog.set_level(logging.WARNING, logger="chatkv")
        e = engine_at(model_dir, data, num_blocks=KILL_BLOCKS)
        s = e.resume(conv)
        msgs = s.messages()
        for ev in events:  # nothing committed is lost
            if ev["ev"] == "committed":
                n = ev["messages"]
                assert len(msgs) >= n, f"trial {trial}: committed message {n} lost"
                assert msgs[n - 1].id == ev["id"] and msgs[n - 1].content == ev["text"]
        r = s.send(f"What is the capital of France? (check {trial})", SamplingParams(**KILL_PARAMS))
        prompt, gen = turn_tokens(s, r)
        assert gen == hf_greedy(ref, prompt, KILL_PARAMS["max_tokens"])[: len(gen)], f"trial {trial}: wrong reply"
        bad = [x.getMessage() for x in caplog.records if any(b in x.getMessage() for b in BAD_LOAD)]
        assert not bad, f"trial {trial}: a segment the manifest lists failed its checks: {bad}"
        if on_disk:  # the verified KV of the manifest on disk, all of it
            assert r.usage.restored_tokens == on_disk, f"trial {trial}: restored {r.usage.restored_tokens} of {on_disk}"
            stats["restored"] += 1
        else:
            stats["recomputed"] += 1
        e.check_integrity()
        e.close()  # the next worker continues this conversation
    elapsed = time.monotonic() - started
    print(
        f"kill -9 at random moments, {KILL_TRIALS} trials in {elapsed:.1f}s: {dict(stats)}; "
        f"median turn {1000 * statistics.median(turn_s):.0f} ms; killed {1000 * min(since_reply):.0f}-"
        f"{1000 * max(since_reply):.0f} ms after the last reply (median {1000 * statistics.median(since_reply):.0f})"
    )
    assert stats["mid_write_temp_file"] >= 3, f"too few kills landed inside a write: {stats}"
    assert stats["restored"] >= KILL_TRIALS // 2, stats


# ------------------------------------------------------- bytes per turn


def test_bytes_written_per_turn_follow_the_new_tokens_not_the_history(model, tmp_path):
    _, model_dir = model
    e = engine_at(model_dir, tmp_path / "data", num_blocks=160)
    snaps = e.session_manager.snapshots
    seal, max_open = snaps.segments.SEAL_TOKENS, snaps.segments.MAX_OPEN
    pool = e.kv.pool
    per_token = 2 * pool.num_layers * pool.num_kv_heads * pool.head_dim * torch.finfo(torch.float32).bits // 8
    kv = tmp_path / "data" / "kv"
    s = e.session(params=GREEDY)
    seen: set[str] = set()
    rows = []  # (kv tokens, new tokens, bytes written, merged)
    prev = 0
    for i in range(20):
        r = s.send(f"{QUESTIONS[i % len(QUESTIONS)]} ({i})")
        snaps.flush()
        n = kv_len(r)
        files = {p.name: p.stat().st_size for p in kv.glob("*.safetensors")}
        new = {name: size for name, size in files.items() if name not in seen}
        seen |= set(files)
        assert len(new) == 1, f"turn {i}: one segment a turn, got {sorted(new)}"
        ((name, size),) = new.items()
        start, end = (int(x) for x in name[: -len(".safetensors")].rsplit("_", 2)[1:])
        assert end == n
        rows.append((n, n - prev, size, start < prev))
        prev = n
        assert all((kv / f).stat().st_mode & 0o777 == 0o600 for f in files) and kv.stat().st_mode & 0o777 == 0o700
    appends = [(n, new, size) for n, new, size, merged in rows if not merged]
    for n, new, size in appends:  # exactly the new tokens' KV, plus their ids and a header
        assert new * per_token < size <= new * (per_token + 8) + 4096
    per_new = [size / new for _, new, size in appends]
    early, late = statistics.mean(per_new[1:4]), statistics.mean(per_new[-3:])
    growth = rows[-1][0] / rows[0][0]
    assert growth >= 10, f"the history grew only {growth:.1f}x"
    assert 0.8 < late / early < 1.25, f"bytes per new token went from {early:.0f} to {late:.0f}"
    # compaction: a merge every MAX_OPEN turns; everything written stays within the policy's bound
    merges = [i for i, row in enumerate(rows) if row[3]]
    assert merges and all(b - a == max_open for a, b in zip(merges, merges[1:]))
    written = sum(row[2] for row in rows)
    final = rows[-1][0] * per_token
    bound = 1 + math.ceil(seal / (max_open * min(row[1] for row in rows)))
    assert written <= bound * final * 1.1
    rewrite_all = sum(row[0] for row in rows) * per_token  # what rewriting the whole snapshot each turn costs
    print(
        f"20 turns: history {rows[0][0]} -> {rows[-1][0]} tokens ({growth:.1f}x); bytes per new token "
        f"{early:.0f} early, {late:.0f} late; merges at turns {[m + 1 for m in merges]}; written {written} B = "
        f"{written / final:.2f}x the final KV, {written / rewrite_all:.2f}x of rewriting it every turn"
    )
    assert written < 0.5 * rewrite_all
    e.close()


# ------------------------------------------------------- spill, epochs, compaction, faults


def test_spilling_a_current_snapshot_writes_nothing(model, tmp_path):
    ref, model_dir = model
    e = engine_at(model_dir, tmp_path / "data", idle_spill_s=0.0)
    snaps = e.session_manager.snapshots
    kv = tmp_path / "data" / "kv"
    a, b = e.session(params=GREEDY), e.session(params=GREEDY)
    ra = [a.send(q) for q in QUESTIONS[:2]]
    snaps.flush()
    listing = lambda: {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in kv.iterdir()}  # noqa: E731
    before, jobs = listing(), snaps.stats["jobs"]
    b.send(QUESTIONS[0])  # its turn spills a (idle): a's snapshot is current, nothing of a is written
    snaps.flush()
    assert a.kept is None
    assert snaps.stats["jobs"] == jobs + 1, "only b's own write-behind"
    assert {k: v for k, v in listing().items() if k.startswith(a.id)} == {
        k: v for k, v in before.items() if k.startswith(a.id)
    }
    assert b.spill() and snaps.stats["jobs"] == jobs + 1  # explicit spill: current too
    e.check_integrity()
    e.close()
    assert snaps.stats["jobs"] == jobs + 1  # and so does closing
    e = engine_at(model_dir, tmp_path / "data")
    a = e.resume(a.id)
    r = a.send(QUESTIONS[2])
    assert r.usage.restored_tokens == kv_len(ra[-1])
    prompt, gen = turn_tokens(a, r)
    assert gen == hf_greedy(ref, prompt, GREEDY["max_tokens"])[: len(gen)]
    e.close()


def _manifest(kv: Path, conv: str) -> dict:
    (path,) = [p for p in kv.glob("*.json") if p.name.startswith(conv)]
    return json.loads(path.read_text())


def test_truncated_history_starts_a_new_epoch_that_restores(model, tmp_path):
    """overflow="truncate" drops the oldest turns: the stored tokens are no longer a prefix,
    so the next write is one base segment of the new context and the old files go."""
    ref, model_dir = model
    data = tmp_path / "data"
    e = engine_at(model_dir, data, context_window=160, overflow="truncate")
    snaps = e.session_manager.snapshots
    kv = data / "kv"
    s = e.session(system=child.SYSTEM, params=GREEDY)
    epochs, dropped = [], 0
    for i in range(12):
        r = s.send(f"{QUESTIONS[i % len(QUESTIONS)]} ({i})")
        snaps.flush()
        man = _manifest(kv, s.id)
        epochs.append(man["epoch"])
        if r.context.dropped_turns:
            dropped += 1
            assert man["epoch"] != epochs[-2], "a truncated history kept the old epoch"
            assert [(x["start"], x["end"]) for x in man["segments"]] == [(0, kv_len(r))], "one base segment"
            files = {p.name for p in kv.glob("*.safetensors")}
            assert files == {x["file"] for x in man["segments"]}, "the old epoch's files are gone"
        elif i:
            assert man["epoch"] == epochs[-2]
        if dropped >= 2:
            break
    assert dropped >= 2, "the window never truncated"
    e.close()
    e = engine_at(model_dir, data, context_window=512, overflow="truncate")  # room for the next turn: no truncation
    s = e.resume(s.id)
    r2 = s.send(QUESTIONS[0])
    assert r2.usage.restored_tokens == kv_len(r)
    prompt, gen = turn_tokens(s, r2)
    assert gen == hf_greedy(ref, prompt, GREEDY["max_tokens"])[: len(gen)]
    e.close()


def test_compaction_merges_and_a_damaged_segment_is_cut_not_copied(model, tmp_path, caplog):
    ref, model_dir = model
    data = tmp_path / "data"
    e = engine_at(model_dir, data)
    snaps = e.session_manager.snapshots
    snaps.segments.SEAL_TOKENS, snaps.segments.MAX_OPEN = 60, 3
    s = e.session(params=GREEDY)
    sealed_seen = {}
    for i in range(10):
        r = s.send(f"{QUESTIONS[i % len(QUESTIONS)]} ({i})")
        snaps.flush()
        segs = _manifest(data / "kv", s.id)["segments"]
        assert segs[-1]["end"] == kv_len(r) and segs[0]["start"] == 0
        unsealed = [x for x in segs if x["end"] - x["start"] < 60]
        assert len(unsealed) <= 3
        for x in segs:  # a sealed segment is never rewritten
            if x["end"] - x["start"] >= 60:
                sealed_seen.setdefault(x["file"], x["checksum"])
        for name in sealed_seen:
            assert name in {x["file"] for x in segs}
    assert snaps.stats["merges"] >= 2 and sealed_seen
    # damage the last unsealed segment on disk: the next merge reads it back, finds the
    # damage, cuts the manifest before it; the next write catches up from memory
    segs = _manifest(data / "kv", s.id)["segments"]
    while len([x for x in segs if x["end"] - x["start"] < 60]) < 3:
        s.send(QUESTIONS[1])
        snaps.flush()
        segs = _manifest(data / "kv", s.id)["segments"]
    victim = data / "kv" / segs[-1]["file"]
    blob = bytearray(victim.read_bytes())
    blob[-3] ^= 0xFF
    victim.write_bytes(bytes(blob))
    caplog.set_level(logging.WARNING)
    s.send(QUESTIONS[2])  # its write merges the run, victim included
    snaps.flush()
    assert any("checksum differs" in x.getMessage() for x in caplog.records)
    assert victim.name not in {x["file"] for x in _manifest(data / "kv", s.id)["segments"]}
    r = s.send(QUESTIONS[3])  # catches up: the KV in memory fills the gap
    snaps.flush()
    assert _manifest(data / "kv", s.id)["segments"][-1]["end"] == kv_len(r)
    e.close()
    caplog.clear()
    e = engine_at(model_dir, data)
    s = e.resume(s.id)
    r2 = s.send(QUESTIONS[0])
    assert r2.usage.restored_tokens == kv_len(r)
    assert not [x for x in caplog.records if any(b in x.getMessage() for b in BAD_LOAD)]
    prompt, gen = turn_tokens(s, r2)
    assert gen == hf_greedy(ref, prompt, GREEDY["max_tokens"])[: len(gen)]
    e.close()


def test_failed_manifest_write_keeps_the_old_manifest(model, tmp_path, monkeypatch, caplog):
    """The segment is written, the manifest's rename fails (ENOSPC): the old manifest stands,
    listing only complete segments; the stray segment is swept on the next open."""
    ref, model_dir = model
    data = tmp_path / "data"
    e = engine_at(model_dir, data)
    snaps = e.session_manager.snapshots
    s = e.session(params=GREEDY)
    r1 = s.send(QUESTIONS[0])
    snaps.flush()
    old = _manifest(data / "kv", s.id)
    real_replace, failed = os.replace, []

    def replace(src, dst, *a, **kw):
        if str(dst).endswith(".json") and Path(dst).parent == data / "kv":
            failed.append(dst)
            raise OSError(28, os.strerror(28), str(dst))
        return real_replace(src, dst, *a, **kw)

    caplog.set_level(logging.WARNING)
    monkeypatch.setattr(os, "replace", replace)
    s.send(QUESTIONS[1])
    snaps.flush()
    monkeypatch.setattr(os, "replace", real_replace)
    assert failed and any("not saved to disk" in x.getMessage() for x in caplog.records)
    assert _manifest(data / "kv", s.id) == old
    stray = {p.name for p in (data / "kv").glob("*.safetensors")} - {x["file"] for x in old["segments"]}
    assert stray, "the segment was written before the manifest"
    assert not list((data / "kv").glob("*.tmp")) and not list((data / "kv").glob(".*.tmp"))
    e.kv.drop(s.kept)  # as if the process ended here, before the next write caught up
    s.kept = None
    e.close()
    e = engine_at(model_dir, data)
    e.session_manager  # opening the store reconciles the directory
    assert not stray & {p.name for p in (data / "kv").glob("*.safetensors")}, "the stray segment was not swept"
    s = e.resume(s.id)
    r3 = s.send(QUESTIONS[2])
    assert r3.usage.restored_tokens == kv_len(r1)
    prompt, gen = turn_tokens(s, r3)
    assert gen == hf_greedy(ref, prompt, GREEDY["max_tokens"])[: len(gen)]
    e.close()


def test_the_database_is_used_only_from_the_callers_thread(model, tmp_path, monkeypatch):
    _, model_dir = model
    threads = set()
    for name in (
        "put_snapshot",
        "get_snapshot",
        "delete_snapshot",
        "touch_snapshot",
        "snapshots_lru",
        "total_snapshot_bytes",
        "add_message",
    ):
        real = getattr(Store, name)

        def spy(*a, _real=real, **kw):
            threads.add(threading.current_thread().name)
            return _real(*a, **kw)

        monkeypatch.setattr(Store, name, spy)
    e = engine_at(model_dir, tmp_path / "data")
    s = e.session(params=GREEDY)
    for q in QUESTIONS[:3]:
        s.send(q)
    e.close()
    assert threads == {threading.current_thread().name}
