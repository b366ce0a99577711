"""The engine end to end on tiny models: greedy equals transformers, prefix reuse, batching, preemption, bad input."""

from __future__ import annotations

import pytest
import torch

from chatkv import ChatKVError, InvalidRequest, ModelNotFound, OutOfBlocks, UnsupportedModel
from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams
from tests.support.tiny import VOCAB, make_model

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    return make_model(d, "llama", seed=11), d


def hf_greedy(ref, ids: list[int], n: int) -> list[int]:
    out = ref.generate(
        torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


def prompt_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_32_tokens_identical_to_transformers_generate(tmp_path, model_type):
    ref = make_model(tmp_path, model_type, seed=3)
    engine = Engine(tmp_path)
    text = "The quick brown fox jumps over the lazy dog."
    ids = engine.tokenizer(text)["input_ids"]
    result = engine.generate(text, GREEDY)
    assert result.token_ids == hf_greedy(ref, ids, 32)
    assert result.usage.generated_tokens == 32 and result.finish_reason == "length"
    engine.check_integrity()


def test_batched_generation_equals_each_alone(llama):
    """Continuous batching: 6 prompts of different lengths in one batch give transformers' greedy tokens."""
    ref, d = llama
    engine = Engine(d, None)
    prompts = [prompt_ids(n, s) for s, n in enumerate([5, 40, 17, 64, 3, 33])]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in [20, 8, 32, 12, 25, 1]]
    results = engine.generate(prompts, params)
    for p, sp, r in zip(prompts, params, results):
        assert r.token_ids == hf_greedy(ref, p, sp.max_tokens)
    engine.check_integrity()


def test_chunked_prefill_and_requests_joining_mid_batch(llama):
    ref, d = llama
    from chatkv.config import EngineConfig

    engine = Engine(d, EngineConfig(max_batch_tokens=16))  # a 70-token prompt takes 5 steps
    a = engine.add_request(prompt_ids(70, 1), GREEDY)
    for _ in range(3):
        engine.step()
    b = engine.add_request(prompt_ids(9, 2), GREEDY)  # joins while a is still prefilling
    while not (a.finished and b.finished):
        engine.step()
    assert a.generated_ids == hf_greedy(ref, prompt_ids(70, 1), 32)
    assert b.generated_ids == hf_greedy(ref, prompt_ids(9, 2), 32)
    engine.check_integrity()


def test_prefix_reuse_second_request_computes_only_new_tokens(llama):
    ref, d = llama
    engine = Engine(d)
    prefix = prompt_ids(200, 5)
    first = engine.generate(prefix + prompt_ids(10, 6), GREEDY)
    second_prompt = prefix + prompt_ids(12, 7)
    second = engine.generate(second_prompt, GREEDY)
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens >= 192
    assert second.usage.computed_tokens == second.usage.prompt_tokens - second.usage.cached_tokens
    assert second.token_ids == hf_greedy(ref, second_prompt, 32)
    engine.check_integrity()


def test_identical_prompt_leaves_last_token_to_compute(llama):
    ref, d = llama
    engine = Engine(d, None)
    p = prompt_ids(48, 8)  # exactly 3 blocks
    engine.generate(p, GREEDY)
    again = engine.generate(p, GREEDY)
    assert again.usage.cached_tokens == 32 and again.usage.computed_tokens == 16
    assert again.token_ids == hf_greedy(ref, p, 32)


def test_preemption_under_memory_pressure_keeps_outputs_exact(llama):
    """A pool too small for all requests at once: sequences are preempted and resumed, outputs unchanged."""
    ref, d = llama
    from chatkv.config import EngineConfig

    engine = Engine(d, EngineConfig(num_blocks=12, block_size=8))  # 96 tokens for 4 x (30 + 32) tokens
    prompts = [prompt_ids(30, 20 + i) for i in range(4)]
    results = engine.generate(prompts, GREEDY)
    assert sum(r.preemptions for r in results) > 0
    for p, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(ref, p, 32)
    engine.check_integrity()


def test_sampling_seed_is_reproducible_and_top_k_1_is_greedy(llama):
    _, d = llama
    engine = Engine(d)
    p = prompt_ids(12, 9)
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=123, ignore_eos=True)
    assert engine.generate(p, sp).token_ids == engine.generate(p, sp).token_ids
    k1 = SamplingParams(max_tokens=16, temperature=1.3, top_k=1, seed=5, ignore_eos=True)
    assert engine.generate(p, k1).token_ids == engine.generate(p, GREEDY).token_ids[:16]


