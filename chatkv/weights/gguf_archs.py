"""The llama-family architectures a GGUF file may hold, as chatkv's converter reads them.

(Past ~400 lines on purpose: each architecture's names, metadata and RoPE are read against one
table, ``ARCHS``, and its config built in one pass; the RoPE recoveries it calls are part of that
reading.)

For each GGUF ``general.architecture`` chatkv converts: the Hugging Face ``config.json`` it stands
for, the tensor names it holds (GGUF name -> Hugging Face name), and whether llama.cpp's own
converter (``convert_hf_to_gguf.py``) permuted the rows of ``attn_q`` / ``attn_k`` for its rotary
layout. What the converter writes, from its source:

- ``llama``: LlamaForCausalLM, and MistralForCausalLM too (registered with the same class: a
  Mistral GGUF says ``llama``, with ``attention.key_length`` when head_dim is not hidden / heads,
  and without the source's sliding window). q and k rows permuted ("normal" RoPE: pairs of
  neighbouring values). Llama 3.1/3.2's RoPE scaling (``rope_type: llama3``) is written as the
  tensor ``rope_freqs.weight``, one factor per frequency, by which llama.cpp divides it: the
  converter recovers the llama3 parameters that give those factors (``llama3_rope_parameters``).
- ``mistral3``: Ministral 3 and Mistral Small 3.x's text model (MistralForCausalLM's layout, q
  and k permuted); without attention temperature scaling or YaRN it is a plain Mistral.
- ``qwen2`` (Qwen2.5): q/k/v biases, no permutation ("neox" RoPE, the Hugging Face layout).
- ``qwen3``: per-head RMSNorm of q and k (``attn_q_norm`` / ``attn_k_norm``), an explicit
  head_dim (``attention.key_length``), no biases, no permutation.
- ``gemma3``: Gemma3ForCausalLM (transformers' ``gemma3_text``): q/k norms, a post-attention norm
  (``post_attention_norm``), ``ffn_norm`` as the pre-feedforward norm and ``post_ffw_norm``, no
  permutation. Its converter stored every norm weight as ``1 + w`` (Gemma3RMSNorm's scale), which the
  conversion takes back off (``stored_shift``). The config follows llama.cpp's reading of the file
  (src/models/gemma3.cpp): sliding layers by ``attention.sliding_window_pattern`` (default: every
  sixth layer full), with ``attention.sliding_window`` and ``rope.freq_base_swa`` (default 10000);
  full layers with ``rope.freq_base`` and the linear scaling; the attention scale ``head_dim ** -0.5``
  except for the 62-layer 27B's ``(hidden / heads) ** -0.5`` (``query_pre_attn_scalar``); the final
  logits' softcapping when the file has one. Its SentencePiece vocabulary is ``llama`` with
  ``add_space_prefix`` off (chatkv.weights.gguf_tokenizer).

llama.cpp gives none of the other architectures a sliding window (its ``swa_type`` stays none), so a
converted directory of theirs attends fully, as llama.cpp does. RoPE scaling: none, linear (llama.cpp
multiplies positions by 1 / factor: transformers' ``linear``) and llama3 (above) are converted;
YaRN, LongRoPE and anything else are refused, as are mixture-of-experts files and partial rotary
dimensions, with UnsupportedModel naming the file.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from chatkv.errors import UnsupportedModel

__all__ = [
    "ARCHS",
    "build_config",
    "hf_name",
    "is_config_tensor",
    "rotary_heads",
    "expected_names",
    "stored_shift",
    "turn_ends",
]


@dataclass(frozen=True)
class Arch:
    model_type: str
    hf_class: str
    #: llama.cpp's "normal" RoPE: its converter permuted the rows of attn_q and attn_k
    permuted: bool
    #: per-block tensors this architecture has beyond the llama ones (GGUF names)
    extra: tuple[str, ...] = ()
    #: extra keys of its config.json
    fields: tuple[tuple[str, Any], ...] = ()
    #: per-block GGUF names this architecture maps otherwise than ``BLOCK_NAMES`` (GGUF -> Hugging Face)
    names: tuple[tuple[str, str], ...] = ()
    #: llama.cpp's converter stored the norm weights as ``1 + w`` (Gemma3RMSNorm's scale)
    norm_shift: bool = False
    #: tokens that end a reply besides EOS: llama.cpp stops at them (end-of-generation names in its
    #: vocabulary loader), and the source's generation_config.json lists them (Gemma's ``<end_of_turn>``)
    turn_ends: tuple[str, ...] = ()


ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", "LlamaForCausalLM", True, (), (("attention_bias", False), ("mlp_bias", False))),
    "mistral3": Arch("mistral", "MistralForCausalLM", True, (), (("sliding_window", None),)),
    "qwen2": Arch(
        "qwen2",
        "Qwen2ForCausalLM",
        False,
        ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
        (("use_sliding_window", False), ("sliding_window", None)),
    ),
    "qwen3": Arch(
        "qwen3",
        "Qwen3ForCausalLM",
        False,
        ("attn_q_norm.weight", "attn_k_norm.weight"),
        (("attention_bias", False), ("use_sliding_window", False), ("sliding_window", None)),
    ),
    "gemma3": Arch(
        "gemma3_text",
        "Gemma3ForCausalLM",
        False,
        ("attn_q_norm.weight", "attn_k_norm.weight", "post_attention_norm.weight", "post_ffw_norm.weight"),
        (("attention_bias", False), ("hidden_activation", "gelu_pytorch_tanh"), ("attn_logit_softcapping", None)),
        (("ffn_norm.weight", "pre_feedforward_layernorm.weight"),),
        norm_shift=True,
        turn_ends=("<end_of_turn>",),
    ),
}

# GGUF tensor name -> Hugging Face name
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
#: every architecture's blocks hold these
BLOCK_NAMES = {
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
#: the ``Arch.extra`` names
EXTRA_BLOCK_NAMES = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
#: tensors that become config.json fields, not weights (the architectures that may hold them)
CONFIG_TENSORS = {"rope_freqs.weight": ("llama", "mistral3")}
BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def is_config_tensor(gguf_name: str) -> bool:
    return gguf_name in CONFIG_TENSORS


def _arch_of(model_type: str) -> Arch:
    return next(a for a in ARCHS.values() if a.model_type == model_type)


def block_names(arch: Arch) -> dict[str, str]:
    """GGUF -> Hugging Face names of one block's tensors in ``arch``."""
    return {**BLOCK_NAMES, **{e: EXTRA_BLOCK_NAMES[e] for e in arch.extra}, **dict(arch.names)}


