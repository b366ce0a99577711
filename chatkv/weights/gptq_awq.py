"""GPTQ and AWQ checkpoints: their own 4-bit weights, computed on chatkv's int4 path as they are.

(Past 400 lines on purpose: the config's validation, the two packed layouts and the reader that
checks a checkpoint's tensors against them are one description of the formats; split, each part
would restate the layouts the others assume.)

A Hugging Face directory whose ``config.json`` has a ``quantization_config`` with ``quant_method``
``gptq`` or ``awq`` stores each quantised projection as 4-bit codes with a scale and a zero point
per group of ``group_size`` inputs: ``w = scale * (code - zero)``. A group of 32, 64, 128, ...
inputs is 1, 2, 4, ... of chatkv's groups of 32 (``chatkv.weights.quantised.Q4Weight``,
``w = code * scale + minimum``) with the same scale and ``minimum = -scale * zero`` (exact in
float32: an f16 scale times an integer of at most 5 bits), so each projection becomes a Q4Weight
of its own codes, scales and zeros: never dequantised and quantised again.

Layouts (int32 words, little-endian; nibble ``i`` of a word is its bits ``4i .. 4i + 3``), as the
formats' packers write them (AutoGPTQ / GPTQModel, and transformers' GPTQ integration through
them; AutoAWQ's GEMM kernels):

- GPTQ: ``qweight`` int32 ``[K / 8, N]``, a word's 8 codes consecutive inputs (word ``r``, nibble
  ``i``: input ``8r + i``); ``qzeros`` int32 ``[G, N / 8]``, 8 consecutive outputs a word;
  ``scales`` ``[G, N]``; ``g_idx`` int32 ``[K]``, each input's group. ``checkpoint_format``
  ``gptq`` (the default, "v1") stores ``zero - 1``, which its kernels read back adding 1 (a stored
  15 is a zero of 16); ``gptq_v2`` stores the zero itself. Symmetric (``sym``) checkpoints store
  the zero 8 like any other, so both read the same way.
- AWQ (``version`` ``gemm``): ``qweight`` int32 ``[K, N / 8]`` and ``qzeros`` int32 ``[G, N / 8]``,
  packed along the outputs in the order ``AWQ_ORDER`` (nibble ``i`` holds output
  ``8c + AWQ_ORDER[i]``); ``scales`` ``[G, N]``; groups are consecutive inputs.

Act order (GPTQ's ``desc_act``): a group's inputs are not consecutive; ``g_idx`` says which group
each is in. Sorted by group (a stable sort of ``g_idx``), the inputs make consecutive groups, so the
projection computes ``x[:, perm] @ W_perm.T``: ``Q4Weight.perm``, which ``Int4Linear`` applies to its
input first. Projections fused into one matmul (q, k, v; gate, up) must share that order. GPTQ
takes it from the Hessian of their common input, so in the checkpoints it makes they do; where
they do not, each run of parts that does is its own linear (``fused``, ``JoinedLinear``).

Everything else (embeddings, norms, biases, an unquantised ``lm_head``) is a float tensor of the
same files. ``chatkv.weights.loading.read_weights`` gives the quantised projections' float weights
too, dequantised (float32, exact) only when one is read: ``--weights bf16`` or ``int8``, where the
user asked for float.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from chatkv.errors import ModelNotFound, UnsupportedModel
from chatkv.weights.gguf_tensors import ForgettableWeights, read_q4
from chatkv.weights.quantised import GROUP, Q4Weight

__all__ = [
    "AWQ_ORDER",
    "QuantConfig",
    "quant_config",
    "checkpoint_kind",
    "gptq_q4",
    "awq_q4",
    "CheckpointQ4",
    "read_checkpoint_q4",
    "read_int4",
    "fused",
    "JoinedLinear",
]

METHODS = ("gptq", "awq")
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what its kernels add to a stored zero
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output 8c + AWQ_ORDER[i]
_AWQ_INVERSE = tuple(sorted(range(8), key=lambda i: AWQ_ORDER[i]))  # output 8c + j is nibble _AWQ_INVERSE[j]
_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_SCALE_DTYPES = ("F16", "BF16", "F32")


@dataclass(frozen=True)
class QuantConfig:
    """What chatkv reads of a checkpoint's ``quantization_config``."""

    method: str  # gptq | awq
    group_size: int  # inputs per group; -1: one group over all of a row's inputs
    zero_offset: int  # added to a stored zero (GPTQ's v1 format stores zero - 1)
    config_file: Path

    @property
    def label(self) -> str:
        return self.method.upper()


