"""Write the K-quant fixtures tests/weights/test_gguf_kquants.py reads: a tiny llama GGUF quantised by
llama.cpp's own ``llama-quantize`` (no one here wrote the quantiser), and llama.cpp's logits on it.

    # llama-quantize from the llama.cpp tree inside llama-cpp-python 0.3.36's sdist
    # (../shared/notes/peers.md: cmake configure with -DBUILD_SHARED_LIBS=ON, then
    # --target llama-quantize llama); the logits through the sdist's own Python package:
    LLAMA_CPP_LIB_PATH=$TREE/build/bin PYTHONPATH=$SDIST:<dir with diskcache> \
        .venv/bin/python tests/support/kquant_fixtures.py $TREE/build/bin/llama-quantize

Rerunning it writes the same bytes (seeded weights; llama-quantize is deterministic).

The model (``write_f16``): 2 layers, hidden 256, 4 heads of 64 (2 KV heads), MLP 256, an
untied output matrix, a byte-level vocabulary of 261 tokens; every width a multiple of 256 so
that llama-quantize uses K-quants and not its 32-block fallbacks. Weights are seeded random
(Student-t, 5 degrees of freedom: heavier tails than a Gaussian, as trained weights have),
written in F16 to a temporary file; only the quantised files are kept:

- ``tiny-Q4_K_M.gguf``, ``tiny-Q5_K_M.gguf``, ``tiny-Q6_K.gguf`` under tests/data/;
- ``tiny-kquants-llama-cpp.safetensors`` (safetensors, never pickle), when ``llama_cpp`` can be
  imported (a llama-cpp-python install, or its sdist's package with ``LLAMA_CPP_LIB_PATH`` naming
  the built libllama): for each file and each of ``PROMPTS`` the next-token logits llama.cpp
  computes after every token (``{stem}.{i}.logits`` [T, vocab]; ids in ``prompt.{i}.ids``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1] / "data"
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K")
REFERENCE = DATA / "tiny-kquants-llama-cpp.safetensors"
N_HEAD, N_KV, HIDDEN, FF, LAYERS, HEAD_DIM = 4, 2, 256, 256, 2, 64
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def fixture(kind: str) -> Path:
    return DATA / f"tiny-{kind}.gguf"


def prompts() -> list[list[int]]:
    """Six seeded prompts of 24..48 byte tokens (ids 3..258: no special tokens)."""
    rng = np.random.default_rng(7)
    return [rng.integers(3, 259, size=int(n)).tolist() for n in rng.integers(24, 49, size=6)]


def write_f16(path: Path) -> None:
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    tokens = SPECIALS + [byte_chars[i] for i in range(256)] + ["Ġt", "he"]
    vocab = len(tokens)
    rng = np.random.default_rng(2026)

    def rand(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_t(5, size=(rows, cols)) * scale / np.sqrt(cols)).astype(np.float16)

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("chatkv tiny k-quant fixture")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(TEMPLATE)
    w.add_tensor("token_embd.weight", rand(vocab, HIDDEN, np.sqrt(HIDDEN)))
    w.add_tensor("output_norm.weight", norm())
    w.add_tensor("output.weight", rand(vocab, HIDDEN, 4.0))
    kv = N_KV * HEAD_DIM
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        for name, (rows, cols) in {
            "attn_q": (HIDDEN, HIDDEN),
            "attn_k": (kv, HIDDEN),
            "attn_v": (kv, HIDDEN),
            "attn_output": (HIDDEN, HIDDEN),
            "ffn_gate": (FF, HIDDEN),
            "ffn_up": (FF, HIDDEN),
            "ffn_down": (HIDDEN, FF),
        }.items():
            # the blocks write small updates into the residual stream, as a trained model's do (a
            # random net of unit gains amplifies any rounding from layer to layer)
            w.add_tensor(
                f"blk.{i}.{name}.weight", rand(rows, cols, 0.5 if name in ("attn_output", "ffn_down") else 1.0)
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tensor_types(path: Path) -> dict[str, str]:
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


def llama_cpp_logits():
    """({name: tensor}, llama-cpp-python's version): the reference file's contents."""
    import llama_cpp
    import torch

    out = {}
    for i, ids in enumerate(prompts()):
        out[f"prompt.{i}.ids"] = torch.tensor(ids, dtype=torch.int32)
    for kind in TYPES:
        llm = llama_cpp.Llama(
            model_path=str(fixture(kind)), n_ctx=128, n_threads=2, n_batch=64, logits_all=True, verbose=False
        )
        for i, ids in enumerate(prompts()):
            llm.reset()
            llm.eval(ids)
            out[f"{kind}.{i}.logits"] = torch.from_numpy(
                np.array(llm.scores[: len(ids)], dtype=np.float32)
            ).contiguous()
        del llm
    return out, llama_cpp.__version__


def main(quantize: str) -> None:
    DATA.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        f16 = Path(tmp) / "tiny-F16.gguf"
        write_f16(f16)
        for kind in TYPES:
            subprocess.run([quantize, str(f16), str(fixture(kind)), kind, "1"], check=True, stdout=subprocess.DEVNULL)
            print(kind, fixture(kind).stat().st_size, json.dumps(tensor_types(fixture(kind))))
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama_cpp not importable: no reference logits written")
        return
    from safetensors.torch import save_file

    tensors, version = llama_cpp_logits()
    save_file(tensors, str(REFERENCE), metadata={"llama_cpp_python": version})
    print("wrote", REFERENCE, REFERENCE.stat().st_size)


if __name__ == "__main__":
    main(sys.argv[1])
