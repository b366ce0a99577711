"""Speculative decoding by prompt lookup (chatkv.engine.speculative), on tiny random models.

- greedy output is token for token transformers' greedy and speculative="off"'s, over many
  prompts (repetitive ones, where proposals are accepted), batched with other requests, under
  preemption, and across a session restored from disk between turns;
- stop tokens, stop strings, max_tokens and the stream see what plain decoding produces;
- sampling: the output distribution is the target's (a statistical test of ``verify`` against
  the exact probabilities, many seeds), and a seeded request's tokens do not depend on
  speculation;
- the KV of rejected proposals is given back: the engine's integrity check after every step of
  a randomized run, and no sequence holds a block past its computed tokens;
- usage and the Prometheus counters report proposals; constrained requests speculate against
  their mask and give speculative='off''s tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

from chatkv import InvalidRequest
from chatkv.config import EngineConfig
from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams, probabilities
from chatkv.engine.speculative import NgramProposer, StepCost, verify
from tests.support.tiny import VOCAB, make_model

pytestmark = pytest.mark.tiny_model("llama", seed=11)

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ref(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(ref, ids: list[int], n: int) -> list[int]:
    out = ref.generate(
        torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def repetitive_ids(seed: int) -> list[int]:
    """A 'source' quoted again: a run of tokens, other tokens, then the run's start again."""
    src = random_ids(24, 100 + seed)
    return src + random_ids(5, 200 + seed) + src[:6]


PROMPTS = [random_ids(n, s) for s, n in enumerate([3, 9, 17, 33, 50])] + [repetitive_ids(s) for s in range(5)]


def engine(model_dir, mode: str, **kw) -> Engine:
    kw.setdefault("num_blocks", 96)
    return Engine(model_dir, EngineConfig(speculative=mode, **kw))


# -- the proposer and the verifier alone ------------------------------------------------


def test_ngram_proposer_takes_the_longest_suffix_match_and_continues_a_loop():
    p = NgramProposer()
    toks = [1, 2, 3, 4, 9, 2, 3, 4, 7, 8, 5, 3, 4]
    # the suffix (3, 4) last occurred before 7: its continuation is proposed
    prop = p.propose(toks, 3)
    assert prop.tokens == [7, 8, 5] and prop.key == 2
    toks += [7]  # tokens grow: the index follows
    prop = p.propose(toks, 2)
    assert prop.tokens == [8, 5] and prop.key == 3
    assert NgramProposer().propose([1, 2, 3], 4) is None  # nothing seen twice
    loop = [5, 6, 5, 6]
    assert NgramProposer().propose(loop, 5).tokens == [5, 6, 5, 6, 5]  # the period continues past the end
    assert NgramProposer().propose([1], 3) is None and NgramProposer().propose(toks, 0) is None


def test_verify_greedy_accepts_while_the_argmax_agrees_then_emits_the_models_token():
    logits = torch.full((4, 8), -5.0)
    for row, best in enumerate([3, 4, 1, 6]):
        logits[row, best] = 5.0
    greedy = SamplingParams(temperature=0)
    assert verify(logits, [3, 4, 5], greedy, [0], None) == [3, 4, 1]  # third proposal rejected: the model's 1
    assert verify(logits, [3, 4, 1], greedy, [0], None) == [3, 4, 1, 6]  # all accepted, then the bonus token
    assert verify(logits, [2, 4, 1], greedy, [0], None) == [3]


def test_verify_repetition_penalty_sees_the_accepted_proposals():
    # row 1 prefers 3 slightly over 4; once 3 is in the history the penalty flips it to 4
    logits = torch.tensor([[0.0, 0, 0, 9, 0], [0.0, 0, 0, 2.0, 1.9]])
    p = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert verify(logits, [3], p, [0], None) == [3, 4]
    assert verify(logits[1:], [], p, [0], None) == [3]  # without 3 in the history: 3


def test_verify_output_distribution_is_the_targets_over_many_seeds():
    """Rejection sampling of a point-mass draft: the first token is distributed as p0, the second
    (where the first proposal was accepted) as p1 given it, and the acceptance rate is p0(d0)."""
    torch.manual_seed(0)
    vocab, k = 6, 3
    logits = torch.randn(k + 1, vocab) * 1.5
    draft = [int(torch.argsort(logits[0])[-2]), 2, 5]  # the first proposal: the second most likely token
    history = [1, 2]
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.95, repetition_penalty=1.2)
    p0 = probabilities(logits[0], params, history)
    p1 = probabilities(logits[1], params, history + [draft[0]])
    n = 6000
    first, second, accepted = torch.zeros(vocab), torch.zeros(vocab), 0
    for seed in range(n):
        g = torch.Generator().manual_seed(seed)
        out = verify(logits, draft, params, history, g)
        first[out[0]] += 1
        if out[0] == draft[0]:
            accepted += 1
            second[out[1]] += 1
    tv0 = 0.5 * (first / n - p0).abs().sum()
    tv1 = 0.5 * (second / second.sum() - p1).abs().sum()
    assert tv0 < 0.03, (first / n, p0)
    assert tv1 < 0.05, (second / second.sum(), p1)
    assert abs(accepted / n - float(p0[draft[0]])) < 0.03
    # chi-square of the first token against p0 (5 dof at most: 20.5 is p = 0.001)
    keep = p0 > 0
    chi2 = float((((first - n * p0) ** 2)[keep] / (n * p0[keep])).sum())
    assert chi2 < 20.5, chi2


