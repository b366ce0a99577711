"""kernels/triton_attention.py against the torch reference (kernels/attention.py), the oracle.

Without CUDA the kernels run under Triton's interpreter on CPU: ``TRITON_INTERPRET=1`` is read when
``@triton.jit`` decorates a kernel, i.e. when chatkv.kernels.triton_attention is first imported, so it
is set here before that import. With CUDA (benchmarks/gpu_check.sh) the same tests run natively.

Tolerances (max abs and rel error, outputs are O(1)):
- fp32: 1e-5 against the reference on the same caches (fp32 operands everywhere, no TF32);
- fp16: 5e-3 against the reference computed in fp32 on the same fp16 caches and queries (the kernels
  accumulate in fp32 and round once at the output; natively P is rounded to fp16 before P.V);
- store_kv: bit-exact.
Unwritten cache slots hold 1e4 (tests/test_attention_naive.make_case), so a key read through a wrong
slot or a missing mask shows.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from chatkv.kernels import attention as ref  # noqa: E402
from chatkv.kernels import attention_backend  # noqa: E402
from chatkv.kernels import triton_attention as tri  # noqa: E402
from tests.test_attention_naive import make_case  # noqa: E402

if tri.INTERPRET:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:  # triton_attention was imported earlier in this process without the interpreter
    pytest.skip("triton kernels compiled for a GPU, and no CUDA device", allow_module_level=True)

TOL = {torch.float32: 1e-5, torch.float16: 5e-3}


def step(block_size, specs, heads, kv_heads, d=8, window=None, dtype=torch.float32, seed=0):
    """A step's queries, caches (new K/V not yet stored), metadata and new K/V, on DEVICE in ``dtype``."""
    q, kc, vc, tables, qlens, ctxs, new_k, new_v, _, _ = make_case(seed + block_size, block_size, specs, heads, kv_heads, d)
    meta = ref.build_metadata(tables, qlens, ctxs, block_size, sliding_window=window, device=DEVICE)
    q, kc, vc, new_k, new_v = (x.to(DEVICE, dtype) for x in (q, kc, vc, new_k, new_v))
    return q, kc, vc, meta, new_k, new_v


def run_case(block_size, specs, heads, kv_heads, d=8, window=None, dtype=torch.float32, splits=(None,)):
    """Triton's paged attention (automatic splits, or ``splits`` keys a split) against the reference in fp32."""
    q, kc, vc, meta, new_k, new_v = step(block_size, specs, heads, kv_heads, d, window, dtype)
    ref.store_kv(kc, vc, meta.slot_mapping, new_k, new_v)
    scale = 1 / math.sqrt(d)
    want = ref.paged_attention(q.float(), kc.float(), vc.float(), meta, scale)
    tol = TOL[dtype]
    for split_tokens in splits:
        tri.DECODE_SPLIT_TOKENS = split_tokens
        meta.scratch.clear()
        try:
            got = tri.paged_attention(q, kc, vc, meta, scale)
        finally:
            tri.DECODE_SPLIT_TOKENS = None
        assert got.dtype == dtype and got.shape == q.shape
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol, msg=lambda m: f"split {split_tokens}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_store_kv_bit_exact(block_size, dtype):
    """Strided new K/V (slices of one qkv tensor, as the model passes them) land in their slots, nothing else moves."""
    q, kc, vc, meta, new_k, new_v = step(block_size, [(7, 9), (0, 3), (13, 1)], 4, 2, dtype=dtype)
    qkv = torch.cat([new_k, new_v, new_k], dim=1)  # [tokens, 3 * kv_heads, d]: k and v are strided views
    k, v = qkv[:, :2], qkv[:, 2:4]
    want_k, want_v = kc.clone(), vc.clone()
    ref.store_kv(want_k, want_v, meta.slot_mapping, k, v)
    tri.store_kv(kc, vc, meta.slot_mapping, k.float(), v)  # an fp32 k into an fp16 cache is cast, as in the reference
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


# (block size, (cached prefix, new tokens) per sequence, heads, kv heads, head_dim, window)
DECODE_CASES = [
    (1, [(5, 1), (0, 1), (30, 1)], 4, 4, 8, None),  # GQA ratio 1
    (5, [(5, 1), (0, 1), (30, 1), (17, 1)], 6, 2, 8, None),  # ratio 3, lengths not multiples of 5
    (16, [(40, 1), (2, 1), (17, 1)], 8, 2, 12, None),  # ratio 4, head_dim not a power of two
    (5, [(40, 1), (2, 1), (17, 1)], 6, 2, 8, 8),  # sliding window: rows start inside their first block
    (16, [(50, 1), (9, 1)], 4, 1, 8, 3),  # window 3, MQA
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=[f"bs{c[0]}-g{c[2] // c[3]}-w{c[5]}" for c in DECODE_CASES])
def test_paged_decode(case, dtype):
    """One query per row; splits of 16 keys (several per row, some empty) and the automatic split."""
    bs, specs, heads, kv_heads, d, window = case
    run_case(bs, specs, heads, kv_heads, d, window, dtype, splits=(None, 16))


PREFILL_CASES = [
    (16, [(21, 6), (0, 19), (4, 2)], 4, 2, 8, None),  # prefix ends mid-block, fresh prompt, a 2-token chunk
    (5, [(13, 20), (3, 4)], 6, 2, 8, None),  # ratio 3; 20 queries span two query tiles
    (1, [(9, 5), (0, 3)], 4, 4, 8, None),
    (5, [(13, 9), (1, 17)], 4, 1, 8, 4),  # window 4 over a cached prefix
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=[f"bs{c[0]}-g{c[2] // c[3]}-w{c[5]}" for c in PREFILL_CASES])
def test_prefill_over_cached_prefix(case, dtype):
    bs, specs, heads, kv_heads, d, window = case
    run_case(bs, specs, heads, kv_heads, d, window, dtype)


