"""Gemma 3 text (chatkv.model.gemma3) against transformers' Gemma3ForCausalLM on the same weights.

A tiny random gemma3_text (tests/support/gemma3.py: five sliding layers with a window of 8 and a
full one, each type with its own RoPE, the full one linearly scaled; GQA; head_dim 32 and a
query_pre_attn_scalar of its own). float32: every logit within 1e-4 of transformers' over fresh
prefills, chunks over a cached prefix, decodes past the window and mixed batches; the engine's
greedy tokens are transformers' greedy, a second turn taking its prefix from the cache. bfloat16:
within a bound of transformers' bfloat16 set by how far transformers' own bfloat16 is from float32.
The final logits' softcapping is checked set; so is attn_logit_softcapping, which transformers'
Gemma 3 (and llama.cpp's gemma3) do not apply. Configs chatkv cannot run are refused by name.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from chatkv.config import EngineConfig
from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams
from chatkv.errors import UnsupportedModel
from chatkv.model.gemma3 import Gemma3Model, model_class
from chatkv.weights.loading import load_config
from tests.model.test_model_equivalence import Runner, ref_logits, tokens
from tests.support.gemma3 import make_gemma3

TOL = 1e-4
WINDOW = 8


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3")
    ref = make_gemma3(d, seed=3)
    return d, ref, Gemma3Model.from_pretrained(d, dtype=torch.float32)


def test_the_factory_picks_gemma3_and_the_layers_their_windows(gemma):
    d, _, model = gemma
    assert model_class(load_config(d)) is Gemma3Model
    assert [layer.window for layer in model.layers] == [WINDOW] * 5 + [None]
    assert model.windows == [None, WINDOW]
    assert model.scale == 24**-0.5
    # the two RoPEs differ: the sliding layers' base 1e4, the full layers' 1e6 scaled by 1/8
    assert torch.allclose(model.local_rope.inv_freq[1], torch.tensor(10_000.0 ** (-2 / 32)))
    assert torch.allclose(model.inv_freq[1], torch.tensor(1e6 ** (-2 / 32) / 8))


@pytest.mark.parametrize("block_size", [5, 16])
def test_prefill_longer_than_the_window_then_decodes_past_it(gemma, block_size):
    _, ref, model = gemma
    ids = tokens(40, 1)
    expected = ref_logits(ref, ids)
    r = Runner(model, block_size)
    (out,) = r.step([("a", ids[:25])])  # 25 > 3 windows
    assert (out - expected[:25]).abs().max().item() <= TOL
    for i in range(25, 40):
        (out,) = r.step([("a", [ids[i]])])
        assert (out[0] - expected[i]).abs().max().item() <= TOL, f"decode at position {i}"


@pytest.mark.parametrize("block_size,prefix", [(16, 21), (5, 13), (1, 9)])
def test_chunk_over_a_cached_prefix(gemma, block_size, prefix):
    _, ref, model = gemma
    ids = tokens(37, 2)
    r = Runner(model, block_size)
    r.step([("a", ids[:prefix])])
    (out,) = r.step([("a", ids[prefix:])])
    assert (out - ref_logits(ref, ids)[prefix:]).abs().max().item() <= TOL


def test_mixed_batch_of_decodes_chunks_and_fresh_prefills(gemma):
    _, ref, model = gemma
    seqs = {n: tokens(L, 10 + i) for i, (n, L) in enumerate([("a", 24), ("b", 41), ("c", 5), ("d", 7), ("e", 30)])}
    r = Runner(model, 5)
    r.step([("a", seqs["a"][:23]), ("b", seqs["b"][:30]), ("d", seqs["d"][:6])])
    starts = {"a": 23, "b": 30, "c": 0, "d": 6, "e": 0}
    outs = r.step([(n, seqs[n][start:]) for n, start in starts.items()])
    for (name, start), out in zip(starts.items(), outs):
        err = (out - ref_logits(ref, seqs[name])[start:]).abs().max().item()
        assert err <= TOL, f"sequence {name}: max abs err {err}"
    r.pool.check_integrity()


def hf_greedy(ref, ids: list[int], n: int) -> list[int]:
    out = ref.generate(
        torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


def test_engine_greedy_is_transformers_greedy_with_a_cached_second_turn(gemma):
    d, ref, _ = gemma
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with Engine(d, EngineConfig(dtype="float32", block_size=4, num_blocks=64)) as engine:
        first_prompt = tokens(19, 4)  # past the window; the reply decodes far past it
        first = engine.generate(first_prompt, params)
        assert first.token_ids == hf_greedy(ref, first_prompt, 24)
        second_prompt = first_prompt + first.token_ids + tokens(6, 5)
        second = engine.generate(second_prompt, params)
        assert second.usage.cached_tokens >= 40  # the first turn's blocks, from the prefix cache
        assert second.token_ids == hf_greedy(ref, second_prompt, 24)
        engine.check_integrity()


def test_bfloat16_is_as_close_to_transformers_as_transformers_is_to_float32(tmp_path):
    ref32 = make_gemma3(tmp_path, seed=5)
    ref16 = make_gemma3(tmp_path / "bf16", seed=5, dtype=torch.bfloat16)  # the same numbers, rounded
    model = Gemma3Model.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    ids = tokens(30, 6)
    exact = ref_logits(ref32, ids)
    theirs = ref_logits(ref16, ids)
    r = Runner(model, 5)
    (ours,) = r.step([("a", ids[:22])])
    decoded = [r.step([("a", [t])])[0][0] for t in ids[22:]]
    ours = torch.cat([ours, torch.stack(decoded)])
    their_err = (theirs - exact).abs().mean().item()
    assert (ours - exact).abs().mean().item() <= 2 * their_err + 1e-3
    assert (ours - theirs).abs().max().item() <= 0.1 * exact.abs().max().item()
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item() >= 0.8  # near-ties of random weights flip


def test_final_softcapping_and_the_unread_attention_softcapping(tmp_path):
    """final_logit_softcapping caps the logits; attn_logit_softcapping, set, changes nothing (transformers'
    Gemma3Attention does not pass it to its attention)."""
    ref = make_gemma3(tmp_path, seed=7, final_logit_softcapping=3.0, attn_logit_softcapping=2.0)
    model = Gemma3Model.from_pretrained(tmp_path, dtype=torch.float32)
    ids = tokens(30, 8)
    expected = ref_logits(ref, ids)
    assert expected.abs().max().item() < 3.0  # capped
    r = Runner(model, 5)
    (out,) = r.step([("a", ids[:20])])
    assert (out - expected[:20]).abs().max().item() <= TOL
    for i in range(20, 30):
        (out,) = r.step([("a", [ids[i]])])
        assert (out[0] - expected[i]).abs().max().item() <= TOL


@pytest.mark.parametrize("first", ["sliding_attention", "full_attention"])
def test_shifted_keys_are_the_keys_computed_at_the_later_positions(tmp_path, first):
    """shift_key_positions rotates each layer's keys with its own RoPE (sliding: base 1e4, full: 1e6 / 8).
    Layer 0's keys depend on their token and position only: shifted, they are the same tokens' keys
    computed after ``delta`` others. Layer 0 is a sliding layer in one model, a full one in the other."""
    types = [first] + ["sliding_attention"] * 4 + ["full_attention"]
    make_gemma3(tmp_path, seed=9, layer_types=types)
    model = Gemma3Model.from_pretrained(tmp_path, dtype=torch.float32)
    ids, delta, bs = tokens(12, 9), 7, 4
    at0, later = Runner(model, bs), Runner(model, bs)
    at0.step([("a", ids)])
    later.step([("a", tokens(delta, 10) + ids)])

    def keys(r: Runner, positions) -> torch.Tensor:
        table = r.tables["a"]
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in positions])
        return r.pool.kv[0, 0].reshape(-1, *r.pool.kv.shape[-2:])[slots]

    before = keys(at0, range(12))
    model.shift_key_positions(at0.pool.kv, at0.tables["a"], delta)
    shifted, recomputed = keys(at0, range(12)), keys(later, range(delta, delta + 12))
    assert (shifted - recomputed).abs().max().item() <= 1e-4
    assert (before - recomputed).abs().max().item() > 1e-2  # the shift moved them


def test_a_config_as_gemma_checkpoints_ship_it_loads_the_same_first_and_from_the_load_cache(tmp_path):
    """Gemma 3's published config.json files spell the RoPE in transformers 4.x's fields (rope_theta,
    rope_local_base_freq, rope_scaling) and the layer types as sliding_window_pattern. The first load
    asks transformers; a later one reads chatkv.weights.load_cache's ResolvedConfig, whose linear
    scaling still goes through transformers' own RoPE function: the same frequencies, the same logits."""
    from chatkv.weights import load_cache

    ref = make_gemma3(tmp_path, seed=13)
    raw = json.loads((tmp_path / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    del raw["layer_types"]
    raw.update(
        rope_theta=rope["full_attention"]["rope_theta"],
        rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
        rope_scaling={"rope_type": "linear", "factor": rope["full_attention"]["factor"]},
        sliding_window_pattern=6,
    )
    (tmp_path / "config.json").write_text(json.dumps(raw))
    key = load_cache.key("config", tmp_path / "config.json")
    assert load_cache.config(key) is None
    first = Gemma3Model.from_pretrained(tmp_path, dtype=torch.float32)
    assert load_cache.config(key) is not None  # kept: the next load reads it back
    again = Gemma3Model.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(again.config).__name__ == "ResolvedConfig"
    for model in (first, again):
        assert [layer.window for layer in model.layers] == [WINDOW] * 5 + [None]
        assert torch.equal(model.inv_freq, first.inv_freq) and torch.equal(
            model.local_rope.inv_freq, first.local_rope.inv_freq
        )
        ids = tokens(20, 14)
        (out,) = Runner(model, 5).step([("a", ids)])
        assert (out - ref_logits(ref, ids)).abs().max().item() <= TOL
    assert torch.allclose(first.inv_freq[1], torch.tensor(1e6 ** (-2 / 32) / 8))


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantised_modes_pass_their_check_against_the_float32_forward(tmp_path, weights):
    """Asked for by name, a quantised mode that failed chatkv's check (its logits against the float32
    Gemma forward of the same numbers, chatkv.model.self_check) would raise WeightCheckFailed."""
    make_gemma3(tmp_path, seed=11, dtype=torch.bfloat16)
    with Engine(tmp_path, EngineConfig(weights=weights, num_blocks=32)) as engine:
        assert isinstance(engine.model, Gemma3Model) and engine.weights.weights == weights
        out = engine.generate(tokens(20, 12), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        assert len(out.token_ids) == 12


def test_multimodal_gemma3_and_unknown_activations_are_refused(tmp_path, gemma):
    d, _, _ = gemma
    mm = tmp_path / "mm"
    mm.mkdir()
    (mm / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": {}}))
    with pytest.raises(UnsupportedModel, match="text-only.*gemma3_text"):
        load_config(mm)
    config = copy.deepcopy(load_config(d))  # load_config's may be shared
    config.hidden_activation = "relu"
    with pytest.raises(UnsupportedModel, match="hidden_activation 'relu'"):
        Gemma3Model(config, {}, torch.float32)
