"""The auto policy's measured pieces (chatkv.engine.speculative): the step-time model that prices a
verified row from the engine's own steps, the engine-wide acceptance prior, the long-match key.

No timing decides a test: the step-cost tests feed synthetic step times, and the engine test
checks what the model runner reports (rows and sequences), not how long anything took.
"""

from __future__ import annotations

import math
import random

import pytest

from chatkv.config import EngineConfig
from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams
from chatkv.engine.speculative import LONG_MATCH, MAX_NGRAM, NgramProposer, Speculator, StepCost

pytestmark = pytest.mark.tiny_model("llama", seed=11)


def profile(cost: StepCost, r: float, steps: int, seed: int = 0, outliers: float = 0.0, seqs: int = 1) -> None:
    """Steps of ``seqs`` sequences and varying rows, each taking ``t0 * (1 + r * (rows - 1))``
    while ``t0`` drifts (a load that changes); a fraction ``outliers`` of them waited 5-20x."""
    rng = random.Random(seed)
    t0 = 0.01
    for _ in range(steps):
        t0 *= math.exp(rng.uniform(-0.05, 0.05))
        rows = seqs + rng.choice([0, 0, 1, 2, 3, 5, 8])
        t = t0 * (1 + r * (rows - 1))
        if rng.random() < outliers:
            t *= rng.uniform(5, 20)
        cost.record(seqs, rows, t)


class Seq:
    """What the speculator reads of a decoding sequence."""

    def __init__(self, toks):
        self.token_ids, self.num_prompt_tokens = toks, len(toks) - 1
        self.params, self.matcher, self.max_total_tokens = SamplingParams(max_tokens=100), None, 10**6
        self.spec = None

    @property
    def num_generated(self):
        return len(self.token_ids) - self.num_prompt_tokens


LOOP = [7, 8, 9, 10] * 6


def test_auto_policy_speculates_where_it_pays():
    loop = [7, 8, 9, 10] * 6
    s = Speculator("auto", max_k=5)
    one = Seq(list(loop))
    assert s.assign([one], 1, 100)[one]  # a new sequence tries (prior 0.5)
    for _ in range(20):
        s.observe(one, 5, 5)  # every proposal accepted
    assert len(s.assign([one], 1, 100)[one]) == 5  # it keeps being accepted: k grows to the most
    bad = Seq(list(loop))
    s.state(bad)
    for _ in range(20):
        bad.spec.key = bad.spec.proposer.propose(bad.token_ids, 3).key  # the kind its proposals are
        s.observe(bad, 3, 0)
    assert bad not in s.assign([bad], 1, 100)  # rejected every time: it stops
    for _ in range(400):  # not tried for long: it is probed again
        if s.assign([bad], 1, 100):
            break
    else:
        raise AssertionError("a sequence that stopped speculating is never probed again")
    big = [Seq(list(loop)) for _ in range(12)]
    assert sum(len(d) for d in s.assign(big, 12, 100).values()) <= 15 - 12  # never past max_rows
    assert Speculator("lookup", 4).assign([Seq(list(loop))], 1, 2)  # the budget bounds lookup too
    assert not Speculator("auto").assign([one], 1, 0)


def test_auto_declines_steps_of_more_decoding_sequences_than_its_batch_bound():
    s = Speculator("auto", max_k=5, max_batch=4)
    seqs = [Seq(list(LOOP)) for _ in range(5)]
    for q in seqs:
        s.state(q)
        q.spec.key = q.spec.proposer.propose(q.token_ids, 5).key
        for _ in range(20):
            s.observe(q, 5, 5)  # every proposal accepted: alone, each would speculate
    assert s.assign(seqs[:4], 4, 100)  # within the bound it speculates
    assert s.assign(seqs, 5, 100) == {}  # one more sequence: none
    fresh = [Seq(list(LOOP)) for _ in range(5)]
    assert s.assign(fresh, 5, 100) == {} and all(q.spec is None for q in fresh)  # nor any lookup made for it
    assert Speculator("auto", max_k=5).max_batch is None  # the bound is the engine's choice (CPU: 4)


@pytest.mark.parametrize("r", [0.05, 0.3, 1.2])
def test_step_cost_recovers_the_row_cost_of_a_drifting_profile(r):
    cost = StepCost(prior=0.2)
    profile(cost, r, 200)
    assert cost.row_cost == pytest.approx(r, rel=0.25, abs=0.02)


def test_step_cost_ignores_outliers():
    cost = StepCost(prior=0.2)
    profile(cost, 0.4, 300, seed=3, outliers=0.15)  # 15% of the steps waited on a busy core
    assert cost.row_cost == pytest.approx(0.4, rel=0.25)


def test_step_cost_batched_steps_compare_like_with_like():
    cost = StepCost(prior=0.2)
    profile(cost, 0.1, 200, seed=5, seqs=8)  # 8 sequences a step: r from T(8 + d) / T(8)
    assert cost.row_cost == pytest.approx(0.1, rel=0.3, abs=0.02)
    other = StepCost(prior=0.2)
    for i in range(50):  # consecutive steps of different batches never pair: nothing is measured
        other.record(1 + i % 2, 4, 0.01 * (1 + i % 2))
    assert other.row_cost == 0.2


