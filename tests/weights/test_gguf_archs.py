"""The llama-family GGUF architectures chatkv converts: llama (Llama 3.1/3.2's llama3 RoPE
included), qwen2, qwen3, and Mistral (which llama.cpp writes as llama).

The files (tests/data/arch-*.gguf) are llama.cpp's own: tiny transformers models turned into GGUF
by its convert_hf_to_gguf.py and quantised by its llama-quantize (tests/support/arch_fixtures.py).
Their source models are rebuilt here from the same seeds (``source_weights``), so each conversion
is held to

- the source weights, bit for bit (their Q8_0 file holds them exactly): names, llama.cpp's rotary
  row permutation undone where its converter made one (llama) and not elsewhere (qwen2, qwen3),
  biases, q/k norms, tied and untied output;
- the source config: the architecture, head_dim, and the llama3 RoPE parameters recovered from
  the file's ``rope_freqs.weight``;
- transformers' forward on the source model: chatkv's forward on the converted directory gives
  its logits within 1e-4 and its greedy tokens;
- llama.cpp's logits on the same files (tests/data/arch-llama-cpp.safetensors), within
  tests/weights/test_gguf_kquants.py's gate;
- an Engine answering from each file as given (prepared into its data directory).

And files chatkv does not convert are refused with UnsupportedModel naming the file and the reason,
leaving nothing behind.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from chatkv.config import EngineConfig
from chatkv.errors import UnsupportedModel
from chatkv.weights import convert_gguf
from chatkv.weights.gguf_archs import llama3_factors, llama3_rope_parameters
from chatkv.weights.loading import load_config, read_weights
from tests.support.arch_fixtures import MODELS, Q4_0_MODELS, REFERENCE, fixture, hf_config, prompts, source_model
from tests.support.arch_fixtures import source_weights as make_source_weights

NAMES = list(MODELS)
#: what llama.cpp's converter writes for each source model
GGUF_ARCH = {"llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}
#: the model_type of the converted directory (a Mistral GGUF says llama: it is converted as one)
MODEL_TYPE = {"llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}
CASES = [(n, "Q8_0") for n in NAMES] + [(n, "Q4_0") for n in Q4_0_MODELS]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(name, type) -> the fixture converted in float32 (the file's exact numbers), once per module."""
    root, done = tmp_path_factory.mktemp("archs"), {}

    def get(name: str, kind: str = "Q8_0") -> Path:
        if (name, kind) not in done:
            done[name, kind] = convert_gguf(fixture(name, kind), root / f"{name}-{kind}", torch.float32, progress=False)
        return done[name, kind]

    return get


def chatkv_model(model_dir: Path):
    from chatkv.model.forward import LlamaModel

    return LlamaModel(load_config(model_dir), read_weights(model_dir), torch.float32)


