"""kernels/triton_attention.py against the torch reference (kernels/attention.py), the oracle.

Without CUDA the kernels run under Triton's interpreter on CPU: ``TRITON_INTERPRET=1`` is read when
``@triton.jit`` decorates a kernel, i.e. when chatkv.kernels.triton_attention is first imported, so it
is set here before that import. With CUDA (benchmarks/gpu_check.sh) the same tests run natively.

Every kv dtype: fp32 and fp16 caches, and the quantised ones (kernels/kv_quant.py: int8 and fp8_e4m3
uint8 rows with their scale), the latter under fp32 and under fp16 queries.

Tolerances (max abs and rel error, outputs are O(1)), set by the query dtype:
- fp32 queries: 1e-5 against the reference on the same caches (fp32 operands everywhere, no TF32). For
  quantised caches both sides dequantise the same bytes to the same fp32 values (element x scale,
  rounded once), so only the summation order differs;
- fp16 queries: 5e-3 against the reference computed in fp32 on the same caches and queries (the kernels
  accumulate in fp32 and round once at the output; natively P is rounded to fp16 before P.V, and
  dequantised K/V are rounded to fp16, as the reference does for fp16 queries);
- store_kv: bit-exact, quantised bytes and scales included (int8 rounding and the fp8 e4m3 cast are
  done with integer ops in the kernel and match torch's on every tie; test_fp8_e4m3_codec checks the
  encoder on ~200k values including every rounding tie, and the decoder on all 256 bytes). Rows with a
  NaN or an inf: their scale is NaN or inf on both sides, their bytes are unspecified.
Unwritten cache slots hold 1e4 (tests/test_attention_naive.make_case; quantised caches hold those
rows quantised), so a key read through a wrong slot or a missing mask shows.
"""

from __future__ import annotations

import inspect
import math
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from chatkv.kernels import attention as ref  # noqa: E402
from chatkv.kernels import attention_backend, kv_quant  # noqa: E402
from chatkv.kernels import triton_attention as tri  # noqa: E402
from tests.kernels.test_attention_naive import make_case  # noqa: E402

if tri.INTERPRET:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:  # triton_attention was imported earlier in this process without the interpreter
    pytest.skip("triton kernels compiled for a GPU, and no CUDA device", allow_module_level=True)

TOL = {torch.float32: 1e-5, torch.float16: 5e-3}  # by query dtype


class KV:
    """A kv dtype under test: the cache's storage dtype, its quantisation, the queries' dtype."""

    def __init__(self, name, cache, quant=None, query=None):
        self.name, self.cache, self.quant, self.query = name, cache, quant, query or cache


FLOAT_KV = [KV("fp32", torch.float32), KV("fp16", torch.float16)]
QUANT_KV = [
    KV(f"{quant}-q{bits}", kv_quant.STORAGE, quant, qdt)
    for quant in kv_quant.FORMATS
    for bits, qdt in ((32, torch.float32), (16, torch.float16))
]
ALL_KV = FLOAT_KV + QUANT_KV


def step(block_size, specs, heads, kv_heads, d=8, window=None, kv=FLOAT_KV[0], seed=0):
    """A step's queries, caches (new K/V not yet stored; quantised when ``kv`` is), metadata and new K/V
    (float), on DEVICE."""
    q, kc, vc, tables, qlens, ctxs, new_k, new_v, _, _ = make_case(
        seed + block_size, block_size, specs, heads, kv_heads, d
    )
    meta = ref.build_metadata(tables, qlens, ctxs, block_size, sliding_window=window, device=DEVICE)
    if kv.quant is not None:  # the garbage in unwritten slots, quantised
        kc, vc = kv_quant.quantize(kc, kv.quant), kv_quant.quantize(vc, kv.quant)
    kc, vc = (x.to(DEVICE, kv.cache) for x in (kc, vc))
    q = q.to(DEVICE, kv.query)
    new_k, new_v = (x.to(DEVICE, kv.query if kv.quant is None else torch.float32) for x in (new_k, new_v))
    return q, kc, vc, meta, new_k, new_v


