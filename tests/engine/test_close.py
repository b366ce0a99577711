"""engine.close(timeout) has a contract.

- It stops admitting at once; requests and turns in flight finish within the grace period
  or are cut: their callers get EngineClosed (carrying what was produced) and a turn's
  partial reply is stored first, marked interrupted. Never a hang, never a lost reply.
- Afterwards every call raises EngineClosed and no thread starts again.
- A process that ends without close() still writes the KV that is pending (the exit path).

Threads and asyncio tasks are caught mid-send, mid-stream and mid-restore, with the loop
thread started and without it. Where a test must hold the engine at one point (a request
in flight, a restore half done) it holds a real resource: the engine's state (a function
run through ``on_loop`` that waits on an event) or the snapshot directory's lock. Every
wait is bounded (``join(timeout)`` then ``is_alive()``), so a regression fails, never hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from chatkv import EngineClosed
from chatkv.config import EngineConfig
from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams
from tests.support import close_child
from tests.support.processes import one_torch_thread
from tests.support.tiny import make_model

pytestmark = pytest.mark.tiny_model("llama", seed=3, max_position_embeddings=4096)

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parents[1] / "support" / "close_child.py"
BOUND = 120.0  # the most any wait here takes before the test fails instead of hanging
LONG = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)  # never done before close cuts it
SHORT = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
MODES = ["started", "not_started"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


def engine_at(model_dir, home, mode: str = "not_started") -> Engine:
    eng = Engine(model_dir, EngineConfig(data_dir=str(home), num_blocks=256))
    return eng.start() if mode == "started" else eng


def until(cond, what: str, bound: float = BOUND) -> None:
    end = time.monotonic() + bound
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


def generated(eng: Engine) -> int:
    """Tokens generated so far by the requests running (read from another thread: a peek)."""
    return max((q.num_generated for q in list(eng.scheduler.running)), default=0)


class Worker(threading.Thread):
    """Runs ``fn`` on a thread of its own; ``outcome()`` is its result or its exception."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            self.error = e

    def outcome(self, bound: float = BOUND):
        self.join(bound)
        assert not self.is_alive(), "the call hung"
        return self.error if self.error is not None else self.result


@contextlib.contextmanager
def held_state(eng: Engine):
    """Hold the engine's state: a function run where it lives (``on_loop``: the loop thread,
    or without one the state's lock) waits until the block ends. No step runs meanwhile."""
    inside, release = threading.Event(), threading.Event()

    def hold():
        inside.set()
        release.wait(BOUND)

    holder = Worker(lambda: eng.on_loop(hold))
    holder.start()
    assert inside.wait(BOUND)
    try:
        yield
    finally:
        release.set()
        holder.outcome()


def close_in_thread(eng: Engine, timeout: float) -> Worker:
    closer = Worker(lambda: eng.close(timeout=timeout))
    closer.start()
    return closer


def cut_mid_request(eng: Engine) -> Worker:
    """close(timeout=0) while a request is in flight and before its next step."""
    with held_state(eng):
        closer = close_in_thread(eng, 0)
        until(lambda: eng._gate.cut, "close() to end the grace period")
    return closer


def stored(model_dir, home, conv_id: str):
    """The conversation as a new engine reads it back: messages (and the engine, to go on)."""
    eng = engine_at(model_dir, home)
    s = eng.resume(conv_id)
    return eng, s, s.messages()


# -- mid-send, mid-stream: cut at the end of the grace period ---------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_close_mid_send_interrupts_the_turn_and_stores_its_partial_reply(model_dir, tmp_path, mode):
    eng = engine_at(model_dir, tmp_path, mode)
    s = eng.session(system="You are a helpful assistant.")
    sender = Worker(lambda: s.send("Hello, how are you today?", LONG))
    sender.start()
    until(lambda: generated(eng) >= 3, "the reply to start")
    closer = cut_mid_request(eng)
    err = sender.outcome()
    assert closer.outcome() is None
    assert isinstance(err, EngineClosed), err
    reply = err.reply
    assert reply.finish_reason == "aborted" and 3 <= reply.usage.generated_tokens < LONG.max_tokens and reply.text
    # the partial reply is stored, marked interrupted; the next engine goes on from it
    eng2, s2, msgs = stored(model_dir, tmp_path, s.id)
    assert [(m.role, m.status) for m in msgs] == [("user", "complete"), ("assistant", "interrupted")]
    assert msgs[1].content == reply.text and msgs[1].id == reply.message_id
    r = s2.send("And then?", SHORT)
    assert r.usage.restored_tokens > 0 and r.finish_reason == "length"  # its KV (partial reply too) was spilled
    eng2.close()


