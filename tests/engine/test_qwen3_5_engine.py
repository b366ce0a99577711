"""The Engine end to end on a tiny seeded Qwen3.5 (``qwen3_5_text``: linear-attention layers with a
per-sequence recurrent state beside full attention), against transformers' greedy generate: batched
and alone, chunked prefill, preemption, a re-sent history resuming from a state checkpoint, and the
features that cannot carry the state refusing clearly."""

from __future__ import annotations

import pytest
import torch

from chatkv import InvalidRequest, UnsupportedModel
from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams
from chatkv.weights.loading import load_config
from tests.support.qwen3_5 import make_qwen3_5
from tests.support.tiny import VOCAB

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def hf_greedy(ref, ids: list[int], n: int) -> list[int]:
    out = ref.generate(
        torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


def prompt_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_5")
    return make_qwen3_5(d, seed=1, dtype=request.param), d


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_5_fp32")
    return make_qwen3_5(d, seed=2), d


def test_greedy_equals_transformers_batched_and_alone(model):
    """Three prompts of different lengths in one batch, then each alone: transformers' greedy tokens."""
    ref, d = model
    engine = Engine.from_pretrained(d)
    assert type(engine.model).__name__ == "Qwen3_5Model" and engine.model.dtype == ref.dtype
    prompts = [prompt_ids(n, s) for s, n in enumerate([7, 41, 20])]
    expected = [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    batched = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in batched] == expected
    engine.check_integrity()
    for p, want in zip(prompts, expected):
        alone = Engine.from_pretrained(d).generate(p, GREEDY)
        assert alone.token_ids == want
    engine.check_integrity()


def test_chunked_prefill_longer_than_the_step_budget(fp32):
    """max_batch_tokens 16: a 70-token prompt is prefilled in 5 chunks (the state carried chunk to chunk),
    beside a short request that joins while it is still prefilling."""
    ref, d = fp32
    engine = Engine.from_pretrained(d, max_batch_tokens=16)
    a = engine.add_request(prompt_ids(70, 1), GREEDY)
    for _ in range(2):
        engine.step()
    assert 0 < a.num_computed < 70  # still prefilling
    b = engine.add_request(prompt_ids(9, 2), GREEDY)
    while not (a.finished and b.finished):
        engine.step()
    assert a.generated_ids == hf_greedy(ref, prompt_ids(70, 1), GREEDY.max_tokens)
    assert b.generated_ids == hf_greedy(ref, prompt_ids(9, 2), GREEDY.max_tokens)
    engine.check_integrity()


def test_preemption_restarts_the_state_and_keeps_outputs_exact(fp32):
    """A pool too small for all at once: preempted sequences resume (from their block-boundary
    checkpoint or token 0) with transformers' tokens."""
    ref, d = fp32
    engine = Engine.from_pretrained(d, num_blocks=12, block_size=8)  # 96 tokens for 4 x (30 + 24)
    prompts = [prompt_ids(30, 20 + i) for i in range(4)]
    results = engine.generate(prompts, GREEDY)
    assert sum(r.preemptions for r in results) > 0
    for p, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(ref, p, GREEDY.max_tokens)
    assert engine.kv_stats()["state_checkpoint_hits"] > 0  # a re-admission resumed from its checkpoint
    engine.check_integrity()


def test_second_turn_resumes_from_the_turn_end_checkpoint(fp32):
    """A chat client re-sends the history: the second turn attaches the first turn's KV up to its last
    full block and that point's state, computes only the rest, and still equals transformers."""
    ref, d = fp32
    engine = Engine.from_pretrained(d, block_size=16)
    first_prompt = prompt_ids(50, 3)
    first = engine.generate(first_prompt, GREEDY)
    assert first.usage.cached_tokens == 0
    history = first_prompt + first.token_ids  # 74 tokens; 73 with KV: 4 full blocks in the tree
    second_prompt = history + prompt_ids(9, 4)
    second = engine.generate(second_prompt, GREEDY)
    assert second.usage.cached_tokens == 64
    assert second.usage.computed_tokens == len(second_prompt) - 64
    assert second.token_ids == hf_greedy(ref, second_prompt, GREEDY.max_tokens)
    stats = engine.kv_stats()
    assert stats["state_checkpoint_hits"] == 1 and stats["state_checkpoints"] == 2
    engine.check_integrity()


def test_a_shared_prefix_without_a_checkpoint_is_computed_from_token_0(fp32):
    """The tree holds a prefix's KV but no state checkpoint ends where a new prompt diverges: the
    prompt is computed whole (its KV alone cannot resume the recurrent layers), exactly."""
    ref, d = fp32
    engine = Engine.from_pretrained(d, block_size=16)
    shared = prompt_ids(40, 5)
    engine.generate(shared + prompt_ids(30, 6), GREEDY)  # checkpoint at 80 tokens, blocks up to 80
    other = shared + prompt_ids(12, 7)  # matches 32 tokens of the tree: no checkpoint there
    r = engine.generate(other, GREEDY)
    assert r.usage.cached_tokens == 0 and r.usage.computed_tokens == len(other)
    assert r.token_ids == hf_greedy(ref, other, GREEDY.max_tokens)
    engine.check_integrity()


@pytest.mark.parametrize("host", [False, True], ids=["no_host_tier", "host_tier"])
def test_a_checkpoint_whose_blocks_left_the_device(fp32, host):
    """Another request evicted the first turn's KV blocks while its turn-end checkpoint stayed: without
    a host tier the re-sent history is computed from token 0 (its KV alone is missing); with one, the
    blocks come back from host memory and the checkpoint is used. Exact either way."""
    ref, d = fp32
    engine = Engine.from_pretrained(d, num_blocks=12, block_size=8, host_cache_bytes=2**20 if host else 0)
    first_prompt = prompt_ids(30, 11)
    first = engine.generate(first_prompt, GREEDY)  # 53 tokens with KV: 6 full blocks, checkpoint at 48
    engine.generate(prompt_ids(60, 12), GREEDY)  # 84 tokens: 11 of the 12 blocks, the first turn's evicted
    assert engine.kv_stats()["state_checkpoints"] == 2  # the first turn's is still kept
    second_prompt = first_prompt + first.token_ids + [7, 8, 9]
    second = engine.generate(second_prompt, GREEDY)
    assert second.token_ids == hf_greedy(ref, second_prompt, GREEDY.max_tokens)
    assert (second.usage.cached_tokens, second.usage.host_tokens) == (0, 48 if host else 0)
    assert second.usage.computed_tokens == len(second_prompt) - (48 if host else 0)
    assert engine.kv_stats()["state_checkpoint_hits"] == (1 if host else 0)
    engine.check_integrity()


def test_checkpoints_are_capped_and_least_recently_used_go_first(fp32):
    ref, d = fp32
    engine = Engine.from_pretrained(d, block_size=8, max_running=4)
    cap = engine.runner.state_cache.max_checkpoints
    assert cap == 8
    prompts = [prompt_ids(17, 100 + i) for i in range(cap + 3)]
    firsts = [engine.generate(p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)) for p in prompts]
    stats = engine.kv_stats()
    assert stats["state_checkpoints"] == cap
    assert stats["state_slots_free"] == stats["state_slots"] - cap  # nothing running: only checkpoints held
    # the newest conversation's checkpoint is kept, the oldest one's was dropped
    newest = prompts[-1] + firsts[-1].token_ids + [5, 6]
    oldest = prompts[0] + firsts[0].token_ids + [5, 6]
    assert engine.generate(newest, GREEDY).usage.cached_tokens == 16
    r = engine.generate(oldest, GREEDY)
    assert r.usage.cached_tokens == 0 and r.token_ids == hf_greedy(ref, oldest, GREEDY.max_tokens)
    engine.check_integrity()


