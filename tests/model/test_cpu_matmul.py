"""The few-row quantised products (kernels/cpu_matmul.c: ``int4_mm``, ``int8_mm``) against exact
float64 arithmetic and torch's weight-only kernels, on the default model's own weights and real
activations, at every row count a step gives them (1 to 16), and the property speculation needs:
a row's numbers do not depend on the other rows of its step.

They need AVX512-BF16 and AVX512-VBMI. Where the CPU lacks them, the tests of the numbers are
skipped, and the last test shows that the model then takes torch's kernels. Where it has AMX
(Intel Sapphire Rapids and later) the tests of the numbers run twice: on AVX-512 alone and on
the tile kernels, which then take every step, one row included.
"""

from __future__ import annotations

import pytest
import torch

from chatkv.kernels import cpu_decode
from chatkv.model import fused_decode
from chatkv.model import self_check as weight_check
from chatkv.model.forward import LlamaModel
from chatkv.weights import load_tokenizer
from chatkv.weights import quantised as quant
from chatkv.weights.quantised import GROUP, Int4Linear, Int8Linear, quantize_int4, quantize_int8, unpack_int4pack

native = pytest.mark.skipif(
    not (fused_decode.kernels_available() and cpu_decode.int4_mm_native()),
    reason="no AVX512-BF16/VBMI here: torch's int4/int8 kernels run (last test)",
)


@pytest.fixture
def tiles():
    """The few-row products on AMX tiles for the test (skipped where the CPU has none, or Linux
    did not grant the tile state); the process's own choice restored after."""
    before = cpu_decode.amx()
    if not cpu_decode.amx(True):
        cpu_decode.amx(before)
        pytest.skip("no AMX here (or Linux did not grant the tile state): AVX-512 alone runs")
    yield
    cpu_decode.amx(before)


@pytest.fixture(params=["avx512", "amx"])
def kernel(request):
    """The few-row products on AVX-512 alone, or on AMX tiles where the CPU has them."""
    if request.param == "amx":
        request.getfixturevalue("tiles")
        yield "amx"
        return
    before = cpu_decode.amx()
    cpu_decode.amx(False)
    yield "avx512"
    cpu_decode.amx(before)


@pytest.fixture(scope="module")
def model(default_model_dir):
    return LlamaModel.from_pretrained(default_model_dir, dtype=torch.bfloat16, weights_mode="int4", head_mode="int8")


@pytest.fixture(scope="module")
def seen(model, default_model_dir):
    """Every projection's (and the output matrix's) real one-row inputs, decoding a chat prompt a
    token a step: ``[(linear, [tokens, K])]`` for all 30 layers and the output matrix."""
    tok = load_tokenizer(default_model_dir)
    ids = tok.apply_chat_template(
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {
                "role": "user",
                "content": "What is the capital of France? Answer in one line, "
                "then write a short story about a lighthouse keeper.",
            },
        ],
        add_generation_prompt=True,
        tokenize=True,
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    got: dict[int, tuple[object, list[torch.Tensor]]] = {}
    real4, real8 = Int4Linear.__call__, Int8Linear.__call__

    def spy(real):
        def call(self, x):
            if x.shape[0] == 1:
                got.setdefault(id(self), (self, []))[1].append(x.clone())
            return real(self, x)

        return call

    Int4Linear.__call__, Int8Linear.__call__ = spy(real4), spy(real8)
    try:
        weight_check.path_logits(model, ids, batched=False)
    finally:
        Int4Linear.__call__, Int8Linear.__call__ = real4, real8
    picked = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return [(lin, torch.cat(got[id(lin)][1])) for lin in picked + [model.lm_head.head]]


@pytest.fixture(scope="module")
def inputs(seen, model):
    """Layer 7's projections' and the output matrix's last 16 one-row inputs."""
    layer = model.layers[7]
    keep = {id(lin) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down, model.lm_head.head)}
    return [(lin, x[-16:].contiguous()) for lin, x in seen if id(lin) in keep]


