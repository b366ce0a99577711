"""Scheduler, driven directly without a model: the test plays the model runner, handing
``postprocess`` the "sampled" token of every sequence whose prompt a step completed.

Admission order, the chunk budget, max_running, preemption, abort, a request that can
never fit, the stop and length checks - and after every schedule and every postprocess
the KV manager's ownership check with exactly the live owners.
"""

from __future__ import annotations

import itertools

import pytest

from chatkv.engine.detokenize import TextStream
from chatkv.engine.sampling import SamplingParams
from chatkv.engine.scheduler import Scheduler
from chatkv.engine.sequence import Status
from chatkv.errors import OutOfBlocks
from chatkv.kvcache.block_pool import BlockPool
from chatkv.kvcache.manager import KVManager
from tests.support.fakes import FakeTokenizer, make_seq

BS = 4
NS = ("model", "float32", None)
TOKEN = 5  # what the fake model samples unless told otherwise


class Harness:
    def __init__(self, num_blocks=16, max_batch_tokens=64, max_running=8, prefix_caching=True):
        self.kv = KVManager(BlockPool(num_blocks, BS), NS, prefix_caching)
        self.s = Scheduler(self.kv, max_batch_tokens, max_running)
        self.kept = []  # RetainedKV left by finished sequences: the "sessions" own them
        self._ids = itertools.count()

    def add(self, tokens, *, max_tokens=100, stop=None, stop_ids=(), retain=False, prefix=None, max_total=10**6):
        seq = make_seq(
            tokens,
            prefix,
            retain,
            next(self._ids),
            params=SamplingParams(max_tokens=max_tokens, stop=list(stop or [])),
            stop=stop,
            stop_ids=stop_ids,
            max_total=max_total,
        )
        self.s.add(seq)
        return seq

    def check(self):
        seqs = self.s.sequences()
        self.kv.check_integrity(seqs, [s.prefix for s in seqs] + self.kept)

    def collect(self, seqs):
        for f in seqs:
            if f.retained is not None:
                self.kept.append(f.retained)

    def step(self, tokens: dict | None = None):
        """schedule -> "run" -> postprocess. Returns (plan, finished)."""
        plan = self.s.schedule()
        self.check()
        for seq, n in plan:
            assert n >= 1 and len(seq.block_table) * BS >= seq.num_computed + n, "plan not covered by blocks"
        sampled = {seq: (tokens or {}).get(seq, TOKEN) for seq, n in plan if seq.num_computed + n == len(seq.token_ids)}
        finished = self.s.postprocess(plan, sampled)
        self.collect(finished)
        self.check()
        return plan, finished

    def run_all(self, limit=200):
        for _ in range(limit):
            if not self.s.has_work():
                return
            self.step()
        raise AssertionError("did not finish")

    def drop_kept(self):
        for h in self.kept:
            self.kv.drop(h)
        self.kept.clear()
        self.check()


def cache(h: Harness, tokens):
    """A finished request that leaves ``tokens``' full blocks in the tree."""
    seq = h.add(tokens, max_tokens=1)
    while not seq.finished:
        h.step()
    assert h.kv.cached_len(list(tokens) + [0]) == len(tokens) // BS * BS
    return seq


A = list(range(100, 116))  # 4 blocks


# -- admission -------------------------------------------------------------------------


def test_admission_takes_the_longest_cached_prefix_first():
    h = Harness()
    cache(h, A)
    x = h.add([1, 2, 3, 4, 5, 6])  # nothing cached
    y = h.add(A[:8] + [7, 7])  # 8 cached
    z = h.add(A + [9])  # 16 cached
    w = h.add([1, 2, 3, 4, 5, 6, 8])  # nothing cached, after x: ties keep arrival order
    plan, _ = h.step()
    assert [s for s, _ in plan] == [z, y, x, w]
    assert [n for _, n in plan] == [1, 2, 6, 7]  # only the uncached tail is computed
    assert (z.num_cached, y.num_cached, x.num_cached) == (16, 8, 0)
    h.run_all()