@pytest.mark.parametrize("mode", MODES)
def test_close_mid_stream_gives_the_reader_engine_closed_after_the_pieces_it_had(model_dir, tmp_path, mode):
    eng = engine_at(model_dir, tmp_path, mode)
    s = eng.session()
    pieces: list[str] = []
    first = threading.Event()

    def read():
        for p in s.stream("Tell me about the quick brown fox.", LONG):
            pieces.append(p)
            first.set()

    reader = Worker(read)
    reader.start()
    assert first.wait(BOUND)
    closer = cut_mid_request(eng)
    err = reader.outcome()
    assert closer.outcome() is None
    assert isinstance(err, EngineClosed), err
    text = err.reply.text
    assert pieces and text.startswith("".join(pieces))
    eng2, _, msgs = stored(model_dir, tmp_path, s.id)
    assert msgs[-1].status == "interrupted" and msgs[-1].content == text
    eng2.close()


@pytest.mark.parametrize("mode", MODES)
def test_close_stores_the_reply_of_a_stream_its_reader_holds_suspended(model_dir, tmp_path, mode):
    """The reader took one piece and stopped reading (on the thread that then closes): close
    neither waits for it nor loses the reply; the reader gets EngineClosed when it reads on."""
    eng = engine_at(model_dir, tmp_path, mode)
    s = eng.session()
    g = s.stream("Hello there, what is the capital of France?", LONG)
    head = next(g)
    closer = close_in_thread(eng, 0)
    assert closer.outcome() is None  # (on this very thread it would return as well: nothing waits for g)
    eng2, _, msgs = stored(model_dir, tmp_path, s.id)
    eng2.close()
    assert [(m.role, m.status) for m in msgs] == [("user", "complete"), ("assistant", "interrupted")]
    assert msgs[1].content.startswith(head)
    rest = []
    with pytest.raises(EngineClosed) as e:
        for p in g:
            rest.append(p)
    assert e.value.reply.text == msgs[1].content == head + "".join(rest)


@pytest.mark.parametrize("mode", MODES)
def test_close_mid_generate_and_mid_engine_stream(model_dir, tmp_path, mode):
    eng = engine_at(model_dir, tmp_path, mode)
    first = threading.Event()

    def read():
        out = []
        for p in eng.stream("Once upon a time", LONG):
            out.append(p)
            first.set()
        return out

    gen = Worker(lambda: eng.generate(["Key-value caches", "keep attention state"], LONG))
    reader = Worker(read)
    gen.start()
    until(lambda: generated(eng) >= 1, "generate to start")
    reader.start()
    assert first.wait(BOUND)
    closer = cut_mid_request(eng)
    for w in (gen, reader):
        err = w.outcome()
        assert isinstance(err, EngineClosed), err
        assert err.reply.finish_reason == "aborted" and err.reply.usage.generated_tokens < LONG.max_tokens
    assert closer.outcome() is None


def test_a_callers_abort_racing_the_teardown_leaves_the_request_error_in_place(model_dir, tmp_path):
    """A caller ending its request (a stream's ``finally``) while close() tears down under the
    loop's lock: the abort finds the engine closed once it gets the lock. It is a no-op then,
    never a bare EngineClosed that would replace the request's own error and its reply (the
    race that failed test_close_mid_generate_and_mid_engine_stream[not_started] in CI)."""
    eng = engine_at(model_dir, tmp_path)
    seq = eng.add_request("Once upon a time", SHORT)
    with eng._loop.lock:  # what _teardown holds while it marks the loop closed
        aborter = Worker(lambda: eng.abort(seq))
        aborter.start()
        time.sleep(0.2)  # it passes its look at ``closed`` (still open) and waits for the lock
        eng.close(timeout=0)  # same thread: the lock is reentrant
    assert aborter.outcome() is None
    assert isinstance(seq.error, EngineClosed) and seq.error.reply is not None


