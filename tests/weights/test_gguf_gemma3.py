"""A Gemma 3 GGUF (llama.cpp's arch ``gemma3``) converted by chatkv into a ``gemma3_text`` directory.

The file (tests/data/gemma3-Q8_0.gguf) is llama.cpp's own: a tiny transformers Gemma3ForCausalLM turned
into GGUF by its convert_hf_to_gguf.py and quantised by its llama-quantize (tests/support/gemma3_fixtures.py,
which also saved llama.cpp's logits and token ids on it). Its source model is rebuilt here from the same
seeds, so the conversion is held to

- the source weights bit for bit: llama.cpp's names (``post_attention_norm``, ``ffn_norm`` as the
  pre-feedforward norm, ``post_ffw_norm``, q/k norms) and the ``1 + w`` its converter stored for every
  norm weight taken back off;
- the source config as llama.cpp reads the file: five sliding layers and a full one, the window,
  each layer type's RoPE (the full layers' linear scaling), the attention scale, the final softcapping;
- transformers' forward on the source model (1e-4, the same greedy tokens);
- llama.cpp's logits on the file, within tests/weights/test_gguf_archs.py's gate;
- llama.cpp's token ids (SentencePiece, no space prefix, Gemma's special tokens) on the shared
  tokenizer corpus and Gemma's turn markers;
- an Engine answering from the file as given, greedy as transformers on the source model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from chatkv.config import EngineConfig
from chatkv.weights import convert_gguf
from chatkv.weights.loading import load_config, load_tokenizer, read_weights
from tests.support.gemma3_fixtures import FIXTURE, REFERENCE, WINDOW, hf_config, prompts, source_model, source_weights
from tests.weights.test_gguf_archs import logits_all


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    return convert_gguf(FIXTURE, tmp_path_factory.mktemp("gemma3") / "gemma3-Q8_0", torch.float32, progress=False)


@pytest.fixture(scope="module")
def model(converted):
    from chatkv.model.gemma3 import Gemma3Model

    return Gemma3Model(load_config(converted), read_weights(converted), torch.float32)


@pytest.fixture(scope="module")
def reference():
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(REFERENCE), framework="pt") as f:
        tokens = json.loads(f.metadata()["tokens"])
    return load_file(str(REFERENCE)), tokens


def test_the_fixture_is_llama_cpps_gemma3_file_with_norms_stored_as_one_plus_w():
    from gguf import GGUFReader

    reader = GGUFReader(str(FIXTURE))
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "gemma3"
    assert FIXTURE.stat().st_size < 300_000
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.0.ffn_down.weight"].tensor_type.name == "Q8_0" and "output.weight" not in tensors
    source = source_weights()
    for gguf_name, hf in (
        ("output_norm.weight", "model.norm.weight"),
        ("blk.2.post_ffw_norm.weight", "model.layers.2.post_feedforward_layernorm.weight"),
        ("blk.2.attn_q_norm.weight", "model.layers.2.self_attn.q_norm.weight"),
    ):
        assert np.array_equal(np.asarray(tensors[gguf_name].data), source[hf] + 1), gguf_name


def test_converted_weights_are_the_source_weights_bit_for_bit(converted):
    source = {k.removeprefix("model."): v for k, v in source_weights().items()}
    ours = read_weights(converted)
    assert set(ours) == set(source)  # every name mapped; the output matrix tied, not written
    for key, want in source.items():
        got = ours[key]
        assert got.dtype == torch.float32 and tuple(got.shape) == want.shape, key
        assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32)), key


def test_converted_config_is_the_source_config(converted):
    src, ours = hf_config(), load_config(converted)
    assert ours.model_type == "gemma3_text"
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "tie_word_embeddings",
        "rms_norm_eps",
        "layer_types",
        "sliding_window",
        "rope_parameters",
        "query_pre_attn_scalar",
        "final_logit_softcapping",
        "hidden_activation",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert getattr(ours, field) == getattr(src, field), field
    assert ours.sliding_window == WINDOW and ours.layer_types[-1] == "full_attention"
    # a reply ends at <end_of_turn> as at <eos>, as llama.cpp ends it and Gemma's generation_config says
    generation = json.loads((converted / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, load_tokenizer(converted).convert_tokens_to_ids("<end_of_turn>")]


def test_chatkv_computes_what_transformers_computes_on_the_source_model(model):
    reference = source_model()
    for ids in prompts():
        got = logits_all(model, ids)
        with torch.no_grad():
            want = reference(torch.tensor([ids])).logits[0].float()
        assert (got - want).abs().max().item() < 1e-4, (got - want).abs().max().item()
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_conversion_computes_what_llama_cpp_computes(model, reference):
    """llama.cpp's own logits on the file after every token of each prompt (past the window), within
    the gate of the other architectures (llama.cpp rounds activations to 8 bits for Q8_0 products)."""
    logits, _ = reference
    d, top = [], []
    for i, ids in enumerate(prompts()):
        got, want = logits_all(model, ids), logits[f"{i}.logits"]
        d.append((got - want).abs().max(-1).values)
        top.append((got.argmax(-1) == want.argmax(-1)).float())
    d = torch.cat(d)
    mean, worst, agree = d.mean().item(), d.max().item(), torch.cat(top).mean().item()
    assert mean < 0.4 and worst < 0.8 and agree >= 0.95, (mean, worst, agree)


def mean_gap(model, logits) -> float:
    return (
        torch.cat(
            [(logits_all(model, ids) - logits[f"{i}.logits"]).abs().max(-1).values for i, ids in enumerate(prompts())]
        )
        .mean()
        .item()
    )


@pytest.mark.parametrize(
    "misreading",
    [
        {"sliding_window": 4096},  # no sliding window (measured 3.7 from llama.cpp)
        {"rope_parameters": "full for both"},  # the sliding layers with the full layers' RoPE (2.2)
        {"rope_parameters": "unscaled"},  # the full layers without the linear scaling (0.43)
        {"final_logit_softcapping": None},  # no softcapping (0.52)
    ],
)
def test_each_field_read_otherwise_is_further_from_llama_cpp(misreading, converted, reference, tmp_path):
    """What the conversion reads from the file shows in llama.cpp's logits: the converted directory is
    within 0.15 of them (measured 0.14), the same weights with one field read otherwise at least twice as far."""
    from chatkv.model.gemma3 import Gemma3Model

    logits, _ = reference
    raw = json.loads((converted / "config.json").read_text())
    right = mean_gap(Gemma3Model(load_config(converted), read_weights(converted), torch.float32), logits)
    rope = raw["rope_parameters"]
    if misreading.get("rope_parameters") == "full for both":
        misreading = {"rope_parameters": {**rope, "sliding_attention": rope["full_attention"]}}
    elif misreading.get("rope_parameters") == "unscaled":
        raw.pop("rope_scaling")
        theta = rope["full_attention"]["rope_theta"]
        misreading = {"rope_parameters": {**rope, "full_attention": {"rope_type": "default", "rope_theta": theta}}}
    (tmp_path / "config.json").write_text(json.dumps({**raw, **misreading}))
    wrong = mean_gap(Gemma3Model(load_config(tmp_path), read_weights(converted), torch.float32), logits)
    assert right < 0.15 and wrong > 2 * right, (right, wrong)


def test_tokenizer_ids_are_llama_cpps(converted, reference):
    _, tokens = reference
    tok = load_tokenizer(converted)
    for i, text in enumerate(tokens["texts"]):
        assert tok.encode(text, add_special_tokens=False) == tokens["special"][i], text
        assert tok.encode(text, add_special_tokens=False, split_special_tokens=True) == tokens["plain"][i], text
        assert tok.encode(text) == tokens["added"][i], text
    marker = tok.encode("<start_of_turn>model\n", add_special_tokens=False)
    assert marker[0] == tok.convert_tokens_to_ids("<start_of_turn>")  # one token
    assert any("<0x" in t for t in tok.convert_ids_to_tokens(tok.encode("日本", add_special_tokens=False)))
    warm = load_tokenizer(converted)  # a later start's tokenizer (chatkv.weights.load_cache): the same ids
    assert [warm.encode(t) for t in tokens["texts"]] == tokens["added"]


def test_an_engine_answers_from_the_gguf_file_as_transformers_does(tmp_path):
    from chatkv.engine.core import Engine
    from chatkv.engine.sampling import SamplingParams
    from chatkv.model.gemma3 import Gemma3Model

    config = EngineConfig(data_dir=str(tmp_path / "data"), dtype="float32")
    engine = Engine.from_pretrained(str(FIXTURE), progress=False, **config.__dict__)
    try:
        assert isinstance(engine.model, Gemma3Model)
        assert engine.eos_ids == {1, engine.tokenizer.convert_tokens_to_ids("<end_of_turn>")}
        ids = engine.encode_chat([{"role": "user", "content": "Name a class attribute."}])
        assert ids[:2] == [2, engine.tokenizer.convert_tokens_to_ids("<start_of_turn>")]  # <bos>, the template's turn
        out = engine.generate(ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        want = source_model().generate(
            torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False, eos_token_id=None
        )
        assert out.token_ids == want[0, len(ids) :].tolist()
    finally:
        engine.close()