def hf_name(gguf_name: str, model_type: str = "llama") -> str:
    """The Hugging Face name of a GGUF weight of the architecture converted to ``model_type``."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = BLOCK_RE.match(gguf_name)
    if m:
        part = block_names(_arch_of(model_type)).get(m.group(2))
        if part:
            return f"model.layers.{int(m.group(1))}.{part}"
    raise UnsupportedModel(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in a {model_type} model")


def turn_ends(config: dict[str, Any]) -> tuple[str, ...]:
    """The tokens beside EOS that end a reply of ``config``'s architecture (``Arch.turn_ends``)."""
    return _arch_of(config["model_type"]).turn_ends


def stored_shift(gguf_name: str, config: dict[str, Any]) -> float:
    """What llama.cpp's converter added to the tensor ``gguf_name`` (1 for gemma3's norm weights, else 0)."""
    return 1.0 if _arch_of(config["model_type"]).norm_shift and gguf_name.endswith("norm.weight") else 0.0


def rotary_heads(gguf_name: str, config: dict[str, Any]) -> int | None:
    """The heads of a tensor whose rows llama.cpp permuted for its rotary layout (attn_q, attn_k
    of the "normal" RoPE architectures), or None."""
    if not any(a.permuted for a in ARCHS.values() if a.model_type == config["model_type"]):
        return None
    if gguf_name.endswith("attn_q.weight"):
        return config["num_attention_heads"]
    if gguf_name.endswith("attn_k.weight"):
        return config["num_key_value_heads"]
    return None


