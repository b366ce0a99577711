"""The Llama-family forward pass over paged KV (llama, qwen2, qwen3, mistral).

(Past ~400 lines on purpose: the weights' stored forms, built in ``__init__``, and the forward
that reads every field of them are one contract; its precision rules, below, bind both.)

Weights and config come from a Hugging Face directory (read by chatkv.weights).
One call computes a flattened batch of sequences in mixed phases (prefill chunks
and single-token decodes); attention reads K/V through block tables.

Precision. The float modes compute as transformers does in their dtype (it is their oracle).
The quantised modes (int4/int8 weights, bfloat16 activations) keep the residual stream in
float32: each layer's two additions and the RMSNorms read and write float32, and only the
matmuls' inputs are rounded to bfloat16. A bfloat16 residual is rounded 60 times per token
on the default model; its error against the exact float32 math of the same weights (mean
|logit difference| 0.21, top-1 flips on 1-3% of positions) exceeds margins the default model
answers on: "What is the capital of France?" is "The" over "L" by 0.10 logits, so with a
bfloat16 residual which of the two a CPU says depends on the order of its own kernels' sums
(one CPU answers "L'Étoile", another "The capital of France is Paris."). float32 halves that
error (tests/model/test_weight_paths.py) for about 7% of a decode step: each addition casts the
projection's bf16 output (benchmarks/README.md).

The logits are float32 where they decide (``ExactTop``): the output matrix's kernels round
their results to bfloat16, whose spacing is 0.125 between logits 16 and 32, where the
default model's are. So two tokens 0.01 apart in exact arithmetic would come out equal, and
argmax would take the lower id: with AMX bf16 kernels the France prompt's "The" (25.235) and
"L" (25.226) both round to 25.25, which would make the int4 mode answer "L'Étoile". The 16
highest of each row are recomputed from the same hidden state and weights in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from chatkv.errors import ModelNotFound, UnsupportedModel
from chatkv.kernels import AttentionMetadata, attention_backend, cpu_decode, kv_quant
from chatkv.kernels.cpu_invariant import RowInvariantLinear, int4_mm_many, rows_attention
from chatkv.model import fused_decode
from chatkv.model.cpu_threads import one_thread
from chatkv.model.prefill import Scratch, ScratchInt8, scratch_int4
from chatkv.weights.loading import load_config, read_weights, release_freed_memory
from chatkv.weights.quantised import (
    GROUP,
    Int4Linear,
    Int8Linear,
    Q4Weight,
    int4_from_nibbles,
    quantize_int4,
    quantize_int8,
)
from chatkv.weights.quantised_cache import QuantisedCache

# oneDNN prepacked linear (CPU). Batch-1 decode is bound by streaming the weights, and
# measured on the default model (SmolLM2-135M, 2 AVX-512 cores, benchmarks/README.md) a
# decode step takes, vs F.linear on the plain row-major weights: prepacked 0.66x (bf16) /
# 0.63x (fp32) of the time; packed for a batch of 64 instead of 1, a further -2% / -11%
# (and no slower for prefill chunks); and padding 1-3 rows to MIN_ROWS, so that oneDNN
# takes its 4-row kernel instead of its 1-row path, a further -2% / -8%.
PACK_WEIGHTS = True  # set False to measure plain F.linear
PACK_BATCH_HINT = 64
MIN_ROWS = 4
_packing_works: dict[torch.dtype, bool] = {}


def _mkldnn_linear_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear runs here for ``dtype`` and agrees with ``F.linear``."""
    if not torch.backends.mkldnn.is_available() or dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(24, 40, generator=g).to(dtype)
        x = torch.randn(3, 40, generator=g).to(dtype)
        y = _mkldnn_linear(x, torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT), None, "none", [], "")
        return torch.allclose(y.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)
    except (RuntimeError, AttributeError):
        return False


try:
    _mkldnn_linear = torch.ops.mkldnn._linear_pointwise.default
except (AttributeError, RuntimeError):  # a torch build without oneDNN
    _mkldnn_linear = None


#: Weight modes of the projections and of the output matrix (chatkv.weights.quantised): float = the model's dtype.
WEIGHT_MODES = ("float", "int4", "int8")
#: How the quantised modes' steps of ``dense_rows`` rows or more get bfloat16 weights:
#: "scratch" dequantised per step into one reused buffer (chatkv.model.prefill), "copy" a resident copy.
DENSE_KINDS = ("scratch", "copy")

#: A layer's projections as they are fused and stored: q, k, v; o; gate, up; down.
PROJECTION_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