def quant_config(model_dir: str | Path, raw: dict | None = None) -> QuantConfig | None:
    """The directory's GPTQ/AWQ settings (``raw``: its config.json, already read), or None for a
    model without a ``quantization_config``. Raises UnsupportedModel naming the file and the field
    for one chatkv cannot run: another method, bits other than 4, a group size that is not whole
    groups of 32, a GPTQ format or AWQ version whose layout is not the one read here."""
    cfg_file = Path(model_dir) / "config.json"
    if raw is None:
        try:
            raw = json.loads(cfg_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None  # chatkv.weights.loading.load_config says what is wrong with it
    qc = raw.get("quantization_config") if isinstance(raw, dict) else None
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise UnsupportedModel(f"'{cfg_file}': quantization_config is a JSON {type(qc).__name__}, not an object")

    def refuse(field: str, value, why: str):
        raise UnsupportedModel(f"'{cfg_file}': quantization_config.{field} is {value!r}; {why}")

    method = qc.get("quant_method")
    if not isinstance(method, str) or method.lower() not in METHODS:
        refuse("quant_method", method, "chatkv runs 4-bit GPTQ and AWQ checkpoints (quant_method gptq or awq)")
    method = method.lower()
    bits_field = "bits" if "bits" in qc or "w_bit" not in qc else "w_bit"
    if qc.get(bits_field) != 4:
        refuse(bits_field, qc.get(bits_field), "chatkv's int4 path runs 4-bit checkpoints only")
    group_field = "group_size" if "group_size" in qc or "q_group_size" not in qc else "q_group_size"
    group = qc.get(group_field, 128)  # transformers' default for both methods
    if isinstance(group, bool) or not isinstance(group, int) or not (group == -1 or (group > 0 and group % GROUP == 0)):
        refuse(
            group_field,
            group,
            f"chatkv's int4 groups are {GROUP} inputs, so a group size must be a multiple of {GROUP} "
            f"(32, 64, 128, ...) or -1 (one group over all inputs)",
        )
    if method == "gptq":
        fmt_field = "checkpoint_format" if "checkpoint_format" in qc or "format" not in qc else "format"
        fmt = qc.get(fmt_field, "gptq")
        if fmt not in GPTQ_FORMATS:
            refuse(fmt_field, fmt, f"chatkv reads the {' and '.join(GPTQ_FORMATS)} layouts")
        if qc.get("pack_dtype", "int32") != "int32":
            refuse("pack_dtype", qc.get("pack_dtype"), "chatkv reads codes packed 8 to an int32 word")
        return QuantConfig("gptq", group, GPTQ_FORMATS[fmt], cfg_file)
    version = qc.get("version", "gemm")
    if not isinstance(version, str) or version.lower() != "gemm":
        refuse("version", version, "chatkv reads AWQ's GEMM layout (version gemm)")
    if qc.get("zero_point", True) is not True:
        refuse("zero_point", qc.get("zero_point"), "chatkv reads AWQ checkpoints with zero points (zero_point true)")
    return QuantConfig("awq", group, 0, cfg_file)


def checkpoint_kind(model_dir: str | Path) -> str | None:
    """ "GPTQ" or "AWQ" for such a checkpoint (chatkv.model.modes: ``weights=auto`` runs it in int4), else None."""
    qc = quant_config(model_dir)
    return None if qc is None else qc.label


# --------------------------------------------------------------------------- the formats' numbers


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 8 W]`` of int32 ``words [..., W]``: position ``8w + i`` is word ``w``'s nibble ``i``."""
    if sys.byteorder != "little":  # the bytes of an int32 view are its memory order
        raise UnsupportedModel("reading GPTQ/AWQ checkpoints needs a little-endian CPU")
    b = words.to(torch.int32).contiguous().view(torch.uint8)  # byte j: nibbles 2j (low) and 2j + 1 (high)
    return torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)


