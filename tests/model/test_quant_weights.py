"""Quantised weights: the GGUF mapping bit for bit, the kernels' packing, the
engine's weight modes, and quality gates against references no one here wrote.

- Mapping: Q4_0, Q4_1 and Q8_0 blocks made by gguf-py's own quantiser, and tensors of the
  packaged GGUF, dequantised by gguf's reference and by ``chatkv.weights.quantised`` are equal bit for
  bit; the converted directory's 4-bit numbers (rows unpermuted for q/k) are exactly the
  GGUF's, and its float weights are their dequantisation.
- Kernels: the int4 pack keeps every code (a one-hot input reads them back exactly); int4 and
  int8 linears equal float matmuls over their dequantised weights within bf16 rounding.
- Gate, int4 on the GGUF (with the int8 output matrix ``auto`` picks), against llama.cpp's
  own logits on the same file
  (tests/data/llama_cpp_q4_1.safetensors, written by tests/support/llama_cpp_reference.py with
  llama-cpp-python 0.3.36): llama.cpp computes with activations quantised to 8 bits, so even
  the exact fp32 dequantisation differs from it by ~0.8 logits on average (max ~1.8). The
  int4 engine must stay within 1.5x of that distance (mean and max over 20 prompts), agree
  on the top token for >= 18 of 20 prompts, and its perplexity over 4096 tokens of a fixed
  text must be within 1% of llama.cpp's.
- Gate, a float directory quantised on load (int8 per channel, int4 groups of 32), against
  the same directory in bf16: teacher-forced top-1 agreement >= 95% over bf16's own 256
  greedy tokens on 20 prompts, and perplexity within 2%. (The only real model here is the
  default one, whose float weights descend from Q4_1, so its int4 requantisation is nearly
  lossless; int8 per channel is a real requantisation.)
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from chatkv.config import EngineConfig
from chatkv.engine.core import Engine
from chatkv.engine.model_runner import BatchItem, ModelRunner
from chatkv.engine.sampling import SamplingParams
from chatkv.errors import InvalidRequest
from chatkv.model.forward import LlamaModel
from chatkv.weights import load_tokenizer
from chatkv.weights.gguf import QUANT_FILE, packaged_gguf_path, read_q4
from chatkv.weights.loading import read_weights
from chatkv.weights.quantised import (
    GROUP,
    Int4Linear,
    Int8Linear,
    Q4Weight,
    from_gguf_blocks,
    quantize_int4,
    quantize_int8,
)
from tests.support.llama_cpp_reference import OUT as REFERENCE
from tests.support.llama_cpp_reference import PROMPTS, prompt_ids


@pytest.fixture(scope="module", autouse=True)
def threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the 4k-token perplexities are real work
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def default_tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def default_engine(default_model_dir, tmp_path_factory):
    return Engine(default_model_dir, EngineConfig(data_dir=str(tmp_path_factory.mktemp("data")), num_blocks=8))


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


# -- the mapping ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_one_block_dequantises_bit_for_bit_as_ggufs_reference(kind):
    g = np.random.default_rng(3)
    w = (g.standard_normal((4, 2 * GROUP)) * 0.05).astype(np.float32)
    w[0, :GROUP] = 0.0  # an all-zero block (scale 0)
    qtype = GGMLQuantizationType[kind]
    raw = quantize(w, qtype)  # gguf-py's own quantiser: [rows, bytes per row]
    ref = dequantize(raw, qtype).reshape(w.shape)
    ours = from_gguf_blocks(kind, raw, w.shape).dequantize().numpy()
    assert np.array_equal(bits(ref), bits(ours))


def test_packaged_gguf_tensors_dequantise_bit_for_bit():
    from gguf import GGUFReader

    reader = GGUFReader(str(packaged_gguf_path()))
    seen = set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in seen or kind not in ("Q4_1", "Q8_0"):
            continue
        seen.add(kind)
        shape = (int(t.shape[1]), int(t.shape[0]))
        ref = dequantize(t.data, t.tensor_type).reshape(shape)
        assert np.array_equal(bits(ref), bits(from_gguf_blocks(kind, t.data, shape).dequantize().numpy())), t.name
    assert seen == {"Q4_1", "Q8_0"}


def test_converted_directory_keeps_the_ggufs_own_4_bit_numbers(default_model_dir):
    q4 = read_q4(default_model_dir)
    floats = read_weights(default_model_dir)
    assert len(q4) == 30 * 7  # q, k, v, o, gate, up, down of 30 layers
    for name in (
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.29.mlp.down_proj.weight",
    ):
        q = q4[name]
        assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 15
        # the float model is these numbers dequantised (then rounded to its bf16): q/k rows unpermuted alike
        assert torch.equal(q.dequantize().to(floats[name].dtype), floats[name]), name


# -- the kernels ---------------------------------------------------------------------------------


def test_int4_pack_keeps_every_code():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (96, 64), generator=g, dtype=torch.uint8)
    ones = torch.ones(96, 64 // GROUP)
    lin = Int4Linear(Q4Weight(codes, ones, torch.zeros_like(ones)))
    eye = torch.eye(64, dtype=torch.bfloat16)
    assert torch.equal(lin(eye).t().float(), codes.float())  # small integers: exact in bf16


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int4_and_int8_linears_equal_their_dequantised_weights(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(192, 128, generator=g) * 0.05
    x = torch.randn(rows, 128, generator=g).to(torch.bfloat16)
    bias = torch.randn(192, generator=g)
    for q, lin in ((quantize_int4(w), Int4Linear), (quantize_int8(w), Int8Linear)):
        ref = x.float() @ q.dequantize().t() + bias.to(torch.bfloat16).float()
        y = lin(q, bias)(x).float()
        assert torch.allclose(y, ref, rtol=1e-2, atol=2e-2), (lin.__name__, (y - ref).abs().max())
        assert (q.dequantize() - w).abs().max() <= (0.6 / 15 if lin is Int4Linear else 0.6 / 127) * w.abs().max() * 2


# -- the engine's weight modes -------------------------------------------------------------------


def test_auto_picks_int4_for_the_gguf_and_says_so(default_engine, tmp_path):
    assert default_engine.weights.weights == "int4" and "GGUF" in default_engine.weights.label
    assert default_engine.weights.head == "int8"  # passes the llama.cpp gate below; int4 (+5.8% perplexity) does not
    assert (default_engine.model_dir / QUANT_FILE).is_file()


def test_quantised_modes_are_part_of_the_fingerprint(default_model_dir, tmp_path):
    a = Engine(default_model_dir, EngineConfig(data_dir=str(tmp_path), weights="int4", num_blocks=8))
    b = Engine(default_model_dir, EngineConfig(data_dir=str(tmp_path), weights="bf16", num_blocks=8))
    assert a.fingerprint != b.fingerprint


@pytest.mark.parametrize(
    "kw, what",
    [
        (dict(weights="int3"), "weights 'int3' unknown"),
        (dict(head_weights="fp8"), "head_weights 'fp8' unknown"),
        (dict(weights="int4", dtype="float32"), "compute in bfloat16"),
        (dict(weights="bf16", dtype="float32"), "disagree"),
        (dict(weights="int8", device="meta"), "CPU only"),
        (dict(head_weights="int8", weights="fp32"), "bfloat16 on CPU"),
    ],
)
def test_bad_weight_options_are_named(default_model_dir, tmp_path, kw, what):
    with pytest.raises(InvalidRequest, match=what):
        Engine(default_model_dir, EngineConfig(data_dir=str(tmp_path), num_blocks=8, **kw))


# -- quality gates -------------------------------------------------------------------------------


def logits_all(model: LlamaModel, ids: list[int], chunk: int = 512) -> torch.Tensor:
    """Logits after every token of ``ids``, computed in prefill chunks over paged KV."""
    runner = ModelRunner(model, EngineConfig(block_size=16, num_blocks=-(-len(ids) // 16) + 1))
    table = runner.pool.allocate(-(-len(ids) // 16))
    return torch.cat(
        [
            runner.forward(runner.build_batch([BatchItem(ids[s : s + chunk], s, table, logits="all")]))
            for s in range(0, len(ids), chunk)
        ]
    )


def perplexity(model: LlamaModel, ids: list[int]) -> float:
    logp = torch.log_softmax(logits_all(model, ids)[:-1].float(), -1).gather(1, torch.tensor(ids[1:])[:, None])
    return math.exp(-logp.mean().item())


def test_int4_gguf_weights_stay_within_llama_cpps_own_logits(default_model_dir):
    ref = load_file(str(REFERENCE))
    prompts = [ref[f"prompt.{i}.ids"].tolist() for i in range(len(PROMPTS))]

    def distance(model):
        d, top = [], 0
        for i, ids in enumerate(prompts):
            a, b = logits_all(model, ids)[-1], ref[f"prompt.{i}.logits"]
            d.append((a - b).abs().max().item())
            top += int(a.argmax() == b.argmax())
        return sum(d) / len(d), max(d), top

    exact = distance(LlamaModel.from_pretrained(default_model_dir, dtype=torch.float32))
    assert exact[0] < 1.0 and exact[1] < 2.0, exact  # the reference itself is what we think it is
    int4 = LlamaModel.from_pretrained(default_model_dir, dtype=torch.bfloat16, weights_mode="int4", head_mode="int8")
    mean, worst, top = distance(int4)
    assert mean <= 1.5 * exact[0] and worst <= 1.5 * exact[1], (mean, worst, exact)
    assert top >= 18, top
    ppl, llama_ppl = perplexity(int4, ref["ppl.ids"].tolist()), math.exp(-ref["ppl.logprobs"].mean().item())
    assert abs(ppl / llama_ppl - 1) <= 0.01, (ppl, llama_ppl)


def test_float_directory_quantised_on_load_keeps_its_greedy_tokens(default_model_dir, default_tokenizer, tmp_path):
    bf16 = Engine(default_model_dir, EngineConfig(data_dir=str(tmp_path), weights="bf16", num_blocks=512))
    prompts = prompt_ids(default_tokenizer)
    outs = bf16.generate(prompts, SamplingParams(max_tokens=256, temperature=0, ignore_eos=True))
    ppl_ids = load_file(str(REFERENCE))["ppl.ids"].tolist()
    base_ppl = perplexity(bf16.model, ppl_ids)
    for mode in ("int8", "int4"):
        m = LlamaModel.from_pretrained(default_model_dir, dtype=torch.bfloat16, weights_mode=mode)
        same = total = 0
        for ids, out in zip(prompts, outs):
            gen = out.token_ids
            pred = logits_all(m, ids + gen)[len(ids) - 1 : -1].argmax(-1)
            same += int((pred == torch.tensor(gen)).sum())
            total += len(gen)
        assert same / total >= 0.95, (mode, same / total)
        ppl = perplexity(m, ppl_ids)
        assert abs(ppl / base_ppl - 1) <= 0.02, (mode, ppl, base_ppl)


def test_steps_of_many_rows_use_the_dense_copy_with_the_same_weights():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 64, generator=g) * 0.05
    q = quantize_int4(w)
    dense_calls = []

    def dense(x):
        dense_calls.append(x.shape[0])
        return x.float().matmul(q.dequantize().t()).to(x.dtype)

    lin = Int4Linear(q, dense=dense, dense_rows=8)
    x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    many = lin(x).float()
    one = torch.cat([lin(x[i : i + 1]) for i in range(8)]).float()
    assert dense_calls == [8]  # the 8-row step went dense, the 1-row ones to the int4 kernel
    assert torch.allclose(many, one, rtol=1e-2, atol=2e-2), (many - one).abs().max()


def test_damaged_4_bit_file_is_a_clear_error(default_model_dir, tmp_path):
    import shutil

    from chatkv.errors import ModelNotFound

    d = tmp_path / "model"
    shutil.copytree(default_model_dir, d)
    q = d / QUANT_FILE
    q.write_bytes(q.read_bytes()[: q.stat().st_size // 2])
    with pytest.raises(ModelNotFound, match="4-bit weights .* unreadable.*convert the model again"):
        Engine(d, EngineConfig(data_dir=str(tmp_path / "data"), num_blocks=8))
    # the directory keeps each tensor once: its float weights are decoded from the same file
    with pytest.raises(ModelNotFound, match="4-bit weights .* unreadable.*convert the model again"):
        Engine(d, EngineConfig(data_dir=str(tmp_path / "data"), num_blocks=8, weights="bf16"))