# -- the engine: greedy identity ----------------------------------------------------------


@pytest.mark.parametrize("mode", ["lookup", "auto"])
def test_greedy_is_transformers_greedy_and_speculative_off_over_many_prompts(model_dir, ref, mode):
    on, off = engine(model_dir, mode), engine(model_dir, "off")
    # the tiny model's verified rows cost more than a whole step each (its forward is mostly
    # per-row overhead): measured, auto rightly declines; the prior is kept so that auto's
    # proposals are made and their exactness tested (tests/engine/test_speculative_policy.py: the measuring)
    on.scheduler.speculator.cost = StepCost(prior=0.2, min_samples=10**9)
    accepted = 0
    for i, p in enumerate(PROMPTS):
        r = on.generate(p, GREEDY)
        assert r.token_ids == off.generate(p, GREEDY).token_ids == hf_greedy(ref, p, 40), i
        assert r.usage.generated_tokens == 40 and r.finish_reason == "length"
        if i >= 5:  # a repetitive prompt: proposals are made (lookup: and some accepted in each)
            assert r.usage.proposed_tokens > 0, (i, r.usage)
            assert r.usage.accepted_tokens > 0 or mode == "auto", (i, r.usage)
            accepted += r.usage.accepted_tokens
        on.check_integrity()
    assert accepted > 0  # auto, after the engine saw some kinds fail, may propose less on a prompt
    assert off.generate(PROMPTS[-1], GREEDY).usage.proposed_tokens == 0


def test_batched_with_other_requests_each_as_alone(model_dir, ref):
    on = engine(model_dir, "lookup", max_batch_tokens=64)  # prefill chunks share steps with verifications
    params = [
        SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (40, 7, 33, 1, 25, 40, 12, 30, 2, 40)
    ]
    results = on.generate(PROMPTS, params)
    for p, sp, r in zip(PROMPTS, params, results):
        assert r.token_ids == hf_greedy(ref, p, sp.max_tokens)
    assert sum(r.usage.accepted_tokens for r in results) > 0
    on.check_integrity()


def test_preemption_keeps_speculative_outputs_exact(model_dir, ref):
    on = engine(model_dir, "lookup", num_blocks=14, block_size=8)  # 112 tokens for 4 x (35 + 40)
    prompts = PROMPTS[5:9]
    results = on.generate(prompts, GREEDY)
    assert sum(r.preemptions for r in results) > 0
    for p, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(ref, p, 40)
    assert sum(r.usage.accepted_tokens for r in results) > 0
    on.check_integrity()


def test_session_restored_from_disk_between_turns_continues_exactly(model_dir, tmp_path):
    params = dict(max_tokens=24, temperature=0.0)
    quote = "The quick brown fox jumps over the lazy dog. " * 3
    questions = [f"Repeat: {quote}", "Again: " + quote, "Once more: " + quote]

    def run(mode: str, data: str, restart: bool):
        e = engine(model_dir, mode, data_dir=str(tmp_path / data))
        s = e.session(params=params)
        replies = [s.send(q) for q in questions[:2]]
        if restart:
            sid = s.id
            e.close()
            e = engine(model_dir, mode, data_dir=str(tmp_path / data))
            s = e.resume(sid)
        replies.append(s.send(questions[2]))
        e.check_integrity()
        e.close()
        return replies

    straight = run("off", "off", False)
    restored = run("lookup", "on", True)
    assert [r.text for r in restored] == [r.text for r in straight]
    assert restored[2].usage.restored_tokens > 0  # the history came from disk
    assert sum(r.usage.proposed_tokens for r in restored) > 0
    assert all(r.usage.accepted_tokens <= r.usage.proposed_tokens for r in restored)


# -- stops and streaming -----------------------------------------------------------------