def _grouped(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, groups: torch.Tensor, where: str
) -> Q4Weight:
    """The Q4Weight of ``codes`` uint8 ``[N, K]`` whose input ``k`` is in group ``groups[k]``
    (``scale``, ``zero``: ``[N, G]``): inputs sorted by group (stable) when they are not already."""
    n, k = codes.shape
    perm = None
    if groups.numel() and (int(groups.min()) < 0 or int(groups.max()) >= scale.shape[1]):
        last = scale.shape[1] - 1
        raise ModelNotFound(f"{where}: its g_idx names groups outside 0..{last}, the groups its scales have")
    if k % GROUP:
        raise UnsupportedModel(f"{where}: {k} inputs are not whole groups of {GROUP}, which chatkv's int4 kernel needs")
    if bool((groups[1:] < groups[:-1]).any()):  # act order: the groups are not consecutive inputs
        perm = torch.argsort(groups, stable=True)
        groups = groups[perm]
        codes = codes[:, perm]
    chunks = groups.view(k // GROUP, GROUP)
    if not bool((chunks == chunks[:, :1]).all()):
        raise UnsupportedModel(
            f"{where}: its g_idx makes a group whose inputs are not a multiple of {GROUP}, "
            f"so its groups are not whole int4 groups of {GROUP}"
        )
    first = chunks[:, 0]
    s = scale[:, first]
    return Q4Weight(codes.contiguous(), s.contiguous(), (-(s * zero[:, first].float())).contiguous(), perm=perm)


def gptq_q4(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    zero_offset: int,
    where: str = "GPTQ weight",
) -> Q4Weight:
    """A GPTQ projection (the module docstring's layout) as a Q4Weight of its own numbers: codes
    ``[N, K]``, scales as float32, ``minimum = -scale * (stored zero + zero_offset)``; inputs in
    ``g_idx``'s group order (``perm``) where it is not ascending."""
    codes = _nibbles(qweight.t()).contiguous()  # [N, K]: word r's nibble i is input 8r + i
    n, k = codes.shape
    zero = _nibbles(qzeros)[:, :n].t().float() + zero_offset  # [N, G]
    scale = scales.float().t()
    if g_idx is None:
        size = k if group_size == -1 else group_size
        g_idx = torch.arange(k) // size
    return _grouped(codes, scale, zero, g_idx.long(), where)


def awq_q4(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int, where: str = "AWQ weight"
) -> Q4Weight:
    """An AWQ (GEMM) projection as a Q4Weight of its own numbers (codes ``[N, K]``, float32 scales,
    ``minimum = -scale * zero``); groups are consecutive inputs."""
    inverse = torch.tensor(_AWQ_INVERSE)

    def unpack(words: torch.Tensor) -> torch.Tensor:  # [R, N / 8] -> [R, N] in output order
        nib = _nibbles(words)
        return nib.view(nib.shape[0], -1, 8)[..., inverse].reshape(nib.shape[0], -1)

    codes = unpack(qweight).t().contiguous()  # [N, K]
    n, k = codes.shape
    size = k if group_size == -1 else group_size
    return _grouped(codes, scales.float().t(), unpack(qzeros).t().float(), torch.arange(k) // size, where)


# --------------------------------------------------------------------------- the checkpoint's files


def _expected_shapes(raw: dict) -> dict[str, tuple[int, int]]:
    """``[N, K]`` of each projection kind the config determines (fewer where a field is missing)."""
    h, heads, inter = raw.get("hidden_size"), raw.get("num_attention_heads"), raw.get("intermediate_size")
    if not all(isinstance(v, int) and v > 0 for v in (h, heads, inter)):
        return {}
    kv = raw.get("num_key_value_heads") or heads
    d = raw.get("head_dim") or h // heads
    out = {
        "self_attn.q_proj": (heads * d, h),
        "self_attn.k_proj": (kv * d, h),
        "self_attn.v_proj": (kv * d, h),
        "self_attn.o_proj": (h, heads * d),
        "mlp.gate_proj": (inter, h),
        "mlp.up_proj": (inter, h),
        "mlp.down_proj": (h, inter),
    }
    if isinstance(raw.get("vocab_size"), int):
        out["lm_head"] = (raw["vocab_size"], h)
    return out


class CheckpointQ4(ForgettableWeights):
    """A GPTQ/AWQ checkpoint's quantised projections as ``Q4Weight``s by name (without ``model.``,
    ``layers.0.self_attn.q_proj.weight``), each read from its file when asked for and not kept, as
    chatkv.weights.gguf's Q4File: a loader taking one projection at a time never holds them all.
    Every projection's parts, dtypes and shapes are checked from the files' headers here, so a
    damaged or mislabelled checkpoint fails at once, naming the directory and the tensor.

    ``checkpoint`` ("GPTQ"/"AWQ") tells chatkv.model.forward these are a checkpoint's own weights
    (fused only where they share an input order: ``fused``)."""

    def __init__(self, model_dir: str | Path, qc: QuantConfig, raw: dict):
        from safetensors import safe_open

        self.model_dir, self.qc, self.checkpoint = Path(model_dir), qc, qc.label
        headers: dict[str, tuple[Path, str, list[int], str]] = {}  # name without "model." -> file, key, shape, dtype
        for f in sorted(self.model_dir.glob("*.safetensors")):
            try:
                with safe_open(str(f), framework="pt") as st:
                    for key in st.keys():
                        sl = st.get_slice(key)
                        headers[key.removeprefix("model.")] = (f, key, list(sl.get_shape()), sl.get_dtype())
            except Exception as e:  # SafetensorError, OSError: truncated, not safetensors
                raise ModelNotFound(f"weights file '{f}' is unreadable: {type(e).__name__}: {e}") from e
        expected = _expected_shapes(raw)
        self._parts: dict[str, dict[str, tuple[Path, str]]] = {}  # projection -> part -> (file, key)
        self._names: dict[str, None] = {}
        for name in sorted(headers):
            if not name.endswith(".qweight"):
                continue
            base = name.removesuffix(".qweight")
            self._parts[base + ".weight"] = self._check(base, headers, expected)
            self._names[base + ".weight"] = None
        #: the files' names (without ``model.``) of every quantised part: not float weights
        self.part_names = {f"{base.removesuffix('.weight')}.{p}" for base in self._parts for p in self._parts[base]}

    def _check(self, base: str, headers: dict, expected: dict) -> dict[str, tuple[Path, str]]:
        qc, where = self.qc, f"the {self.qc.label} checkpoint '{self.model_dir}'"
        parts = {p: headers.get(f"{base}.{p}") for p in _PARTS}
        for p in ("qzeros", "scales"):
            if parts[p] is None:
                raise ModelNotFound(
                    f"{where} has '{base}.qweight' but no '{base}.{p}' in its weights files; "
                    f"a {qc.label} projection is stored as qweight, qzeros and scales"
                )
        if qc.method == "awq" and parts["g_idx"] is not None:
            raise ModelNotFound(
                f"{where} has '{base}.g_idx', which AWQ's layout does not have: is it a GPTQ checkpoint?"
            )

        def shape_error(part: str, want: list[int]) -> ModelNotFound:
            got = parts[part][2]
            return ModelNotFound(
                f"{where}: '{base}.{part}' has shape {got}, expected {want} for a 4-bit {qc.label} projection "
                f"of {n} outputs and {k} inputs in groups of {size} (quantization_config says bits 4, "
                f"group_size {qc.group_size})"
            )

        for p, kinds in (
            ("qweight", ("I32",)),
            ("qzeros", ("I32",)),
            ("scales", _SCALE_DTYPES),
            ("g_idx", ("I32", "I64")),
        ):
            if parts[p] is not None and parts[p][3] not in kinds:
                raise ModelNotFound(
                    f"{where}: '{base}.{p}' is {parts[p][3]}, "
                    f"not {' or '.join(kinds)} as the {qc.label} layout stores it"
                )
        qweight, scales = parts["qweight"][2], parts["scales"][2]
        if len(qweight) != 2 or len(scales) != 2:
            raise ModelNotFound(f"{where}: '{base}.qweight' and '.scales' must be matrices, not {qweight} and {scales}")
        n = scales[1]
        k = qweight[0] * 8 if qc.method == "gptq" else qweight[0]
        kind = base.split(".", 2)[-1] if base.startswith("layers.") else base
        if kind in expected and (n, k) != expected[kind]:
            n, k = expected[kind]
        size = k if qc.group_size == -1 else qc.group_size
        groups = -(-k // size)
        want = {
            "qweight": [k // 8, n] if qc.method == "gptq" else [k, n // 8],
            "qzeros": [groups, n // 8],
            "scales": [groups, n],
            "g_idx": [k],
        }
        for p in _PARTS:
            if parts[p] is not None and parts[p][2] != want[p]:
                raise shape_error(p, want[p])
        if k % size or n % 8:
            raise UnsupportedModel(
                f"{where}: '{base}' has {k} inputs and {n} outputs, not whole groups of {size} inputs "
                f"and whole words of 8 outputs"
            )
        return {p: (v[0], v[1]) for p, v in parts.items() if v is not None}

    def weight(self, name: str) -> Q4Weight:
        """``name``'s Q4Weight, read from the files (whether or not the name was forgotten)."""
        from safetensors import safe_open

        parts = self._parts[name]  # KeyError for a name the checkpoint does not quantise
        tensors = {}
        try:
            for p, (f, key) in parts.items():
                with safe_open(str(f), framework="pt") as st:
                    tensors[p] = st.get_tensor(key)
        except Exception as e:  # noqa: BLE001 - changed or damaged since its header was read
            raise ModelNotFound(f"weights file '{f}' is unreadable: {type(e).__name__}: {e}") from e
        where = f"'{name}' of the {self.qc.label} checkpoint '{self.model_dir}'"
        if self.qc.method == "gptq":
            return gptq_q4(
                tensors["qweight"],
                tensors["qzeros"],
                tensors["scales"],
                tensors.get("g_idx"),
                self.qc.group_size,
                self.qc.zero_offset,
                where,
            )
        return awq_q4(tensors["qweight"], tensors["qzeros"], tensors["scales"], self.qc.group_size, where)

    def float_sources(self, where: dict) -> dict:
        """``where`` (chatkv.weights.loading.read_weights' name -> source) without the quantised
        parts, with each quantised projection's float weight: its Q4Weight dequantised (float32,
        in input order) when it is read."""
        out = {n: s for n, s in where.items() if n not in self.part_names}
        for name in self._parts:
            out[name] = lambda name=name: self.weight(name).dequantize()
        return out


def read_checkpoint_q4(model_dir: str | Path) -> CheckpointQ4 | None:
    """The GPTQ/AWQ checkpoint's 4-bit projections (``CheckpointQ4``), or None for another model."""
    cfg_file = Path(model_dir) / "config.json"
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    qc = quant_config(model_dir, raw)
    return None if qc is None else CheckpointQ4(model_dir, qc, raw)


def read_int4(model_dir: str | Path):
    """The directory's own 4-bit weights by name: a GPTQ/AWQ checkpoint's (``CheckpointQ4``), else a
    converted GGUF's (chatkv.weights.gguf_tensors.read_q4: empty for a float directory)."""
    own = read_checkpoint_q4(model_dir)
    if own is not None:
        return own
    return read_q4(model_dir)


# --------------------------------------------------------------------------- fusing


def _same_order(a: Q4Weight, b: Q4Weight) -> bool:
    return (a.perm is None and b.perm is None) or (
        a.perm is not None and b.perm is not None and torch.equal(a.perm, b.perm)
    )


def fused(parts: list[Q4Weight], bias: torch.Tensor | None) -> list[tuple[Q4Weight, torch.Tensor | None]]:
    """One fused group's projections (``parts``, in output order) joined along the output wherever
    consecutive parts share their input order, each join with its slice of the group's ``bias``."""
    runs: list[list[Q4Weight]] = []
    for q in parts:
        if runs and _same_order(runs[-1][0], q):
            runs[-1].append(q)
        else:
            runs.append([q])
    out, start = [], 0
    for run in runs:
        rows = sum(q.codes.shape[0] for q in run)
        q = (
            run[0]
            if len(run) == 1
            else Q4Weight(
                torch.cat([x.codes for x in run]),
                torch.cat([x.scale for x in run]),
                torch.cat([x.minimum for x in run]),
                perm=run[0].perm,
            )
        )
        out.append((q, None if bias is None else bias[start : start + rows]))
        start += rows
    return out


class JoinedLinear:
    """Linears over the same input with their outputs side by side: a fused group of a checkpoint's
    projections that do not share one input order (``fused``)."""

    __slots__ = ("parts", "out_features", "bias")

    def __init__(self, parts: list):
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None  # each part adds its own

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)