def run_case(block_size, specs, heads, kv_heads, d=8, window=None, kv=FLOAT_KV[0], splits=(None,)):
    """Triton's paged attention (automatic splits, or ``splits`` keys a split) against the reference in fp32
    on the same caches (quantised ones: the same bytes, dequantised by the reference in fp32)."""
    q, kc, vc, meta, new_k, new_v = step(block_size, specs, heads, kv_heads, d, window, kv)
    ref.store_kv(kc, vc, meta.slot_mapping, new_k, new_v, quant=kv.quant)
    scale = 1 / math.sqrt(d)
    if kv.quant is None:
        want = ref.paged_attention(q.float(), kc.float(), vc.float(), meta, scale)
    else:
        want = ref.paged_attention(q.float(), kc, vc, meta, scale, quant=kv.quant)
    assert want.isfinite().all()
    tol = TOL[kv.query]
    for split_tokens in splits:
        tri.DECODE_SPLIT_TOKENS = split_tokens
        meta.scratch.clear()
        try:
            got = tri.paged_attention(q, kc, vc, meta, scale, quant=kv.quant)
        finally:
            tri.DECODE_SPLIT_TOKENS = None
        assert got.dtype == kv.query and got.shape == q.shape
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol, msg=lambda m: f"split {split_tokens}: {m}")


def tie_rows(quant, d):
    """Rows (fp32, [rows, d]) whose quantised values fall exactly on rounding ties: amax = QMAX, so scale = 1."""
    if quant == "int8":
        vals = [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.5, 0.49999997, 0.0]
    else:  # e4m3 midpoints: between normals (both parities), subnormals, normal/subnormal and a carry
        vals = [
            448.0,
            1.0625,
            1.1875,
            -1.0625,
            2.0**-10,
            3 * 2.0**-10,
            15 * 2.0**-10,
            0.96875 + 2**-6,
            -(2.0**-11),
            432.0,
            1e-30,
            -0.0,
        ]
    rows = torch.tensor(vals)[torch.arange(2 * d) % len(vals)].view(2, d)
    rows[1, 0] = -rows[1, 0]  # the other row's amax is negative
    return rows


def quantised_rows_agree(got, want, quant):
    """Bit-exact, except the bytes of rows whose scale is not finite (NaN/inf inputs: unspecified)."""
    s_got, s_want = kv_quant.scales(got), kv_quant.scales(want)
    nan = s_want.isnan()
    assert torch.equal(nan, s_got.isnan()) and torch.equal(s_got[~nan], s_want[~nan])
    finite = s_want.isfinite()
    assert torch.equal(got[finite], want[finite])


@pytest.mark.parametrize("kv", FLOAT_KV + QUANT_KV[::2], ids=lambda kv: kv.name.split("-")[0])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_store_kv_bit_exact(block_size, kv):
    """Strided new K/V (slices of one qkv tensor, as the model passes them) land in their slots, nothing else
    moves; quantised: the same bytes and scales as kv_quant.quantize, rounding ties and zero rows included.
    The reference runs on CPU, the oracle (its bytes do not depend on the device)."""
    q, kc, vc, meta, new_k, new_v = step(block_size, [(7, 9), (0, 3), (13, 1)], 4, 2, kv=kv)
    if kv.quant is not None:
        new_k[3, :2] = tie_rows(kv.quant, new_k.shape[-1])
        new_v[4, :2] = tie_rows(kv.quant, new_k.shape[-1]).flip(0)
        new_v[5, 1] = 0.0  # a zero row: scale 0, zero bytes
        new_k[6] *= 1e30  # huge rows: amax / QMAX and 1 / scale stay normal
        new_v[7, 0] *= 1e-30  # tiny ones: e4m3 subnormals
    qkv = torch.cat([new_k, new_v, new_k], dim=1)  # [tokens, 3 * kv_heads, d]: k and v are strided views
    k, v = qkv[:, :2], qkv[:, 2:4]
    # an fp32 k into an fp16 cache is cast, as in the reference; into a quantised one, an fp16 v is quantised
    k, v = k.float(), (v if kv.quant is None else v.half())
    want_k, want_v = kc.cpu().clone(), vc.cpu().clone()  # .cpu() alone would alias a CPU cache
    ref.store_kv(want_k, want_v, meta.slot_mapping.cpu(), k.cpu(), v.cpu(), quant=kv.quant)
    tri.store_kv(kc, vc, meta.slot_mapping, k, v, quant=kv.quant)
    if kv.quant is not None:
        assert kv_quant.scales(want_v).view(-1, 2)[meta.slot_mapping.cpu()[5], 1] == 0
    assert torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on inf * 0
