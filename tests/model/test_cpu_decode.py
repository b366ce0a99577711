"""The fused CPU decode ops (chatkv.kernels.cpu_decode, chatkv.model.fused_decode) against their formulas
and against the torch ops they replace, at the default model's real activations (residual
outlier channels in the hundreds), and whole decode steps of the default model both ways.

They are built with the machine's own compiler for its own CPU, so these run on every machine
the suite runs on: a wrong op on some CPU fails here, and at load the weight self-check
(chatkv.model.self_check) runs its decode path through them (the last test breaks one on purpose).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chatkv.kernels import build_metadata, cpu_decode
from chatkv.kernels.attention import paged_attention, store_kv
from chatkv.model import fused_decode
from chatkv.model import self_check as weight_check
from chatkv.model.forward import LlamaModel
from chatkv.weights import load_tokenizer

pytestmark = pytest.mark.skipif(
    not fused_decode.kernels_available(), reason="no C compiler here: the torch ops run instead"
)

BF16_REL = 2.0**-8  # one bfloat16 step, relative


@pytest.fixture(scope="module")
def model_dir(default_model_dir):
    return default_model_dir


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Whole-model steps on one thread: on a busy machine two threads wait on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(model_dir):
    return LlamaModel.from_pretrained(model_dir, dtype=torch.bfloat16, weights_mode="int4", head_mode="int8")


@pytest.fixture(scope="module")
def france(model_dir):
    tok = load_tokenizer(model_dir)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def activations(model, france):
    """Every RMSNorm's float32 input on the default model's real residual stream (torch path)."""
    seen = []
    real = model.rms

    def record(x, weight, out=None):
        if x.dtype == torch.float32 and weight.dim() == 1:
            seen.append((x.clone(), weight.float().contiguous()))
        return real(x, weight, out)

    model.rms = record
    try:
        weight_check.path_logits(model, france, batched=True)
    finally:
        del model.rms
    return seen


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in bfloat16 steps at the larger magnitude (both bf16-valued)."""
    m = torch.maximum(a.abs(), b.abs()).clamp_min(1e-30)
    step = torch.exp2(torch.floor(torch.log2(m)) - 7)  # bfloat16 keeps 8 significant bits
    return ((a - b).abs() / step).nan_to_num(0.0)


def test_add_rms_is_float64_rmsnorm_rounded_once_at_real_activations(model, activations):
    assert len(activations) == 2 * model.num_layers + 1
    assert max(float(x.abs().max()) for x, _ in activations) > 100  # the outlier channels
    g = torch.Generator().manual_seed(0)
    for x, weight in activations:
        y = (torch.randn(x.shape, generator=g) * x.abs().mean()).to(torch.bfloat16)  # a projection's output
        h = x.clone()
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        cpu_decode.add_rms(h, y, weight, out, model.eps)
        summed = x + y.float()  # the residual addition, in float32 as the model's h.add_(y)
        assert torch.equal(h, summed)
        exact = (
            summed.double() / torch.sqrt(summed.double().pow(2).mean(-1, keepdim=True) + model.eps) * weight.double()
        )
        want = exact.float().to(torch.bfloat16)
        off = out.double() != want.double()
        # rounded once from float64's value: at most a tie's other side, at most one step
        assert float(off.float().mean()) <= 1e-3 and float(ulps(out.double(), want.double()).max()) <= 1.0
        # and without the addition: the model's own torch norm of the same numbers
        out2 = torch.empty_like(out)
        cpu_decode.add_rms(x.clone(), None, weight, out2, model.eps)
        torch_norm = F.rms_norm(x, (x.shape[-1],), weight, eps=model.eps).to(torch.bfloat16)
        assert float((out2 != torch_norm).float().mean()) <= 1e-3
        assert float(ulps(out2.double(), torch_norm.double()).max()) <= 1.0


def test_add_rms_catches_a_wrong_norm():
    """The formula check above is not vacuous: a norm off by one part in 10^3 fails it."""
    x = torch.randn(2, 576) * 30
    w = torch.rand(576) + 0.5
    out = torch.empty(2, 576, dtype=torch.bfloat16)
    cpu_decode.add_rms(x.clone(), None, w, out, 1e-5)
    exact = (x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()).float()
    assert float((out.float() != exact.to(torch.bfloat16).float()).float().mean()) <= 1e-3
    assert float((out.float() != (exact * 1.001).to(torch.bfloat16).float()).float().mean()) > 0.1