def expected_names(config: dict[str, Any]) -> set[str]:
    """The Hugging Face weights a complete conversion of ``config`` holds."""
    parts = list(block_names(_arch_of(config["model_type"])).values())
    out = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(config["num_hidden_layers"]):
        out.update(f"model.layers.{i}.{v}" for v in parts)
    if not config["tie_word_embeddings"]:
        out.add("lm_head.weight")
    return out


def _f32(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _check_names(names: list[str], arch_name: str, source: Path) -> None:
    """Every tensor is one this architecture has (a weight or a config tensor)."""
    arch = ARCHS[arch_name]
    for name in names:
        if name in CONFIG_TENSORS:
            if arch_name not in CONFIG_TENSORS[name]:
                raise UnsupportedModel(f"{source}: GGUF tensor {name!r} is not expected in a {arch_name!r} model")
            continue
        m = BLOCK_RE.match(name)
        part = m.group(2) if m else None
        if name in GLOBAL_NAMES or part in block_names(arch):
            continue
        raise UnsupportedModel(
            f"{source}: GGUF tensor {name!r} has no Hugging Face counterpart in a {arch_name!r} model "
            f"(chatkv's converter maps {arch.model_type} weights only)"
        )


def build_config(
    meta: dict[str, Any],
    names: list[str],
    read: Callable[[str], np.ndarray],
    tied: bool,
    dtype: str,
    source: Path,
) -> dict[str, Any]:
    """config.json of the GGUF ``source``: ``meta`` its metadata, ``names`` its tensors, ``read(name)``
    a tensor's float32 values (``rope_freqs.weight``), ``dtype`` the config's dtype name."""
    arch_name = meta.get("general.architecture")
    if arch_name not in ARCHS:
        raise UnsupportedModel(
            f"{source}: GGUF architecture {arch_name!r} is not supported by chatkv's converter; "
            f"it converts {', '.join(repr(a) for a in ARCHS)}"
        )
    arch = ARCHS[arch_name]
    _check_names(names, arch_name, source)

    def need(key: str) -> Any:
        full = f"{arch_name}.{key}"
        if full not in meta:
            raise UnsupportedModel(f"{source}: GGUF metadata lacks {full!r}")
        return meta[full]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch_name}.{key}", default)

    if get("expert_count"):
        raise UnsupportedModel(
            f"{source}: a mixture-of-experts GGUF ({arch_name}.expert_count = {get('expert_count')}) "
            "is not supported by chatkv's converter"
        )
    if get("attention.temperature_scale"):
        raise UnsupportedModel(
            f"{source}: GGUF attention temperature scaling ({arch_name}.attention.temperature_scale) "
            "is not supported by chatkv's converter"
        )
    hidden = int(need("embedding_length"))
    n_head = int(need("attention.head_count"))
    n_kv = int(get("attention.head_count_kv", n_head))
    head_dim = int(get("attention.key_length", hidden // n_head))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModel(
            f"{source}: GGUF value heads of {get('attention.value_length')} differ from key heads of {head_dim}"
        )
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedModel(
            f"{source}: GGUF RoPE over {get('rope.dimension_count')} of {head_dim} head dimensions "
            "(partial rotary) is not supported by chatkv's converter"
        )
    vocab = meta.get("tokenizer.ggml.tokens#len") or get("vocab_size")
    if not vocab:
        raise UnsupportedModel(f"{source}: GGUF has no token list to size the vocabulary")
    rope_theta = _f32(get("rope.freq_base", 10000.0))
    rope = _rope_parameters(meta, arch_name, names, read, rope_theta, head_dim, source)
    cfg: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        # rope_theta (and rope_scaling) at top level are the transformers 4.x layout; rope_parameters the 5.x one
        "rope_theta": rope_theta,
        "rope_parameters": rope,
        "max_position_embeddings": int(need("context_length")),
        "tie_word_embeddings": bool(tied),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": dtype,
    }
    if rope["rope_type"] != "default":
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if arch.model_type == "llama":
        cfg["pretraining_tp"] = 1
    if arch_name == "gemma3":
        _gemma3_fields(cfg, get, rope, source)
    cfg.update(arch.fields)
    for key, hf in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("padding_token_id", "pad_token_id"),
    ):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None:
            cfg[hf] = int(value)
    return cfg