SLOT_BYTES = 4 * 4 * (4 * 16 * 24 + 160 * 3)  # 4 linear layers x (4 heads x 16 x 24 + conv 160 x 3), float32


def test_state_slots_come_out_of_the_kv_budget_and_bound_the_running_sequences(fp32):
    """The slots' bytes are taken from kv_cache_bytes (at most half of it); a budget of 7 slots there
    runs 3 sequences at once (a live and a block-boundary slot each) and keeps 1 checkpoint: 5
    requests still all equal transformers."""
    ref, d = fp32
    budget = 2 * 7 * SLOT_BYTES
    engine = Engine.from_pretrained(d, kv_cache_bytes=budget, block_size=16)
    cache, pool = engine.runner.state_cache, engine.runner.pool
    assert cache.slots.bytes_per_slot == SLOT_BYTES
    assert (cache.slots.num_slots, engine.scheduler.max_running, cache.max_checkpoints) == (7, 3, 1)
    assert pool.num_blocks == (budget - 7 * SLOT_BYTES) // (pool.bytes_per_token * 16)
    prompts = [prompt_ids(20, 30 + i) for i in range(5)]
    results = engine.generate(prompts, GREEDY)
    for p, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(ref, p, GREEDY.max_tokens)
    engine.check_integrity()