def test_step_cost_keeps_its_prior_until_measured_and_rejects_nonsense():
    cost = StepCost(prior=0.25, min_samples=5)
    for t in [0.0, -1.0, float("nan"), float("inf")]:
        cost.record(1, 3, t)
    cost.record(1, 0, 0.01)  # fewer rows than sequences
    assert cost.row_cost == 0.25 and cost.samples == 0
    for _ in range(4):  # a prefill between every pair of decode steps: no neighbours
        cost.record(1, 1, 0.01)
        cost.skip()
        cost.record(1, 5, 0.05)
        cost.skip()
    assert cost.row_cost == 0.25
    for _ in range(6):
        cost.record(1, 1, 0.01)
        cost.record(1, 5, 0.05)  # 1 + 4 r = 5: r = 1
    assert cost.row_cost == pytest.approx(1.0)
    for _ in range(40):
        cost.record(1, 1, 0.01)
        cost.record(1, 3, 1.0)  # absurdly slow rows: clamped
    assert cost.row_cost == cost.hi


def test_a_high_measured_cost_expires_and_is_measured_again():
    cost = StepCost(prior=0.2, max_age=100)
    profile(cost, 1.5, 60)  # a heavy spell: rows measured dear, so auto stops speculating...
    assert cost.row_cost == pytest.approx(1.5, rel=0.25)
    for _ in range(150):  # ... and only one-row steps follow: nothing new is measured
        cost.record(1, 1, 0.01)
    assert cost.row_cost == 0.2 and cost.samples == 0  # the old estimates expired: the prior again
    profile(cost, 0.3, 60, seed=2)
    assert cost.row_cost == pytest.approx(0.3, rel=0.25)


def test_auto_declines_where_the_measured_row_cost_exceeds_the_expected_gain():
    cheap, dear = Speculator("auto", max_k=5), Speculator("auto", max_k=5)
    profile(cheap.cost, 0.1, 100)
    profile(dear.cost, 0.8, 100)  # a machine where a verified row costs most of a step
    a, b = Seq(list(LOOP)), Seq(list(LOOP))
    for spec, seq in [(cheap, a), (dear, b)]:
        spec.state(seq)
        for _ in range(10):
            seq.spec.key = MAX_NGRAM
            spec.observe(seq, 2, 1)  # half of the proposals accepted
    assert cheap.assign([a], 1, 100).get(a)  # 0.5 tokens a row at 0.1 of a step each: pays
    assert b not in dear.assign([b], 1, 100)  # at 0.8 of a step a row: it does not
    # the same sequence on the cheap machine keeps proposing as long as each row pays
    assert len(cheap.assign([a], 1, 100)[a]) >= 1


def test_a_new_request_starts_from_the_engines_acceptance():
    spec = Speculator("auto", max_k=8)
    old = Seq(list(LOOP))
    spec.state(old)
    for _ in range(30):  # long matches were accepted every time, short ones never
        old.spec.key = LONG_MATCH
        spec.observe(old, 8, 8)
        old.spec.key = 1
        spec.observe(old, 2, 0)
    new = spec.state(Seq(list(LOOP)))
    assert new.alpha(LONG_MATCH) > 0.85 and new.alpha(1) < 0.2
    assert new.alpha(2) == 0.5  # a kind never tried anywhere: the uniform prior
    assert Speculator("auto").state(Seq(list(LOOP))).alpha(LONG_MATCH) == 0.5  # another engine's is its own


def test_a_long_match_is_its_own_kind():
    p = NgramProposer()
    passage = list(range(20, 40))
    quoted = passage + [1, 2, 3] + passage[:10]  # the suffix matches 10 tokens of the passage
    prop = p.propose(quoted, 4)
    assert prop.tokens == passage[10:14] and prop.key == LONG_MATCH
    phrase = [1, 2, 3, 4, 5, 50, 60, 9, 2, 3, 4, 5]  # a 4-token match that goes no further
    prop = NgramProposer().propose(phrase, 2)
    assert prop.tokens == [50, 60] and prop.key == MAX_NGRAM


def test_the_model_runner_reports_every_decode_step_with_its_rows(model_dir):
    class Recorder(StepCost):
        def __init__(self):
            super().__init__(prior=0.2)
            self.calls, self.skips = [], 0

        def record(self, seqs, rows, seconds):
            self.calls.append((seqs, rows))
            super().record(seqs, rows, seconds)

        def skip(self):
            self.skips += 1
            super().skip()

    eng = Engine(model_dir, EngineConfig(speculative="lookup", num_blocks=96))
    try:
        rec = eng.scheduler.speculator.cost = Recorder()
        src = list(range(5, 29))
        r = eng.generate(src + [3, 4] + src[:6], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        assert r.usage.proposed_tokens > 0
        # one sequence: every step after its first token is decode-only, and its rows are
        # its token plus its proposals
        assert all(seqs == 1 for seqs, _ in rec.calls)
        assert sum(rows - 1 for _, rows in rec.calls) == r.usage.proposed_tokens
        assert len(rec.calls) + 1 + r.usage.accepted_tokens == r.usage.generated_tokens
        assert rec.lo <= eng.scheduler.speculator.row_cost <= rec.hi
    finally:
        eng.close()