def logits_all(model, ids: list[int]) -> torch.Tensor:
    """chatkv's next-token logits after every token of ``ids`` (one prefill through the ModelRunner)."""
    from chatkv.engine.model_runner import BatchItem, ModelRunner

    runner = ModelRunner(model, EngineConfig(block_size=16, num_blocks=-(-len(ids) // 16) + 1))
    table = runner.pool.allocate(-(-len(ids) // 16))
    return runner.forward(runner.build_batch([BatchItem(ids, 0, table, logits="all")])).float()


def gguf_tensors(name: str, kind: str = "Q8_0"):
    from gguf import GGUFReader

    return GGUFReader(str(fixture(name, kind)))


# =========================================================================== the files


@pytest.mark.parametrize("name,kind", CASES)
def test_fixtures_are_llama_cpps_files_of_each_architecture(name, kind):
    reader = gguf_tensors(name, kind)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    assert arch == GGUF_ARCH[name] and fixture(name, kind).stat().st_size < 300_000
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_down.weight"] == kind
    assert ("rope_freqs.weight" in types) == (name == "llama3")  # Llama 3's RoPE scaling, as a tensor
    assert ("blk.0.attn_q.bias" in types) == (name == "qwen2")
    assert ("blk.0.attn_q_norm.weight" in types) == (name == "qwen3")
    assert ("output.weight" in types) == (not hf_config(name).tie_word_embeddings)


# =========================================================================== against the source model


@pytest.mark.parametrize("name", NAMES)
def test_converted_weights_are_the_source_weights_bit_for_bit(name, converted):
    """The Q8_0 file holds the source weights exactly, so the conversion must give them back:
    every name, llama.cpp's rotary permutation undone (llama, Mistral) or never made (qwen)."""
    source = {k.removeprefix("model."): v for k, v in make_source_weights(name).items()}
    ours = read_weights(converted(name))
    assert set(ours) == set(source)
    for key, want in source.items():
        got = ours[key]
        assert got.dtype == torch.float32 and tuple(got.shape) == want.shape, key
        assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32)), key


@pytest.mark.parametrize("name", NAMES)
def test_converted_config_is_the_source_config(name, converted):
    from chatkv.model.forward import rope_inv_freq

    src, ours = hf_config(name), load_config(converted(name))
    assert ours.model_type == MODEL_TYPE[name]
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "tie_word_embeddings",
        "rms_norm_eps",
    ):
        assert getattr(ours, field) == getattr(src, field), field
    assert ours.head_dim == (getattr(src, "head_dim", None) or src.hidden_size // src.num_attention_heads)
    assert ours.rope_parameters == src.rope_parameters  # llama3's four parameters recovered from rope_freqs
    assert getattr(ours, "sliding_window", None) is None
    # the RoPE chatkv computes is the one transformers computes for the source model
    want = source_model(name).model.rotary_emb.inv_freq
    assert torch.allclose(rope_inv_freq(ours)[0], want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_chatkv_computes_what_transformers_computes_on_the_source_model(name, converted):
    model, reference = chatkv_model(converted(name)), source_model(name)
    for ids in prompts():
        got = logits_all(model, ids)
        with torch.no_grad():
            want = reference(torch.tensor([ids])).logits[0].float()
        assert (got - want).abs().max().item() < 1e-4, (got - want).abs().max().item()
        assert torch.equal(got.argmax(-1), want.argmax(-1))


# =========================================================================== against llama.cpp


@pytest.mark.parametrize("name,kind", CASES)
def test_the_conversion_computes_what_llama_cpp_computes(name, kind, converted):
    """llama.cpp's own logits on the same file, after every token of each prompt: within
    tests/weights/test_gguf_kquants.py's gate (llama.cpp rounds its activations to 8 bits, so even
    the exact model differs from it)."""
    from safetensors.torch import load_file

    ref = load_file(str(REFERENCE))
    model = chatkv_model(converted(name, kind))
    d, top = [], []
    for i, ids in enumerate(prompts()):
        got, want = logits_all(model, ids), ref[f"{name}-{kind}.{i}.logits"]
        d.append((got - want).abs().max(-1).values)
        top.append((got.argmax(-1) == want.argmax(-1)).float())
    d = torch.cat(d)
    mean, worst, agree = d.mean().item(), d.max().item(), torch.cat(top).mean().item()
    assert mean < 0.4 and worst < 0.8 and agree >= 0.95, (mean, worst, agree)


def test_llama3_rope_factors_are_what_llama_cpp_applies(converted, tmp_path):
    """The llama3 fixture's RoPE scaling shows at its prompts' positions: the same weights with
    unscaled RoPE are far from llama.cpp's logits (measured mean 3.5, max 12), the converted
    directory's llama3 parameters within the gate (measured 0.29 / 0.54)."""
    import json

    from safetensors.torch import load_file

    model_dir = converted("llama3")
    raw = json.loads((model_dir / "config.json").read_text())
    assert raw["rope_parameters"]["rope_type"] == "llama3" and raw["rope_scaling"]["factor"] == 8.0
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": raw["rope_theta"]}
    del raw["rope_scaling"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    from chatkv.model.forward import LlamaModel

    unscaled = LlamaModel(load_config(tmp_path), read_weights(model_dir), torch.float32)
    ref = load_file(str(REFERENCE))
    for model, near in ((chatkv_model(model_dir), True), (unscaled, False)):
        d = torch.cat(
            [
                (logits_all(model, ids) - ref[f"llama3-Q8_0.{i}.logits"]).abs().max(-1).values
                for i, ids in enumerate(prompts())
            ]
        )
        assert (d.mean().item() < 0.4) == near and (d.mean().item() > 2.0) == (not near), d.mean().item()


@pytest.mark.parametrize("name", Q4_0_MODELS)
def test_q4_0_keeps_the_files_4_bit_numbers_in_their_own_row_order(name, converted):
    """qwen2 / qwen3 rows are not permuted: the 4-bit file holds each Q4_0 tensor's codes row for
    row, and the float model is their values."""
    from chatkv.weights.gguf import _hf_name, read_q4
    from chatkv.weights.quantised import from_gguf_blocks

    model_dir = converted(name, "Q4_0")
    q4, floats = read_q4(model_dir), read_weights(model_dir)
    own = [t for t in gguf_tensors(name, "Q4_0").tensors if t.tensor_type.name == "Q4_0"]
    assert {_hf_name(t.name).removeprefix("model.") for t in own} == set(q4)
    assert any(t.name.endswith("attn_q.weight") for t in own)
    for t in own:
        hf = _hf_name(t.name).removeprefix("model.")
        mine = from_gguf_blocks("Q4_0", t.data, (int(t.shape[1]), int(t.shape[0])))
        assert torch.equal(q4[hf].codes, mine.codes), t.name
        assert torch.equal(q4[hf].dequantize(), floats[hf]), t.name


# =========================================================================== the Engine


@pytest.mark.parametrize("name,kind", CASES)
def test_an_engine_answers_from_each_gguf_file(name, kind, tmp_path):
    from chatkv.engine.core import Engine
    from chatkv.engine.sampling import SamplingParams

    engine = Engine.from_pretrained(str(fixture(name, kind)), data_dir=str(tmp_path / "data"), progress=False)
    try:
        assert engine.model_dir.is_relative_to(tmp_path / "data")
        ids = engine.encode_chat([{"role": "user", "content": "Name a class attribute."}])
        out = engine.generate(ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        assert len(out.token_ids) == 6 and isinstance(out.text, str)
        if kind == "Q4_0":
            assert engine.weights.weights == "int4"  # the file's own 4-bit numbers, run as they are
    finally:
        engine.close()


# =========================================================================== refusals


def write_gguf(path: Path, arch: str, **meta) -> Path:
    """A small GGUF of architecture ``arch``: llama-like metadata and one tensor."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    for key, value in meta.items():
        getattr(w, f"add_{key}")(value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(ord("a") + i) for i in range(8)])
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ["falcon", "gpt2"])
def test_an_unknown_architecture_is_refused_naming_it_and_the_file(arch, tmp_path):
    path = write_gguf(tmp_path / f"{arch}-model.gguf", arch)
    parent = tmp_path / "models"
    with pytest.raises(UnsupportedModel) as e:
        convert_gguf(path, parent / "out", torch.float32, progress=False)
    assert repr(arch) in str(e.value) and str(path) in str(e.value)
    assert "'llama'" in str(e.value) and "'qwen3'" in str(e.value)  # what it does convert
    assert not parent.exists() or not any(parent.iterdir())


@pytest.mark.parametrize(
    "meta,why",
    [
        ({"rope_scaling_type": __import__("gguf").RopeScalingType.YARN, "rope_scaling_factor": 4.0}, "'yarn'"),
        ({"expert_count": 8}, "mixture-of-experts"),
        ({"rope_dimension_count": 8}, "partial rotary"),
    ],
)
def test_what_the_converter_cannot_represent_is_refused(meta, why, tmp_path):
    path = write_gguf(tmp_path / "model.gguf", "llama", **meta)
    parent = tmp_path / "models"
    with pytest.raises(UnsupportedModel, match=why) as e:
        convert_gguf(path, parent / "out", torch.float32, progress=False)
    assert str(path) in str(e.value)
    assert not parent.exists() or not any(parent.iterdir())


def test_linear_rope_scaling_is_transformers_linear(tmp_path):
    """llama.cpp multiplies positions by 1 / factor; transformers' linear RoPE divides the
    frequencies by it: the same angles."""
    import gguf

    from chatkv.model.forward import rope_inv_freq
    from chatkv.weights.gguf import _build_config

    meta = {
        "general.architecture": "qwen2",
        "qwen2.embedding_length": 64,
        "qwen2.attention.head_count": 4,
        "qwen2.feed_forward_length": 128,
        "qwen2.block_count": 2,
        "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
        "qwen2.context_length": 4096,
        "qwen2.rope.freq_base": 10000.0,
        "qwen2.rope.scaling.type": gguf.RopeScalingType.LINEAR.value,
        "qwen2.rope.scaling.factor": 4.0,
        "tokenizer.ggml.tokens#len": 320,
    }
    cfg = _build_config(meta, True, torch.float32)
    assert cfg["rope_parameters"] == {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(__import__("json").dumps(cfg))
    inv, scale = rope_inv_freq(load_config(tmp_path))
    default = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert torch.allclose(inv, default / 4.0, rtol=1e-6) and scale == 1.0


def test_llama3_parameters_are_recovered_for_llama_3_1_and_3_2_and_unmatched_factors_refused():
    """convert_hf_to_gguf's factors for Llama 3.1 (factor 8) and 3.2 (factor 32), head_dim 128:
    the recovered parameters are Meta's, and transformers reproduces every factor. Factors no
    llama3 RoPE makes are refused, naming the file."""
    import math

    def llama_cpp_factors(factor: float, dim: int = 128, base: float = 500000.0) -> np.ndarray:
        freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        out = []
        for f in freqs.tolist():
            wavelen = 2 * math.pi / f
            if wavelen < 8192 / 4:
                out.append(1.0)
            elif wavelen > 8192:
                out.append(factor)
            else:
                s = (8192 / wavelen - 1) / (4 - 1)
                out.append(1 / ((1 - s) / factor + s))
        return np.array(out, dtype=np.float32)

    for factor in (8.0, 32.0):
        r = llama_cpp_factors(factor)
        params = llama3_rope_parameters(r, 500000.0, 128, Path("Llama-3.gguf"))
        assert params == {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        assert np.allclose(llama3_factors(params, 500000.0, 128), r, rtol=1e-6, atol=0)
    bent = llama_cpp_factors(8.0)
    bent[40] *= 1.01  # one factor of the smoothed band off the curve
    with pytest.raises(UnsupportedModel, match="no llama3 rope_parameters") as e:
        llama3_rope_parameters(bent, 500000.0, 128, Path("odd-rope.gguf"))
    assert "odd-rope.gguf" in str(e.value)
