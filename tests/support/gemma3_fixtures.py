"""Write the Gemma 3 GGUF fixture tests/weights/test_gguf_gemma3.py reads: a tiny Gemma3ForCausalLM made by
transformers, turned into GGUF (arch ``gemma3``) by llama.cpp's own ``convert_hf_to_gguf.py``, quantised
by its ``llama-quantize``, with llama.cpp's logits and token ids on it.

    TREE=/path/to/llama.cpp    # built: build/bin/llama-quantize and build/bin/libllama.so
    LLAMA_CPP_LIB_PATH=$TREE/build/bin PYTHONPATH=$SDIST:<dir with sentencepiece> \\
        .venv/bin/python tests/support/gemma3_fixtures.py $TREE

($SDIST: llama-cpp-python 0.3.36's sdist, whose vendor/llama.cpp is $TREE; its Python bindings give the
token ids, with ``vocab_only``; the logits come from tests/support/llama_logits.c as for the other
architectures, tests/support/arch_fixtures.py.)

The model (``CONFIG``): 6 layers, llama.cpp's default pattern of five sliding layers (window
``WINDOW``, shorter than the prompts) and a full one; the full layers' RoPE base 1e6 linearly scaled
by 8 (gemma-3-4b's), the sliding ones' 1e4; GQA (two query heads per KV head) with a head_dim of 32
beside a hidden size of 64; a final logit softcapping of 30 (Gemma 2's, which llama.cpp's gemma3 applies
when the file has one), which bends the larger logits without flattening them; tied output.
``query_pre_attn_scalar`` is head_dim: llama.cpp scales by ``head_dim ** -0.5`` for every Gemma 3 but
the 62-layer 27B, whatever the source config says. The 2-D weights are Q8_0-exact
(arch_fixtures._exact_q8) and the norm weights multiples of 2**-12, so ``1 + w`` (what the converter
stores) is exact in float32 and the conversion must give back the source weights bit for bit.

The tokenizer is a SentencePiece BPE model trained here on Python's pydoc topics with Gemma's
special tokens at Gemma's ids (``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3, then
``<start_of_turn>`` and ``<end_of_turn>`` as user-defined pieces, marked special as Gemma's
tokenizer_config.json marks them), byte fallback on and no dummy prefix, as Gemma's tokenizer.model
is; a real Gemma vocabulary (262k pieces) would not fit a fixture. The converter writes it as the
``llama`` vocabulary with ``add_space_prefix`` off, as for Gemma.

Written to tests/data/: ``gemma3-Q8_0.gguf`` and ``gemma3-llama-cpp.safetensors`` (``{i}.logits``
[T, vocab] after every token of ``prompts()``, and in its metadata ``tokens``: JSON of llama.cpp's
ids for tests/support/tokenizer_fixtures.CORPUS plus ``TEXTS``, special tokens parsed and not, and
with BOS added). Rerunning it writes the same files.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1] / "data"
FIXTURE = DATA / "gemma3-Q8_0.gguf"
REFERENCE = DATA / "gemma3-llama-cpp.safetensors"
VOCAB = 512
LAYERS = 6
WINDOW = 6
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
TURNS = ["<start_of_turn>", "<end_of_turn>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=LAYERS,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    query_pre_attn_scalar=32,
    sliding_window=WINDOW,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
    },
    final_logit_softcapping=30.0,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
#: texts beside the shared corpus: Gemma's turn markers typed in text, and runs of spaces
TEXTS = (
    "<start_of_turn>user\nHi there!<end_of_turn>\n<start_of_turn>model\n",
    "two  spaces   three    four",
    "<bos>text after a typed bos<eos>",
)


def hf_config():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**CONFIG)


def prompts() -> list[list[int]]:
    """Two seeded prompts of 14..20 token ids (ids 6..VOCAB - 1: no special tokens), past the window."""
    rng = np.random.default_rng(23)
    return [rng.integers(6, VOCAB, size=int(n)).tolist() for n in rng.integers(14, 21, size=2)]


def source_weights() -> dict[str, np.ndarray]:
    """The source model's tensors (Hugging Face names), seeded."""
    from tests.support.arch_fixtures import _exact_q8

    config = hf_config()
    rng = np.random.default_rng(3_000_017)
    h, ff, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d

    def norm(n: int) -> np.ndarray:  # Gemma's norms scale by 1 + w; multiples of 2**-12, so 1 + w is exact
        return (np.rint(0.15 * rng.standard_normal(n) * 4096) / 4096).astype(np.float32)

    out = {"model.embed_tokens.weight": _exact_q8(rng, VOCAB, h, 2.0)}  # tied: logits of spread ~3
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm"):
            out[f"{p}{name}.weight"] = norm(h)
        out[p + "post_feedforward_layernorm.weight"] = norm(h)
        out[p + "self_attn.q_norm.weight"] = norm(d)
        out[p + "self_attn.k_norm.weight"] = norm(d)
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
    out["model.norm.weight"] = norm(h)
    return out


