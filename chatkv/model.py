"""The Llama-family forward pass over paged KV (llama, qwen2, qwen3, mistral).

Weights come from a Hugging Face directory (safetensors); config from transformers.
One call computes a flattened batch of sequences in mixed phases (prefill chunks
and single-token decodes); attention reads K/V through block tables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from chatkv.errors import ModelNotFound, UnsupportedModel
from chatkv.kernels import AttentionMetadata, attention_backend

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # q, k, v projections fused: [(H + 2 KVH) * D, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # qwen3: RMSNorm over head_dim of q and k
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # gate and up fused: [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    window: int | None  # sliding window of this layer, None for full attention


def load_config(model_dir: str | Path):
    """Read and validate a model directory's config; raises ModelNotFound/UnsupportedModel."""
    from transformers import AutoConfig

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"no model at '{model_dir}': expected a Hugging Face directory with config.json")
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"model_type '{model_type}' is not supported; chatkv runs {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return AutoConfig.from_pretrained(str(path))


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFound(f"no *.safetensors weights in '{model_dir}'")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                weights[name.removeprefix("model.")] = st.get_tensor(name)
    return weights


def _layer_windows(config) -> list[int | None]:
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if config.model_type == "mistral":
        return [window] * n
    if not getattr(config, "use_sliding_window", False) or window is None:
        return [None] * n
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * n
    return [window if t == "sliding_attention" else None for t in types]


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scaling for the config's RoPE (transformers' own init functions)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type in ("dynamic", "longrope"):
        raise UnsupportedModel(f"rope_type '{rope_type}' (length-dependent RoPE) is not supported yet")
    return ROPE_INIT_FUNCTIONS[rope_type](config)


class LlamaModel:
    """Weights and the forward pass. Not an nn.Module: nothing here trains."""

    def __init__(self, config, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: str = "cpu"):
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

        windows = _layer_windows(config)
        self.layers: list[Layer] = []
        for i in range(self.num_layers):
            p = f"layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            self.layers.append(
                Layer(
                    input_norm=w(p + "input_layernorm.weight"),
                    qkv=torch.cat([w(attn + f"{x}_proj.weight") for x in "qkv"]),
                    qkv_bias=cat_opt([attn + f"{x}_proj.bias" for x in "qkv"]),
                    o=w(attn + "o_proj.weight"),
                    o_bias=opt(attn + "o_proj.bias"),
                    q_norm=opt(attn + "q_norm.weight"),
                    k_norm=opt(attn + "k_norm.weight"),
                    post_norm=w(p + "post_attention_layernorm.weight"),
                    gate_up=torch.cat([w(mlp + "gate_proj.weight"), w(mlp + "up_proj.weight")]),
                    gate_up_bias=cat_opt([mlp + "gate_proj.bias", mlp + "up_proj.bias"]),
                    down=w(mlp + "down_proj.weight"),
                    down_bias=opt(mlp + "down_proj.bias"),
                    window=windows[i],
                )
            )
        self.embed = w("embed_tokens.weight")
        self.norm = w("norm.weight")
        tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in weights
        self.lm_head = self.embed if tied else w("lm_head.weight")
        inv_freq, self.rope_scaling = rope_inv_freq(config)
        self.inv_freq = inv_freq.to(self.device)
        self.windows = sorted({l.window for l in self.layers}, key=lambda x: -1 if x is None else x)
        self.store_kv, self.attention = attention_backend(self.device)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: torch.dtype | None = None, device: str = "cpu") -> "LlamaModel":
        config = load_config(model_dir)
        if dtype is None:
            dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
            if isinstance(dtype, str):
                dtype = getattr(torch, dtype)
        return cls(config, _read_weights(Path(model_dir)), dtype, device)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # as transformers: normalise in fp32, cast back, then scale
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(self.dtype)[:, None, :]
        sin = (emb.sin() * self.rope_scaling).to(self.dtype)[:, None, :]
        return cos, sin

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: torch.Tensor,
        metas: dict[int | None, AttentionMetadata],
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Compute one flattened step.

        input_ids, positions: ``[T]``; kv: the pool tensor ``[layers, 2, blocks, block_size, kv_heads, head_dim]``;
        metas: attention metadata per sliding-window value (None = full attention);
        logits_rows: indices into the T tokens whose next-token logits are wanted.
        Returns float32 logits ``[len(logits_rows), vocab]``.
        """
        t = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed)
        cos, sin = self._rope(positions)
        nq, nkv, d = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.head_dim
        slot_mapping = metas[self.layers[0].window].slot_mapping
        for i, layer in enumerate(self.layers):
            x = self._rms(h, layer.input_norm)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            q = qkv[:, :nq].view(t, self.num_heads, d)
            k = qkv[:, nq : nq + nkv].view(t, self.num_kv_heads, d)
            v = qkv[:, nq + nkv :].view(t, self.num_kv_heads, d)
            if layer.q_norm is not None:
                q = self._rms(q, layer.q_norm)
                k = self._rms(k, layer.k_norm)
            q = self._rotate(q, cos, sin)
            k = self._rotate(k, cos, sin)
            self.store_kv(kv[i, 0], kv[i, 1], slot_mapping, k, v)
            o = self.attention(q, kv[i, 0], kv[i, 1], metas[layer.window], self.scale)
            h = h + F.linear(o.reshape(t, nq), layer.o, layer.o_bias)
            x = self._rms(h, layer.post_norm)
            gu = F.linear(x, layer.gate_up, layer.gate_up_bias)
            g, u = gu.chunk(2, dim=-1)
            h = h + F.linear(F.silu(g) * u, layer.down, layer.down_bias)
        h = self._rms(h.index_select(0, logits_rows), self.norm)
        return F.linear(h, self.lm_head).float()
