"""Log probabilities, logit bias and OpenAI's presence/frequency penalties in the engine
(chatkv.engine.sampling), on a tiny random float32 llama against transformers' own forward.

- greedy logprobs (the picked token's and the top alternatives) equal transformers' float32
  ``log_softmax`` of the same positions within 1e-3; they are the raw logits' even where bias,
  penalties and temperature changed the pick;
- a token that speculative decoding verified reports its plain decode's logprobs (speculation on
  and off agree within 1e-4, with proposals accepted);
- ``logit_bias`` and the penalties pick what a reference loop over transformers' logits picks with
  OpenAI's formula; a stop token is left out of the logprobs; asking for logprobs changes no token;
- the new fields are validated: NaN, inf, out of range, wrong types and out-of-vocabulary ids are
  ``InvalidRequest``s naming the field.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from chatkv import InvalidRequest
from chatkv.config import EngineConfig
from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams, adjust, sample
from chatkv.engine.speculative import StepCost
from tests.support.tiny import VOCAB

pytestmark = pytest.mark.tiny_model("llama", seed=11)


@pytest.fixture(scope="module")
def ref(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def eng(model_dir):
    e = Engine(model_dir, EngineConfig(speculative="off", num_blocks=128, dtype="float32"))
    yield e
    e.check_integrity()
    e.close()


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logprobs(ref, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax at each generated position: ``[len(generated), vocab]``."""
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + generated])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)], dim=-1)


def test_greedy_logprobs_equal_transformers_log_softmax(eng, ref):
    for seed, n in [(1, 5), (2, 17), (3, 40)]:
        prompt = ids_of(n, seed)
        r = eng.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5))
        assert [e.token_id for e in r.logprobs] == r.token_ids and len(r.token_ids) == 12
        want = hf_logprobs(ref, prompt, r.token_ids)
        for i, e in enumerate(r.logprobs):
            assert abs(e.logprob - float(want[i, e.token_id])) < 1e-3
            top = torch.topk(want[i], 5)
            assert [t for t, _ in e.top][0] == e.token_id == int(top.indices[0])  # greedy picks the best
            assert [v for _, v in e.top] == pytest.approx(top.values.tolist(), abs=1e-3)
            assert [t for t, _ in e.top] == [t for t, _ in sorted(e.top, key=lambda tv: -tv[1])]
        plain = eng.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        assert plain.token_ids == r.token_ids and plain.logprobs is None  # asking changes no token


def test_logprobs_are_the_raw_logits_whatever_changed_the_pick(eng, ref):
    prompt = ids_of(9, 4)
    base = eng.generate(prompt, SamplingParams(max_tokens=1, temperature=0)).token_ids[0]
    params = SamplingParams(
        max_tokens=10,
        temperature=0.7,
        seed=3,
        ignore_eos=True,
        logprobs=0,
        logit_bias={base: -100.0, 7: 5.0},
        presence_penalty=1.5,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
    )
    r = eng.generate(prompt, params)
    assert r.token_ids[0] != base  # the bias moved the first pick
    want = hf_logprobs(ref, prompt, r.token_ids)
    got = torch.tensor([e.logprob for e in r.logprobs])
    assert torch.allclose(got, want[torch.arange(10), torch.tensor(r.token_ids)], atol=1e-3)
    assert all(e.top == [] for e in r.logprobs)  # logprobs=0: the picked token's alone
    again = eng.generate(prompt, params)
    assert again.token_ids == r.token_ids  # seeded: the same draws


def test_speculation_reports_the_logprobs_of_plain_decoding(model_dir):
    on = Engine(model_dir, EngineConfig(speculative="lookup", num_blocks=128, dtype="float32"))
    off = Engine(model_dir, EngineConfig(speculative="off", num_blocks=128, dtype="float32"))
    on.scheduler.speculator.cost = StepCost(prior=0.2, min_samples=10**9)
    try:
        accepted = 0
        for seed in range(4):
            src = ids_of(24, 100 + seed)
            prompt = src + ids_of(5, 200 + seed) + src[:6]  # a quoted source: proposals are accepted
            for params in (
                SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=3),
                SamplingParams(max_tokens=30, temperature=0.8, seed=seed, ignore_eos=True, logprobs=3),
            ):
                a, b = on.generate(prompt, params), off.generate(prompt, params)
                assert a.token_ids == b.token_ids
                accepted += a.usage.accepted_tokens
                for x, y in zip(a.logprobs, b.logprobs, strict=True):
                    assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
                    assert [t for t, _ in x.top] == [t for t, _ in y.top]
                    assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-4)
        assert accepted > 0
        on.check_integrity()
    finally:
        on.close()
        off.close()


