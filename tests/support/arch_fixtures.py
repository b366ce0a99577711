"""Write the GGUF fixtures tests/weights/test_gguf_archs.py reads: one tiny model of each llama-family
architecture chatkv converts, made by transformers, turned into GGUF by llama.cpp's own
``convert_hf_to_gguf.py``, quantised by its own ``llama-quantize``, and llama.cpp's logits on them.

    TREE=/path/to/llama.cpp    # built: build/bin/llama-quantize and build/bin/libllama.so
    PYTHONPATH=<dir with sentencepiece> .venv/bin/python tests/support/arch_fixtures.py $TREE

(the llama.cpp tree inside llama-cpp-python 0.3.36's sdist; gcc compiles tests/support/llama_logits.c
against it for the logits.)

The models (``MODELS``): ``llama3`` (Llama 3.1/3.2-like: llama3 RoPE scaling with Llama 3.1's
factors over a short original context, tied output, BPE vocabulary), ``qwen2`` (Qwen2.5-like: q/k/v
biases, untied output), ``qwen3`` (Qwen3-like: q/k norms, a head_dim other than hidden / heads,
tied) and ``mistral`` (MistralForCausalLM with a Mistral-Nemo-like head_dim and a SentencePiece
vocabulary; llama.cpp writes it as arch ``llama``).
Each is 2 layers, float32, with seeded weights (``source_weights``: numpy's PCG64, so the tests
rebuild the same source model without any file). The 2-D weights are integers of at most 127
times a power of two per 32-wide block, one entry of each block being +-127: llama.cpp's Q8_0
holds them exactly (its scale is the block's maximum / 127), so the Q8_0 file *is* the float
model and the tests can compare the conversion with the source weights bit for bit.

Written to tests/data/:

- ``arch-{name}-Q8_0.gguf`` for each model (convert_hf_to_gguf at F16, then llama-quantize Q8_0;
  checked here to dequantise to the source weights exactly);
- ``arch-{name}-Q4_0.gguf`` for ``Q4_0_MODELS`` (4-bit groups of 32, the int4 path);
- ``arch-llama-cpp.safetensors``: for each file and each of ``prompts()`` the next-token logits
  llama.cpp computes after every token (``{name}-{type}.{i}.logits`` [T, vocab]), through its C
  API (llama_logits.c: without repacked weight buffers, whose AMX path crashes on this CPU).

Only the converter's BPE pre-tokenizer detection is bypassed (it hashes the tokenizer's output
on a fixed text and knows only published tokenizers): the fixture names the pre-tokenizer of the
model it imitates. Everything written to the tensors and the model metadata is the converter's.
Rerunning it writes the same weights (tokenizer training is deterministic as well).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1] / "data"
REFERENCE = DATA / "arch-llama-cpp.safetensors"
VOCAB = 320
LAYERS = 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: name -> (transformers config class, its fields, tokenizer kind, the pre-tokenizer it imitates)
MODELS: dict[str, tuple[str, dict, str, str]] = {
    "llama3": (
        "LlamaConfig",
        {
            "hidden_size": 128,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "intermediate_size": 128,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": True,
            # Llama 3.1's factors over an original context of 64 (Meta's is 8192): the prompts' few
            # positions turn the scaled frequencies far enough to tell them from unscaled ones, and
            # 5 of the 32 frequencies fall in the smoothed band
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        "bpe",
        "llama-bpe",
    ),
    "qwen2": (
        "Qwen2Config",
        {
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "bpe",
        "qwen2",
    ),
    "qwen3": (
        "Qwen3Config",
        {
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "intermediate_size": 128,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "bpe",
        "qwen2",
    ),
    "mistral": (
        "MistralConfig",
        {
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "intermediate_size": 128,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": False,
            "sliding_window": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "spm",
        "default",
    ),
}
Q4_0_MODELS = ("qwen2", "qwen3")
SPECIAL_IDS = {"bpe": {"bos_token_id": 1, "eos_token_id": 2}, "spm": {"bos_token_id": 1, "eos_token_id": 2}}


def fixture(name: str, kind: str = "Q8_0") -> Path:
    return DATA / f"arch-{name}-{kind}.gguf"


def prompts() -> list[list[int]]:
    """Two seeded prompts of 14..20 token ids (ids 3..VOCAB - 1: no special tokens)."""
    rng = np.random.default_rng(17)
    return [rng.integers(3, VOCAB, size=int(n)).tolist() for n in rng.integers(14, 21, size=2)]


def hf_config(name: str):
    """The transformers config of the source model (float32, 2 layers, VOCAB tokens)."""
    import transformers

    cls, fields, tok, _ = MODELS[name]
    return getattr(transformers, cls)(
        vocab_size=VOCAB,
        num_hidden_layers=LAYERS,
        rms_norm_eps=1e-5,
        pad_token_id=None,
        **SPECIAL_IDS[tok],
        **fields,
    )


def _exact_q8(rng: np.random.Generator, rows: int, cols: int, gain: float) -> np.ndarray:
    """``rows x cols`` float32 of standard deviation about ``gain / sqrt(cols)`` that Q8_0 holds
    exactly: each 32-wide block is integers in [-127, 127], one of them +-127, times 2**-e."""
    k = np.clip(np.rint(rng.standard_t(5, size=(rows, cols // 32, 32)) * 40), -127, 127) + 0.0  # no -0.0
    at = rng.integers(0, 32, size=(rows, cols // 32))
    sign = np.where(rng.random((rows, cols // 32)) < 0.5, -1.0, 1.0)
    np.put_along_axis(k, at[..., None], (127 * sign)[..., None], axis=2)
    e0 = int(np.rint(-np.log2(gain / (np.sqrt(cols) * 52.0))))
    e = e0 + rng.integers(-1, 2, size=(rows, cols // 32, 1))
    return (k * np.exp2(-e.astype(np.float64))).reshape(rows, cols).astype(np.float32)


def source_weights(name: str) -> dict[str, np.ndarray]:
    """The source model's tensors (Hugging Face names), seeded by the model's name."""
    config = hf_config(name)
    rng = np.random.default_rng(sum(map(ord, name)) * 7919)
    h, ff = config.hidden_size, config.intermediate_size
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d

    def vec(n: int, centre: float, spread: float) -> np.ndarray:
        return (centre + spread * rng.standard_normal(n)).astype(np.float32)

    # a tied embedding is also the output matrix: entries of 3.2 / sqrt(hidden) keep the logits' spread
    # near an untied model's
    embed_gain = 3.2 if config.tie_word_embeddings else np.sqrt(h)
    out = {"model.embed_tokens.weight": _exact_q8(rng, VOCAB, h, embed_gain)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = vec(h, 1.0, 0.1)
        out[p + "post_attention_layernorm.weight"] = vec(h, 1.0, 0.1)
        # the blocks write small updates into the residual stream, as a trained model's do
        for proj, rows, cols, gain in (
            ("self_attn.q_proj", q, h, 1.0),
            ("self_attn.k_proj", kv, h, 1.0),
            ("self_attn.v_proj", kv, h, 1.0),
            ("self_attn.o_proj", h, q, 0.5),
            ("mlp.gate_proj", ff, h, 1.0),
            ("mlp.up_proj", ff, h, 1.0),
            ("mlp.down_proj", h, ff, 0.5),
        ):
            out[f"{p}{proj}.weight"] = _exact_q8(rng, rows, cols, gain)
        if config.model_type == "qwen2":
            for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                out[f"{p}self_attn.{proj}.bias"] = vec(rows, 0.0, 0.3)
        if config.model_type == "qwen3":
            out[p + "self_attn.q_norm.weight"] = vec(d, 1.0, 0.1)
            out[p + "self_attn.k_norm.weight"] = vec(d, 1.0, 0.1)
    out["model.norm.weight"] = vec(h, 1.0, 0.1)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = _exact_q8(rng, VOCAB, h, 4.0)
    return out


def source_model(name: str):
    """The transformers model (float32, eval) holding ``source_weights(name)``."""
    import torch
    from transformers import AutoModelForCausalLM

    config = hf_config(name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = {k: torch.from_numpy(v) for k, v in source_weights(name).items()}
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    return model


# --------------------------------------------------------------------------- writing (llama.cpp needed)


def _text() -> str:
    import pydoc_data.topics as t

    return "\n\n".join(t.topics[k] for k in sorted(t.topics)[:40])


def _save_bpe(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_text()], trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIALS[1], eos_token=SPECIALS[2], chat_template=TEMPLATE
    )
    fast.save_pretrained(str(out))


def _save_spm(out: Path) -> None:
    import sentencepiece as spm

    with tempfile.TemporaryDirectory() as tmp:
        # ASCII text, no byte fallback: the characters and merges fit VOCAB pieces
        (Path(tmp) / "text.txt").write_text(_text().encode("ascii", "ignore").decode(), encoding="utf-8")
        spm.SentencePieceTrainer.train(
            input=str(Path(tmp) / "text.txt"),
            model_prefix=str(out / "tokenizer"),
            vocab_size=VOCAB,
            model_type="bpe",
            byte_fallback=False,
            character_coverage=1.0,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            num_threads=1,
            minloglevel=2,
        )
    (out / "tokenizer.vocab").unlink()
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")


def save_source(name: str, out: Path) -> None:
    """The source model as a Hugging Face directory: weights, config and tokenizer files."""
    model = source_model(name)
    model.save_pretrained(str(out))
    (_save_spm if MODELS[name][2] == "spm" else _save_bpe)(out)


def convert_f16(tree: Path, src: Path, out: Path, pre: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py on ``src`` at F16, told the pre-tokenizer's name."""
    code = (
        "import sys\n"
        f"sys.path[:0] = [{str(tree)!r}, {str(tree / 'gguf-py')!r}]\n"
        "import conversion.base as base\n"
        f"base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}\n"
        "import convert_hf_to_gguf\n"
        f"sys.argv = ['convert_hf_to_gguf.py', {str(src)!r}, '--outtype', 'f16', '--outfile', {str(out)!r}]\n"
        "convert_hf_to_gguf.main()\n"
    )
    env = dict(os.environ, NO_LOCAL_GGUF="")
    env.pop("NO_LOCAL_GGUF")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, stdout=subprocess.DEVNULL)