def exact_int4(lin: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    """float64 ``x @ w.T`` with the kernel's own numbers: ``(code - 8) * s + z``, s and z bfloat16."""
    n = lin.out_features
    k = x.shape[1]
    codes = unpack_int4pack(lin.packed, n, quant.int4pack_block()).double().view(n, k // GROUP, GROUP)
    sz = lin.scales_zeros.double()  # [K / 32, N, 2]
    w = (codes - 8) * sz[..., 0].t().unsqueeze(-1) + sz[..., 1].t().unsqueeze(-1)
    return x.double() @ w.view(n, k).t()


def exact_int8(lin: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    return (x.double() @ lin.codes.double().t()) * lin.scales.double()


def torch_kernel(lin, x: torch.Tensor) -> torch.Tensor:
    if isinstance(lin, Int4Linear):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, lin.packed, GROUP, lin.scales_zeros)
    return torch.ops.aten._weight_int8pack_mm(x, lin.codes, lin.scales)


def native_call(lin):
    return (
        cpu_decode.int4_mm_call(lin.packed, lin.scales_zeros)
        if isinstance(lin, Int4Linear)
        else cpu_decode.int8_mm_call(lin.codes, lin.scales)
    )


@native
def test_the_default_models_products_are_exact_sums_rounded_once_as_torchs(inputs, kernel):
    """At every row count, each output is the exact sum rounded to bfloat16 (but for float32's
    own rounding of the sum): never further from exact than torch's kernel is, and equal to it
    but for a few ties of rounding."""
    for lin, x in inputs:
        call = native_call(lin)
        assert call, type(lin).__name__
        exact_of = exact_int4 if isinstance(lin, Int4Linear) else exact_int8
        for rows in (1, 2, 3, 5, 6, 7, 11, 16):
            xr = x[:rows].contiguous()
            got, ref, exact = call(xr).double(), torch_kernel(lin, xr).double(), exact_of(lin, xr)
            assert got.shape == (rows, lin.out_features) and torch.isfinite(got).all()
            worst_torch = (ref - exact).abs().max().item()
            assert (got - exact).abs().max().item() <= worst_torch * 1.01 + 1e-6, (type(lin).__name__, rows)
            assert (got == ref).double().mean().item() >= 0.99, (type(lin).__name__, rows)


@native
def test_a_rows_numbers_do_not_depend_on_the_other_rows(inputs, kernel):
    """What lets a verified proposal's logits be its plain decode's bit for bit: row r of a step
    of any row count equals the one-row step of that row, and any prefix of the rows as much,
    on any number of threads."""
    for lin, x in inputs:
        call = native_call(lin)
        full = call(x)
        for r in range(x.shape[0]):
            assert torch.equal(call(x[r : r + 1].contiguous())[0], full[r]), (type(lin).__name__, r)
        for rows in range(1, x.shape[0]):
            assert torch.equal(call(x[:rows].contiguous()), full[:rows]), (type(lin).__name__, rows)
        before = torch.get_num_threads()
        try:  # the thread governor may change the count between steps: the same bits on any count
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                assert torch.equal(call(x), full), (type(lin).__name__, threads)
        finally:
            torch.set_num_threads(before)


@native
def test_every_layers_rows_are_their_one_row_steps_bits(seen, kernel):
    """The same over every projection of all 30 layers and the output matrix, on all of a decoded
    prompt's inputs in steps of 16 rows: 121 weights' worth of real activations. (A last-bit
    difference between two kernels shows in about one call of a few hundred: layer 7's sixteen
    rows alone missed the one that split a one-row step on AVX-512 from verified rows on AMX.)"""
    for lin, x in seen:
        call = native_call(lin)
        one = torch.cat([call(x[r : r + 1].contiguous()) for r in range(x.shape[0])])
        for start in range(0, x.shape[0], 16):
            part = x[start : start + 16].contiguous()
            assert torch.equal(call(part), one[start : start + part.shape[0]]), (
                type(lin).__name__,
                lin.out_features,
                start,
            )


@native
def test_the_model_takes_them_for_its_int4_projections_and_int8_output_matrix(model):
    """Where they are built: every int4 projection and the int8 output matrix, up to 16 rows; an
    int8 projection keeps torch's kernel (its numbers took the int8 mode's logits further from
    transformers', chatkv.weights.quantised.Int8Linear.native_few_rows)."""
    for layer in model.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            assert lin.few_rows(), lin
    assert model.lm_head.head.few_rows()
    assert not Int8Linear(quantize_int8(torch.randn(64, 64))).few_rows()
    lin = model.layers[0].o
    x = torch.randn(3, lin.scales_zeros.shape[0] * GROUP).to(torch.bfloat16)
    before = quant.few_row_kernel()  # CHATKV_FEW_ROW_KERNELS=0 in the environment starts it off
    try:
        quant.few_row_kernel(True)
        assert torch.equal(lin(x), native_call(lin)(x))
        quant.few_row_kernel(False)  # as CHATKV_FEW_ROW_KERNELS=0: torch's numbers exactly
        assert torch.equal(lin(x), torch_kernel(lin, x))
    finally:
        quant.few_row_kernel(before)


@native
def test_shapes_outside_the_kernels_take_torchs_and_bad_calls_are_errors():
    g = torch.Generator().manual_seed(3)
    odd = Int4Linear(quantize_int4(torch.randn(96, 64, generator=g)))  # 96 rows: not whole blocks of 64
    assert odd.few_rows() is False
    x = torch.randn(2, 64, generator=g).to(torch.bfloat16)
    assert torch.equal(odd(x), torch_kernel(odd, x))
    lin = Int4Linear(quantize_int4(torch.randn(128, 64, generator=g)))
    call = lin.few_rows()
    assert call
    with pytest.raises(ValueError, match="at most 16 rows"):
        call(torch.zeros(17, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="64 inputs"):
        call(torch.zeros(2, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float32"):
        call(torch.zeros(2, 64))
    y = lin(torch.zeros(17, 64, dtype=torch.bfloat16))  # more rows than it takes: torch's kernel
    assert y.shape == (17, 128) and not y.any()
    for empty in (lin, Int8Linear(quantize_int8(torch.randn(128, 64, generator=g))).native_few_rows()):
        # a prefill chunk that wants no logits asks the output matrix for 0 rows
        assert empty(torch.zeros(0, 64, dtype=torch.bfloat16)).shape == (0, 128)
    nan = torch.full((1, 64), float("nan"), dtype=torch.bfloat16)
    assert torch.isnan(call(nan)).all()  # a NaN activation stays NaN, as in torch's kernel


def test_without_the_instructions_the_model_takes_torchs_kernels(model, monkeypatch):
    """A CPU without AVX512-BF16 (an AVX-512 Xeon before Sapphire Rapids), or no library: torch's
    kernels, the same numbers as before these existed."""
    monkeypatch.setattr(cpu_decode, "int4_mm_native", lambda: False)
    monkeypatch.setattr(cpu_decode, "_lib", None)
    lin = Int4Linear(quantize_int4(torch.randn(128, 64)))
    assert lin.few_rows() is False
    x = torch.randn(2, 64).to(torch.bfloat16)
    assert torch.equal(lin(x), torch_kernel(lin, x))
    assert Int8Linear(quantize_int8(torch.randn(64, 64))).native_few_rows().few_rows() is False


@native
def test_threads_calling_at_once_get_their_own_numbers(inputs, kernel):
    """Two engines in one process (or the loop thread beside a prefill) call the kernels at once:
    each call keeps its own scratch, so every result is the one computed alone."""
    import threading

    lin, x = inputs[2]  # gate_up, the largest projection
    head, hx = inputs[4]
    ref = {r: (lin(x[:r].contiguous()), head(hx[:r].contiguous())) for r in range(1, 17)}
    bad: list[tuple[int, int]] = []

    def work(t: int) -> None:
        for i in range(40):
            r = (i * 5 + t) % 16 + 1
            a, b = lin(x[:r].contiguous()), head(hx[:r].contiguous())
            if not (torch.equal(a, ref[r][0]) and torch.equal(b, ref[r][1])):
                bad.append((t, r))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad, bad


@native
def test_amx_is_the_process_choice_for_every_row_count(inputs, tiles):
    """On AMX every step takes the tiles, one row included: their sums are not AVX-512's bit for
    bit (in the last bit of some group sums), so a one-row step on AVX-512 beside verified rows on
    tiles would break the greedy identity. Each row count, on tiles, gives each row the bits of
    that row alone on tiles (the output matrix's too where no heap is left for its inputs' layout),
    and CHATKV_AMX=0 keeps AVX-512 alone in a new process."""
    import os
    import subprocess
    import sys

    for lin, x in inputs:
        call = native_call(lin)
        one = torch.cat([call(x[r : r + 1].contiguous()) for r in range(x.shape[0])])
        for rows in (2, 7, 16):
            assert torch.equal(call(x[:rows].contiguous()), one[:rows]), (rows, lin.out_features)
        if not isinstance(lin, Int4Linear):  # int8_mm's path for a heap with no room: the same numbers
            cpu_decode.library().amx_enable(2)  # (the tiles fixture sets the process's choice back)
            for rows in (1, 15, 16):
                assert torch.equal(call(x[:rows].contiguous()), one[:rows]), ("no heap", rows)
            cpu_decode.amx(True)
    code = (
        "from chatkv.model import fused_decode; from chatkv.kernels import cpu_decode; "
        "fused_decode.kernels_available(); print(cpu_decode.amx())"
    )
    for env, want in (("0", "False"), ("1", "True")):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "CHATKV_AMX": env},
        )
        assert out.stdout.strip().splitlines()[-1] == want, (env, out.stdout, out.stderr[-500:])


@native
def test_greedy_speculation_on_the_default_model_is_offs_token_for_token(default_model_dir, tmp_path):
    """The product's path end to end: the default model's int4 projections and int8 output
    matrix, each verification's rows through the few-row kernels the process chose (the tiles
    where the CPU has AMX, else AVX-512), ``lookup`` proposing whenever a match exists: every
    greedy reply is speculative="off"'s token for token. (A finer net for the kernels' bits is
    the every-layer row test above.)"""
    from chatkv.config import EngineConfig
    from chatkv.engine.core import Engine
    from chatkv.engine.sampling import SamplingParams

    doc = (
        "Items may be returned within 30 days of delivery for a full refund, provided they are unused and in "
        "their original packaging. Refunds are issued to the original payment method within 5 business days."
    )
    chats = [
        [
            {"role": "system", "content": f"Answer from this document only, quoting it.\n\n{doc}"},
            {"role": "user", "content": "How do I return an item and when do I get my refund?"},
        ],
        [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}],
    ]
    params = SamplingParams(max_tokens=80, temperature=0)
    replies, proposed = {}, 0
    for mode in ("off", "lookup"):
        eng = Engine(default_model_dir, EngineConfig(data_dir=str(tmp_path), speculative=mode, num_blocks=64))
        try:
            for i, chat in enumerate(chats):
                res = eng.generate(eng.encode_chat(chat), params)
                replies[mode, i] = res.token_ids
                proposed += res.usage.proposed_tokens if mode == "lookup" else 0
        finally:
            eng.close()
    assert proposed > 20  # the verified rows this is about did run
    for i in range(len(chats)):
        assert replies["lookup", i] == replies["off", i], (cpu_decode.amx(), i)