def test_silu_mul_is_torchs_bf16_silu_times_u():
    g = torch.Generator().manual_seed(1)
    gu = (torch.randn(3, 2 * 1536, generator=g) * 6).to(torch.bfloat16)
    gu[0, :8] = torch.tensor([0.0, -0.0, 80.0, -80.0, 1e-30, -1e-30, 3.0, -3.0])
    # the vectorised exp's edges: its clamps at -87.3 and 88.8, overflow, infinities and NaN
    gu[1, :12] = torch.tensor(
        [88.5, -88.5, 89.0, -89.0, 100.0, -100.0, 1e4, -1e4, float("inf"), -float("inf"), float("nan"), 87.0]
    )
    out = torch.empty(3, 1536, dtype=torch.bfloat16)
    cpu_decode.silu_mul(gu, out)
    gate, up = gu.chunk(2, dim=-1)
    want = F.silu(gate) * up
    torch.testing.assert_close(out[1, :12], want[1, :12], rtol=0, atol=0, equal_nan=True)  # bit for bit
    assert float((out != want).float().mean()) <= 2e-3
    assert float(ulps(out.double(), want.double()).max()) <= 1.0


def _pool(blocks: int, block_size: int, kvh: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(blocks, block_size, kvh, d, generator=g) * 2).to(torch.bfloat16)