def test_max_running_limits_admission_in_order():
    h = Harness(max_running=2)
    cache(h, A)
    a = h.add([1, 2, 3], max_tokens=2)
    b = h.add([4, 5, 6], max_tokens=2)
    c = h.add(A + [1], max_tokens=2)  # longest cached prefix: first in
    plan, _ = h.step()
    assert [s for s, _ in plan] == [c, a] and b.status is Status.WAITING
    plan, finished = h.step()
    assert [s for s, _ in plan] == [c, a] and set(finished) == {c, a}  # 2 tokens each: done
    plan, _ = h.step()
    assert [s for s, _ in plan] == [b]
    h.run_all()
    assert all(s.finish_reason == "length" for s in (a, b, c))


# -- the chunk budget --------------------------------------------------------------------


def test_a_long_prefill_is_split_across_steps():
    h = Harness(max_batch_tokens=8)
    seq = h.add(list(range(20)), max_tokens=2)
    chunks = []
    while not seq.finished:
        plan, _ = h.step()
        chunks.append([n for s, n in plan if s is seq])
    assert chunks == [[8], [8], [4], [1]]  # prefill in three chunks, then one decode
    assert seq.num_prefilled == 20 and seq.num_generated == 2


def test_running_sequences_get_their_share_before_admissions():
    h = Harness(max_batch_tokens=8)
    r = h.add([1, 2, 3], max_tokens=50)
    h.step()  # r prefilled, now decoding
    p = h.add(list(range(30, 50)), max_tokens=1)  # a 20-token prompt arrives
    plan, _ = h.step()
    assert plan == [(r, 1), (p, 7)]  # the decode first, the prefill gets what is left
    plan, _ = h.step()
    assert plan == [(r, 1), (p, 7)]
    q = h.add([7, 8], max_tokens=1)
    plan, _ = h.step()
    assert plan == [(r, 1), (p, 6), (q, 1)]  # running ones first, in order; the newcomer last
    h.s.abort(r)
    h.collect([r])
    h.run_all()


def test_every_running_sequence_gets_a_token_even_past_the_budget():
    h = Harness(max_batch_tokens=64)
    seqs = [h.add([i, i + 1, i + 2], max_tokens=5) for i in range(0, 12, 3)]
    plan, _ = h.step()
    assert [n for _, n in plan] == [3, 3, 3, 3]
    late = h.add([50, 51])
    h.s.max_batch_tokens = 2  # fewer tokens than running sequences
    plan, _ = h.step()
    assert plan == [(s, 1) for s in seqs]  # one token each, none starved; no admission
    assert late.status is Status.WAITING
    h.s.abort(late)
    h.run_all()
    assert all(s.finish_reason == "length" and s.num_generated == 5 for s in seqs)


def test_running_decodes_go_before_a_new_long_prefill():
    h = Harness(max_batch_tokens=8, max_running=4)
    p = h.add(list(range(30, 40)), max_tokens=1)  # a long prompt admitted first
    r = h.add([1, 2], max_tokens=10)
    plan, _ = h.step()
    assert plan == [(p, 8)]  # r waits: no budget left
    plan, _ = h.step()  # p: 2 left; r admitted with its 2 tokens
    assert plan == [(p, 2), (r, 2)]
    # now p decodes... it finished (max_tokens=1); make a new long prefill run before r's decode
    assert p.finished
    q = h.add(list(range(60, 84)), max_tokens=1)
    plan, _ = h.step()
    assert plan == [(r, 1), (q, 7)]
    plan, _ = h.step()
    assert plan == [(r, 1), (q, 7)]
    h.run_all()


# -- preemption ------------------------------------------------------------------------------


def test_preemption_takes_the_newest_and_its_full_blocks_stay_cached():
    h = Harness(num_blocks=6)
    a = h.add(list(range(10, 19)), stop_ids={99})  # 9 tokens: 3 blocks
    b = h.add(list(range(20, 26)), stop_ids={99})  # 6 tokens: 2 blocks
    for _ in range(4):
        plan, _ = h.step()
        assert [s for s, _ in plan] == [a, b]
    assert (a.num_computed, len(a.token_ids), b.num_computed, len(b.token_ids)) == (12, 13, 9, 10)
    assert h.kv.pool.num_free == 0
    # a needs a 4th block: none free, nothing to evict -> b, the newest, is preempted
    plan, finished = h.step({a: 99})  # a's token ends it
    assert plan == [(a, 1)]
    assert b.preemptions == 1 and a.preemptions == 0
    assert b.status is Status.WAITING and h.s.waiting[0] is b
    assert b.block_table == [] and b.lock_node is None and b.num_computed == 0
    assert h.kv.cached_len(b.token_ids) == 8  # its 2 computed full blocks are in the tree
    assert finished == [a]
    # re-admission hits them: only the rest is recomputed
    plan, _ = h.step()
    assert plan == [(b, 2)]
    assert b.num_cached == 0  # stats keep the first admission's hit
    assert len(b.token_ids) == 11  # the sampled token continues its output
    h.s.abort(b)
    h.check()


