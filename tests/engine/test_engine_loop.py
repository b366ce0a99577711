"""The engine loop: many chats at once from threads and asyncio, cancellation, admission errors.

The oracle for every concurrent reply is the same request run alone (greedy) on an engine
without the loop; the pool invariant and the owners of every block are checked afterwards.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from chatkv import InvalidRequest
from chatkv.config import EngineConfig
from chatkv.engine import loop as engine_loop
from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams
from chatkv.errors import EngineClosed

pytestmark = pytest.mark.tiny_model("llama", seed=5)

G = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def question(i: int) -> str:
    return f"Question {i}: what is the capital of France, and why is the fox quick?"


def solo_replies(model_dir, home, n: int) -> list[list[int]]:
    eng = Engine(model_dir, EngineConfig(data_dir=str(home), num_blocks=256))
    out = []
    for i in range(n):
        s = eng.session(system="You are a helpful assistant.")
        first = s.send(question(i), G)
        second = s.send("And then?", G)
        out.append((first.text, second.text))
    eng.close()
    return out


def test_32_sessions_from_threads_and_asyncio_share_a_small_pool(model_dir, tmp_path):
    n = 32
    want = solo_replies(model_dir, tmp_path / "solo", n)
    before = threading.active_count()
    # 24 blocks of 16 tokens: about a third of what 32 chats hold at once
    eng = Engine(model_dir, EngineConfig(data_dir=str(tmp_path / "many"), num_blocks=24)).start()
    got: dict[int, tuple[str, str]] = {}
    errors: list[BaseException] = []

    def chat(i: int) -> None:
        try:
            s = eng.session(system="You are a helpful assistant.")
            got[i] = (s.send(question(i), G).text, s.send("And then?", G).text)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    async def achat(i: int) -> None:
        s = eng.session(system="You are a helpful assistant.")
        first = await s.asend(question(i), G)
        pieces = [p async for p in s.astream("And then?", G)]
        got[i] = (first.text, pieces[-1].text)
        assert "".join(p for p in pieces if isinstance(p, str)) == pieces[-1].text

    async def many() -> None:
        await asyncio.gather(*(achat(i) for i in range(n // 2, n)))

    t0 = time.monotonic()
    threads = [threading.Thread(target=chat, args=(i,)) for i in range(n // 2)]
    for t in threads:
        t.start()
    asyncio.run(many())
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[:3]
    assert time.monotonic() - t0 < 600  # bounded: nothing hangs
    assert [got[i] for i in range(n)] == want
    eng.check_integrity()
    stats = eng.kv_stats()
    eng.close()
    assert stats["blocks_total"] == 24
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)  # asyncio's executor threads wind down
    assert not [t.name for t in threading.enumerate() if t.name.startswith("chatkv-engine")]


def test_submit_streams_cancel_frees_blocks_at_once_and_too_large_is_refused(model_dir, tmp_path):
    eng = Engine(model_dir, EngineConfig(data_dir=str(tmp_path), num_blocks=16)).start()
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    stream = eng.submit("Hello, how are you today?", long)
    it = iter(stream)
    next(it)
    stream.cancel()
    r = stream.result()
    assert r.finish_reason == "aborted" and 0 < r.usage.generated_tokens < 200
    eng.check_integrity()
    st = eng.kv_stats()
    assert st["blocks_free"] + st["blocks_evictable"] == st["blocks_total"]  # nothing held by the request
    with pytest.raises(InvalidRequest, match="KV pool can hold"):
        eng.submit([5] * 400, G)  # 16 blocks of 16 tokens cannot hold it
    with pytest.raises(InvalidRequest, match="priority"):
        eng.submit("Hello", G, priority=1.5)
    eng.close()


def test_asyncio_generate_and_stream_equal_the_synchronous_results(model_dir, tmp_path):
    eng = Engine(model_dir, EngineConfig(data_dir=str(tmp_path), num_blocks=64))
    want = [eng.generate(question(i), G).token_ids for i in range(6)]

    async def main():
        rs = await asyncio.gather(*(eng.agenerate(question(i), G) for i in range(6)))
        pieces = [p async for p in eng.submit(question(0), G)]
        return [r.token_ids for r in rs], "".join(pieces)

    got, text = asyncio.run(main())
    assert got == want and text == eng.generate(question(0), G).text
    eng.close()


@pytest.mark.parametrize("age_rounds", [4, 10_000])
def test_priority_first_and_aging_so_nothing_starves(model_dir, tmp_path, age_rounds):
    eng = Engine(model_dir, EngineConfig(data_dir=str(tmp_path), num_blocks=64, max_running=1))
    eng.scheduler.age_rounds = age_rounds
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    low = eng.add_request("A batch job.", one, priority=5)
    started_at = None
    for step in range(30):  # an interactive request arrives every step: the batch job waits behind them
        eng.add_request(f"Interactive {step}", one, priority=0)
        eng.step()
        if low.num_cached >= 0 and started_at is None:
            started_at = step
    while eng.has_work():
        eng.step()
    if age_rounds == 4:
        assert started_at is not None and started_at <= age_rounds + 1  # aged past the newer, higher-priority ones
    else:
        assert started_at is None  # without aging it would wait as long as interactive requests keep coming
    assert low.finished and low.finish_reason == "length"
    eng.check_integrity()
    eng.close()


def test_engine_stats_count_sessions_spills_and_restores(model_dir, tmp_path):
    eng = Engine(model_dir, EngineConfig(data_dir=str(tmp_path), num_blocks=64))
    s = eng.session()
    s.send("Hello there", G)
    st = eng.stats()
    assert (st.sessions_open, st.sessions_in_memory, st.num_running, st.num_waiting) == (1, 1, 0, 0)
    assert st.blocks_total == 64 and 0 < st.kv_cache_usage < 1
    sid = s.id
    eng.close()
    eng = Engine(model_dir, EngineConfig(data_dir=str(tmp_path), num_blocks=64, host_cache_bytes=0)).start()
    r = eng.resume(sid).send("And then?", G)
    eng.on_loop(eng.session_manager.snapshots.flush)  # the turn's write-behind has reached the disk
    st = eng.stats()
    assert st.sessions_on_disk == 1 and st.spills >= 1 and st.spill_bytes > 0
    assert st.restores == 1 and st.restore_bytes > 0 and r.usage.restored_tokens > 0
    eng.close()


def test_a_bad_prompt_in_a_started_batch_leaves_nothing_running(model_dir, tmp_path):
    eng = Engine(model_dir, EngineConfig(data_dir=str(tmp_path), num_blocks=64)).start()
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        eng.generate(["Hello", [10**9]], G)  # the first is queued before the second is refused
    eng.check_integrity()  # the first was aborted: nothing holds KV
    assert eng.stats().num_running == eng.stats().num_waiting == 0
    eng.close()


_POOL_CHILD = r"""
import json, os, threading, time, torch
from chatkv.engine import loop as engine_loop
torch.set_num_threads(2)
count = lambda: len(os.listdir("/proc/self/task"))
seen = {"gomp": engine_loop._libgomp() is not None}

