"""The sampler against transformers' logits processors, and SamplingParams validation."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from chatkv.engine.sampling import SamplingParams, make_generator, probabilities, sample
from chatkv.errors import InvalidRequest

VOCAB = 50


def logits_for(seed: int, vocab: int = VOCAB, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale


def draws(logits, params, n, history=(), seed=0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [sample(logits, params, list(history), g) for _ in range(n)]


# ---------------------------------------------------------------- greedy and repetition penalty


@pytest.mark.parametrize("seed", range(5))
def test_greedy_is_argmax(seed):
    logits = logits_for(seed)
    params = SamplingParams(temperature=0)
    assert sample(logits, params, [], None) == int(torch.argmax(logits))
    assert make_generator(params) is None
    # the sampler does not modify the caller's logits
    before = logits.clone()
    sample(logits, SamplingParams(temperature=0, repetition_penalty=1.7), [1, 2, 3], None)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0, 7.0])
@pytest.mark.parametrize("seed", range(4))
def test_repetition_penalty_is_transformers(seed, penalty):
    logits = logits_for(seed)
    rng = torch.Generator().manual_seed(100 + seed)
    # history with repeats, mixing the best tokens (positive logits) and bad ones (negative)
    history = (
        torch.argsort(logits, descending=True)[:3].tolist() + torch.randint(0, VOCAB, (12,), generator=rng).tolist()
    )
    ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([history]), logits[None].clone())[0]
    assert sample(logits, SamplingParams(temperature=0, repetition_penalty=penalty), history, None) == int(
        torch.argmax(ref)
    )
    # sampled: the distribution is softmax of transformers' penalised logits
    probs = probabilities(logits, SamplingParams(temperature=1.0, repetition_penalty=penalty), history)
    torch.testing.assert_close(probs, torch.softmax(ref.double(), -1), rtol=1e-5, atol=1e-7)


def test_repetition_penalty_changes_the_greedy_pick():
    logits = torch.tensor([1.0, 3.0, 2.9, -1.0])
    assert sample(logits, SamplingParams(temperature=0), [1], None) == 1
    assert sample(logits, SamplingParams(temperature=0, repetition_penalty=1.5), [1], None) == 2
    assert sample(logits, SamplingParams(temperature=0, repetition_penalty=1.0), [1], None) == 1


# ---------------------------------------------------------------- top-k, top-p, temperature


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_only_samples_the_k_best(k):
    logits = logits_for(7, scale=1.0)  # flat-ish: many tokens would be drawn without top-k
    best = set(torch.topk(logits, k).indices.tolist())
    got = draws(logits, SamplingParams(temperature=1.5, top_k=k), 600)
    assert set(got) <= best
    if k > 1:
        assert len(set(got)) > 1  # it does sample, it is not greedy
    # the kept set is exactly transformers' TopKLogitsWarper's
    ref = TopKLogitsWarper(k)(None, TemperatureLogitsWarper(1.5)(None, logits[None].clone()))[0]
    probs = probabilities(logits, SamplingParams(temperature=1.5, top_k=k), [])
    assert torch.equal(probs > 0, torch.isfinite(ref))
    torch.testing.assert_close(probs, torch.softmax(ref.double(), -1), rtol=1e-5, atol=1e-7)


def _top_p_mask(logits, temperature, top_p):
    scaled = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
    return torch.isfinite(TopPLogitsWarper(top_p)(None, scaled)[0])


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.75, 0.9, 0.99])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("seed", range(3))
def test_top_p_keeps_the_smallest_set_reaching_p(seed, temperature, top_p):
    logits = logits_for(seed, scale=2.0)
    params = SamplingParams(temperature=temperature, top_p=top_p)
    kept = probabilities(logits, params, []) > 0
    full = torch.softmax(logits.double() / temperature, -1)
    # by definition: the most probable tokens, as few as possible, whose mass reaches top_p
    order = torch.argsort(full, descending=True)
    cum = full[order].cumsum(0)
    n = int((cum < top_p).sum()) + 1
    assert not any(math.isclose(c, top_p, rel_tol=1e-6) for c in cum.tolist())  # no boundary case in this data
    assert int(kept.sum()) == n
    assert set(torch.nonzero(kept).flatten().tolist()) == set(order[:n].tolist())
    # and the same set as transformers' TopPLogitsWarper over the same logits
    assert torch.equal(kept, _top_p_mask(logits, temperature, top_p))


@pytest.mark.parametrize(
    "scale, temperature, top_p",
    [(3.0, 0.7, 0.9), (6.0, 1.0, 0.99), (3.0, 1.3, 0.5), (0.3, 1.0, 0.9), (0.05, 2.0, 0.95)],
)
def test_top_p_at_the_default_models_vocabulary_is_the_full_sorts_nucleus(scale, temperature, top_p):
    """At 49,152 tokens the nucleus is found among the best NUCLEUS_CANDIDATES first (peaked
    logits) or by sorting the whole vocabulary (flat ones: the last two cases): either way the
    kept set is transformers' TopPLogitsWarper's and the distribution the full sort's."""
    from chatkv.engine import sampling

    logits = logits_for(7, vocab=49152, scale=scale)
    probs = probabilities(logits, SamplingParams(temperature=temperature, top_p=top_p), [])
    assert torch.equal(probs > 0, _top_p_mask(logits, temperature, top_p))
    z = (logits.double() - logits.double().max()) / temperature
    order = torch.sort(logits.double(), descending=True).indices
    p = torch.softmax(z[order], -1)
    ref = torch.softmax(z.scatter(0, order, z[order].masked_fill(p.cumsum(-1) - p >= top_p, float("-inf"))), -1)
    torch.testing.assert_close(probs, ref, rtol=1e-12, atol=1e-15)
    fast = int((probs > 0).sum()) < sampling.NUCLEUS_CANDIDATES
    assert fast == (scale >= 3.0)  # both ways of finding it are tried


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_inf_logits_with_a_huge_temperature_stay_uniform_over_them(top_p):
    """+inf logits at temperature 1e300: the draw is uniform over the +inf tokens (it was nan:
    the +inf branch made a float32 tensor, and 1e300 overflowed it)."""
    logits = logits_for(2, vocab=4096)
    logits[[5, 9]] = float("inf")
    probs = probabilities(logits, SamplingParams(temperature=1e300, top_p=top_p), [])
    assert torch.isfinite(probs).all() and probs[5] == probs[9] == 0.5 and float(probs.sum()) == 1.0