def test_the_preempted_go_to_the_front_of_the_queue_oldest_first():
    h = Harness(num_blocks=5, max_running=3)
    a = h.add(list(range(10, 17)), stop_ids={99})  # 7 tokens: 2 blocks
    b = h.add([20, 21, 22], stop_ids={99})  # 1 block
    c = h.add([30, 31, 32], stop_ids={99})  # 1 block
    h.step()
    assert [s.status for s in (a, b, c)] == [Status.RUNNING] * 3 and h.kv.pool.num_free == 1
    w = h.add([40], stop_ids={99})  # max_running: waits
    order = []
    for _ in range(10):
        h.step()
        order += [s for s in (b, c) if s.preemptions and s not in order]
        assert a.preemptions == 0  # the oldest is never the victim
        if b.preemptions:
            break
    assert order == [c, b]  # newest first
    assert list(h.s.waiting) == [b, c, w]  # each went to the front: the older ahead of the newer
    assert b.preemptions == c.preemptions == 1
    for s in (a, b, c, w):
        h.s.abort(s)
    h.check()


def test_a_sequence_that_is_the_newest_preempts_itself_and_the_older_keep_running():
    h = Harness(num_blocks=3)
    a = h.add([1, 2, 3], stop_ids={99})  # 1 block, decodes into a 2nd at token 5
    b = h.add([4, 5, 6, 7, 8], stop_ids={99})  # 2 blocks
    h.step()
    assert h.kv.pool.num_free == 0
    plan, _ = h.step()  # a: 4 tokens fit in its block; b: 6 fit in its two
    assert [s for s, _ in plan] == [a, b]
    plan, _ = h.step()  # a needs a 2nd block: b, the newest, goes
    assert plan[0] == (a, 1) and b.preemptions == 1 and b.status is Status.WAITING
    for s in (a, b):
        h.s.abort(s)
    h.check()


# -- abort ------------------------------------------------------------------------------------


def test_abort_while_waiting_drops_the_handed_prefix():
    h = Harness()
    first = h.add(A[:10], max_tokens=1, retain=True)
    h.run_all()
    kept = h.kept.pop()  # the "session" hands its retained KV to the next turn
    assert kept is first.retained and kept.tail_block is not None
    free = h.kv.pool.num_free
    seq = h.add(A[:10] + [TOKEN, 1, 2], prefix=kept, retain=True)
    h.check()
    h.s.abort(seq)
    assert seq.finished and seq.finish_reason == "aborted" and seq not in h.s.waiting
    assert seq.prefix is None and kept.node is None and kept.tail_block is None
    assert seq.retained is None  # nothing was computed: nothing to retain
    assert h.kv.pool.num_free == free + 1 and h.kv.stats()["retained"] == 0
    assert h.kv.cache.evictable_blocks == h.kv.cache.cached_blocks  # the history's lock is gone
    h.check()
    assert seq.result().finish_reason == "aborted" and seq.result().text == ""
    h.s.abort(seq)  # twice: a no-op


def test_abort_while_running_frees_its_blocks():
    h = Harness(max_batch_tokens=8)
    seq = h.add(list(range(40, 60)))  # 20 tokens: chunked
    h.step()
    h.step()  # 16 computed
    assert seq.status is Status.RUNNING and len(seq.block_table) == 4
    h.s.abort(seq)
    assert seq.finished and seq.finish_reason == "aborted" and seq not in h.s.running
    assert seq.block_table == [] and seq.lock_node is None
    assert h.kv.cache.cached_blocks == 4  # its computed full blocks stay cached
    assert h.kv.pool.num_free + h.kv.cache.evictable_blocks == 16
    h.check()
    assert h.s.schedule() == [] and not h.s.has_work()


def test_abort_while_running_with_retain_keeps_the_kv_for_the_conversation():
    h = Harness()
    seq = h.add(list(range(40, 46)), retain=True)
    h.step()
    h.step()
    h.s.abort(seq)
    assert seq.retained is not None and seq.retained.kv_len == 7
    with pytest.raises(AssertionError, match="held by no live"):
        h.check()  # issued and nobody holds it yet
    h.collect([seq])
    h.check()
    h.drop_kept()