def source_model():
    """transformers' Gemma3ForCausalLM (float32, eval, eager attention) holding ``source_weights()``."""
    import torch
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(hf_config()).eval()
    state = {k: torch.from_numpy(v) for k, v in source_weights().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    model.config._attn_implementation = "eager"
    return model


# --------------------------------------------------------------------------- writing (llama.cpp needed)


def _save_tokenizer(out: Path) -> None:
    import sentencepiece as spm

    from tests.support.arch_fixtures import _text

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "text.txt").write_text(_text().encode("ascii", "ignore").decode(), encoding="utf-8")
        spm.SentencePieceTrainer.train(
            input=str(Path(tmp) / "text.txt"),
            model_prefix=str(out / "tokenizer"),
            vocab_size=VOCAB,
            model_type="bpe",
            byte_fallback=True,
            character_coverage=1.0,
            pad_id=0,
            eos_id=1,
            bos_id=2,
            unk_id=3,
            pad_piece=SPECIALS[0],
            eos_piece=SPECIALS[1],
            bos_piece=SPECIALS[2],
            unk_piece=SPECIALS[3],
            user_defined_symbols=TURNS,
            add_dummy_prefix=False,
            remove_extra_whitespaces=False,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            num_threads=1,
            minloglevel=2,
        )
    (out / "tokenizer.vocab").unlink()
    decoder = {
        str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False}
        for i, t in enumerate(SPECIALS + TURNS)
    }
    cfg = {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": decoder,
        "chat_template": TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")


def llama_cpp_ids(path: Path, texts: list[str]) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    out = {
        "texts": texts,
        "special": [llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts],
        "plain": [llm.tokenize(t.encode(), add_bos=False, special=False) for t in texts],
        "added": [llm.tokenize(t.encode(), add_bos=True, special=True) for t in texts],
    }
    del llm
    return out


def main(tree: Path) -> None:
    from safetensors.torch import save_file

    from tests.support.arch_fixtures import _check_exact, _tree_version, convert_f16, logits_of_files
    from tests.support.tokenizer_fixtures import CORPUS

    DATA.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "gemma3"
        src.mkdir()
        source_model().save_pretrained(str(src))
        _save_tokenizer(src)
        f16 = Path(tmp) / "gemma3-F16.gguf"
        convert_f16(tree, src, f16, "default")
        subprocess.run(
            [str(tree / "build" / "bin" / "llama-quantize"), str(f16), str(FIXTURE), "Q8_0", "1"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _check_exact(f16, FIXTURE)
    print(FIXTURE.name, FIXTURE.stat().st_size)
    logits = logits_of_files(tree, {"gemma3": FIXTURE}, prompts())
    tensors = {k.removeprefix("gemma3."): v for k, v in logits.items()}
    tokens = llama_cpp_ids(FIXTURE, list(CORPUS) + list(TEXTS))
    meta = {"llama_cpp": _tree_version(tree), "tokens": json.dumps(tokens, ensure_ascii=False)}
    save_file(tensors, str(REFERENCE), metadata=meta)
    print("wrote", REFERENCE, REFERENCE.stat().st_size)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main(Path(sys.argv[1]))