def work():
    seen["before"] = count()
    x = torch.ones(1 << 22)
    (x * 2).sum()  # a parallel op: this thread's pool starts
    seen["with pool"] = count()
    seen["released"] = engine_loop.release_openmp_pool()
    # libgomp's workers are detached: each leaves /proc/self/task a moment after the pause
    # returns (CI once counted one still exiting), so wait up to 10 s for them to be gone
    deadline = time.monotonic() + 10
    while count() >= seen["with pool"] and time.monotonic() < deadline:
        time.sleep(0.01)
    seen["after"] = count()
    (x * 2).sum()  # and comes back when needed
    seen["again"] = count()

t = threading.Thread(target=work)
t.start()
t.join()
print(json.dumps(seen))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GNU OpenMP and /proc: Linux")
def test_release_openmp_pool_ends_this_threads_workers():
    """GNU OpenMP keeps a pool of workers per thread that ran a parallel op; once the pools hold
    more workers than there are cores, every parallel region sleeps and wakes its workers (a
    decode step on the loop thread took twice as long). ``release_openmp_pool`` ends the
    calling thread's pool (counted here in OS threads, not timed, in a fresh process: other
    tests' background threads come and go in this one)."""
    import json
    import subprocess

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: torch runs one intra-op thread, there is no pool")
    out = subprocess.run(
        [sys.executable, "-c", _POOL_CHILD],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["gomp"], "torch's libgomp was not found: the fix does nothing on this machine"
    assert seen["with pool"] > seen["before"], seen
    assert seen["released"] is True
    assert seen["after"] < seen["with pool"], seen
    assert seen["again"] > seen["after"], seen


def test_start_releases_the_openmp_pool_of_the_thread_that_starts_it(model_dir, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(engine_loop, "release_openmp_pool", lambda: calls.append(threading.current_thread()))
    eng = Engine(model_dir, EngineConfig(data_dir=str(tmp_path), num_blocks=64))
    eng.start()
    eng.start()  # already running: nothing more
    assert calls == [threading.current_thread()]
    assert len(eng.generate("Hello", G).token_ids) == G.max_tokens
    eng.close()


# -- one driver: the same loop whether a thread runs it or the caller does ---------------------------------


def everything_once(eng: Engine) -> dict:
    """One of each way in (a submitted stream, ``stream``, a batched ``generate``, a session
    turn), with a finish listener; what each produced, in the order it was produced."""
    finished = []
    eng.add_finish_listener(lambda r, seq: finished.append((r.request_id, r.text, tuple(r.token_ids), r.finish_reason)))
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    out = {"submitted": list(eng.submit(question(1), G))}
    *pieces, result = list(eng.stream(question(2), sampled))
    out["streamed"] = (pieces, result.token_ids, result.finish_reason)
    out["generated"] = [r.token_ids for r in eng.generate([question(3), question(4)], G)]
    s = eng.session()
    out["turn"] = [p for p in s.stream(question(5), G) if isinstance(p, str)]
    out["finished"] = sorted(finished)  # the batch's two may end in either order
    out["seq.stream"] = eng.add_request(question(6), G).stream is not None  # every request has its stream
    eng.check_integrity()
    return out


def test_inline_and_started_run_the_same_loop(model_dir, tmp_path):
    """Without start() the caller runs the engine loop's rounds itself; with it the loop thread
    does. Either way every request gets the same tokens, the same stream pieces in the same
    steps and the same finish events (listeners once saw only the started engine's)."""
    inline = Engine(model_dir, EngineConfig(data_dir=str(tmp_path / "a"), num_blocks=64))
    started = Engine(model_dir, EngineConfig(data_dir=str(tmp_path / "b"), num_blocks=64)).start()
    try:
        a, b = everything_once(inline), everything_once(started)
    finally:
        inline.close()
        started.close()
    assert len(a["finished"]) == 5  # submit, stream, generate's two, the turn (the last request never ran)
    assert a == b


def wait_of(thread: threading.Thread, bound: float = 30.0):
    """The timeout of the ``threading`` wait ``thread`` sleeps in, once it sleeps in one (a thread
    that sleeps in ``time.sleep`` or spins never is; the test fails then)."""
    end = time.monotonic() + bound
    while time.monotonic() < end:
        frame = sys._current_frames().get(thread.ident)
        if frame is not None and frame.f_code.co_name == "wait" and frame.f_code.co_filename == threading.__file__:
            return frame.f_locals.get("timeout")
        time.sleep(0.01)
    raise AssertionError(f"{thread.name} never waited on a condition: it polls or spins")


def test_nothing_polls_while_it_waits_for_the_loop(model_dir, tmp_path):
    """The idle loop thread, a reader waiting for its next piece, a caller waiting for a round
    and close(timeout=None) waiting for a request in flight all sleep until they are woken:
    every one in a wait with no timeout (a 1 s re-check or a 5 ms sleep once stood here)."""
    eng = Engine(model_dir, EngineConfig(data_dir=str(tmp_path), num_blocks=64)).start()
    assert wait_of(eng._loop._thread) is None  # idle
    stream = eng.submit(question(0), SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True))
    pieces = iter(stream)
    next(pieces)
    inside, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=lambda: eng.on_loop(lambda: (inside.set(), release.wait(120))), name="holder")
    holder.start()  # the loop thread now runs this command: no round steps the request meanwhile
    assert inside.wait(120)
    reader = threading.Thread(target=lambda: [None for _ in pieces], name="reader")
    caller = threading.Thread(target=lambda: eng.kv_stats(), name="caller")
    closer = threading.Thread(target=lambda: eng.close(timeout=None), name="closer")
    try:
        for t in (reader, caller):
            t.start()
            assert wait_of(t) is None, t.name
        closer.start()
        until = time.monotonic() + 30
        while eng._gate.state != "closing":
            assert time.monotonic() < until
            time.sleep(0.01)
        assert wait_of(closer) is None
    finally:
        stream.cancel()  # posted: the loop aborts it once the holder lets go, then close() goes on
        release.set()
        for t in (holder, reader, caller, closer):
            if t.ident is not None:
                t.join(120)
                assert not t.is_alive(), f"{t.name} hung"