def test_without_prefix_caching_a_sequence_holds_one_slot_and_nothing_is_checkpointed(fp32):
    ref, d = fp32
    off = Engine.from_pretrained(d, enable_prefix_caching=False, max_running=5)
    assert off.runner.state_cache.slots.num_slots == 5 and off.runner.state_cache.max_checkpoints == 0
    p = prompt_ids(40, 9)
    first = off.generate(p, GREEDY)
    again = off.generate(p + first.token_ids + [4, 5], GREEDY)
    assert again.usage.cached_tokens == 0
    assert again.token_ids == hf_greedy(ref, p + first.token_ids + [4, 5], GREEDY.max_tokens)
    off.check_integrity()


def test_features_that_cannot_carry_the_state_refuse(fp32, tmp_path):
    _, d = fp32
    engine = Engine.from_pretrained(d, speculative="lookup", data_dir=str(tmp_path / "home"))
    assert engine.scheduler.speculator is None  # speculative decoding turned off at construction
    with pytest.raises(UnsupportedModel, match="sessions"):
        engine.session(system="be brief")
    with pytest.raises(UnsupportedModel, match="resuming a session"):
        engine.resume("any-id")
    with pytest.raises(UnsupportedModel, match="retaining"):
        engine.add_request(prompt_ids(5, 1), GREEDY, retain=True)
    with pytest.raises(UnsupportedModel, match="attention-sink"):
        engine.shift_keys([0], 4)
    with pytest.raises(UnsupportedModel, match="RAG chunk KV"):
        engine._precompute_kv(["a source"], False)  # KnowledgeBase.add(precompute_kv=True)'s hook
    with pytest.raises(UnsupportedModel, match="restoring saved KV"):
        engine.kv.import_kv([1] * 16, 16, [], [])
    # a batch computed outside a request (RAG placement's) has no state slot
    from chatkv.engine.model_runner import BatchItem

    with pytest.raises(UnsupportedModel, match="recurrent state"):
        engine.runner.forward(engine.runner.build_batch([BatchItem([5, 6], 0, [0], "none")]))
    with pytest.raises(UnsupportedModel, match="float weights only"):
        Engine.from_pretrained(d, weights="int8")
    engine.check_integrity()
    assert engine.generate(prompt_ids(5, 1), GREEDY).usage.generated_tokens == GREEDY.max_tokens
    cache = engine.runner.state_cache
    assert len(cache.checkpoints) == 1
    engine.close()  # releases the prefix cache and with it every state checkpoint
    assert not cache.checkpoints and len(cache.free) == cache.slots.num_slots


def test_multimodal_qwen3_5_config_is_refused_naming_the_text_form(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    with pytest.raises(UnsupportedModel, match="qwen3_5_text"):
        load_config(tmp_path)


def test_bad_prompt_still_raises_invalid_request(fp32):
    _, d = fp32
    engine = Engine.from_pretrained(d)
    with pytest.raises(InvalidRequest):
        engine.generate([VOCAB + 5], GREEDY)
