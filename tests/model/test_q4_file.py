"""The converted GGUF's 4-bit file read one weight at a time (chatkv.weights.gguf.Q4File).

Unpacking every 4-bit weight of the file at once (1 byte a code, on top of what is being packed
for the kernel) would make the load's peak hold them all, so ``read_q4`` returns a
mapping that reads a weight when it is asked for, and a loader that forgets a name (``del``) never
reads it. Each weight read is the file's numbers exactly.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from chatkv.errors import ModelNotFound
from chatkv.weights.gguf import QUANT_FILE, Q4File, read_q4
from chatkv.weights.loading import release_freed_memory


@pytest.fixture(scope="module")
def model_dir(default_model_dir):
    return default_model_dir  # the packaged default model, converted once for the run (conftest)


def test_each_weight_is_read_when_asked_for_and_is_the_files_numbers(model_dir, monkeypatch):
    q4 = read_q4(model_dir)
    assert isinstance(q4, Q4File)
    assert len(q4) == 30 * 7 and "layers.0.self_attn.q_proj.weight" in q4 and "embed_tokens.weight" not in q4
    name = "layers.3.mlp.down_proj.weight"
    with safe_open(str(model_dir / QUANT_FILE), framework="pt") as st:
        packed = st.get_tensor(name + ".codes")  # two codes a byte: element 2j low, 2j + 1 high
        d, m = st.get_tensor(name + ".d"), st.get_tensor(name + ".m")  # Q4_1's own f16 fields, as the GGUF has them
        assert sorted(k for k in st.keys() if k.startswith(name + ".")) == [name + p for p in (".codes", ".d", ".m")]
    assert d.dtype == m.dtype == torch.float16 and d.shape == (576, 1536 // 32)
    got = q4[name]
    assert torch.equal(got.codes[:, 0::2], packed & 0x0F) and torch.equal(got.codes[:, 1::2], packed >> 4)
    assert torch.equal(got.scale, d.float()) and torch.equal(got.minimum, m.float())  # w = d * q + m
    assert torch.equal(q4.get(name).codes, got.codes) and q4.get("nothing") is None
    with pytest.raises(KeyError):
        q4["nothing"]
    reads = []
    real = Q4File.nibbles  # every read of the file: q4[name] too
    monkeypatch.setattr(Q4File, "nibbles", lambda self, n: reads.append(n) or real(self, n))
    del q4[name]  # forgotten without reading it
    assert name not in q4 and len(q4) == 30 * 7 - 1 and reads == []
    assert list(q4)[:1] == sorted(q4.keys())[:1]


def test_the_int4_load_reads_each_weight_once_and_forgets_it(model_dir, monkeypatch):
    from chatkv.model.forward import LlamaModel

    reads = []
    real = Q4File.nibbles  # the bytes as stored, repacked for the kernel without unpacking them
    monkeypatch.setattr(Q4File, "nibbles", lambda self, n: reads.append(n) or real(self, n))
    LlamaModel.from_pretrained(model_dir, dtype=torch.bfloat16, weights_mode="int4", head_mode="int8")
    assert sorted(reads) == sorted(read_q4(model_dir).keys())  # each once, one projection at a time


def test_the_file_bytes_repacked_are_the_kernels_packing_of_the_codes(model_dir):
    """The load packs the file's bytes for the kernel directly (chatkv.weights.quantised.int4_from_nibbles):
    the same packed weights, scales and zeros as packing the unpacked codes."""
    from chatkv.weights.quantised import Int4Linear, Q4Weight, int4_from_nibbles

    q4 = read_q4(model_dir)
    names = [f"layers.5.self_attn.{p}_proj.weight" for p in "qkv"]
    fast = int4_from_nibbles([q4.nibbles(n) for n in names])
    parts = [q4[n] for n in names]
    slow = Int4Linear(Q4Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "minimum"))))
    if fast is None:  # this build packs some other way: the load took the codes path
        pytest.skip("torch's int4 packing here is not the layout chatkv.weights.quantised knows")
    assert torch.equal(fast.packed, slow.packed) and torch.equal(fast.scales_zeros, slow.scales_zeros)
    assert fast.out_features == slow.out_features == 576 + 2 * 192


def test_a_damaged_4_bit_file_fails_when_it_is_opened(model_dir, tmp_path):
    import shutil

    d = tmp_path / "model"
    shutil.copytree(model_dir, d)
    q = d / QUANT_FILE
    q.write_bytes(q.read_bytes()[: q.stat().st_size // 2])
    with pytest.raises(ModelNotFound, match="4-bit weights .* unreadable.*convert the model again"):
        read_q4(d)


def test_releasing_freed_memory_is_safe_to_call():
    release_freed_memory()
    release_freed_memory()