def reference_greedy(ref, prompt: list[int], n: int, bias: dict, presence: float, frequency: float) -> list[int]:
    """Greedy over transformers' logits with OpenAI's bias and penalties, one token at a time."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            x = ref(torch.tensor([prompt + out])).logits[0, -1].float().clone()
        for t, b in bias.items():
            x[t] += b
        for t in set(out):
            x[t] -= out.count(t) * frequency + presence
        out.append(int(torch.argmax(x)))
    return out


@pytest.mark.parametrize(
    "bias,presence,frequency",
    [({}, 0.0, 2.0), ({}, 2.0, 0.0), ({}, -1.0, 0.7), ({5: 3.0, 9: -100.0, 11: 2.5}, 0.4, 0.4)],
)
def test_bias_and_penalties_pick_what_openais_formula_picks(eng, ref, bias, presence, frequency):
    prompt = ids_of(7, 5)
    params = SamplingParams(
        max_tokens=16,
        temperature=0,
        ignore_eos=True,
        logit_bias=bias,
        presence_penalty=presence,
        frequency_penalty=frequency,
    )
    got = eng.generate(prompt, params).token_ids
    assert got == reference_greedy(ref, prompt, 16, bias, presence, frequency)
    if not bias:  # the penalties did something here: plain greedy repeats tokens this one does not
        plain = eng.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)).token_ids
        assert plain != got


def test_a_strong_bias_forces_a_token_and_the_stop_token_is_not_reported(eng):
    prompt = ids_of(6, 6)
    r = eng.generate(prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logit_bias={42: 100}))
    assert r.token_ids == [42] * 5
    stop = r.token_ids[0]
    params = SamplingParams(max_tokens=5, temperature=0, logit_bias={42: 100}, stop_token_ids=[stop], logprobs=2)
    r = eng.generate(prompt, params)
    assert r.finish_reason == "stop" and r.token_ids == [42] and r.logprobs == []  # the stop token left out


def test_adjust_and_sample_leave_the_default_path_alone():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0)
    assert adjust(logits, params, [1, 2, 2, 3], 1) is logits  # nothing set: the very tensor
    assert sample(logits, params, [1, 2], None) == int(torch.argmax(logits))
    kept = logits.clone()
    biased = adjust(
        logits, SamplingParams(logit_bias={4: 2.0}, frequency_penalty=0.5, presence_penalty=0.25), [9, 4, 4, 7], 1
    )
    want = logits.clone()
    want[4] += 2.0 - 2 * 0.5 - 0.25  # generated: 4 twice and 7 once (9 is the prompt)
    want[7] -= 0.5 + 0.25
    assert torch.allclose(biased, want, atol=1e-6, rtol=0) and torch.equal(logits, kept)  # logits itself unchanged


@pytest.mark.parametrize(
    "field,value",
    [
        ("presence_penalty", math.nan),
        ("presence_penalty", math.inf),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", "1"),
        ("frequency_penalty", True),
        ("logprobs", 21),
        ("logprobs", -1),
        ("logprobs", 10**6),
        ("logprobs", True),
        ("logprobs", 1.0),
        ("logit_bias", [1, 2]),
        ("logit_bias", {"abc": 1.0}),
        ("logit_bias", {"1.5": 1.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {5: math.nan}),
        ("logit_bias", {5: 101}),
        ("logit_bias", {i: 1.0 for i in range(1025)}),
    ],
)
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams.from_dict({field: value})


def test_a_bias_read_back_from_json_keeps_its_token_ids():
    stored = json.loads(json.dumps({"logit_bias": {5: 1.5, 300: -100}, "temperature": 0}))  # a session's settings
    assert SamplingParams.from_dict(stored).logit_bias == {5: 1.5, 300: -100}


def test_a_bias_outside_the_vocabulary_is_refused_before_it_runs(eng):
    with pytest.raises(InvalidRequest, match=r"logit_bias token id\(s\) \[384\] outside the vocabulary"):
        eng.submit([1, 2, 3], SamplingParams(max_tokens=2, logit_bias={VOCAB: 1.0, 3: 1.0}))
    assert eng.generate([1, 2, 3], SamplingParams(max_tokens=2, temperature=0)).usage.generated_tokens == 2