def test_top_p_draws_stay_in_the_nucleus():
    logits = logits_for(3, scale=2.0)
    params = SamplingParams(temperature=1.0, top_p=0.6, seed=11)
    kept = set(torch.nonzero(_top_p_mask(logits, 1.0, 0.6)).flatten().tolist())
    got = draws(logits, params, 500)
    assert set(got) <= kept and len(set(got)) > 1


def test_top_k_then_top_p_in_transformers_order():
    logits = logits_for(5, scale=1.5)
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.7)
    x = TemperatureLogitsWarper(0.8)(None, logits[None].clone())
    x = TopPLogitsWarper(0.7)(None, TopKLogitsWarper(8)(None, x))[0]
    probs = probabilities(logits, params, [])
    assert torch.equal(probs > 0, torch.isfinite(x))
    torch.testing.assert_close(probs, torch.softmax(x.double(), -1), rtol=1e-5, atol=1e-7)


def test_same_seed_same_draws_other_seed_other_draws():
    logits = logits_for(1, scale=1.0)
    params = SamplingParams(temperature=1.0, seed=1234)
    a = [sample(logits, params, [], g) for g in [make_generator(params)] for _ in range(64)]
    b = [sample(logits, params, [], g) for g in [make_generator(params)] for _ in range(64)]
    assert a == b
    other = SamplingParams(temperature=1.0, seed=1235)
    c = [sample(logits, other, [], g) for g in [make_generator(other)] for _ in range(64)]
    assert c != a


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_temperature_frequencies_follow_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n = 6000
    got = draws(logits, SamplingParams(temperature=temperature), n, seed=42)
    freq = torch.bincount(torch.tensor(got), minlength=5).double() / n
    want = torch.softmax(logits.double() / temperature, -1)
    # a binomial's standard deviation is at most 0.5 / sqrt(6000) = 0.0065: 0.03 is > 4.5 sigma
    assert (freq - want).abs().max() < 0.03, (freq, want)


@pytest.mark.parametrize("temperature", [1e-300, 1e-30, 1e-6, 1e6, 1e30, 1e300, 1.7e308, 5e-324])
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"top_k": 3},
        {"top_p": 0.5},
        {"repetition_penalty": 1e38},
        {"repetition_penalty": 1e-300},
        {"repetition_penalty": 1.7e308},
    ],
)
def test_extreme_finite_values_give_a_distribution(temperature, extra):
    logits = logits_for(2)
    history = [0, 1, 2, 3, int(torch.argmax(logits))]
    params = SamplingParams(temperature=temperature, **extra)
    params.validate()
    probs = probabilities(logits, params, history)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert abs(float(probs.sum()) - 1) < 1e-9
    tok = sample(logits, params, history, torch.Generator().manual_seed(0))
    assert probs[tok] > 0


def test_limits_of_temperature():
    logits = logits_for(4)
    # tiny: all the mass on the argmax; huge: uniform over what top-k keeps
    assert probabilities(logits, SamplingParams(temperature=1e-30), [])[int(torch.argmax(logits))] == 1
    probs = probabilities(logits, SamplingParams(temperature=1e300, top_k=4), [])
    best = torch.topk(logits, 4).indices
    torch.testing.assert_close(probs[best], torch.full((4,), 0.25, dtype=torch.float64))
    assert int((probs > 0).sum()) == 4