@pytest.mark.parametrize("ctx", [[1], [37], [5, 70, 16], [300, 17]])
def test_decode_attention_is_the_torch_path(model, ctx):
    """RoPE, the KV store and attention of one-token rows (each over its own keys, as a plain
    decode and a verification row) against the model's torch ops on the same inputs: the
    stored keys and values bit for bit, the output within a bfloat16 step of the float64
    formula, as torch's own SDPA is."""
    nh, nkv, d, bs = model.num_heads, model.num_kv_heads, model.head_dim, 16
    rows = len(ctx)
    g = torch.Generator().manual_seed(sum(ctx))
    per = max(ctx) // bs + 1  # blocks per row
    tables = [list(range(i * per, (i + 1) * per))[::-1] for i in range(rows)]  # disjoint, out of order
    positions = torch.tensor([c - 1 for c in ctx])
    slots = torch.tensor([tables[i][(c - 1) // bs] * bs + (c - 1) % bs for i, c in enumerate(ctx)])
    qkv = (torch.randn(rows, (nh + 2 * nkv) * d, generator=g) * 3).to(torch.bfloat16)
    qkv[:, 5] = 300.0  # an outlier channel
    k_pool, v_pool = _pool(per * rows, bs, nkv, d, 1), _pool(per * rows, bs, nkv, d, 2)
    model.rope(positions)
    table = model._cos_sin

    # the torch path: model.rotate, store_kv, paged_attention (decode rows, padded)
    meta = build_metadata(tables, [1] * rows, ctx, bs)
    x = qkv.view(rows, nh + 2 * nkv, d)
    cos, sin = table.index_select(0, positions)[:, 0:1], table.index_select(0, positions)[:, 1:2]
    qk = model.rotate(x[:, : nh + nkv], cos, sin)
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    store_kv(k_ref, v_ref, meta.slot_mapping, qk[:, nh:], x[:, nh + nkv :])
    o_ref = paged_attention(qk[:, :nh].contiguous(), k_ref, v_ref, meta, model.scale).reshape(rows, nh * d)

    blocks = torch.tensor([tb for tb in tables])
    k_got, v_got = k_pool.clone(), v_pool.clone()
    out = torch.empty(rows, nh * d, dtype=torch.bfloat16)
    scratch = (
        torch.empty(rows, nh * d, dtype=torch.bfloat16),
        cpu_decode.attention_scratch(rows, nh, nkv, d, max(ctx)),
    )
    before = torch.get_num_threads()
    threaded = torch.empty_like(out)
    try:
        torch.set_num_threads(1)
        cpu_decode.decode_attention(
            qkv, table, positions, k_got, v_got, slots, blocks, torch.tensor(ctx), nh, nkv, model.scale, out, scratch
        )
        # the (row, kv head, segment) items split over threads: the same bits on any thread count
        torch.set_num_threads(2)
        cpu_decode.decode_attention(
            qkv,
            table,
            positions,
            k_pool.clone(),
            v_pool.clone(),
            slots,
            blocks,
            torch.tensor(ctx),
            nh,
            nkv,
            model.scale,
            threaded,
            (torch.empty(rows, nh * d, dtype=torch.bfloat16), cpu_decode.attention_scratch(rows, nh, nkv, d, max(ctx))),
        )
    finally:
        torch.set_num_threads(before)  # the rest of the run keeps its threads, even after a failure
    assert torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref)
    assert torch.equal(threaded, out)

    # float64 attention over the stored keys
    q = qk[:, :nh].double()
    for r in range(rows):
        sl = torch.tensor([tables[r][j // bs] * bs + j % bs for j in range(ctx[r])])
        k = k_ref.view(-1, nkv, d)[sl].double().repeat_interleave(nh // nkv, dim=1)  # [n, nh, d]
        v = v_ref.view(-1, nkv, d)[sl].double().repeat_interleave(nh // nkv, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[r], k) * model.scale, dim=-1)
        exact = torch.einsum("hn,nhd->hd", p, v).reshape(-1)
        tol = 2 * BF16_REL * exact.abs().max()  # outputs are convex sums of values: a step of their scale
        assert float((out[r].double() - exact).abs().max()) <= tol
        assert float((o_ref[r].double() - exact).abs().max()) <= tol  # what torch's path gives, for scale


@pytest.mark.parametrize("blocked", [True, False])
@pytest.mark.parametrize("start", [1, 60, 130])
def test_a_verifications_rows_are_their_lone_decodes_bits(model, blocked, start):
    """Speculative decoding's exactness at the kernel: rows of one sequence in one call (the last
    token and its proposals, one block table, each a key further; the blocked path converts each
    key once for all of them) give every row exactly the bits of a plain decode, one call per
    token; on both paths, across segment edges (64 keys), on 1 and 2 threads. The paths agree
    with each other and with float64 to a bfloat16 step."""
    nh, nkv, d, bs, rows = model.num_heads, model.num_kv_heads, model.head_dim, 16, 6
    ctx = [start + i for i in range(rows)]
    table = list(range(max(ctx) // bs + 1))[::-1]
    g = torch.Generator().manual_seed(start)
    qkv = (torch.randn(rows, (nh + 2 * nkv) * d, generator=g) * 3).to(torch.bfloat16)
    positions = torch.tensor([c - 1 for c in ctx])
    slots = torch.tensor([table[(c - 1) // bs] * bs + (c - 1) % bs for c in ctx])
    model.rope(positions)
    k0, v0 = _pool(len(table), bs, nkv, d, 3), _pool(len(table), bs, nkv, d, 4)

    def call(r0: int, r1: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = r1 - r0
        out = torch.empty(n, nh * d, dtype=torch.bfloat16)
        cpu_decode.decode_attention(
            qkv[r0:r1].contiguous(),
            model._cos_sin,
            positions[r0:r1].contiguous(),
            k,
            v,
            slots[r0:r1].contiguous(),
            torch.tensor([table] * n),
            torch.tensor(ctx[r0:r1]),
            nh,
            nkv,
            model.scale,
            out,
            (
                torch.empty(n, nh * d, dtype=torch.bfloat16),
                cpu_decode.attention_scratch(n, nh, nkv, d, max(ctx[r0:r1])),
            ),
        )
        return out

    before_path, before_threads = cpu_decode.attention_blocked(blocked), torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            k, v = k0.clone(), v0.clone()
            together = call(0, rows, k, v)
            kl, vl = k0.clone(), v0.clone()
            alone = torch.cat([call(r, r + 1, kl, vl) for r in range(rows)])
            assert torch.equal(k, kl) and torch.equal(v, vl)
            assert torch.equal(together, alone), (
                f"rows differ from their lone decodes: {(together != alone).any(1).tolist()}"
            )
            results.append(together)
        assert torch.equal(results[0], results[1])
        cpu_decode.attention_blocked(not blocked)
        other = call(0, rows, k0.clone(), v0.clone())
    finally:
        cpu_decode.attention_blocked(before_path)
        torch.set_num_threads(before_threads)
    tol = 2 * BF16_REL * results[0].double().abs().max()
    assert float((results[0].double() - other.double()).abs().max()) <= tol
    q = torch.stack(
        [
            model.rotate(
                qkv[r].view(1, nh + 2 * nkv, d)[:, :nh],
                model._cos_sin[positions[r], 0:1].unsqueeze(0),
                model._cos_sin[positions[r], 1:2].unsqueeze(0),
            )[0]
            for r in range(rows)
        ]
    ).double()
    for r in range(rows):
        sl = torch.tensor([table[j // bs] * bs + j % bs for j in range(ctx[r])])
        kk = k.view(-1, nkv, d)[sl].double().repeat_interleave(nh // nkv, dim=1)
        vv = v.view(-1, nkv, d)[sl].double().repeat_interleave(nh // nkv, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[r], kk) * model.scale, dim=-1)
        exact = torch.einsum("hn,nhd->hd", p, vv).reshape(-1)
        assert float((results[0][r].double() - exact).abs().max()) <= 2 * BF16_REL * exact.abs().max()


def test_decode_steps_of_the_default_model_fused_and_torch_agree(model, france):
    """Whole decode steps (one token a step, the France prompt): the fused path and the torch
    path compute the same model, to bfloat16 rounding noise: the same answer token, and top-1
    agreement over the prompt as the paths' own agreement with transformers (test_weight_paths)."""
    assert model.fused_decode
    fused = weight_check.path_logits(model, france, batched=False)
    model.fused_decode = False
    try:
        plain = weight_check.path_logits(model, france, batched=False)
    finally:
        model.fused_decode = True
    m = weight_check.compare(fused, plain)
    assert int(fused[-1].argmax()) == int(plain[-1].argmax())
    assert m["top1"] >= 0.95 and m["mean"] <= 0.045 * m["std"], m


def test_mixed_steps_take_the_torch_ops(model, france):
    """A step with a prefill chunk is not fused (``fused_decode.forward`` declines it)."""
    from chatkv.config import EngineConfig
    from chatkv.engine.model_runner import BatchItem, ModelRunner

    runner = ModelRunner(model, EngineConfig(block_size=16, num_blocks=8, enable_prefix_caching=False))
    table = runner.pool.allocate(4)
    batch = runner.build_batch([BatchItem(france[:20], 0, table, "last")])
    assert (
        fused_decode.forward(
            model, batch.input_ids, batch.positions, runner.pool.kv, batch.metas, batch.logits_rows, None
        )
        is None
    )
    one = runner.build_batch([BatchItem(france[20:21], 20, table, "last")])
    assert (
        fused_decode.forward(model, one.input_ids, one.positions, runner.pool.kv, one.metas, one.logits_rows, None)
        is not None
    )
    assert (
        fused_decode.forward(model, one.input_ids, one.positions, runner.pool.kv, one.metas, one.logits_rows, "int8")
        is None
    )  # quantised KV: torch's


def test_a_wrong_fused_op_fails_the_weight_self_check(model, model_dir, france, monkeypatch):
    """The self-check at load runs the decode path through the fused ops: one that is wrong (by
    a permutation of its output, the scale of a real kernel fault) fails it."""
    from chatkv.model.self_check import reference_model, run_check
    from chatkv.weights.gguf import read_q4
    from chatkv.weights.loading import load_config, read_weights

    d = model_dir
    reference = reference_model(load_config(d), read_weights(d), read_q4(d), "int4", "int8")
    ids = france[:16]  # the check's own prompt is longer; a short one shows the same (and is faster)
    real = cpu_decode.DecodeStep.attention
    monkeypatch.setattr(cpu_decode.DecodeStep, "attention", lambda self, qkv, layer: real(self, qkv, layer).roll(1, -1))
    verdict = run_check(model, reference, ids)
    assert not verdict.ok and "decode path" in verdict.reason and "batched" not in verdict.reason, verdict.reason


def test_without_the_library_the_model_takes_its_torch_ops(model, monkeypatch):
    """No compiler, a failed build or CHATKV_FUSED_DECODE=0: not supported, and nothing calls C."""
    monkeypatch.setattr(cpu_decode, "_lib", None)
    assert not fused_decode.supported(model)
    with pytest.raises(RuntimeError, match="not loaded"):
        cpu_decode.library()


def test_a_block_outside_the_pool_is_an_error_not_a_stray_write(model):
    kv = torch.zeros(model.num_layers, 2, 4, 16, model.num_kv_heads, model.head_dim, dtype=torch.bfloat16)
    model.rope(torch.tensor([40]))
    h = torch.zeros(1, model.config.hidden_size)
    args = dict(
        h=h,
        table=model._cos_sin,
        positions=torch.tensor([20]),
        slots=torch.tensor([20]),
        ctx=torch.tensor([21]),
        max_ctx=21,
        kv=kv,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        intermediate=1536,
        scale=model.scale,
        eps=model.eps,
    )
    cpu_decode.DecodeStep(blocks=torch.tensor([[0, 1]]), **args)  # inside: fine
    with pytest.raises(ValueError, match="outside the pool"):
        cpu_decode.DecodeStep(blocks=torch.tensor([[0, 9]]), **args)
    with pytest.raises(ValueError, match="outside the pool"):
        cpu_decode.DecodeStep(blocks=torch.tensor([[0, 1]]), **{**args, "slots": torch.tensor([64])})
