"""KV dtypes (EngineConfig.kv_dtype: bf16, fp16, int8, fp8) through every cache path.

The oracle is transformers' own forward on the same weights with its attention's keys and
values passed through the same storage first: rounded to the KV dtype, or quantised and
dequantised by chatkv.kernels.kv_quant (per token and head, after RoPE), then transformers'
SDPA attention. chatkv stores a token's K/V once and every later query reads that stored
form, so its logits must match that oracle on every path: a fresh prefill, a prefill over a
cached prefix ending mid-block, decode steps, a mixed batch. Tolerance (max abs error on O(1)
logits, fp32 model): 2e-3 for int8/fp8, 5e-4 for bf16, 2e-4 for fp16. The two forwards
compute K in a different order, so a value sitting on a rounding boundary may land one step
apart; a wrong scale, a missed dequantisation or a key read in the wrong form is far larger,
and each stored form moves the logits by more than its tolerance (the first test).

Sessions with quantised KV spill, restore from disk after a restart and resume to the same
tokens as an uninterrupted run; snapshots hold the quantised form (half the bytes of bf16);
a snapshot of another kv dtype is never restored into a pool (the tokens are recomputed).
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from chatkv import InvalidRequest
from chatkv.config import EngineConfig
from chatkv.engine.core import Engine
from chatkv.engine.model_runner import ModelRunner, kv_format
from chatkv.engine.sampling import SamplingParams
from chatkv.kernels import kv_quant
from chatkv.model.forward import LlamaModel
from tests.model.test_model_equivalence import Runner, tokens
from tests.support.tiny import make_model

TOL = {"bf16": 5e-4, "fp16": 2e-4, "int8": 2e-3, "fp8": 2e-3}
KV_DTYPES = ["bf16", "fp16", "int8", "fp8"]
FLOATS = {"bf16": torch.bfloat16, "fp16": torch.float16}
QUANT = {"int8": "int8", "fp8": "fp8_e4m3"}


def stored(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """``x`` as chatkv stores and reads it back: [..., head_dim] in, same shape and dtype out."""
    if kv_dtype in FLOATS:
        return x.to(FLOATS[kv_dtype]).to(x.dtype)
    return kv_quant.dequantize(kv_quant.quantize(x, QUANT[kv_dtype]), QUANT[kv_dtype], x.dtype)


for _name in KV_DTYPES:

    def _attention(module, query, key, value, attention_mask, _kv=_name, **kw):
        return sdpa_attention_forward(module, query, stored(key, _kv), stored(value, _kv), attention_mask, **kw)

    AttentionInterface.register(f"chatkv_kv_{_name}", _attention)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    # head_dim 32, 4 query heads over 2 KV heads: GQA
    ref = make_model(
        d,
        "llama",
        seed=3,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        num_hidden_layers=2,
    )
    return ref, LlamaModel.from_pretrained(d, dtype=torch.float32), d


def oracle(ref, ids: list[int], kv_dtype: str) -> torch.Tensor:
    ref.config._attn_implementation = f"chatkv_kv_{kv_dtype}"
    try:
        with torch.no_grad():
            return ref(torch.tensor([ids])).logits[0].float()
    finally:
        ref.config._attn_implementation = "sdpa"


class KVRunner(Runner):
    def __init__(self, model, block_size: int, kv_dtype: str):
        self.runner = ModelRunner(model, EngineConfig(block_size=block_size, num_blocks=64, kv_dtype=kv_dtype))
        self.pool = self.runner.pool
        random.Random(0).shuffle(self.pool._free)
        self.tables, self.done = {}, {}


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_the_oracle_is_not_the_plain_forward(pair, kv_dtype):
    """The stored forms change the logits by more than TOL (else the tests below prove nothing)."""
    ref, _, _ = pair
    ids = tokens(40, 1)
    with torch.no_grad():
        plain = ref(torch.tensor([ids])).logits[0]
    diff = err(oracle(ref, ids, kv_dtype), plain)
    assert diff > TOL[kv_dtype], f"{kv_dtype}: {diff}"


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("block_size", [16, 5])
def test_fresh_prefix_hit_and_decode_match_the_oracle(pair, kv_dtype, block_size):
    ref, model, _ = pair
    ids = tokens(61, 2)
    expected = oracle(ref, ids, kv_dtype)
    r = KVRunner(model, block_size, kv_dtype)
    assert r.pool.quant == QUANT.get(kv_dtype)
    (out,) = r.step([("a", ids[:37])])  # 37: ends mid-block for both block sizes
    assert err(out, expected[:37]) <= TOL[kv_dtype]
    (out,) = r.step([("a", ids[37:50])])  # a chunk over a cached prefix that ends mid-block
    assert err(out, expected[37:50]) <= TOL[kv_dtype]
    for i in range(50, 61):
        (out,) = r.step([("a", [ids[i]])])
        assert err(out[0], expected[i]) <= TOL[kv_dtype], f"decode step {i}"
    r.pool.check_integrity()


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_mixed_batch_matches_the_oracle(pair, kv_dtype):
    ref, model, _ = pair
    seqs = {n: tokens(L, 10 + i) for i, (n, L) in enumerate([("a", 24), ("b", 41), ("c", 13), ("d", 7)])}
    r = KVRunner(model, 5, kv_dtype)
    r.step([("a", seqs["a"][:23]), ("b", seqs["b"][:30]), ("d", seqs["d"][:6])])
    outs = r.step([("a", seqs["a"][23:]), ("b", seqs["b"][30:]), ("c", seqs["c"]), ("d", seqs["d"][6:])])
    for (name, start), out in zip({"a": 23, "b": 30, "c": 0, "d": 6}.items(), outs):
        assert err(out, oracle(ref, seqs[name], kv_dtype)[start:]) <= TOL[kv_dtype], name


def test_pool_bytes_per_token(pair):
    """Measured from the pool tensor: int8/fp8 rows are head_dim bytes + a 4-byte scale."""
    _, model, _ = pair
    per = {k: ModelRunner(model, EngineConfig(num_blocks=4, kv_dtype=k)).pool for k in ["fp32", "bf16", "int8", "fp8"]}
    for k, pool in per.items():
        assert pool.bytes_per_token * pool.num_blocks * pool.block_size == pool.kv.numel() * pool.kv.element_size(), k
    layers, heads, d = model.num_layers, model.num_kv_heads, model.head_dim
    assert per["bf16"].bytes_per_token == 2 * layers * heads * d * 2
    assert per["int8"].bytes_per_token == per["fp8"].bytes_per_token == 2 * layers * heads * (d + 4)
    # the byte budget buys more blocks
    big = {
        k: ModelRunner(model, EngineConfig(kv_cache_bytes=2**20, kv_dtype=k)).pool.num_blocks for k in ["bf16", "int8"]
    }
    assert big["int8"] >= (2 * d) // (d + 4) * big["bf16"] - 1 and big["int8"] > 1.7 * big["bf16"]


def test_kv_format_names_and_bad_option():
    assert kv_format("auto", torch.bfloat16).name == "bfloat16"  # what every existing snapshot says
    assert kv_format("bf16", torch.bfloat16).name == "bfloat16"
    assert kv_format("fp32", torch.bfloat16).name == "float32@bfloat16"
    assert kv_format("int8", torch.bfloat16).name == "int8@bfloat16"
    assert kv_format("fp8", torch.float32).name == "fp8_e4m3@float32"
    with pytest.raises(InvalidRequest, match="kv_dtype must be one of"):
        EngineConfig.from_kwargs(kv_dtype="int4")


def test_shifted_quantised_keys_stay_within_one_step(pair):
    """An attention-sink shift re-rotates quantised keys: dequantise, rotate, quantise again."""
    _, model, _ = pair
    for kv_dtype, quant in QUANT.items():
        r = KVRunner(model, 16, kv_dtype)
        r.step([("a", tokens(32, 4))])
        blocks = r.tables["a"]
        before = r.pool.read(blocks, 32)[:, 0]
        float_r = KVRunner(model, 16, "auto")
        float_r.step([("a", tokens(32, 4))])
        model.shift_key_positions(r.pool.kv, blocks, -7, r.pool.quant)
        model.shift_key_positions(float_r.pool.kv, float_r.tables["a"], -7)
        after = kv_quant.dequantize(r.pool.read(blocks, 32)[:, 0], r.pool.quant, torch.float32)
        want = float_r.pool.read(float_r.tables["a"], 32)[:, 0]
        # one quantisation step (int8: the scale; e4m3 near its max 448: 32 scales), once when the
        # keys were stored and once after the rotation
        step = kv_quant.scales(before).max().item() * (1 if quant == "int8" else 32)
        assert err(after, want) <= 2 * step, quant
        assert err(after, want) > 0


# -- sessions ---------------------------------------------------------------------

GREEDY = dict(max_tokens=6, temperature=0.0)
QUESTIONS = [
    "Hello, how are you today?",
    "What is the capital of France?",
    "The quick brown fox jumps.",
    "Key-value caches keep attention state.",
]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    make_model(
        d,
        "llama",
        seed=7,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
    )
    return d


def engine_at(model_dir, data_dir, **kw) -> Engine:
    kw.setdefault("num_blocks", 128)
    return Engine(model_dir, EngineConfig(data_dir=str(data_dir), **kw))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantised_session_restarts_restores_and_continues_exactly(chat_model, tmp_path, kv_dtype):
    with engine_at(chat_model, tmp_path / "a", kv_dtype=kv_dtype) as e:
        s = e.session(system="You are a helpful assistant.", params=GREEDY)
        straight = [s.send(q) for q in QUESTIONS]
        straight_tokens = list(s.tokens)
    with engine_at(chat_model, tmp_path / "b", kv_dtype=kv_dtype) as e:
        s = e.session(system="You are a helpful assistant.", params=GREEDY)
        first = [s.send(q) for q in QUESTIONS[:3]]
        sid = s.id
        history_kv = first[-1].usage.prompt_tokens + first[-1].usage.generated_tokens - 1
    manifest = json.loads(next((tmp_path / "b" / "kv").glob("*.json")).read_text())
    assert manifest["kv_dtype"] == f"{QUANT[kv_dtype]}@float32"
    with engine_at(chat_model, tmp_path / "b", kv_dtype=kv_dtype) as e2:
        s2 = e2.resume(sid)
        fourth = s2.send(QUESTIONS[3])
        assert fourth.usage.restored_tokens == history_kv  # the whole history came back from disk
        assert fourth.text == straight[3].text
        assert list(s2.tokens) == straight_tokens
        e2.check_integrity()


def test_quantised_idle_spill_and_host_tier_resume_exactly(chat_model, tmp_path):
    """Spilled: full blocks to the host tier, the partial last block to disk; both come back as
    the same bytes, so the next turns equal an uninterrupted run's."""
    with engine_at(chat_model, tmp_path / "a", kv_dtype="int8") as e:
        s = e.session(params=GREEDY)
        straight = [s.send(q).text for q in QUESTIONS[:3]]
    with engine_at(chat_model, tmp_path / "b", kv_dtype="int8", idle_spill_s=0.0) as e:
        s = e.session(params=GREEDY)
        r1 = s.send(QUESTIONS[0])
        assert e.spill_idle() == 1
        e.kv.cache.evict(e.kv.pool.num_blocks)
        assert e.kv.pool.num_free == e.kv.pool.num_blocks
        r2 = s.send(QUESTIONS[1])
        history = r1.usage.prompt_tokens + r1.usage.generated_tokens - 1
        assert r2.usage.host_tokens > 0 and r2.usage.host_tokens + r2.usage.restored_tokens == history
        texts = [r1.text, r2.text, s.send(QUESTIONS[2]).text]
        e.check_integrity()
    assert texts == straight