def test_degenerate_logits_never_give_nan():
    g = torch.Generator().manual_seed(0)
    p = SamplingParams(temperature=1.0)
    inf = float("inf")
    assert sample(torch.tensor([0.0, inf, 1.0, inf]), p, [], g) in (1, 3)
    assert sample(torch.tensor([0.0, float("nan"), 1.0]), p, [], g) in (0, 2)
    probs = probabilities(torch.full((4,), -inf), p, [])
    torch.testing.assert_close(probs, torch.full((4,), 0.25, dtype=torch.float64))


# ---------------------------------------------------------------- validation

NAN, INF = float("nan"), float("inf")

BAD = [
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 3.5),
    ("max_tokens", 10.0),
    ("max_tokens", "10"),
    ("max_tokens", True),
    ("max_tokens", None),
    ("max_tokens", NAN),
    ("temperature", NAN),
    ("temperature", INF),
    ("temperature", -INF),
    ("temperature", -0.1),
    ("temperature", "0.7"),
    ("temperature", None),
    ("temperature", True),
    ("temperature", 1j),
    ("top_k", -1),
    ("top_k", 2.0),
    ("top_k", 2.5),
    ("top_k", True),
    ("top_k", "5"),
    ("top_p", NAN),
    ("top_p", 0),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.0000001),
    ("top_p", INF),
    ("top_p", "0.9"),
    ("top_p", False),
    ("repetition_penalty", NAN),
    ("repetition_penalty", INF),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1.2),
    ("repetition_penalty", "1.1"),
    ("repetition_penalty", True),
    ("seed", 2**70),
    ("seed", 2**63),
    ("seed", -1),
    ("seed", 1.0),
    ("seed", "42"),
    ("seed", True),
    ("seed", NAN),
    ("stop", "###"),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop", [None]),
    ("stop", [b"bytes"]),
    ("stop", ["lone \ud800 surrogate"]),
    ("stop", None),
    ("stop", {"a": 1}),
    ("stop_token_ids", [1, 2.0]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["3"]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 3),
    ("stop_token_ids", None),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("ignore_eos", None),
]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_validate_rejects(name, value):
    params = SamplingParams(**{name: value})
    with pytest.raises(InvalidRequest, match=name) as info:
        params.validate()
    shown = repr(value)
    assert shown[:60] in str(info.value)  # names the value too
    with pytest.raises(InvalidRequest, match=name):
        SamplingParams.from_dict({name: value})


GOOD = [
    {},
    {"max_tokens": 1},
    {"max_tokens": 10**12},
    {"temperature": 0},
    {"temperature": 0.0},
    {"temperature": 2},
    {"temperature": 1e-300},
    {"temperature": 1e30},
    {"temperature": 1.7e308},
    {"top_k": 0},
    {"top_k": 1},
    {"top_k": 10**9},
    {"top_p": 1},
    {"top_p": 1.0},
    {"top_p": 1e-9},
    {"repetition_penalty": 1},
    {"repetition_penalty": 1e-300},
    {"repetition_penalty": 1e300},
    {"seed": None},
    {"seed": 0},
    {"seed": 2**63 - 1},
    {"stop": []},
    {"stop": ("a", "bc")},
    {"stop": ["\n\n", "é", "日本"]},
    {"stop_token_ids": []},
    {"stop_token_ids": (0, 5)},
    {"stop_token_ids": [2**40]},
    {"ignore_eos": True},
    {"ignore_eos": False},
]


@pytest.mark.parametrize("d", GOOD, ids=[repr(d) for d in GOOD])
def test_validate_accepts(d):
    SamplingParams(**d).validate()
    assert SamplingParams.from_dict(d) == SamplingParams(**d)


def test_numpy_scalars_are_numbers():
    np = pytest.importorskip("numpy")
    SamplingParams(max_tokens=np.int64(5), temperature=np.float32(0.5), top_k=np.int32(3), seed=np.int64(7)).validate()
    with pytest.raises(InvalidRequest, match="temperature"):
        SamplingParams(temperature=np.float64("nan")).validate()


def test_largest_seed_seeds_a_generator():
    params = SamplingParams(temperature=1.0, seed=2**63 - 1)
    params.validate()
    logits = logits_for(0, scale=0.5)
    first = [sample(logits, params, [], g) for g in [make_generator(params)] for _ in range(16)]
    again = [sample(logits, params, [], g) for g in [make_generator(params)] for _ in range(16)]
    assert first == again


def test_from_dict_names_unknown_keys():
    with pytest.raises(InvalidRequest, match="'temprature'") as info:
        SamplingParams.from_dict({"temprature": 0.5, "max_tokens": 3})
    assert "max_tokens" not in str(info.value).split("(known")[0]
    with pytest.raises(InvalidRequest, match="'a', 'b'"):
        SamplingParams.from_dict({"b": 1, "a": 2})
    with pytest.raises(InvalidRequest, match="mapping"):
        SamplingParams.from_dict([("temperature", 0.5)])
    with pytest.raises(InvalidRequest, match="unknown"):
        SamplingParams.from_dict({1: 2})
    assert SamplingParams.from_dict({"temperature": 0.5, "seed": 3}) == SamplingParams(temperature=0.5, seed=3)