def projection_mode(names: list[str], mode: str, q4: dict) -> str:
    """The mode one fused group of projections ``names`` computes in. In int4 mode on a GGUF
    (``q4``: its own 4-bit tensors), a group holding a wider tensor (Q5_0/Q5_1/Q5_K/Q6_K/Q8_0,
    decoded exactly into the float model) is int8 per channel: measured within llama.cpp's
    gate where int4 groups are 3.3x outside it (docs/reference/weights.md, "GGUF K-quants")."""
    if mode == "int4" and q4 and any(n not in q4 for n in names):
        return "int8"
    return mode


class Linear:
    """``y = x @ weight.T + bias``, with the weight stored for the fastest matmul on its device.

    On CPU the weight is prepacked once into oneDNN's blocked layout (the plain copy is
    dropped). Same math and dtype as ``F.linear``; only the accumulation order inside
    the dot products differs.
    """

    __slots__ = ("weight", "bias", "packed", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.weight, self.bias, self.packed = weight, bias, None
        self.out_features = weight.shape[0]
        dtype = weight.dtype
        if pack and PACK_WEIGHTS and _mkldnn_linear is not None and weight.device.type == "cpu":
            if dtype not in _packing_works:
                _packing_works[dtype] = _mkldnn_linear_works(dtype)
            if _packing_works[dtype]:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
                self.weight = None  # the packed copy replaces it (a tied embedding stays referenced elsewhere)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return _mkldnn_linear(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def float_linear(weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, invariant: bool):
    """A float projection: ``RowInvariantLinear`` for a deterministic model (each row's numbers its
    own, whatever else the step holds: chatkv.kernels.cpu_invariant), else ``Linear``."""
    if invariant:
        return RowInvariantLinear(weight, bias)
    return Linear(weight, bias, pack)


class LazyLinear:
    """``y = x @ weight.T + bias`` for the fused projections whose weights ``makes`` make, each made
    for the call and dropped after its product (plain ``F.linear``): a model that computes each
    projection once, as a reference does, holds one projection's weight at a time."""

    __slots__ = ("makes", "bias", "out_features")

    def __init__(self, makes, bias: torch.Tensor | None = None):
        self.makes, self.bias, self.out_features = makes, bias, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([F.linear(x, make()) for make in self.makes], dim=-1)
        return y if self.bias is None else y + self.bias


def _int8_activations() -> bool:
    """Whether the int4 few-row steps take the int8-activation kernels (their switch, where built)."""
    from chatkv.weights import quantised

    switch = getattr(quantised, "vnni_kernels", None)
    return bool(switch and switch()[0])


def _in_row_chunks(self, x: torch.Tensor) -> torch.Tensor:
    """The few-row kernel ``INT4_MM_ROWS`` rows a call, whatever the step's rows."""
    n = cpu_decode.INT4_MM_ROWS
    call = super(type(self), self).__call__
    if x.shape[0] <= n:
        return call(x)
    return torch.cat([call(x[i : i + n]) for i in range(0, x.shape[0], n)])


class RowChunkedInt4(Int4Linear):
    """An ``Int4Linear`` of a deterministic model (``row_chunks``). Where its few-row kernel is
    ``int4_mm``, a step of more rows takes ``int4_mm_many``: the same numbers, with each weight tile
    decoded once for all of them (AMX)."""

    __slots__ = ()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= cpu_decode.INT4_MM_ROWS or self.perm is not None or _int8_activations() or not self.few_rows():
            return _in_row_chunks(self, x)
        y = int4_mm_many(x, self.packed, self.scales_zeros)
        return y if self.bias is None else y + self.bias


class RowChunkedInt8(Int8Linear):
    """An ``Int8Linear`` of a deterministic model (``row_chunks``)."""

    __slots__ = ()
    __call__ = _in_row_chunks


def row_chunks(lin):
    """A quantised projection of a deterministic model: its few-row kernel (``int4_mm``/``int8_mm``,
    each row computed alone) ``INT4_MM_ROWS`` rows a call for any number of rows, so that no step's
    row count ever picks another kernel (torch's, or the dense path's oneDNN). The object stays
    what it was (its class becomes the subclass that chunks), without its dense path. A float
    projection is returned as it is (RowInvariantLinear already)."""
    if isinstance(lin, Int8Linear):
        lin.native_few_rows()
        lin.dense = None
        lin.__class__ = RowChunkedInt8
    elif isinstance(lin, Int4Linear):
        lin.dense = None
        lin.__class__ = RowChunkedInt4
    return lin


AnyLinear = Linear | RowInvariantLinear | Int4Linear | Int8Linear | LazyLinear


class ExactTop:
    """The output matrix with each row's ``k`` highest logits recomputed in float32.

    ``head(x)``'s kernels round to the activations' dtype (bfloat16: 0.125 apart at logits
    16-32), which ties tokens an exact product separates; ``rows(ids)`` gives the float32
    weight rows ``[R, k, K]`` that ``head`` computes with (int8 codes times their bfloat16
    scales, or the float matrix itself), so the top ``k`` are ``x @ rows.T`` without the
    output rounding. The rest keep ``head``'s values: sampling's tail, 1/128 relative."""

    __slots__ = ("head", "rows", "bias", "k", "out_features")

    def __init__(self, head: AnyLinear, rows, k: int = 16):
        self.head, self.rows, self.k = head, rows, k
        self.bias = head.bias
        self.out_features = head.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(x).float()
        if logits.shape[-1] <= self.k or x.shape[0] == 0:
            return logits
        top = logits.topk(self.k, dim=-1).indices  # [R, k]
        # an elementwise product and a sum over the inputs: each logit's sum in one fixed order,
        # whatever the number of rows (a batched matmul may choose its kernel by the batch)
        exact = (self.rows(top) * x.float().unsqueeze(1)).sum(-1)
        if self.bias is not None:
            exact += self.bias.float()[top]
        return logits.scatter_(1, top, exact)


def exact_top(head: AnyLinear, matrix: torch.Tensor | None) -> AnyLinear | ExactTop:
    """``head`` as an ``ExactTop`` where its float32 rows can be read: an int8 head's codes and
    scales, or ``matrix`` (the float output matrix, which a prepacked ``Linear`` no longer
    holds). A float32 head needs none; an int4 head stays as it is (its codes are packed for
    the kernel)."""
    if isinstance(head, Int8Linear):
        codes, scales = head.codes, head.scales
        return ExactTop(head, lambda ids: codes[ids].float() * scales[ids].float().unsqueeze(-1))
    if isinstance(head, (Linear, RowInvariantLinear)) and matrix is not None and matrix.dtype != torch.float32:
        return ExactTop(head, lambda ids: matrix[ids].float())
    return head


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: AnyLinear  # q, k, v projections fused: [(H + 2 KVH) * D, hidden]
    o: AnyLinear
    qk_norm: torch.Tensor | None  # qwen3: RMSNorm weights over head_dim, q's repeated per head then k's: [H + KVH, D]
    post_norm: torch.Tensor
    gate_up: AnyLinear  # gate and up fused: [2 * intermediate, hidden]
    down: AnyLinear
    window: int | None  # sliding window of this layer, None for full attention


def _layer_windows(config) -> list[int | None]:
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if config.model_type == "mistral":
        return [window] * n
    if not getattr(config, "use_sliding_window", False) or window is None:
        return [None] * n
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * n
    return [window if t == "sliding_attention" else None for t in types]


def rope_inv_freq(config, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scaling for the config's RoPE (transformers' own init functions;
    imported only for a scaled RoPE: the default one is computed here, as transformers does).
    ``layer_type``: the RoPE of that layer type, where ``rope_parameters`` holds one per type
    (gemma3_text's sliding and full attention layers: chatkv.model.gemma3)."""
    params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type in ("dynamic", "longrope"):
        raise UnsupportedModel(f"rope_type '{rope_type}' (length-dependent RoPE) is not supported yet")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if not hasattr(config, "standardize_rope_params"):
        # a later start's chatkv.weights.load_cache.ResolvedConfig (the fields only): transformers' init
        # functions call the config class's methods, so they get the config made again from those fields
        from transformers import AutoConfig

        fields = config.to_dict()
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    return ROPE_INIT_FUNCTIONS[rope_type](config, layer_type=layer_type)


class LlamaModel:
    """Weights and the forward pass. Not an nn.Module: nothing here trains."""

    #: hook for a subclass whose config keys its RoPE by layer type: the type whose RoPE ``rope``
    #: computes (chatkv.model.gemma3: its full attention layers'); None: the config's one RoPE
    rope_layer_type: str | None = None

    def __init__(
        self,
        config,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: str = "cpu",
        weights_mode: str = "float",
        head_mode: str = "float",
        q4: dict[str, Q4Weight] | None = None,
        dense_rows: int = 16,
        pack: bool = True,
        consume: bool = False,
        dense: str = "scratch",
        lazy: bool = False,
        cache: QuantisedCache | None = None,
        deterministic: bool = False,
    ):
        """``weights_mode``/``head_mode``: how the layers' projections / the output matrix are
        stored and computed (``WEIGHT_MODES``; the quantised ones need bfloat16 on CPU); ``q4``:
        a GGUF's own 4-bit weights by name, used as they are in int4 mode (others are quantised);
        ``dense_rows``: in the quantised modes, steps of this many rows or more (prefill chunks,
        batched decodes) compute with bfloat16 weights, faster there (0: the quantised kernels
        for every step); ``dense`` (``DENSE_KINDS``): whether those weights are dequantised per
        step into one reused buffer (``scratch``: no second copy resident) or a resident ``copy``;
        ``pack``: False computes the float weights with plain ``F.linear`` (no oneDNN prepacking:
        chatkv.model.self_check's reference); ``consume``: the dicts are the caller's to give away,
        each projection's tensors are removed once stored (start-up peak memory: the float
        weights and their stored form are not all held at once); ``lazy``: each float projection
        reads its weight from ``weights`` when it computes and drops it after (``LazyLinear``), and
        the embeddings and the output matrix are left to the caller
        (chatkv.model.self_check's reference: one layer's float32 weights in memory at a time);
        ``cache``: where what is quantised here is read from, or kept for the next load
        (chatkv.weights.quantised_cache); ``deterministic``: every row of a step computed alone
        (``invariant``, below)."""
        for what, mode in (("weights", weights_mode), ("head", head_mode)):
            if mode not in WEIGHT_MODES:
                raise ValueError(f"{what} mode {mode!r} unknown; use one of {', '.join(WEIGHT_MODES)}")
            if mode != "float" and (dtype != torch.bfloat16 or torch.device(device).type != "cpu"):
                raise ValueError(f"{what} mode {mode} computes in bfloat16 on CPU, not {dtype} on {device}")
        if dense not in DENSE_KINDS:
            raise ValueError(f"dense {dense!r} unknown; use one of {', '.join(DENSE_KINDS)}")
        self.weights_mode, self.head_mode = weights_mode, head_mode
        # deterministic: each token's numbers depend on its own inputs only, not on the other rows of
        # its step (other requests, the prefill chunk it falls in) or the thread count. The float
        # projections are RowInvariantLinear and every row's attention is rows_attention's
        # (chatkv.kernels.cpu_invariant); the quantised ones run their few-row kernels (each row
        # alone by construction) INT4_MM_ROWS rows a call, never the dense path (``row_chunks``). On
        # CPU, where the C kernels are built (and for the quantised modes their native few-row ones)
        quantised_modes = weights_mode != "float" or head_mode != "float"
        self.invariant = bool(
            deterministic
            and not lazy
            and torch.device(device).type == "cpu"
            and dtype in (torch.bfloat16, torch.float32)
            and fused_decode.kernels_available()
            and (not quantised_modes or cpu_decode.int4_mm_native())
        )
        if self.invariant and quantised_modes:
            dense_rows = 0  # no dense path: its rows' numbers would depend on the step's row count
        self.scratch = Scratch(dtype)  # the scratch path's buffer, shared by every projection
        # the quantised modes keep the residual stream in float32 (module docstring: "Precision")
        self.residual_dtype = torch.float32 if weights_mode != "float" else dtype
        self._norm_weights: dict[int, torch.Tensor] = {}  # id(norm weight) -> its float32 copy
        q4 = q4 or {}
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_layers = config.num_hidden_layers
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ModelNotFound(f"weight '{name}' missing from the model's safetensors")
            return weights[name].to(device=self.device, dtype=dtype).contiguous()

        def opt(name: str) -> torch.Tensor | None:
            return w(name) if name in weights else None

        def cat_opt(names: list[str]) -> torch.Tensor | None:
            parts = [opt(n) for n in names]
            if all(p is None for p in parts):
                return None
            sizes = [w(n.replace(".bias", ".weight")).shape[0] for n in names]
            return torch.cat([p if p is not None else torch.zeros(s, dtype=dtype) for p, s in zip(parts, sizes)])

        def proj(names: list[str], bias: torch.Tensor | None, mode: str, dense_rows: int = dense_rows) -> AnyLinear:
            """The projections ``names`` fused along the output, stored for ``mode``; with
            ``consume``, their source tensors then leave ``weights``/``q4`` (freed layer by layer)."""
            out = _proj(names, bias, mode, dense_rows)
            if consume:
                for n in names:
                    if n in weights:
                        del weights[n]  # without reading it (a converted GGUF's would be decoded first)
                    if n in q4:
                        del q4[n]  # without reading it (chatkv.weights.gguf.Q4File)
            return out

        def quantised(name: str, how: str, names: list[str] | None = None):
            """Weight ``name`` (int8: the fused ``names``) quantised for ``how``, or read from ``cache``."""
            if how == "int4":
                make = lambda: quantize_int4(weights[name])  # noqa: E731
            else:
                make = lambda: quantize_int8(  # noqa: E731
                    weights[names[0]] if len(names) == 1 else torch.cat([weights[n] for n in names])
                )
            if cache is None:
                return make()
            return cache.int4(name, make) if how == "int4" else cache.int8(name, make)

        def _proj(names: list[str], bias: torch.Tensor | None, mode: str, dense_rows: int) -> AnyLinear:
            if mode == "int4" and getattr(q4, "checkpoint", None) and all(n in q4 for n in names):
                # a GPTQ/AWQ checkpoint's own 4-bit weights (chatkv.weights.gptq_awq), fused where the
                # parts share their input order; an act order's Int4Linear permutes its input for every
                # path, so its resident copy is the weight in the Q4Weight's column order
                from chatkv.weights.gptq_awq import JoinedLinear, fused

                lins = []
                for q, b in fused([q4[n] for n in names], bias):
                    lin = Int4Linear(q, b, None, dense_rows)
                    if dense_rows and dense == "copy":
                        lin.dense = Linear(Q4Weight(q.codes, q.scale, q.minimum).dequantize().to(dtype), b)
                    elif dense_rows:
                        lin.dense = scratch_int4(lin, self.scratch)  # None: the int4 kernel for every step
                    lins.append(lin)
                return lins[0] if len(lins) == 1 else JoinedLinear(lins)
            for n in names:
                if n not in weights:
                    raise ModelNotFound(f"weight '{n}' missing from the model's safetensors")
            # a GGUF's own 4-bit weights are read from its 4-bit file; ``weights[n]`` would decode them to
            # float (chatkv.weights.gguf) only to be dropped again
            all_q4 = all(n in q4 for n in names)
            cached = cache is not None and all(n in q4 or cache.has(n) for n in names)
            if mode == "int4" and (all_q4 or cached or all(weights[n].shape[1] % GROUP == 0 for n in names)):
                copy_wanted = bool(dense_rows) and dense == "copy"
                # a converted GGUF's float weights are its 4-bit numbers dequantised: with a resident
                # copy wanted, those are the copy, with nothing to dequantise
                own = copy_wanted and all_q4 and all(weights[n].dtype == dtype for n in names)
                lin = None
                if hasattr(q4, "nibbles") and all_q4 and (own or not copy_wanted):
                    lin = int4_from_nibbles(
                        [q4.nibbles(n) for n in names], bias, dense_rows
                    )  # the file's bytes repacked
                if lin is None:
                    parts = [q4[n] if n in q4 else quantised(n, "int4") for n in names]
                    cat = lambda f: torch.cat([getattr(x, f) for x in parts])  # noqa: E731
                    q = Q4Weight(cat("codes"), cat("scale"), cat("minimum"))
                    lin = Int4Linear(q, bias, None, dense_rows)
                if copy_wanted:
                    lin.dense = Linear(torch.cat([w(n) for n in names]) if own else q.dequantize().to(dtype), bias)
                if dense_rows and dense == "scratch":
                    lin.dense = scratch_int4(lin, self.scratch)  # None: the int4 kernel for every step
                return lin
            if mode == "int8":
                q8 = quantised("+".join(names), "int8", names)
                lin = Int8Linear(q8, bias, None, dense_rows)
                if dense_rows:
                    lin.dense = (
                        ScratchInt8(lin.codes, q8.scale, lin.bias, self.scratch)
                        if dense == "scratch"
                        else Linear(q8.dequantize().to(dtype), bias)
                    )
                return lin
            if lazy:
                return LazyLinear([lambda n=n: w(n) for n in names], bias)
            return float_linear(torch.cat([w(n) for n in names]), bias, pack, self.invariant)

        windows = _layer_windows(config)
        self.layers: list[Layer] = []
        gguf_q4 = dict.fromkeys(q4)  # the file's own 4-bit names, kept while ``consume`` empties q4
        self.int8_groups = 0  # int4 mode: groups that hold a GGUF's wider tensor, computed in int8
        for i in range(self.num_layers):
            p = f"layers.{i}."
            attn = p + "self_attn."
            qk_norm = None
            if attn + "q_norm.weight" in weights:
                qk_norm = torch.cat(
                    [
                        w(attn + "q_norm.weight").expand(self.num_heads, -1),
                        w(attn + "k_norm.weight").expand(self.num_kv_heads, -1),
                    ]
                )
            stored = []
            for group in PROJECTION_GROUPS:
                names = [f"{p}{g}.weight" for g in group]
                mode = projection_mode(names, weights_mode, gguf_q4)
                self.int8_groups += mode != weights_mode
                bias = cat_opt([f"{p}{g}.bias" for g in group]) if len(group) > 1 else opt(f"{p}{group[0]}.bias")
                stored.append(proj(names, bias, mode))
            qkv, o, gate_up, down = stored
            self.layers.append(
                Layer(
                    input_norm=w(p + "input_layernorm.weight"),
                    qkv=qkv,
                    o=o,
                    qk_norm=qk_norm,
                    post_norm=w(p + "post_attention_layernorm.weight"),
                    gate_up=gate_up,
                    down=down,
                    window=windows[i],
                )
            )
        self.embed = None if lazy else w("embed_tokens.weight")  # lazy: the caller's (rows read in their dtype)
        self.norm = w("norm.weight")
        tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in weights
        if lazy:
            self.lm_head = None  # the caller's (chatkv.model.self_check.reference_model)
        elif head_mode == "float":
            matrix = self.embed if tied else w("lm_head.weight")
            self.lm_head: AnyLinear | ExactTop = exact_top(float_linear(matrix, None, pack, self.invariant), matrix)
        else:
            # no dense copy: the output matrix computes only the rows whose logits are wanted
            head = proj(["embed_tokens.weight" if tied else "lm_head.weight"], None, head_mode, 0)
            self.lm_head = exact_top(head.native_few_rows() if isinstance(head, Int8Linear) else head, None)
        # padding decode rows helps oneDNN's prepacked kernel and slows the int4/int8 ones
        self.min_rows = (
            MIN_ROWS
            if isinstance(self.layers[0].qkv, Linear) and getattr(self.layers[0].qkv, "packed", None) is not None
            else 1
        )
        inv_freq, self.rope_scaling = rope_inv_freq(config, self.rope_layer_type)
        self.inv_freq = inv_freq.to(self.device)
        self._cos_sin = torch.empty(0, 2, self.head_dim, dtype=dtype, device=self.device)  # grown on demand
        self.windows = sorted({l.window for l in self.layers}, key=lambda x: -1 if x is None else x)
        self.store_kv, self.attention = attention_backend(self.device)
        # decode steps through the fused CPU ops where they apply (chatkv.model.fused_decode; False: torch ops)
        if self.invariant and quantised_modes:
            self._row_chunks()
        self.fused_decode = fused_decode.supported(self)
        self._fused_weights: list[torch.Tensor] | None = None

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        dtype: torch.dtype | None = None,
        device: str = "cpu",
        weights_mode: str = "float",
        head_mode: str = "float",
        dense_rows: int = 16,
        dense: str = "scratch",
        deterministic: bool = False,
    ) -> "LlamaModel":
        config = load_config(model_dir)
        if dtype is None:
            dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
            if isinstance(dtype, str):
                dtype = getattr(torch, dtype)
        from chatkv.weights.gptq_awq import read_int4

        # the directory's own 4-bit weights: a GPTQ/AWQ checkpoint's, else a converted GGUF's (read_q4)
        q4 = read_int4(model_dir) if weights_mode == "int4" else None
        quantising = weights_mode != "float" or head_mode != "float"
        cache = QuantisedCache(model_dir, f"weights {weights_mode}, head {head_mode}") if quantising else None
        with one_thread():  # copies and repackings, bound by memory (chatkv.model.cpu_threads.one_thread)
            model = cls(
                config,
                read_weights(model_dir),
                dtype,
                device,
                weights_mode,
                head_mode,
                q4,
                dense_rows,
                consume=True,
                dense=dense,
                cache=cache,
                deterministic=deterministic,
            )
        if cache is not None:
            cache.save()  # what this load quantised, for the next one
        release_freed_memory()  # what loading freed on the heaps, not held resident
        return model

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token at the model's own dtype (the pool's actual figure: BlockPool.bytes_per_token)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    def rms(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of ``x`` scaled by ``weight``, in the compute dtype (the matmuls' input).

        float32 ``x`` (the fp32 model, or the quantised modes' float32 residual stream):
        torch's rms_norm in float32, rounded once to the compute dtype (into ``out`` when given:
        a buffer of the step's, one op instead of a cast's four). Otherwise as transformers (the
        oracle of the float modes): normalise in fp32, cast back, then scale.

        Not a LayerNorm over ``[x, -x]`` (half the ops): at the default model's real
        activations, whose outlier channels reach hundreds, its variance is 1.3e-5 off in
        relative terms where rms_norm is 3e-7 off float64 (tests/model/test_weight_paths.py),
        enough to flip the default model's answer."""
        if x.dtype == torch.float32 and weight.dim() == 1:
            if weight.dtype != torch.float32:
                w = self._norm_weights.get(id(weight))
                if w is None:
                    w = self._norm_weights[id(weight)] = weight.float()
                weight = w
            y = F.rms_norm(x, (x.shape[-1],), weight, eps=self.eps)
            if y.dtype == self.dtype:
                return y
            return y.to(self.dtype) if out is None else out.copy_(y)
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def fused_norm_weights(self) -> list[torch.Tensor]:
        """float32 RMSNorm weights in the order a step applies them: layer 0's input norm, then
        per layer its post-attention norm and the next layer's input norm (the last: the final norm)."""
        if self._fused_weights is None:
            ws = [self.layers[0].input_norm]
            for i, layer in enumerate(self.layers):
                ws += [layer.post_norm, self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm]
            self._fused_weights = [w.float().contiguous() for w in ws]
        return self._fused_weights

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin ``[T, 1, D]`` of ``positions``, from a table grown to the longest position seen."""
        need = int(positions.max()) + 1
        if need > self._cos_sin.shape[0]:
            n = max(need, 2 * self._cos_sin.shape[0], 256)
            # as transformers: angles and cos/sin in fp32, scaled, then cast
            freqs = torch.arange(n, device=self.device).float()[:, None] * self.inv_freq[None, :]
            half = freqs.shape[-1]
            emb = torch.cat((freqs, freqs), dim=-1)
            sin = emb.sin() * self.rope_scaling
            sin[:, :half] = -sin[:, :half]  # rotate_half(x) * sin == cat(x2, x1) * cat(-sin1, sin2)
            self._cos_sin = torch.stack(((emb.cos() * self.rope_scaling), sin), dim=1).to(self.dtype)
        cs = self._cos_sin.index_select(0, positions)
        return cs[:, 0:1], cs[:, 1:2]

    def rope_table(self, positions: torch.Tensor) -> torch.Tensor:
        """The whole cos/sin table ``[N, 2, D]`` (what ``rope`` selects from), grown to ``positions``."""
        self.rope(positions)
        return self._cos_sin

    @torch.inference_mode()
    def shift_key_positions(self, kv: torch.Tensor, blocks: list[int], delta: int, quant: str | None = None) -> None:
        """Move the keys held in ``blocks`` of the pool tensor ``kv`` by ``delta`` positions, in place.

        RoPE rotations compose, R(p + delta) = R(delta) R(p), so a key stored at position p
        becomes the key at p + delta without its hidden state: this is how an attention-sink
        window re-assigns positions after dropping tokens (StreamingLLM). The angle is taken in
        float64 and the rotation computed in float32; only the rotation (not any RoPE attention
        scaling, which both positions share) is applied. Values are position-free: untouched.
        Quantised keys (``quant``) are dequantised, rotated and quantised again (new scales).
        """
        if not blocks or delta == 0:
            return
        idx = torch.tensor(blocks, dtype=torch.long, device=kv.device)
        for layer in range(kv.shape[0]):
            keys = kv[layer, 0]  # [blocks, block_size, kv_heads, row], contiguous
            keys.index_copy_(0, idx, self.rotate_keys(keys.index_select(0, idx), delta, quant))

    @torch.inference_mode()
    def rotate_keys(self, stored: torch.Tensor, delta: int, quant: str | None = None) -> torch.Tensor:
        """Keys ``[..., row]`` in the pool's stored form moved by ``delta`` positions (see
        ``shift_key_positions``, which applies it to blocks; chatkv.rag.placement applies it to a
        chunk's KV computed in its canonical frame). A new tensor, in the stored form."""
        if delta == 0:
            return stored.clone()
        angle = float(delta) * self.inv_freq.double()
        emb = torch.cat((angle, angle))
        cos, sin = emb.cos().float().to(stored.device), emb.sin().float().to(stored.device)
        half = angle.shape[0]
        sin[:half] = -sin[:half]
        k = kv_quant.dequantize(stored, quant, torch.float32) if quant else stored.float()
        k = k * cos + torch.cat((k[..., half:], k[..., :half]), dim=-1) * sin
        return kv_quant.quantize(k, quant) if quant else k.to(stored.dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return x * cos + swapped * signed_sin

    @torch.inference_mode()
    def _row_chunks(self) -> None:
        """A deterministic quantised model's projections and output matrix as ``row_chunks``."""
        for layer in self.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                row_chunks(getattr(layer, name))
        row_chunks(self.lm_head.head if isinstance(self.lm_head, ExactTop) else self.lm_head)

    def rows_keys(self, metas: dict, quant: str | None):
        """A deterministic model's step: each row's block table and key count (ModelRunner.build_batch's),
        with which each token attends alone over its own keys; None otherwise (quantised KV included)."""
        return metas[self.layers[0].window].scratch.get("rows") if self.invariant and quant is None else None

    def attend(self, q, k_cache, v_cache, metas: dict, window: int | None, rows_keys, quant: str | None):
        """One layer's attention of the step's queries ``[T, H, D]``, as ``[T, H * D]``: with
        ``rows_keys`` (bf16 KV) every row alone (``rows_attention``: row r over keys [lo, ctx) of its
        blocks, lo the first key its sliding window still sees), else the batched kernels."""
        t = q.shape[0]
        if rows_keys is not None and k_cache.dtype == torch.bfloat16:
            blocks, ctx = rows_keys
            lo = None if window is None else (ctx - window).clamp_(min=0)
            return rows_attention(q, k_cache, v_cache, blocks, lo, ctx, self.scale).reshape(t, -1)
        return self.attention(q, k_cache, v_cache, metas[window], self.scale, quant=quant).reshape(t, -1)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: torch.Tensor,
        metas: dict[int | None, AttentionMetadata],
        logits_rows: torch.Tensor,
        quant: str | None = None,
    ) -> torch.Tensor:
        """Compute one flattened step.

        input_ids, positions: ``[T]``; kv: the pool tensor ``[layers, 2, blocks, block_size, kv_heads, row]``
        (quantised rows when ``quant`` is set: chatkv.kernels.kv_quant);
        metas: attention metadata per sliding-window value (None = full attention);
        logits_rows: indices into the T tokens whose next-token logits are wanted.
        Returns float32 logits ``[len(logits_rows), vocab]``.
        """
        if self.fused_decode:
            out = fused_decode.forward(self, input_ids, positions, kv, metas, logits_rows, quant)
            if out is not None:
                return out
        t = input_ids.shape[0]
        # decode: compute at least MIN_ROWS rows through the projections (oneDNN's faster kernel);
        # the padding rows are never rotated, stored or attended, and their logits are not taken
        rows = max(t, self.min_rows)
        if rows > t:
            input_ids = torch.cat((input_ids, input_ids.new_zeros(rows - t)))
        h = F.embedding(input_ids, self.embed).to(self.residual_dtype)  # the step's own tensor
        # the norms' rounded outputs (float32 residual): each is consumed by its matmul before the next
        normed = h.new_empty(h.shape, dtype=self.dtype) if h.dtype != self.dtype else None
        cos, sin = self.rope(positions)
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        slot_mapping = metas[self.layers[0].window].slot_mapping
        k_caches, v_caches = kv[:, 0].unbind(0), kv[:, 1].unbind(0)
        o_pad = h.new_zeros(rows - t, nh * d) if rows > t else None
        rows_keys = self.rows_keys(metas, quant)
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches):
            qkv = layer.qkv(self.rms(h, layer.input_norm, normed))
            qkv = (qkv[:t] if rows > t else qkv).view(t, nh + 2 * nkv, d)
            qk = qkv[:, : nh + nkv]  # q and k heads get the same normalisation and rotation
            if layer.qk_norm is not None:
                qk = self.rms(qk, layer.qk_norm)
            qk = self.rotate(qk, cos, sin)
            q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :]
            self.store_kv(k_cache, v_cache, slot_mapping, k, v, quant=quant)
            o = self.attend(q, k_cache, v_cache, metas, layer.window, rows_keys, quant)
            if o_pad is not None:
                o = torch.cat((o, o_pad))
            h.add_(layer.o(o))  # in place: h is the step's own tensor, same math
            g, u = layer.gate_up(self.rms(h, layer.post_norm, normed)).chunk(2, dim=-1)
            h.add_(layer.down(F.silu(g) * u))
        return self.lm_head(self.rms(h.index_select(0, logits_rows), self.norm)).float()