@pytest.mark.parametrize("quant", list(kv_quant.FORMATS))
def test_store_kv_quantised_non_finite_rows(quant):
    """A row holding a NaN gets a NaN scale, one holding an inf (and no NaN) an inf scale, as in kv_quant;
    both dequantise to non-finite values only, so attention over them is NaN, as over a float cache;
    every other row of the same tokens is bit-exact."""
    kv = KV(quant, kv_quant.STORAGE, quant, torch.float32)
    q, kc, vc, meta, new_k, new_v = step(5, [(3, 4)], 4, 2, kv=kv)
    new_k[0, 0, 3] = float("nan")
    new_k[1, 1, 0] = float("inf")
    new_v[2, 0, 5] = -float("inf")
    new_v[3, 1, :2] = torch.tensor([float("inf"), float("nan")])
    want_k, want_v = kc.cpu().clone(), vc.cpu().clone()  # .cpu() alone would alias a CPU cache
    ref.store_kv(want_k, want_v, meta.slot_mapping.cpu(), new_k.cpu(), new_v.cpu(), quant=quant)
    tri.store_kv(kc, vc, meta.slot_mapping, new_k, new_v, quant=quant)
    for got, want in ((kc.cpu(), want_k), (vc.cpu(), want_v)):
        quantised_rows_agree(got, want, quant)
    s = kv_quant.scales(kc.cpu()).view(-1, 2)[meta.slot_mapping.cpu()]
    assert s[0, 0].isnan() and s[1, 1].isinf() and s[0, 1].isfinite() and s[1, 0].isfinite()
    for cache in (kc, vc):
        rows = kv_quant.dequantize(cache.cpu(), quant, torch.float32).view(-1, 2, 8)[meta.slot_mapping.cpu()]
        bad = ~kv_quant.scales(cache.cpu()).view(-1, 2)[meta.slot_mapping.cpu()].isfinite()
        assert bad.sum() == 2 and not rows[bad].isfinite().any() and rows[~bad].isfinite().all()