def test_a_waiting_sequence_handed_a_prefix_takes_its_tail_when_admitted():
    h = Harness()
    first = h.add(A[:10], max_tokens=2, retain=True)
    h.run_all()
    kept = h.kept.pop()
    assert kept.kv_len == 11  # the prompt and the first sampled token have KV
    seq = h.add(first.token_ids + [7, 7], prefix=kept, max_tokens=1)
    plan, _ = h.step()
    assert plan == [(seq, 3)]  # the history's 11 tokens with KV are not recomputed (2 blocks + its tail)
    assert seq.num_cached == 11
    h.check()


# -- a request that can never fit --------------------------------------------------------------


def test_a_request_that_can_never_fit_fails_alone_and_the_others_keep_running():
    h = Harness(num_blocks=4)
    small = h.add([1, 2, 3], max_tokens=4)
    h.step()
    big = h.add(list(range(20)), max_tokens=4)  # 20 tokens: 5 blocks of a 4-block pool
    after = h.add([7, 8], max_tokens=2)
    plan, _ = h.step()  # small keeps running; big cannot start now (and blocks those behind it)
    assert plan == [(small, 1)] and big.status is Status.WAITING and not big.finished
    while not small.finished:
        h.step()
    plan, _ = h.step()  # alone and still no room: it never will
    assert plan == []
    assert big.finished and big.finish_reason == "error" and isinstance(big.error, OutOfBlocks)
    assert "20 tokens" in str(big.error)
    assert big.block_table == [] and big not in h.s.waiting
    h.check()
    h.run_all()  # the next request runs
    assert after.finish_reason == "length" and small.finish_reason == "length"
    assert h.kv.pool.num_free + h.kv.cache.evictable_blocks == 4


def test_the_request_failed_as_never_fitting_is_the_one_that_does_not_fit():
    """Pinned prefixes leave one free block. The request ranked first (longest cached prefix)
    needs two; the one that arrived first needs one and fits."""
    h = Harness(num_blocks=8)
    p1 = list(range(100, 116))  # 4 blocks
    p2 = list(range(200, 212))  # 3 blocks
    cache(h, p1)
    cache(h, p2)
    pins = [h.kv.pin(p1), h.kv.pin(p2)]
    assert h.kv.pool.num_free == 1 and h.kv.cache.evictable_blocks == 0
    fits = h.add([1, 2, 3], max_tokens=1)  # arrived first; 1 block
    never = h.add(p1 + list(range(8)), max_tokens=1)  # 16 cached, 8 more need 2 blocks
    for _ in range(3):
        h.step()
    assert never.finish_reason == "error" and isinstance(never.error, OutOfBlocks)
    assert fits.finish_reason == "length" and fits.error is None
    for key in pins:
        h.kv.unpin(key)
    h.check()


def test_an_exception_from_on_pressure_at_admission_leaves_the_request_waiting_holding_nothing():
    h = Harness(num_blocks=4)
    cache(h, A[:8])
    hog = h.add(list(range(50, 57)), max_tokens=100)  # 2 blocks, running (its next token fits in them)
    h.step()
    assert h.kv.pool.num_free == 0 and h.kv.cache.cached_blocks == 2
    seq = h.add(A[:8] + [1, 2, 3, 4, 5], max_tokens=3)  # 8 cached (the tree's 2 blocks), 5 more need 2 blocks

    def boom(missing):
        raise OSError(28, "No space left on device")

    h.kv.on_pressure = boom
    with pytest.raises(OSError):
        h.s.schedule()
    assert seq.status is Status.WAITING and seq in h.s.waiting
    assert seq.block_table == [] and seq.lock_node is None and seq.num_computed == 0
    h.check()
    h.kv.on_pressure = None
    h.s.abort(hog)
    h.run_all()  # the hog's blocks are evicted for it now
    assert seq.finish_reason == "length" and seq.num_cached == 8
    h.check()


# -- postprocess: stop and length ----------------------------------------------------------------


def test_stop_token():
    h = Harness()
    seq = h.add([1, 2, 3], stop_ids={2, 9})
    h.step({})
    _, finished = h.step({seq: 9})
    assert finished == [seq] and seq.finish_reason == "stop"
    assert seq.generated_ids == [TOKEN, 9] and seq.text == "f"  # the stop token is not text
    assert seq.block_table == []
    h.check()


