"""The first load of a GGUF model (preparation, load, weight self-check) stays within the warm load's
memory plus one layer's float32 weights: nothing holds the whole model in float, at any step.

The model is made here with gguf's own writer and quantiser: 8 layers of width 1024 and MLP 6144
(about 185M parameters in the layers, Q4_0: 105 MB), so that one layer's float32 weights (92 MiB)
stand out from the process's own noise (peaks vary by about 50 MiB from run to run on 2 busy
cores), and a whole-model float copy (740 MB in float32, 370 MB in bf16) could not hide in the
bound. Each load runs in a process of its own
(tests/support/first_load_child.py), which reports its peak resident set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
HIDDEN, FF, LAYERS, HEADS, VOCAB = 1024, 6144, 8, 16, 512
LAYER_PARAMS = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * FF


def write_model(path: Path) -> None:
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    rng = np.random.default_rng(11)
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chars[i] for i in range(256)] + ["Ġt"]
    tokens += [f"w{i}" for i in range(VOCAB - len(tokens))]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (VOCAB - 3))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def q4(rows: int, cols: int) -> np.ndarray:
        return quantize((rng.standard_normal((rows, cols)) * 0.02).astype(np.float32), T.Q4_0)

    w.add_tensor(
        "token_embd.weight", quantize(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), T.Q8_0), raw_dtype=T.Q8_0
    )
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        for name, (rows, cols) in {
            "attn_q": (HIDDEN, HIDDEN),
            "attn_k": (HIDDEN, HIDDEN),
            "attn_v": (HIDDEN, HIDDEN),
            "attn_output": (HIDDEN, HIDDEN),
            "ffn_gate": (FF, HIDDEN),
            "ffn_up": (FF, HIDDEN),
            "ffn_down": (HIDDEN, FF),
        }.items():
            w.add_tensor(f"blk.{i}.{name}.weight", q4(rows, cols), raw_dtype=T.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def load(model: Path, tmp: Path) -> dict:
    env = dict(os.environ, CHATKV_HOME=str(tmp / "home"), CHATKV_CACHE_DIR=str(tmp / "cache"))
    out = subprocess.run(
        [sys.executable, "-m", "tests.support.first_load_child", str(model), str(tmp / "home")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_first_load_needs_at_most_one_layer_of_float32_more_than_a_warm_one(tmp_path):
    model = tmp_path / "mem-Q4_0.gguf"
    write_model(model)
    first = load(model, tmp_path)
    warm = load(model, tmp_path)
    assert first["weights"] == warm["weights"] == "int4"
    assert first["generated"] == warm["generated"]
    layer_f32 = LAYER_PARAMS * 4
    extra = first["peak"] - warm["peak"]
    print(
        f"peak RSS: first {first['peak'] / 2**20:.0f} MiB, warm {warm['peak'] / 2**20:.0f} MiB, "
        f"one layer float32 {layer_f32 / 2**20:.0f} MiB"
    )
    assert extra <= layer_f32, (first, warm, layer_f32)