# -- within the grace period: what is in flight finishes ---------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_turn_in_flight_finishes_within_the_grace_period_and_new_calls_are_refused(model_dir, tmp_path, mode):
    eng = engine_at(model_dir, tmp_path, mode)
    s = eng.session()
    other = eng.session()
    with held_state(eng):
        sender = Worker(lambda: s.send("What is the capital of France?", SHORT))
        sender.start()
        until(lambda: eng._gate.turns == 1, "the turn to be in flight")
        closer = close_in_thread(eng, BOUND)
        until(lambda: eng._gate.state == "closing", "close() to begin")
        # closing: nothing new is admitted, not even on a session opened before
        for refused in (lambda: other.send("Hi", SHORT), lambda: eng.generate("Hi", SHORT), eng.session):
            with pytest.raises(EngineClosed):
                refused()
    reply = sender.outcome()
    assert closer.outcome() is None
    assert not isinstance(reply, BaseException), reply
    assert reply.finish_reason == "length" and reply.usage.generated_tokens == SHORT.max_tokens
    _, _, msgs = stored(model_dir, tmp_path, s.id)
    assert [(m.role, m.status) for m in msgs] == [("user", "complete"), ("assistant", "complete")]
    assert msgs[1].content == reply.text


# -- mid-restore ------------------------------------------------------------------------------------------


def saved_conversation(model_dir, home) -> tuple[str, int]:
    """A conversation of two turns, closed: its KV is on disk. Its id and how many tokens of KV."""
    eng = engine_at(model_dir, home)
    s = eng.session(system="You are a helpful assistant.")
    s.send("Hello, how are you today?", SHORT)
    r = s.send("What is the capital of France?", SHORT)
    eng.close()
    return s.id, r.usage.prompt_tokens + r.usage.generated_tokens - 1


@contextlib.contextmanager
def snapshot_dir_locked(home: Path):
    """Hold the snapshot directory's lock as another process restoring from it would."""
    fd = os.open(home / "kv" / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        os.close(fd)


def restoring() -> bool:
    """Some thread waits for the snapshot lock inside Snapshots.restore."""
    for frame in sys._current_frames().values():
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        if "locked" in names and "restore" in names:
            return True
    return False


@pytest.mark.parametrize("mode,caller", [("started", "thread"), ("not_started", "thread"), ("started", "asyncio")])
@pytest.mark.parametrize("grace", ["cut", "finishes"])
def test_close_mid_restore(model_dir, tmp_path, mode, caller, grace):
    """A turn restoring its history from disk when close() comes: cut, it is refused with
    nothing stored and the snapshot intact; with time to spare it restores and finishes."""
    conv, kv = saved_conversation(model_dir, tmp_path)
    eng = engine_at(model_dir, tmp_path, mode)
    s = eng.resume(conv)
    question = "And why is the fox quick?"
    with snapshot_dir_locked(tmp_path):
        if caller == "asyncio":  # an asyncio task on an event loop of its own
            sender = Worker(lambda: asyncio.run(asyncio.wait_for(s.asend(question, SHORT), BOUND)))
        else:
            sender = Worker(lambda: s.send(question, SHORT))
        sender.start()
        until(restoring, "the turn to be restoring")
        closer = close_in_thread(eng, 0 if grace == "cut" else BOUND)
        until(lambda: eng._gate.cut if grace == "cut" else eng._gate.state == "closing", "close() to begin")
    out = sender.outcome()
    assert closer.outcome() is None
    eng2, s2, msgs = stored(model_dir, tmp_path, conv)
    if grace == "cut":
        assert isinstance(out, EngineClosed) and out.reply is None, out
        assert len(msgs) == 4  # nothing of the refused turn
        r = s2.send(question, SHORT)
        assert r.usage.restored_tokens == kv  # the snapshot is whole: it all comes back
    else:
        assert not isinstance(out, BaseException), out
        assert out.usage.restored_tokens == kv and out.finish_reason == "length"
        assert len(msgs) == 6 and msgs[-1].status == "complete" and msgs[-1].content == out.text
    eng2.close()


# -- asyncio ----------------------------------------------------------------------------------------------


def test_asyncio_tasks_mid_send_and_mid_stream_get_engine_closed(model_dir, tmp_path):
    eng = engine_at(model_dir, tmp_path)  # asend starts the loop thread
    s = eng.session()

    async def main():
        send = asyncio.create_task(s.asend("Hello, how are you today?", LONG))
        stream = eng.submit("Once upon a time", LONG)

        async def read():
            return [p async for p in stream]

        reader = asyncio.create_task(read())
        gen = asyncio.create_task(eng.agenerate("Key-value caches keep", LONG))
        end = time.monotonic() + BOUND
        while len(eng.scheduler.running) < 3 or generated(eng) < 2:
            assert time.monotonic() < end, "the requests did not start"
            await asyncio.sleep(0.01)
        closer = close_in_thread(eng, 0)
        for task in (send, reader, gen):
            with pytest.raises(EngineClosed) as e:
                await asyncio.wait_for(task, BOUND)
            assert e.value.reply.finish_reason == "aborted"
        assert await asyncio.to_thread(closer.outcome) is None
        with pytest.raises(EngineClosed):
            await s.asend("Again?", SHORT)
        with pytest.raises(EngineClosed):
            await eng.agenerate("Again", SHORT)

    asyncio.run(asyncio.wait_for(main(), 2 * BOUND))
    eng2, _, msgs = stored(model_dir, tmp_path, s.id)
    eng2.close()
    assert [(m.role, m.status) for m in msgs] == [("user", "complete"), ("assistant", "interrupted")]


# -- after close --------------------------------------------------------------------------------------------


def chatkv_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("chatkv-")}


