"""A GGUF file's tensors as a converted directory keeps them: the file's own numbers, written one
tensor at a time, and decoded to float only when a float weight is asked for.

(Past ~400 lines on purpose: the directory's three tensor files are one layout, written by
``write_tensors`` and read back by ``decoded_weights`` and ``Q4File``; split, each half would
restate the other's names, dtypes and scale fields.)

A converted directory (chatkv.weights.gguf.convert_gguf) holds three tensor files:

- ``model.safetensors``: the float tensors (F32/F16/BF16 in the file: the norms, any float
  projection), in the directory's dtype, Hugging Face names;
- ``QUANT_FILE``: the 4-bit tensors (Q4_0, Q4_1, Q4_K): codes two a byte along the row (the int4
  kernel's packing is made from them without unpacking), and the blocks' own scale fields
  (``_Q4_PARTS``), from which each group of 32's float32 scale and minimum are computed when read,
  as chatkv.weights.quantised.from_gguf_blocks computes them;
- ``BLOCKS_FILE``: every other quantised tensor (Q5_*, Q6_K, Q8_0, IQ4_*, ...: the embeddings, a
  Q4_K_M's wider projections) as the file's bytes, each row's blocks as they are, rows in Hugging
  Face order.

No tensor is kept twice, so the directory is about the GGUF's size. ``decoded_weights`` gives the
name of every tensor of the last two files and decodes it to the directory's float dtype when it
is read (chatkv.weights.loading.read_weights merges them with ``model.safetensors``): the float
weights a ``--weights bf16`` run or the int8 mode needs are made at load, exactly as a stored
float copy would hold them (bf16 of the exact float32 decoding).

Conversion memory: ``write_tensors`` knows every output's dtype and shape from the file's tensor
index before it decodes any, so it writes each file's header first and then each tensor as it
is made (chatkv.storage.tensor_file): one tensor in memory at a time, whatever the model's size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from chatkv.errors import ModelNotFound, UnsupportedModel
from chatkv.storage.tensor_file import TensorFileWriter
from chatkv.weights.quantised import GROUP, Q4Weight, dequantize_gguf_blocks, from_gguf_blocks, kquant_scale_min

__all__ = [
    "QUANT_FILE",
    "BLOCKS_FILE",
    "Q4_TYPES",
    "DECODED_TYPES",
    "write_tensors",
    "decoded_weights",
    "read_q4",
    "read_wide",
    "Q4File",
    "ForgettableWeights",
]

#: The GGUF's 4-bit projection weights as stored (codes, scale, minimum per group of 32; rows in
#: Hugging Face order), for ``weights=int4`` (chatkv.weights.quantised)
QUANT_FILE = Path("quantized") / "gguf-q4.safetensors"
#: The GGUF's other quantised tensors, each row's bytes as the file has them (rows in Hugging Face order)
BLOCKS_FILE = Path("quantized") / "gguf-blocks.safetensors"
#: GGUF types whose numbers are int4 groups of 32 as stored: kept exactly (Q4_K's sub-blocks are
#: such groups, with scale d * sc and minimum -dmin * m: chatkv.weights.quantised.from_gguf_blocks)
Q4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
#: Wider types (a Q4_K_M keeps attn_v and ffn_down of some layers and the output in Q6_K;
#: Q5_0/Q5_1 are llama-quantize's fallback for rows that are not whole 256-blocks): the int4 mode
#: computes a projection group holding one in int8 per channel; what that costs against int4
#: groups: docs/reference/weights.md, "GGUF K-quants".
WIDE_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")
#: decoded by chatkv.weights.quantised (bit for bit as gguf's reference: tests/weights/test_gguf_kquants.py,
#: tests/weights/test_gguf_quant_types.py for the non-linear IQ4 types, which are not int4 groups: the int4
#: mode computes a group holding one in int8, as a wider type's); any other quantised type is decoded by
#: gguf's own reference
DECODED_TYPES = Q4_TYPES + WIDE_TYPES + ("IQ4_NL", "IQ4_XS")
_FLOAT_TYPES = ("F32", "F16", "BF16")
#: rows of a quantised tensor decoded at a time when it is read (``decoded_weights``)
DECODE_ROWS = 2048
_DTYPE_JSON = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class _Planned:
    tensor: Any  # the GGUFReader tensor
    name: str  # Hugging Face name, without "model."
    shape: tuple[int, ...]  # logical shape, torch order
    kind: str  # "float" | "q4" | "blocks"
    heads: int | None  # rotary rows to put back in Hugging Face order (llama.cpp's permutation), or None


def _shape(tensor: Any) -> tuple[int, ...]:
    # GGUF lists dims innermost-first (ggml "ne"); torch wants them reversed.
    return tuple(int(d) for d in reversed(list(tensor.shape)))


def _rotary_order(rows: int, heads: int, unpermute: Callable) -> np.ndarray:
    return unpermute(np.arange(rows)[:, None], heads)[:, 0]


#: What ``QUANT_FILE`` keeps of each 4-bit type besides its codes: the block's own scale fields, in
#: their own dtype, as (suffix, dtype, weights per value). A group of 32's float32 scale and minimum
#: are computed from them when read (``q4_weight``), exactly as from_gguf_blocks computes them.
_Q4_PARTS = {
    "Q4_0": [(".d", torch.float16, 32)],
    "Q4_1": [(".d", torch.float16, 32), (".m", torch.float16, 32)],
    "Q4_K": [
        (".d", torch.float16, 256),
        (".dmin", torch.float16, 256),
        (".sc", torch.uint8, 32),
        (".mn", torch.uint8, 32),
    ],
}


def _q4_scales(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The scale fields (``_Q4_PARTS``) of a 4-bit tensor's blocks ``raw`` (``[N, bytes per row]``)."""
    n, k = shape
    per, nbytes = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}[kind]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // per, nbytes)

    def f16(a: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(blocks[..., a : a + 2]).view(np.float16)[..., 0].copy())

    if kind == "Q4_0":
        return {".d": f16(0)}
    if kind == "Q4_1":
        return {".d": f16(0), ".m": f16(2)}
    sc, mn = kquant_scale_min(blocks[..., 4:16])  # [N, K/256, 8]
    return {".d": f16(0), ".dmin": f16(2), ".sc": sc.reshape(n, k // GROUP), ".mn": mn.reshape(n, k // GROUP)}


def q4_weight(codes: torch.Tensor, parts: dict[str, torch.Tensor]) -> Q4Weight:
    """A Q4Weight from its codes and the scale fields ``QUANT_FILE`` keeps (``_Q4_PARTS``; or the
    float32 ``.scale`` and ``.minimum`` themselves), the numbers from_gguf_blocks gives."""
    n = codes.shape[0]
    if ".scale" in parts:
        return Q4Weight(codes, parts[".scale"], parts[".minimum"])
    d = parts[".d"].float()
    if ".sc" in parts:  # Q4_K: w = (d * sc) * q - (dmin * m) per sub-block of 32
        dmin = parts[".dmin"].float()
        sc, mn = parts[".sc"].view(n, d.shape[1], 8), parts[".mn"].view(n, d.shape[1], 8)
        scale = (d[..., None] * sc.float()).reshape(n, -1)
        return Q4Weight(codes, scale, -(dmin[..., None] * mn.float()).reshape(n, -1))
    if ".m" in parts:  # Q4_1: w = d * q + m
        return Q4Weight(codes, d, parts[".m"].float())
    return Q4Weight(codes, d, d * -8.0)  # Q4_0: w = (q - 8) * d; -8d is exact


def _drop_pages(reader: Any) -> None:
    """Let the pages of the GGUF file read so far leave this process's resident memory (they stay
    in the page cache): a mapped file's pages count in the process's RSS once touched, so reading
    a 1 GB file through its mapping would leave 1 GB resident by the end of the conversion."""
    import mmap

    m = getattr(getattr(reader, "data", None), "_mmap", None)  # numpy.memmap keeps its mmap here
    if m is None or not hasattr(m, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    try:
        m.madvise(mmap.MADV_DONTNEED)
    except (OSError, ValueError):  # a closed mapping, an unsupported platform: only memory
        pass


def write_tensors(
    reader: Any,
    out: Path,
    dtype: torch.dtype,
    hf_name: Callable[[str], str],
    rotary_heads: Callable[[str], int | None],
    unpermute: Callable[[np.ndarray, int], np.ndarray],
    dequantize: Callable[[Any], np.ndarray],
    report: Callable[[int], None],
) -> set[str]:
    """Write the tensors of ``reader`` (a GGUFReader) into the directory ``out`` as the module
    docstring lays them out; returns the Hugging Face names written (``model.`` prefixed as in
    ``model.safetensors``). ``hf_name``, ``rotary_heads``, ``unpermute`` and ``dequantize`` are the
    converter's mapping of names, of llama.cpp's rotary row order, and its float decoding of one
    tensor; ``report(done)`` is called after each tensor."""
    plans: list[_Planned] = []
    for t in reader.tensors:
        shape = _shape(t)
        kind = t.tensor_type.name
        name = hf_name(t.name)
        if kind in _FLOAT_TYPES or len(shape) != 2:
            how = "float"
        elif kind in Q4_TYPES:
            how = "q4"
        else:
            how = "blocks"
        plans.append(_Planned(t, name, shape, how, rotary_heads(t.name)))
    for p in plans:
        if p.heads is not None and p.shape[0] % (2 * p.heads):
            raise UnsupportedModel(
                f"attention weight {p.tensor.name} with {p.shape[0]} rows does not split into {p.heads} heads"
            )
        if p.kind == "q4" and p.shape[1] % GROUP:
            raise UnsupportedModel(
                f"4-bit tensor {p.tensor.name} of {p.shape[1]} columns is not whole groups of {GROUP}"
            )

    def short(p: _Planned) -> str:
        return p.name.removeprefix("model.")

    floats = [p for p in plans if p.kind == "float"]
    q4s = [p for p in plans if p.kind == "q4"]
    blocks = [p for p in plans if p.kind == "blocks"]
    wide = {short(p): p.tensor.tensor_type.name for p in blocks if p.name.startswith("model.layers.")}
    writers: dict[str, TensorFileWriter] = {}
    try:
        writers["float"] = TensorFileWriter(
            out / "model.safetensors", [(p.name, dtype, p.shape) for p in floats], {"format": "pt"}
        )
        if q4s or blocks:
            (out / QUANT_FILE).parent.mkdir(mode=0o700, exist_ok=True)
        if q4s:
            specs = []
            for p in q4s:
                n, k = p.shape
                specs.append((short(p) + ".codes", torch.uint8, (n, k // 2)))
                specs += [
                    (short(p) + part, dt, (n, k // per)) for part, dt, per in _Q4_PARTS[p.tensor.tensor_type.name]
                ]
            # "wide": the projections the int4 mode does not find here, for a loader to route elsewhere (int8)
            meta = {"format": "chatkv-q4", "group": "32", "wide": json.dumps(wide, sort_keys=True)}
            writers["q4"] = TensorFileWriter(out / QUANT_FILE, specs, meta)
        if blocks:
            types = {short(p): [p.tensor.tensor_type.name, *p.shape] for p in blocks}
            specs = [(short(p), torch.uint8, tuple(np.asarray(p.tensor.data).shape)) for p in blocks]
            for p, (_, _, raw) in zip(blocks, specs):
                if len(raw) != 2 or raw[0] != p.shape[0]:
                    raise UnsupportedModel(f"GGUF tensor {p.tensor.name} has {raw} bytes for shape {p.shape}")
            meta = {"format": "chatkv-gguf-blocks", "types": json.dumps(types, sort_keys=True)}
            writers["blocks"] = TensorFileWriter(out / BLOCKS_FILE, specs, meta)
        # each file's tensors in its own order, files interleaved in the reader's order
        done = 0
        for p in plans:
            if p.kind == "float":
                w = dequantize(p.tensor)
                if p.heads is not None:
                    w = unpermute(w, p.heads)
                writers["float"].write(p.name, torch.from_numpy(np.ascontiguousarray(w)).to(dtype))
            elif p.kind == "q4":
                q = from_gguf_blocks(p.tensor.tensor_type.name, p.tensor.data, p.shape)
                order = None if p.heads is None else _rotary_order(p.shape[0], p.heads, unpermute)
                if order is not None:
                    q = q.rows(order)
                writers["q4"].write(short(p) + ".codes", q.codes[:, 0::2] | (q.codes[:, 1::2] << 4))  # two a byte
                for part, value in _q4_scales(p.tensor.tensor_type.name, p.tensor.data, p.shape).items():
                    writers["q4"].write(short(p) + part, value if order is None else value[order])
            else:
                raw = np.asarray(p.tensor.data)
                if p.heads is not None:
                    raw = raw[_rotary_order(p.shape[0], p.heads, unpermute)]
                writers["blocks"].write(short(p), np.asarray(raw, dtype=np.uint8))
            done += 1
            _drop_pages(reader)
            report(done)
        for w in writers.values():
            w.close()
    except BaseException:
        for w in writers.values():
            w.abandon()
        raise
    return {p.name for p in plans}


# --------------------------------------------------------------------------- reading


def _dir_dtype(model_dir: Path) -> torch.dtype:
    try:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return torch.float32
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") if isinstance(cfg, dict) else None
    return _DTYPE_JSON.get(dtype, torch.float32)


def _unreadable(path: Path, model_dir: Path, e: BaseException) -> ModelNotFound:
    return ModelNotFound(
        f"the quantised weights '{path}' are unreadable ({type(e).__name__}: {e}); "
        f"delete '{model_dir}' to convert the model again"
    )


def decode_blocks(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    """float32 ``[N, K]`` of a GGUF tensor's rows of blocks ``raw`` (``[N, bytes per row]``)."""
    if kind in DECODED_TYPES:
        return dequantize_gguf_blocks(kind, raw, shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(np.asarray(dequantize(raw, GGMLQuantizationType[kind]), dtype=np.float32).reshape(shape))


class _Decoded:
    """A quantised tensor's decoding to float: ``()`` for the whole, ``(rows=(a, b))`` for rows
    ``a:b`` alone (chatkv.weights.loading's ``read(name, rows)``)."""

    takes_rows = True

    def __init__(self, decode: Callable[..., torch.Tensor], name: str):
        self.decode, self.name = decode, name

    def __call__(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        return self.decode(self.name, rows)


def decoded_weights(model_dir: str | Path) -> dict[str, Callable[[], torch.Tensor]]:
    """Every tensor of a converted directory's ``QUANT_FILE`` and ``BLOCKS_FILE`` (names without
    ``model.``) -> a function that reads it and decodes it to the directory's float dtype; empty
    for a directory without them. The files' headers are read here: one that is not whole fails
    with ModelNotFound naming it."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    out: dict[str, Callable[[], torch.Tensor]] = {}
    dtype = _dir_dtype(model_dir)
    q4_path, blocks_path = model_dir / QUANT_FILE, model_dir / BLOCKS_FILE
    if q4_path.is_file():
        q4 = Q4File(q4_path, model_dir)

        def q4_float(name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
            packed, scale, minimum = q4.parts(name)
            lo, hi = rows or (0, packed.shape[0])
            result = torch.empty(hi - lo, packed.shape[1] * 2, dtype=dtype)
            for a in range(lo, hi, DECODE_ROWS):  # in row chunks, as ``read`` below
                b = min(a + DECODE_ROWS, hi)
                codes = torch.stack((packed[a:b] & 0x0F, packed[a:b] >> 4), dim=-1).reshape(b - a, -1)
                result[a - lo : b - lo] = Q4Weight(codes, scale[a:b], minimum[a:b]).dequantize()
            return result

        for name in q4.keys():
            out[name] = _Decoded(q4_float, name)
    if blocks_path.is_file():
        try:
            with safe_open(str(blocks_path), framework="pt") as st:
                types = json.loads((st.metadata() or {}).get("types", "{}"))
                names = set(st.keys())
        except Exception as e:  # SafetensorError, OSError, bad JSON
            raise _unreadable(blocks_path, model_dir, e) from e

        def read(name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
            kind, n, k = types[name]
            lo, hi = rows or (0, int(n))
            k = int(k)
            try:
                with safe_open(str(blocks_path), framework="np") as st:
                    raw = st.get_slice(name)[lo:hi]  # whole rows of blocks: each row decodes alone
                # in row chunks straight into the result: decoding a 128k-row embedding whole makes
                # several float32 temporaries of its full size
                result = torch.empty(hi - lo, k, dtype=dtype)
                for a in range(0, hi - lo, DECODE_ROWS):
                    b = min(a + DECODE_ROWS, hi - lo)
                    result[a:b] = decode_blocks(kind, raw[a:b], (b - a, k))
            except Exception as e:  # changed or damaged since it was opened, an unknown type
                raise _unreadable(blocks_path, model_dir, e) from e
            return result

        for name in sorted(names):
            if name not in types:
                raise _unreadable(blocks_path, model_dir, KeyError(f"{name} has no type"))
            out[name] = _Decoded(read, name)
    return out


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
        raise _unreadable(path, Path(model_dir), e) from e


def read_q4(model_dir: str | Path) -> "Q4File | dict[str, Q4Weight]":
    """The 4-bit weights a converted GGUF directory keeps (name without ``model.`` -> Q4Weight);
    empty when it has none (a Hugging Face directory, a GGUF without Q4 tensors). A mapping that
    reads each weight from the file when it is asked for (``Q4File``), so that a loader taking
    them one projection at a time never holds them all. A file that is not whole fails here."""
    path = Path(model_dir) / QUANT_FILE
    if not path.is_file():
        return {}
    return Q4File(path, model_dir)


class ForgettableWeights:
    """4-bit weights by name, each read from its files by ``weight(name)`` when asked for and never
    kept, with the names a loader may forget once it is done with one (``del``, ``pop``). The
    mapping part of ``Q4File`` and chatkv.weights.gptq_awq's ``CheckpointQ4``; a subclass fills
    ``_names`` and gives ``weight``."""

    _names: dict[str, None]

    def weight(self, name: str) -> Q4Weight:
        raise NotImplementedError

    def __getitem__(self, name: str) -> Q4Weight:
        if name not in self._names:
            raise KeyError(name)
        return self.weight(name)

    def get(self, name: str, default=None):
        return self[name] if name in self._names else default

    def pop(self, name: str, *default):
        value = self[name] if name in self._names or not default else default[0]
        self._names.pop(name, None)
        return value

    def __delitem__(self, name: str) -> None:
        """Forget ``name`` without reading it (a loader done with it)."""
        del self._names[name]

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


class Q4File(ForgettableWeights):
    """The 4-bit weights of a ``QUANT_FILE``, read one at a time: ``q4[name]`` reads that weight's
    codes (two a byte in the file), scales and minimums; ``pop`` also forgets the name. Nothing is
    cached: each access opens the file, copies that weight's tensors out of its mapping and closes
    it again (the page cache keeps the bytes), so the pages read never stay in the process's
    resident memory: a model's whole 4-bit file would, while one mapping of it stayed open."""

    def __init__(self, path: Path, model_dir: str | Path):
        self.path, self.model_dir = path, model_dir
        self._parts_of: dict[str, list[str]] = {}  # weight -> its tensors in the file (".codes", scales)
        with self._open() as st:
            for k in st.keys():
                self._parts_of.setdefault(k.rsplit(".", 1)[0], []).append(k)
        self._names = dict.fromkeys(sorted(self._parts_of))

    def _open(self):
        from safetensors import safe_open

        try:
            return safe_open(str(self.path), framework="pt")
        except Exception as e:  # SafetensorError, OSError: truncated, not safetensors
            raise self._unreadable(e) from e

    def _unreadable(self, e: BaseException) -> ModelNotFound:
        return ModelNotFound(
            f"the 4-bit weights '{self.path}' are unreadable ({type(e).__name__}: {e}); "
            f"delete '{self.model_dir}' to convert the model again"
        )

    def parts(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``name``'s codes two a byte (as ``nibbles``), float32 scale and minimum, whether or not
        the name was forgotten."""
        try:
            with self._open() as st:  # copies out of the mapping, closed with it
                parts = {k[len(name) :]: st.get_tensor(k).clone() for k in self._parts_of[name]}
            packed = parts.pop(".codes")
            q = q4_weight(packed, parts)
        except ModelNotFound:
            raise
        except Exception as e:  # SafetensorError, a missing or misshapen part
            raise self._unreadable(e) from e
        return packed, q.scale, q.minimum

    def weight(self, name: str) -> Q4Weight:
        """``name``'s Q4Weight, read whether or not the name was forgotten (a float weight decoded
        from it: ``decoded_weights``)."""
        packed, scale, minimum = self.parts(name)
        codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
        return Q4Weight(codes, scale, minimum)

    def nibbles(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``name``'s codes as the file holds them (uint8 ``[N, K / 2]``, byte ``j`` holding code
        ``2j`` in its low nibble and ``2j + 1`` in its high one), scale and minimum
        (chatkv.weights.quantised.repack_nibbles packs them for the kernel without unpacking them)."""
        if name not in self._names:
            raise KeyError(name)
        return self.parts(name)