def test_stop_tokens_strings_max_tokens_and_stream_see_what_plain_decoding_produces(model_dir):
    on, off = engine(model_dir, "lookup"), engine(model_dir, "off")
    for p in PROMPTS[5:]:
        full = off.generate(p, GREEDY)
        gen = full.token_ids
        cases = [
            SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[gen[9]], ignore_eos=True),
            SamplingParams(
                max_tokens=40, temperature=0, stop=[full.text[12:15]] if len(full.text) > 15 else [], ignore_eos=True
            ),
            SamplingParams(max_tokens=11, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=40, temperature=0),
        ]
        for sp in cases:
            a, b = on.generate(p, sp), off.generate(p, sp)
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
            pieces_on = list(on.stream(p, sp))
            pieces_off = list(off.stream(p, sp))
            assert "".join(pieces_on[:-1]) == "".join(pieces_off[:-1]) == b.text
            assert pieces_on[-1].token_ids == b.token_ids
        on.check_integrity()


def test_seeded_sampling_gives_the_same_tokens_with_speculation_on_or_off(model_dir):
    on, off = engine(model_dir, "lookup"), engine(model_dir, "off")
    prompts = PROMPTS[5:] * 4
    params = [
        SamplingParams(
            max_tokens=24, temperature=t, top_p=0.9, top_k=40, repetition_penalty=rp, seed=s, ignore_eos=True
        )
        for s, (t, rp) in enumerate([(0.05, 1.0), (0.1, 1.1), (0.2, 1.0), (0.7, 1.3)] * 5)
    ]
    a, b = [], []
    for i in range(0, len(prompts), 4):  # batches of 4: a step of 20 decodes is past max_rows, never speculated
        a += on.generate(prompts[i : i + 4], params[i : i + 4])
        b += off.generate(prompts[i : i + 4], params[i : i + 4])
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert sum(r.usage.accepted_tokens for r in a) > 0


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantised_kv_greedy_is_speculative_offs_with_the_same_kv_dtype(model_dir, kv_dtype):
    """A verified row reads the keys of the rows before it as a later plain decode reads them:
    quantised (per-token scales) and dequantised, so the tokens match off's with the same KV."""
    on, off = engine(model_dir, "lookup", kv_dtype=kv_dtype), engine(model_dir, "off", kv_dtype=kv_dtype)
    assert on.kv_dtype.startswith(kv_dtype) and on.runner.kv_format.quant is not None  # stored quantised
    for i, p in enumerate(PROMPTS[3:]):
        r = on.generate(p, GREEDY)
        assert r.token_ids == off.generate(p, GREEDY).token_ids, i
        on.check_integrity()
    batch = on.generate(PROMPTS[5:], GREEDY)  # verifications beside other rows of the step
    assert [r.token_ids for r in batch] == [r.token_ids for r in off.generate(PROMPTS[5:], GREEDY)]
    assert sum(r.usage.accepted_tokens for r in batch) > 0
    on.check_integrity()