def _gemma3_fields(cfg: dict[str, Any], get: Callable[..., Any], rope: dict[str, Any], source: Path) -> None:
    """The gemma3_text fields of ``cfg``, as llama.cpp reads the file (module docstring)."""
    n = cfg["num_hidden_layers"]
    window = int(get("attention.sliding_window", 0) or 0)
    pattern = get("attention.sliding_window_pattern", 6)
    if window <= 0:
        sliding = [False] * n
    elif isinstance(pattern, list):
        if len(pattern) != n:
            raise UnsupportedModel(f"{source}: GGUF sliding_window_pattern has {len(pattern)} entries for {n} layers")
        sliding = [bool(x) for x in pattern]
    else:
        k = int(pattern)
        sliding = [k == 0 or i % k < k - 1 for i in range(n)]  # llama_hparams::set_swa_pattern
    local = _f32(get("rope.freq_base_swa", 10000.0))
    del cfg["hidden_act"]
    cfg.update(
        {
            "sliding_window": window or None,
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": local},
                "full_attention": rope,
            },
            "rope_local_base_freq": local,  # the transformers 4.x name
            "query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"] if n == 62 else cfg["head_dim"],
            "final_logit_softcapping": _f32(get("final_logit_softcapping")) if get("final_logit_softcapping") else None,
            "use_bidirectional_attention": False,
        }
    )


# --------------------------------------------------------------------------- RoPE


def _rope_parameters(
    meta: dict[str, Any],
    arch: str,
    names: list[str],
    read: Callable[[str], np.ndarray],
    theta: float,
    head_dim: int,
    source: Path,
) -> dict[str, Any]:
    """transformers' rope_parameters for the file's RoPE: default, linear or llama3 (module docstring)."""
    scaling = meta.get(f"{arch}.rope.scaling.type")
    has_freqs = "rope_freqs.weight" in names
    if scaling in (None, "none"):
        if not has_freqs:
            return {"rope_type": "default", "rope_theta": theta}
        factors = np.asarray(read("rope_freqs.weight"), dtype=np.float32).reshape(-1)
        return llama3_rope_parameters(factors, theta, head_dim, source)
    if has_freqs:
        raise UnsupportedModel(f"{source}: GGUF has both rope_freqs.weight and RoPE scaling {scaling!r}")
    if scaling == "linear":
        factor = meta.get(f"{arch}.rope.scaling.factor")
        if not factor or factor <= 0:
            raise UnsupportedModel(f"{source}: GGUF linear RoPE scaling without a positive {arch}.rope.scaling.factor")
        return {"rope_type": "linear", "factor": _f32(factor), "rope_theta": theta}
    raise UnsupportedModel(
        f"{source}: GGUF RoPE scaling {scaling!r} is not supported by chatkv's converter "
        "(it converts none, linear and Llama 3's rope_freqs)"
    )