def snapshot_bytes(data_dir) -> int:
    return sum(p.stat().st_size for p in (data_dir / "kv").rglob("*.safetensors"))


def test_snapshot_of_another_kv_dtype_is_recomputed_not_restored(chat_model, tmp_path):
    with engine_at(chat_model, tmp_path, kv_dtype="int8") as e:
        s = e.session(system="You are a helpful assistant.", params=GREEDY)
        for q in QUESTIONS[:2]:
            s.send(q)
        sid = s.id
    int8_bytes = snapshot_bytes(tmp_path)
    with engine_at(chat_model, tmp_path / "fresh") as e:  # what a float engine answers from scratch
        s = e.session(system="You are a helpful assistant.", params=GREEDY)
        for q in QUESTIONS[:2]:
            s.send(q)
        want = s.send(QUESTIONS[2]).text
    with engine_at(chat_model, tmp_path) as e:  # kv_dtype auto (float32) on the int8 conversation
        r = e.resume(sid).send(QUESTIONS[2])
        assert r.usage.restored_tokens == 0
        assert r.text == want
    float_bytes = snapshot_bytes(tmp_path)
    # the float32 snapshot that replaced it holds 1 more turn at 4 bytes a value, vs (64 + 4) / 64 bytes
    assert int8_bytes < float_bytes / 3


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_batched_and_preempted_generation_equals_the_oracle_greedy(pair, kv_dtype):
    """A pool too small for 4 x (30 + 24) tokens: sequences are preempted and recomputed in a
    batch; every one still gets the oracle's greedy tokens (transformers generate with its
    K/V in the stored form)."""
    ref, _, d = pair
    engine = Engine(d, EngineConfig(num_blocks=14, block_size=8, kv_dtype=kv_dtype))
    prompts = [tokens(30, 20 + i) for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    results = engine.generate(prompts, params)
    assert sum(r.preemptions for r in results) > 0
    ref.config._attn_implementation = f"chatkv_kv_{kv_dtype}"
    try:
        for p, r in zip(prompts, results):
            out = ref.generate(
                torch.tensor([p]),
                max_new_tokens=24,
                min_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            assert r.token_ids == out[0, len(p) :].tolist()
    finally:
        ref.config._attn_implementation = "sdpa"
    engine.check_integrity()