def test_async_for_on_an_engine_not_started_runs_the_loop_off_the_event_loop(model_dir, tmp_path):
    """``async for`` over a stream of an engine without ``start()`` once waited forever (nobody
    ran a step); the loop's rounds now run in an executor thread, the event loop stays free."""
    eng = Engine(model_dir, EngineConfig(data_dir=str(tmp_path), num_blocks=64))
    want = eng.generate(question(0), G).text

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        text = "".join([p async for p in eng.submit(question(0), G)])
        ticker.cancel()
        return text, ticks

    text, ticks = asyncio.run(asyncio.wait_for(main(), 120))
    assert text == want and not eng.started
    assert ticks > 0  # the event loop ran other tasks while the request was stepped
    eng.check_integrity()
    eng.close()


def test_a_command_waits_one_round_not_a_generation_behind_a_caller_running_rounds(model_dir, tmp_path):
    """Not started, a caller's generate runs round after round on its own thread. A command
    from another thread (on_loop: what close() and a timed call wait for too) gets the state
    after the round in progress, not whenever the lock happens to be free as the generating
    thread lets go (threading.RLock let it take the lock back before the waiter woke: CI saw
    a whole 3,000-token generation pass by a waiting command)."""
    eng = Engine(model_dir, EngineConfig(data_dir=str(tmp_path), num_blocks=256))
    rounds = 0
    run_batch = eng.run_batch

    def counted():
        nonlocal rounds
        rounds += 1
        return run_batch()

    eng.run_batch = counted  # the loop's own rounds, counted as they step
    ended = []

    def generate():
        try:
            eng.generate("Once upon a time", SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True))
        except EngineClosed as e:  # close() below ends it mid-generation, as it should
            ended.append(e)

    gen = threading.Thread(target=generate, daemon=True)
    gen.start()
    waited = []
    try:
        while rounds < 3:
            time.sleep(0.001)
        for _ in range(30):
            time.sleep(0.01)  # (back to back, this thread would be the one taking the lock again and again)
            before = rounds
            got = eng.on_loop(lambda: rounds)  # noqa: B023 - read inside the round it runs in
            waited.append(got - before)
            assert gen.is_alive(), f"the generation ended while a command waited for the state ({waited})"
    finally:
        eng.close(timeout=0)
        gen.join(60)
    assert not gen.is_alive() and len(ended) == 1
    # the round in progress when it asked, and perhaps one begun just before it queued
    assert max(waited) <= 2, waited