def _default_inv_freq(theta: float, dim: int):
    import torch

    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def llama3_factors(params: dict[str, Any], theta: float, dim: int) -> np.ndarray:
    """The per-frequency divisors transformers' llama3 RoPE applies (default / llama3 inverse
    frequencies, float32): what llama.cpp's ``rope_freqs.weight`` holds for the same parameters."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=dim,
        num_attention_heads=1,
        head_dim=dim,
        max_position_embeddings=int(params["original_max_position_embeddings"] * params["factor"]) + 1,
        rope_parameters={**params, "rope_theta": theta},
    )
    inv, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    return (_default_inv_freq(theta, dim) / inv).numpy()


#: how close transformers' factors must come to the file's: float32 rounding of both computations
LLAMA3_RTOL = 1e-5


def llama3_rope_parameters(factors: np.ndarray, theta: float, dim: int, source: Path) -> dict[str, Any]:
    """The llama3 ``rope_parameters`` whose factors are ``factors`` (a GGUF's ``rope_freqs.weight``).

    llama.cpp's converter wrote ``factor`` where a frequency's wavelength exceeds
    ``original_max_position_embeddings / low_freq_factor``, 1 below ``... / high_freq_factor``, and
    ``1 / ((1 - s) / factor + s)`` between, ``s = (L / wavelength - low) / (high - low)``. The
    factors depend on L, low and high only through L / low and L / high, so low_freq_factor is taken
    as 1 (Meta's value) and L and high are fitted to the smoothed band's factors (with one
    factor there, high = 4, Meta's value; with none, Meta's 8192 and 4). Whatever is chosen must
    reproduce every factor through transformers' own llama3 RoPE within ``LLAMA3_RTOL``, or the file
    is refused.
    """
    r = np.asarray(factors, dtype=np.float64)
    if r.shape != (dim // 2,) or not np.all(np.isfinite(r)) or np.any(r <= 0):
        raise UnsupportedModel(
            f"{source}: GGUF rope_freqs.weight holds {r.shape} values, not {dim // 2} positive factors"
        )
    if np.allclose(r, 1.0, rtol=0, atol=LLAMA3_RTOL):
        return {"rope_type": "default", "rope_theta": theta}
    factor = float(r.max())
    inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * math.pi / inv
    band = (r > 1 + LLAMA3_RTOL) & (r < factor * (1 - LLAMA3_RTOL))
    s = (1 / r[band] - 1 / factor) / (1 - 1 / factor)  # r = 1 / ((1 - s) / factor + s)
    candidates: list[tuple[float, float]] = []  # (L, high) with low = 1: s = (L / w - 1) / (high - 1)
    if band.sum() >= 2:
        a, b = np.linalg.lstsq(np.stack([1 / wavelen[band], -np.ones(band.sum())], 1), s, rcond=None)[0]
        if b > 0:
            candidates.append((a / b, 1 + 1 / b))
    elif band.sum() == 1:
        candidates.append((float(wavelen[band][0] * (3 * s[0] + 1)), 4.0))
    candidates.append((8192.0, 4.0))
    for length, high in candidates:
        for rounded in (True, False):
            params = _llama3_params(factor, length, high, rounded)
            if params is None:
                continue
            try:
                ours = llama3_factors(params, theta, dim)
            except Exception:  # parameters transformers rejects
                continue
            if np.allclose(ours, r, rtol=LLAMA3_RTOL, atol=0):
                return params
    raise UnsupportedModel(
        f"{source}: GGUF rope_freqs.weight holds RoPE factors that no llama3 rope_parameters reproduce "
        f"(factors {np.round(r, 4).tolist()}); chatkv's converter supports Llama 3.1/3.2's llama3 RoPE scaling"
    )


def _llama3_params(factor: float, length: float, high: float, rounded: bool) -> dict[str, Any] | None:
    """llama3 rope_parameters for ``L / low = length`` and ``L / high_factor = length / high``, with
    an integral original_max_position_embeddings (L and both factors scaled together when
    ``length`` is not one); ``rounded``: values within 1e-4 of an integer taken as that integer."""
    if not (math.isfinite(length) and math.isfinite(high)) or length <= 0 or high <= 1:
        return None
    if rounded:
        length = float(round(length)) if abs(length - round(length)) <= 1e-4 * length else length
        high = float(round(high)) if abs(high - round(high)) <= 1e-4 * high else high
    low = 1.0
    if length != int(length):
        scale = math.ceil(length) / length
        length, low, high = float(math.ceil(length)), scale, high * scale
    return {
        "rope_type": "llama3",
        "factor": _f32(factor),
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": int(length),
    }