def test_repetition_penalty_matches_transformers(llama):
    ref, d = llama
    engine = Engine(d)
    p = prompt_ids(10, 10)
    got = engine.generate(p, SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.5, ignore_eos=True))
    out = ref.generate(
        torch.tensor([p]),
        max_new_tokens=20,
        min_new_tokens=20,
        do_sample=False,
        repetition_penalty=1.5,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert got.token_ids == out[0, 10:].tolist()


def test_stop_on_eos_stop_string_and_stream(llama):
    _, d = llama
    engine = Engine(d)
    p = prompt_ids(10, 12)
    full = engine.generate(p, GREEDY)
    # an eos that greedy decoding will hit: pick the 5th generated token as a stop token
    stop_tok = full.token_ids[4]
    first = full.token_ids.index(stop_tok)
    r = engine.generate(p, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, stop_token_ids=[stop_tok]))
    assert r.finish_reason == "stop" and r.token_ids == full.token_ids[: first + 1]
    # a stop string cut out of the text
    if len(full.text) > 6:
        s = full.text[3:6]
        r = engine.generate(p, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, stop=[s]))
        assert r.finish_reason == "stop" and r.text == full.text[: full.text.find(s)]
    pieces = list(engine.stream(p, GREEDY))
    result = pieces[-1]
    assert "".join(pieces[:-1]) == result.text == full.text
    assert result.token_ids == full.token_ids


def test_stream_closed_early_releases_blocks(llama):
    _, d = llama
    engine = Engine(d)
    it = engine.stream(prompt_ids(20, 13), SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    next(it)
    it.close()
    assert not engine.has_work()
    engine.check_integrity()


def test_bad_input_raises_clear_errors_and_engine_keeps_serving(llama, tmp_path):
    ref, d = llama
    engine = Engine(d, None)
    with pytest.raises(InvalidRequest, match="empty"):
        engine.generate("", GREEDY)
    with pytest.raises(InvalidRequest, match="empty"):
        engine.generate([], GREEDY)
    with pytest.raises(InvalidRequest, match="empty"):
        engine.generate([[]], GREEDY)
    with pytest.raises(InvalidRequest, match="context is 1024"):
        engine.generate(prompt_ids(1100, 1), GREEDY)
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        engine.generate([1, 2, VOCAB + 5], GREEDY)
    with pytest.raises(InvalidRequest, match="temperature"):
        engine.generate("hi", SamplingParams(temperature=-1))
    small = Engine(d, __import__("chatkv.config").config.EngineConfig(num_blocks=4, block_size=8))
    with pytest.raises(InvalidRequest, match="KV pool can hold at most 32"):
        small.generate(prompt_ids(40, 1), GREEDY)
    with pytest.raises(ModelNotFound, match="does not exist"):
        Engine.from_pretrained(tmp_path / "nope")
    with pytest.raises(InvalidRequest, match="unknown engine option"):
        Engine.from_pretrained(d, blok_size=16)
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(UnsupportedModel, match="model_type 'gpt2'.*llama, qwen2, qwen3, mistral"):
        Engine.from_pretrained(tmp_path / "gpt2")
    assert issubclass(OutOfBlocks, ChatKVError)
    # the engine serves the next request normally
    p = prompt_ids(15, 3)
    assert engine.generate(p, GREEDY).token_ids == hf_greedy(ref, p, 32)
    engine.check_integrity()


def test_from_chatkv_engine_import_engine_is_the_sdks_engine_loaded_on_first_use():
    """``chatkv.engine`` is a package: importing it loads none of its modules, and its ``Engine``
    (the name programs took from the module ``chatkv.engine`` was) is the SDK's, loaded when asked."""
    import subprocess
    import sys

    code = (
        "import sys, chatkv.engine as e\n"
        "assert 'chatkv.engine.core' not in sys.modules and 'torch' not in sys.modules\n"
        "from chatkv.engine import Engine\n"
        "import chatkv\n"
        "assert Engine is chatkv.Engine and Engine.__module__ == 'chatkv.engine.core'\n"
        "try:\n"
        "    e.Nothing\n"
        "except AttributeError as x:\n"
        "    assert 'Nothing' in str(x)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