# -- KV integrity after rejections ---------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_kv_integrity_after_every_step_of_a_randomized_run(model_dir, seed):
    rng = random.Random(seed)
    e = engine(model_dir, "lookup", num_blocks=40, block_size=4, max_batch_tokens=48)
    bs = 4
    pending = []
    for i in range(14):
        p = (
            repetitive_ids(rng.randrange(1000))
            if rng.random() < 0.7
            else random_ids(rng.randrange(2, 40), rng.randrange(1000))
        )
        sp = SamplingParams(
            max_tokens=rng.randrange(1, 30),
            temperature=rng.choice([0.0, 0.0, 0.8, 1.2]),
            top_k=rng.choice([0, 20]),
            repetition_penalty=rng.choice([1.0, 1.2]),
            seed=rng.randrange(1000),
            stop=rng.choice([[], ["a"], ["the"]]),
            stop_token_ids=rng.choice([[], [rng.randrange(3, VOCAB)]]),
            ignore_eos=rng.random() < 0.5,
        )
        pending.append((rng.randrange(0, 20), p, sp))
    seqs, steps = [], 0
    while pending or e.has_work():
        for item in [x for x in pending if x[0] <= steps]:
            pending.remove(item)
            seqs.append(e.add_request(item[1], item[2]))
        e.step()
        steps += 1
        e.check_integrity()
        for s in e.scheduler.running:
            assert not s.draft
            assert len(s.block_table) == -(-s.num_computed // bs), "a block past the computed tokens is held"
            assert s.num_computed <= len(s.token_ids) - 1
        assert steps < 2000
    e.check_integrity()
    assert e.kv.pool.num_free + e.kv.cache.cached_blocks == e.kv.pool.num_blocks  # nothing else holds a block
    proposed = sum(s.spec.proposed for s in seqs if s.spec)
    accepted = sum(s.spec.accepted for s in seqs if s.spec)
    assert 0 < accepted < proposed  # proposals were both accepted and rejected


# -- reporting, options, constraints -------------------------------------------------------


def test_prometheus_counters_shaped_like_vllms(model_dir):
    from chatkv.engine.metrics import EngineMetrics

    e = engine(model_dir, "lookup").start()  # finish listeners run on the loop thread
    m = EngineMetrics(e, "tiny")
    results = e.generate(PROMPTS[5:], GREEDY)
    text = m.render().decode()
    e.close()
    proposed = sum(r.usage.proposed_tokens for r in results)
    accepted = sum(r.usage.accepted_tokens for r in results)
    assert f'chatkv:spec_decode_num_draft_tokens_total{{model_name="tiny"}} {float(proposed)}' in text
    assert f'chatkv:spec_decode_num_accepted_tokens_total{{model_name="tiny"}} {float(accepted)}' in text
    assert 'chatkv:spec_decode_num_drafts_total{model_name="tiny"}' in text
    assert 'chatkv:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in text


def test_options_are_validated(model_dir):
    with pytest.raises(InvalidRequest, match="speculative"):
        Engine.from_pretrained(model_dir, speculative="draft")
    with pytest.raises(InvalidRequest, match="num_speculative_tokens"):
        Engine.from_pretrained(model_dir, num_speculative_tokens=-1)
    assert Engine.from_pretrained(model_dir, num_blocks=8, num_speculative_tokens=0).scheduler.speculator is None
    assert EngineConfig().speculative == "auto"


ROWS = {
    "type": "array",
    "minItems": 3,
    "maxItems": 5,
    "items": {
        "type": "object",
        "properties": {"name": {"enum": ["ab", "cd"]}, "id": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["name", "id"],
        "additionalProperties": False,
    },
}


def test_constrained_requests_speculate_against_the_mask(model_dir):
    """Proposals of a constrained request are cut to what its constraint accepts and
    each verified position is masked as plain decoding masks it: greedy and seeded outputs are
    speculative='off''s token for token, valid when they stop, with proposals accepted."""
    pytest.importorskip("llguidance")
    import json

    import jsonschema

    quote = "The quick brown fox jumps over the lazy dog. The quick brown fox"
    cases = [
        SamplingParams(max_tokens=80, temperature=0, json_schema=ROWS),
        SamplingParams(max_tokens=80, temperature=0.8, seed=4, json_schema=ROWS),
        SamplingParams(max_tokens=40, temperature=0, regex="(ab ){3,6}cd"),
        SamplingParams(max_tokens=20, temperature=0, choice=["quick brown fox jumps", "lazy dog"]),
        GREEDY,
    ]
    prompts = [quote] * 4 + [PROMPTS[6]]
    runs = {}
    for mode in ("off", "lookup"):
        e = engine(model_dir, mode)
        runs[mode] = e.generate(prompts, [SamplingParams(**vars(p)) for p in cases])
        e.check_integrity()
        e.close()
    for p, off, on in zip(cases, runs["off"], runs["lookup"]):
        assert on.token_ids == off.token_ids and on.finish_reason == off.finish_reason, p
        if p.json_schema is not None and on.finish_reason == "stop":
            jsonschema.validate(json.loads(on.text), ROWS)
    assert runs["lookup"][2].finish_reason != "stop" or __import__("re").fullmatch(
        "(ab ){3,6}cd", runs["lookup"][2].text
    )
    constrained = runs["lookup"][:4]
    assert (
        sum(r.usage.proposed_tokens for r in constrained) > 0 and sum(r.usage.accepted_tokens for r in constrained) > 0
    )
    assert all(r.usage.proposed_tokens == 0 for r in runs["off"])


def test_a_turns_speculation_counts_are_stored_with_its_reply(tmp_path):
    """usage.proposed_tokens / accepted_tokens reach the stored message (migration 0006) and come
    back as the reply's usage after a restart (the app's /stats reads them there)."""
    from chatkv.outputs import Usage

    d = tmp_path / "m"
    make_model(d, "llama", seed=3, max_position_embeddings=4096)
    text = "one two three four five six seven eight " * 6
    with Engine(d, EngineConfig(data_dir=str(tmp_path / "data"), num_blocks=256, speculative="lookup")) as e:
        s = e.session(params=dict(max_tokens=24, temperature=0.0, ignore_eos=True))
        r = s.send(text)
        conv = s.id
    with Engine(d, EngineConfig(data_dir=str(tmp_path / "data"), num_blocks=256)) as e:
        stored = Usage.from_message(e.resume(conv).messages()[-1])
    assert r.usage.proposed_tokens > 0
    assert (stored.proposed_tokens, stored.accepted_tokens) == (r.usage.proposed_tokens, r.usage.accepted_tokens)