def test_the_fair_lock_is_reentrant_times_out_cleanly_and_hands_over_in_order():
    from chatkv.engine.loop import FairRLock

    lock = FairRLock()
    assert lock.acquire() and lock.acquire()  # reentrant
    order: list[int] = []
    ready = threading.Barrier(2)

    def taker(i: int) -> None:
        if i == 0:
            ready.wait()
        with lock:
            order.append(i)

    assert not taken_elsewhere(lock, timeout=0.05)  # another thread times out, leaves no waiter behind
    threads = [threading.Thread(target=taker, args=(i,)) for i in range(2)]
    threads[1].start()
    while len(lock._waiters) < 1:
        time.sleep(0.001)
    threads[0].start()
    ready.wait()
    while len(lock._waiters) < 2:
        time.sleep(0.001)
    lock.release()
    assert len(lock._waiters) == 2  # still held once (reentrant)
    lock.release()
    for t in threads:
        t.join(10)
    assert order == [1, 0]  # in the order they asked, not the order they were started
    with pytest.raises(RuntimeError):
        lock.release()  # not held by this thread
    assert lock.acquire(timeout=0)  # free again, nothing queued
    lock.release()


def taken_elsewhere(lock, timeout: float) -> bool:
    """Whether another thread gets ``lock`` within ``timeout`` (it releases it if it does)."""
    out = []

    def take():
        got = lock.acquire(timeout=timeout)
        out.append(got)
        if got:
            lock.release()

    t = threading.Thread(target=take)
    t.start()
    t.join(10)
    assert len(lock._waiters) == 0
    return out[0]