def test_stop_string_cuts_the_text():
    h = Harness()
    seq = h.add([1], stop=["cd"])
    for t in [0, 1, 2]:  # "abc"
        _, finished = h.step({seq: t})
        assert not finished
    _, finished = h.step({seq: 3})  # "d" completes the stop string
    assert finished == [seq] and seq.finish_reason == "stop" and seq.text == "ab"
    assert seq.generated_ids == [0, 1, 2, 3]
    h.check()


def test_max_tokens():
    h = Harness()
    seq = h.add([1, 2], max_tokens=3)
    for i in range(3):
        _, finished = h.step()
        assert (finished == [seq]) == (i == 2)
    assert seq.finish_reason == "length" and seq.num_generated == 3 and seq.text == "fff"


def test_max_total_tokens():
    h = Harness()
    seq = h.add([1, 2, 3, 4, 5], max_tokens=100, max_total=7)
    h.step()
    _, finished = h.step()
    assert finished == [seq] and seq.finish_reason == "length" and len(seq.token_ids) == 7


def test_a_stop_token_wins_over_length():
    h = Harness()
    seq = h.add([1, 2], max_tokens=1, stop_ids={9})
    h.step({seq: 9})
    assert seq.finish_reason == "stop"


def test_a_sampling_error_fails_only_its_sequence():
    h = Harness()
    bad = h.add([1, 2, 3], retain=True)
    good = h.add([4, 5, 6], max_tokens=2)
    plan = h.s.schedule()
    err = RuntimeError("logits are nan")
    finished = h.s.postprocess(plan, {bad: err, good: TOKEN})
    assert finished == [bad] and bad.finish_reason == "error" and bad.error is err
    assert bad.retained is None  # a failed request retains nothing
    assert bad.block_table == []
    h.check()
    h.run_all()
    assert good.finish_reason == "length"


def test_finished_sequences_hand_back_their_kv_and_retain_on_request():
    h = Harness()
    plain = h.add(A[:10], max_tokens=2)
    kept = h.add(A[:6] + [1, 1, 1, 1, 1], max_tokens=2, retain=True)
    h.run_all()
    assert plain.retained is None and kept.retained is not None
    assert kept.retained.kv_len == len(kept.token_ids) - 1  # the last sampled token has no KV yet
    assert h.kv.pool.num_free + h.kv.cache.evictable_blocks == 16 - 1 - 2  # its tail + locked full blocks
    h.drop_kept()
    assert h.kv.pool.num_free + h.kv.cache.evictable_blocks == 16


def test_an_exception_while_finishing_leaks_nothing():
    """A text stream that raises when settled (e.g. a tokenizer error): the sequence is finished
    and its KV must not be left held by nobody."""

    class Broken(TextStream):
        def finish(self):
            raise RuntimeError("decode failed")

    h = Harness()
    seq = h.add([1, 2, 3], max_tokens=2)
    seq.out = Broken(FakeTokenizer())
    h.step()
    with pytest.raises(RuntimeError):
        h.s.abort(seq)
    assert seq.finished and seq not in h.s.running
    assert seq.block_table == [] and seq.lock_node is None
    h.check()


# -- caching off --------------------------------------------------------------------------------


def test_with_caching_off_nothing_is_shared_and_everything_returns():
    h = Harness(num_blocks=6, prefix_caching=False)
    a = h.add(A[:10], max_tokens=3, retain=True)
    b = h.add(A[:10], max_tokens=3)
    plan, _ = h.step()
    assert plan == [(a, 10), (b, 10)]  # no hit for the second
    h.run_all()
    assert a.retained is None and h.kv.pool.num_free == 6
    h.check()


def test_preemption_with_caching_off_recomputes_everything():
    h = Harness(num_blocks=3, prefix_caching=False)
    a = h.add([1, 2, 3], stop_ids={99})
    b = h.add([4, 5, 6, 7, 8], stop_ids={99})
    h.step()
    h.step()
    plan, finished = h.step({a: 99})  # a's 5th token needs a block: b preempted; a then finishes
    assert b.preemptions == 1 and finished == [a]
    n = len(b.token_ids)
    plan, _ = h.step()
    assert plan == [(b, n)]  # everything again: nothing was cached
    h.s.abort(b)
    assert h.kv.pool.num_free == 3