def _check_exact(f16: Path, q8: Path) -> None:
    """llama-quantize's Q8_0 file holds the F16 file's numbers exactly (the weights are built so)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    wide = {t.name: dequantize(t.data, t.tensor_type) for t in GGUFReader(str(f16)).tensors}
    types = set()
    for t in GGUFReader(str(q8)).tensors:
        types.add(t.tensor_type.name)
        assert np.array_equal(dequantize(t.data, t.tensor_type), wide[t.name]), t.name
    assert "Q8_0" in types, types


def llama_cpp_logits(tree: Path, names) -> dict:
    """llama.cpp's logits on each (name, type) fixture for each of ``prompts()``."""
    files = {f"{name}-{kind}": fixture(name, kind) for name, kind in names}
    return logits_of_files(tree, files, prompts())


def logits_of_files(tree: Path, files: dict[str, Path], cases: list[list[int]]) -> dict:
    """``{"<key>.<i>.logits": [T, vocab]}``: llama.cpp's logits after every token of each of ``cases``
    on each file of ``files`` (key -> GGUF), computed by tests/support/llama_logits.c (llama.cpp's C
    API) built against ``tree``."""
    import torch

    out = {}
    lib = tree / "build" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "llama_logits"
        subprocess.run(
            ["gcc", "-O1", "-o", str(exe), str(Path(__file__).with_name("llama_logits.c"))]
            + [f"-I{tree / 'include'}", f"-I{tree / 'ggml' / 'include'}", f"-L{lib}", "-lllama", f"-Wl,-rpath,{lib}"],
            check=True,
        )
        for key, path in files.items():
            for i, ids in enumerate(cases):
                dump = Path(tmp) / "logits.f32"
                subprocess.run([str(exe), str(path), str(dump), *map(str, ids)], check=True, stderr=subprocess.DEVNULL)
                logits = np.fromfile(dump, dtype=np.float32).reshape(len(ids), -1)
                out[f"{key}.{i}.logits"] = torch.from_numpy(logits.copy())
    return out