@triton.jit
def _fp8_encode_kernel(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.program_id(0) * N + tl.arange(0, N)
    tl.store(out_ptr + i, tri._fp8_e4m3_bits(tl.load(x_ptr + i)))


@triton.jit
def _fp8_decode_kernel(b_ptr, out_ptr, N: tl.constexpr):
    i = tl.program_id(0) * N + tl.arange(0, N)
    tl.store(out_ptr + i, tri._fp8_e4m3_value(tl.load(b_ptr + i)))


@triton.jit
def _int8_round_kernel(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.program_id(0) * N + tl.arange(0, N)
    tl.store(out_ptr + i, tri._int8_rne(tl.load(x_ptr + i)))


def _padded(x, n):
    return torch.cat([x, x.new_zeros((-x.numel()) % n)])


def test_fp8_e4m3_codec_matches_torch():
    """The kernels' integer e4m3 encoder against torch's cast (float8_e4m3fn) on every fp32 whose upper 16 bits
    lie in [0, 448] with the low 16 bits 0, 1, 0x7fff, 0x8000, 0x8001, 0xffff (each rounding tie, both
    neighbours of it, every binade, subnormals and the carry into the next exponent), both signs; the decoder
    on all 256 bytes (0x7f and 0xff are NaN, -0 keeps its sign)."""
    hi = torch.arange(0, 0x43E1, dtype=torch.int32) << 16
    lo = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int32)
    x = (hi[:, None] | lo[None, :]).flatten().view(torch.float32)
    x = torch.cat([x, -x])
    x = _padded(x[x.abs() <= 448], 4096)
    out = torch.empty(x.shape, dtype=torch.uint8, device=DEVICE)
    _fp8_encode_kernel[(x.numel() // 4096,)](x.to(DEVICE), out, N=4096)
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(out.cpu(), want), x[out.cpu() != want][:8]
    b = torch.arange(256, dtype=torch.uint8)
    got = torch.empty(256, device=DEVICE)
    _fp8_decode_kernel[(1,)](b.to(DEVICE), got, N=256)
    want = b.view(torch.float8_e4m3fn).float()
    got = got.cpu()
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().sum() == 2
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)) and torch.equal(
        got.signbit()[:255], want.signbit()[:255]
    )


def test_int8_rounding_matches_torch():
    """Integer round-half-to-even against torch's round on every quarter in [-127, 127], the floats next to
    each half, and random values."""
    quarters = torch.arange(-127 * 4, 127 * 4 + 1) / 4.0
    halves = torch.arange(-127, 127) + 0.5
    near = torch.cat([halves.nextafter(halves + 1), halves.nextafter(halves - 1)])
    rand = torch.rand(20000, generator=torch.Generator().manual_seed(0)) * 254 - 127
    x = _padded(torch.cat([quarters, near, rand, torch.tensor([1e-30, -1e-30, 0.49999997])]), 4096)
    out = torch.empty(x.shape, dtype=torch.int8, device=DEVICE)
    _int8_round_kernel[(x.numel() // 4096,)](x.to(DEVICE), out, N=4096)
    assert torch.equal(out.cpu(), x.round().to(torch.int8))


def test_same_signatures_as_the_reference():
    for name in ("store_kv", "paged_attention"):
        assert inspect.signature(getattr(tri, name)) == inspect.signature(getattr(ref, name)), name


# (block size, (cached prefix, new tokens) per sequence, heads, kv heads, head_dim, window)
DECODE_CASES = [
    (1, [(5, 1), (0, 1), (30, 1)], 4, 4, 8, None),  # GQA ratio 1
    (5, [(5, 1), (0, 1), (30, 1), (17, 1)], 6, 2, 8, None),  # ratio 3, lengths not multiples of 5
    (16, [(40, 1), (2, 1), (17, 1)], 8, 2, 12, None),  # ratio 4, head_dim not a power of two
    (5, [(40, 1), (2, 1), (17, 1)], 6, 2, 8, 8),  # sliding window: rows start inside their first block
    (16, [(50, 1), (9, 1)], 4, 1, 8, 3),  # window 3, MQA
]


@pytest.mark.parametrize("kv", ALL_KV, ids=lambda kv: kv.name)
@pytest.mark.parametrize("case", DECODE_CASES, ids=[f"bs{c[0]}-g{c[2] // c[3]}-w{c[5]}" for c in DECODE_CASES])
def test_paged_decode(case, kv):
    """One query per row; splits of 16 keys (several per row, some empty) and the automatic split."""
    bs, specs, heads, kv_heads, d, window = case
    run_case(bs, specs, heads, kv_heads, d, window, kv, splits=(None, 16))


PREFILL_CASES = [
    (16, [(21, 6), (0, 19), (4, 2)], 4, 2, 8, None),  # prefix ends mid-block, fresh prompt, a 2-token chunk
    (5, [(13, 20), (3, 4)], 6, 2, 8, None),  # ratio 3; 20 queries span two query tiles
    (1, [(9, 5), (0, 3)], 4, 4, 8, None),
    (5, [(13, 9), (1, 17)], 4, 1, 8, 4),  # window 4 over a cached prefix
]


@pytest.mark.parametrize("kv", ALL_KV, ids=lambda kv: kv.name)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=[f"bs{c[0]}-g{c[2] // c[3]}-w{c[5]}" for c in PREFILL_CASES])
def test_prefill_over_cached_prefix(case, kv):
    bs, specs, heads, kv_heads, d, window = case
    run_case(bs, specs, heads, kv_heads, d, window, kv)


@pytest.mark.parametrize("quant", [None, *kv_quant.FORMATS])
@pytest.mark.parametrize("window", [None, 3])
def test_mixed_step_through_the_backend(window, quant):
    """A step of prefills and decodes together, with the pair ``attention_backend`` returns when forced to Triton:
    the kernels' own store_kv (quantising when asked) then their attention, against the reference's pair."""
    store, attention = attention_backend(DEVICE, "triton")
    assert store is tri.store_kv and attention is tri.paged_attention
    specs = [(7, 9), (0, 12), (13, 1), (0, 1), (22, 1), (3, 4)]
    kv = FLOAT_KV[0] if quant is None else KV(quant, kv_quant.STORAGE, quant, torch.float32)
    q, kc, vc, meta, new_k, new_v = step(5, specs, 6, 2, window=window, kv=kv)
    want_k, want_v = kc.cpu().clone(), vc.cpu().clone()  # .cpu() alone would alias a CPU cache
    store(kc, vc, meta.slot_mapping, new_k, new_v, quant=quant)
    ref.store_kv(want_k, want_v, meta.slot_mapping.cpu(), new_k.cpu(), new_v.cpu(), quant=quant)
    assert torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)
    scale = 1 / math.sqrt(8)
    got = attention(q, kc, vc, meta, scale, quant=quant)
    assert meta.scratch  # packed once per step; a second layer reuses it
    again = attention(q, kc, vc, meta, scale, quant)
    want = ref.paged_attention(q, kc, vc, meta, scale, quant=quant)
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
    """transformers' model (the oracle, CPU) and a Runner (tests/model/test_model_equivalence.py) whose model
    runs on DEVICE with the Triton kernels forced."""
    from chatkv.config import EngineConfig
    from chatkv.engine.model_runner import ModelRunner
    from chatkv.model.forward import LlamaModel
    from tests.model.test_model_equivalence import Runner
    from tests.support.tiny import make_model

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
    from tests.model.test_model_equivalence import TOL as MODEL_TOL
    from tests.model.test_model_equivalence import ref_logits, tokens

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
    from tests.model.test_model_equivalence import TOL as MODEL_TOL
    from tests.model.test_model_equivalence import ref_logits, tokens

    ref_model, r = triton_runner(tmp_path, "mistral", 5, sliding_window=8, num_hidden_layers=2)
    seqs = {n: tokens(L, 40 + i) for i, (n, L) in enumerate([("a", 22), ("b", 6)])}
    expected = {n: ref_logits(ref_model, ids) for n, ids in seqs.items()}
    (out_a, out_b) = r.step([(n, ids[:-2]) for n, ids in seqs.items()])
    assert (out_a - expected["a"][:20]).abs().max().item() <= MODEL_TOL
    for back in (2, 1):
        outs = r.step([(n, [ids[-back]]) for n, ids in seqs.items()])
        for (n, ids), out in zip(seqs.items(), outs):
            assert (out[0] - expected[n][len(ids) - back]).abs().max().item() <= MODEL_TOL, (n, back)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_model_with_quantised_kv_triton_matches_the_torch_pair(tmp_path, kv_dtype):
    """chatkv's forward with int8/fp8 KV through the engine's pool: the Triton pair (store_kv quantising in the
    kernel, attention dequantising in it) against the torch reference pair on the same steps (a prompt ending
    mid-block, a chunk over it, decodes): the same pool bytes, and logits within 1e-4 (fp32 model)."""
    from chatkv.config import EngineConfig
    from chatkv.engine.model_runner import ModelRunner
    from chatkv.model.forward import LlamaModel
    from tests.model.test_model_equivalence import Runner, tokens
    from tests.support.tiny import make_model

    make_model(
        tmp_path,
        "llama",
        seed=3,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        num_hidden_layers=2,
    )  # head_dim 32, GQA 2
    model = LlamaModel.from_pretrained(tmp_path, dtype=torch.float32, device=DEVICE)
    ids = tokens(34, 2)
    outs, pools = {}, {}
    for backend in ("torch", "triton"):
        model.store_kv, model.attention = attention_backend(DEVICE, backend)
        r = Runner.__new__(Runner)
        r.runner = ModelRunner(model, EngineConfig(block_size=5, num_blocks=64, kv_dtype=kv_dtype, device=DEVICE))
        r.pool = r.runner.pool
        random.Random(0).shuffle(r.pool._free)
        r.tables, r.done = {}, {}
        assert r.pool.quant == {"int8": "int8", "fp8": "fp8_e4m3"}[kv_dtype]
        got = [r.step([("a", ids[:23])])[0], r.step([("a", ids[23:31])])[0]]
        got += [r.step([("a", [t])])[0] for t in ids[31:]]
        outs[backend], pools[backend] = torch.cat(got), r.pool.kv.cpu()
    # layer 0's K/V come from the embeddings alone: the same bytes. Deeper layers' inputs differ by float noise
    # (~1e-6) after the first attention, which moves scales by an ulp and may move a value across a rounding
    # boundary: one step at most
    assert torch.equal(pools["triton"][0], pools["torch"][0])
    quant = {"int8": "int8", "fp8": "fp8_e4m3"}[kv_dtype]
    dq = {b: kv_quant.dequantize(p, quant, torch.float32) for b, p in pools.items()}
    one_step = kv_quant.scales(pools["torch"]).max().item() * (1 if quant == "int8" else 32)
    assert (dq["triton"] - dq["torch"]).abs().max().item() <= one_step
    assert (outs["triton"] - outs["torch"]).abs().max().item() <= 1e-4


def test_a_step_with_queries_at_given_positions_takes_the_reference():
    """``build_metadata(positions=)`` (chatkv.rag.placement's recompute): the kernels compute a
    prefill's queries as the last of its context, so a step holding such an item is handed to the
    reference, whose numbers it gives, with an ordinary prefill and a decode in the same step."""
    q, kc, vc, tables, _, _, _, _, truth_k, truth_v = make_case(11, 4, [(30, 0), (11, 6), (20, 1)], 4, 2, 8)
    at = [2, 3, 9, 17, 18, 25]
    qlens, ctxs = [len(at), 6, 1], [at[-1] + 1, 17, 21]
    q = torch.randn(sum(qlens), 4, 8, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    meta = ref.build_metadata(tables, qlens, ctxs, 4, device=DEVICE, positions=[at, None, None])
    kc, vc = kc.to(DEVICE), vc.to(DEVICE)
    new_k = torch.cat([truth_k[0][at], truth_k[1][11:], truth_k[2][20:]]).to(DEVICE)
    new_v = torch.cat([truth_v[0][at], truth_v[1][11:], truth_v[2][20:]]).to(DEVICE)
    tri.store_kv(kc, vc, meta.slot_mapping, new_k, new_v)
    want = ref.paged_attention(q, kc, vc, meta, 1 / math.sqrt(8))
    assert torch.equal(tri.paged_attention(q, kc, vc, meta, 1 / math.sqrt(8)), want)
