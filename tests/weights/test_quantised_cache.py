"""What a load quantises is kept for the next load of the same model in the same mode
(chatkv.weights.quantised_cache): the second load quantises nothing and holds the same numbers.

The model is the packaged default one in ``weights=int8`` (every projection and the output matrix
quantised from the float weights on load), with the user cache directory in a temporary one.
"""

from __future__ import annotations

import torch

from chatkv.model.forward import LlamaModel
from chatkv.weights import quantised as quantised_module


def _load(model_dir, weights="int8", head="int8"):
    return LlamaModel.from_pretrained(model_dir, dtype=torch.bfloat16, weights_mode=weights, head_mode=head)


def _codes(model) -> list[torch.Tensor]:
    out = []
    for layer in model.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            out += [lin.codes, lin.scales] if hasattr(lin, "codes") else [lin.packed, lin.scales_zeros]
    head = getattr(model.lm_head, "head", model.lm_head)
    return out + ([head.codes, head.scales] if hasattr(head, "codes") else [])


def _float_dir(model_dir, out):
    """A plain Hugging Face directory of the model's float weights (no quantised files)."""
    import shutil

    from safetensors.torch import save_file

    from chatkv.weights.loading import read_weights

    out.mkdir()
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "chatkv-converted.json":
            shutil.copy(f, out / f.name)
    weights = read_weights(model_dir)
    save_file({"model." + n: weights.read(n).contiguous() for n in list(weights)}, str(out / "model.safetensors"))
    return out


def _count_quantising(monkeypatch) -> list[str]:
    calls = []
    for name in ("quantize_int8", "quantize_int4"):
        real = getattr(quantised_module, name)
        monkeypatch.setattr(
            "chatkv.model.forward." + name, lambda w, *a, _real=real, _name=name: calls.append(_name) or _real(w, *a)
        )
    return calls


def test_a_second_load_quantises_nothing_and_holds_the_same_numbers(default_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CHATKV_CACHE_DIR", str(tmp_path / "cache"))
    calls = _count_quantising(monkeypatch)
    first = _codes(_load(default_model_dir))
    assert calls.count("quantize_int8") == 30 * 4 + 1  # every projection group and the output matrix
    files = list((tmp_path / "cache" / "quantised").glob("*.safetensors"))
    assert len(files) == 1 and files[0].stat().st_mode & 0o077 == 0
    calls.clear()
    second = _codes(_load(default_model_dir))
    assert calls == []
    assert len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(first, second))


def test_each_mode_has_its_own_file_and_int4_from_float_is_kept_too(default_model_dir, tmp_path, monkeypatch):
    """A float directory in int4 (the default model's decoded float weights): quantised once, then read."""
    monkeypatch.setenv("CHATKV_CACHE_DIR", str(tmp_path / "cache"))
    d = _float_dir(default_model_dir, tmp_path / "float")
    calls = _count_quantising(monkeypatch)
    first = _codes(_load(d, "int4", "float"))
    assert calls.count("quantize_int4") == 30 * 7
    calls.clear()
    second = _codes(_load(d, "int4", "float"))
    assert calls == [] and all(torch.equal(a, b) for a, b in zip(first, second))
    _load(d, "int8", "float")
    assert len(list((tmp_path / "cache" / "quantised").glob("*.safetensors"))) == 2


def test_a_damaged_file_is_quantised_again_and_rewritten(default_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CHATKV_CACHE_DIR", str(tmp_path / "cache"))
    first = _codes(_load(default_model_dir))
    (f,) = (tmp_path / "cache" / "quantised").glob("*.safetensors")
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    calls = _count_quantising(monkeypatch)
    again = _codes(_load(default_model_dir))
    assert calls.count("quantize_int8") == 30 * 4 + 1
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    calls.clear()
    _load(default_model_dir)
    assert calls == []  # rewritten whole


def test_an_unwritable_cache_costs_only_the_quantising(default_model_dir, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "quantised").write_text("a file where the directory would go")  # as root, modes do not stop writes
    monkeypatch.setenv("CHATKV_CACHE_DIR", str(cache))
    model = _load(default_model_dir)
    assert model.layers[0].qkv.codes.dtype == torch.int8
    assert (cache / "quantised").read_text() == "a file where the directory would go"


def test_turned_off_it_writes_nothing(default_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CHATKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CHATKV_QUANTISED_CACHE", "0")
    _load(default_model_dir)
    assert not (tmp_path / "cache" / "quantised").exists()