def _tree_version(tree: Path) -> str:
    """The llama-cpp-python sdist version whose vendored tree ``tree`` is, when it is one."""
    init = tree.parents[1] / "llama_cpp" / "__init__.py"
    if init.is_file():
        for line in init.read_text().splitlines():
            if line.startswith("__version__"):
                return "llama-cpp-python " + line.split("=")[1].strip().strip('"') + " vendor/llama.cpp"
    return "unknown"


def main(tree: Path) -> None:
    quantize = tree / "build" / "bin" / "llama-quantize"
    DATA.mkdir(exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (_, _, _, pre) in MODELS.items():
            src = Path(tmp) / name
            src.mkdir()
            save_source(name, src)
            f16 = Path(tmp) / f"{name}-F16.gguf"
            convert_f16(tree, src, f16, pre)
            for kind in ("Q8_0",) + (("Q4_0",) if name in Q4_0_MODELS else ()):
                subprocess.run(
                    [str(quantize), str(f16), str(fixture(name, kind)), kind, "1"],
                    check=True,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                written.append((name, kind))
                print(fixture(name, kind).name, fixture(name, kind).stat().st_size)
            _check_exact(f16, fixture(name, "Q8_0"))
    from safetensors.torch import save_file

    save_file(llama_cpp_logits(tree, written), str(REFERENCE), metadata={"llama_cpp": _tree_version(tree)})
    print("wrote", REFERENCE, REFERENCE.stat().st_size)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