@pytest.mark.parametrize("window", [None, 3])
def test_mixed_step_through_the_backend(window):
    """A step of prefills and decodes together, with the pair ``attention_backend`` returns when forced to Triton."""
    store, attention = attention_backend(DEVICE, "triton")
    assert store is tri.store_kv and attention is tri.paged_attention
    specs = [(7, 9), (0, 12), (13, 1), (0, 1), (22, 1), (3, 4)]
    q, kc, vc, meta, new_k, new_v = step(5, specs, 6, 2, window=window)
    want_k, want_v = kc.clone(), vc.clone()
    store(kc, vc, meta.slot_mapping, new_k, new_v)
    ref.store_kv(want_k, want_v, meta.slot_mapping, new_k, new_v)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    scale = 1 / math.sqrt(8)
    got = attention(q, kc, vc, meta, scale)
    assert meta.scratch  # packed once per step; a second layer reuses it
    again = attention(q, kc, vc, meta, scale)
    want = ref.paged_attention(q, kc, vc, meta, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, again)


def test_dispatch(monkeypatch):
    """CPU keeps the torch reference by default; the switch forces either; a typo is an error naming the switch."""
    monkeypatch.delenv("CHATKV_ATTENTION", raising=False)
    assert attention_backend("cpu") == (ref.store_kv, ref.paged_attention)
    monkeypatch.setenv("CHATKV_ATTENTION", "torch")
    assert attention_backend("cuda") == (ref.store_kv, ref.paged_attention)
    monkeypatch.setenv("CHATKV_ATTENTION", "triton")
    assert attention_backend("cpu") == (tri.store_kv, tri.paged_attention)
    monkeypatch.delenv("CHATKV_ATTENTION")
    assert attention_backend("cuda") == (tri.store_kv, tri.paged_attention)
    monkeypatch.setenv("CHATKV_ATTENTION", "cuda")
    with pytest.raises(ValueError, match="CHATKV_ATTENTION"):
        attention_backend("cpu")


def triton_runner(tmp_path, model_type, block_size, **overrides):
    """transformers' model (the oracle, CPU) and a Runner (tests/test_model_equivalence.py) whose model
    runs on DEVICE with the Triton kernels forced."""
    from chatkv.config import EngineConfig
    from chatkv.model import LlamaModel
    from chatkv.model_runner import ModelRunner
    from tests.test_model_equivalence import Runner
    from tests.tiny import make_model

    ref_model = make_model(tmp_path, model_type, seed=3, **overrides)
    ref_model.config._attn_implementation = "eager"
    model = LlamaModel.from_pretrained(tmp_path, dtype=torch.float32, device=DEVICE)
    model.store_kv, model.attention = attention_backend(DEVICE, "triton")
    r = Runner(model, block_size)
    if DEVICE != "cpu":
        r.runner = ModelRunner(model, EngineConfig(block_size=block_size, num_blocks=256, device=DEVICE))
        r.pool = r.runner.pool
        random.Random(0).shuffle(r.pool._free)  # block tables never contiguous by accident, as in Runner
    return ref_model, r


def test_model_forward_with_triton_matches_transformers(tmp_path):
    """chatkv's forward with the Triton kernels, against transformers (fp32, max abs err <= 1e-4 as in
    test_model_equivalence): a mixed step of a decode, a chunk over a prefix ending mid-block and a fresh
    prompt, then decodes."""
    from tests.test_model_equivalence import TOL as MODEL_TOL
    from tests.test_model_equivalence import ref_logits, tokens

    ref_model, r = triton_runner(tmp_path, "llama", 5)
    seqs = {n: tokens(L, 30 + i) for i, (n, L) in enumerate([("a", 14), ("b", 23), ("c", 9)])}
    r.step([("a", seqs["a"][:13]), ("b", seqs["b"][:12])])
    outs = r.step([("a", seqs["a"][13:]), ("b", seqs["b"][12:20]), ("c", seqs["c"][:8])])
    for (name, start), out in zip({"a": 13, "b": 12, "c": 0}.items(), outs):
        want = ref_logits(ref_model, seqs[name])[start : start + out.shape[0]]
        assert (out - want).abs().max().item() <= MODEL_TOL, name
    outs = r.step([("b", [seqs["b"][20]]), ("c", [seqs["c"][8]])])  # two decodes
    assert (outs[0][0] - ref_logits(ref_model, seqs["b"])[20]).abs().max().item() <= MODEL_TOL
    assert (outs[1][0] - ref_logits(ref_model, seqs["c"])[8]).abs().max().item() <= MODEL_TOL


def test_model_sliding_window_with_triton_matches_transformers(tmp_path):
    """Mistral with a window of 8 shorter than the prompt: prefill and batched decodes past the window."""
    from tests.test_model_equivalence import TOL as MODEL_TOL
    from tests.test_model_equivalence import ref_logits, tokens

    ref_model, r = triton_runner(tmp_path, "mistral", 5, sliding_window=8, num_hidden_layers=2)
    seqs = {n: tokens(L, 40 + i) for i, (n, L) in enumerate([("a", 22), ("b", 6)])}
    expected = {n: ref_logits(ref_model, ids) for n, ids in seqs.items()}
    (out_a, out_b) = r.step([(n, ids[:-2]) for n, ids in seqs.items()])
    assert (out_a - expected["a"][:20]).abs().max().item() <= MODEL_TOL
    for back in (2, 1):
        outs = r.step([(n, [ids[-back]]) for n, ids in seqs.items()])
        for (n, ids), out in zip(seqs.items(), outs):
            assert (out[0] - expected[n][len(ids) - back]).abs().max().item() <= MODEL_TOL, (n, back)