@pytest.mark.parametrize("mode", MODES)
def test_after_close_every_call_raises_engine_closed_and_no_thread_starts(model_dir, tmp_path, mode):
    before = chatkv_threads()
    eng = engine_at(model_dir, tmp_path, mode)
    s = eng.session()
    s.send("Hello", SHORT)
    sid = s.id
    eng.close()
    assert chatkv_threads() <= before  # the loop and the snapshot writer are gone
    calls = {
        "generate": lambda: eng.generate("Hello", SHORT),
        "stream": lambda: list(eng.stream("Hello", SHORT)),
        "submit": lambda: eng.submit("Hello", SHORT),
        "add_request": lambda: eng.add_request("Hello", SHORT),
        "step": eng.step,
        "start": eng.start,
        "on_loop": lambda: eng.on_loop(lambda: None),
        "session": eng.session,
        "resume": lambda: eng.resume(sid),
        "sessions": eng.sessions,
        "stats": eng.stats,
        "kv_stats": eng.kv_stats,
        "spill_idle": eng.spill_idle,
        "check_integrity": eng.check_integrity,
        "knowledge_base": lambda: eng.knowledge_base("kb"),
        "send": lambda: s.send("Again?", SHORT),
        "session.stream": lambda: list(s.stream("Again?", SHORT)),
        "messages": s.messages,
        "asend": lambda: asyncio.run(s.asend("Again?", SHORT)),
        "agenerate": lambda: asyncio.run(eng.agenerate("Hello", SHORT)),
    }
    for name, call in calls.items():
        with pytest.raises(EngineClosed):
            call()
            pytest.fail(f"{name} after close() did not raise")
    assert chatkv_threads() <= before, "a call after close() started a thread"
    eng.close()  # idempotent
    s.close()  # closed with the engine: nothing to do


# -- the exit path --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_kv_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("big_kv_model")
    make_model(d, "llama", seed=4, **close_child.BIG_KV)
    return d


@pytest.mark.parametrize("mode", ["plain", "started"])
def test_a_process_ending_without_close_writes_its_pending_kv(big_kv_model, tmp_path, mode):
    """The turn's KV is written in the exit path, where concurrent.futures refuses new work;
    the next process restores all of it."""
    data = tmp_path / "data"
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, str(CHILD), str(big_kv_model), str(data), mode],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert "not saved" not in out.stderr, out.stderr
    ev = json.loads(out.stdout.splitlines()[-1])
    kv = ev["prompt_tokens"] + ev["generated_tokens"] - 1  # all the KV the child had
    assert ev["kv_bytes"] > 4 << 20  # big enough for the checksum's thread pool
    with Engine(big_kv_model, EngineConfig(data_dir=str(data), num_blocks=close_child.NUM_BLOCKS)) as eng:
        s = eng.resume(ev["conv"])
        assert len(s.tokens) == ev["tokens"]
        r = s.send("And why is the fox quick?", SamplingParams(**close_child.GREEDY))
    assert r.usage.restored_tokens == kv >= 0.95 * ev["tokens"], "the history's KV was not restored from disk"
    assert r.usage.computed_tokens == r.usage.prompt_tokens - kv
