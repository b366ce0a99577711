"""Gemma 3's text model (transformers' ``gemma3_text``) over paged KV: ``Gemma3Model``.

What differs from the Llama forward (chatkv.model.forward.LlamaModel), each as transformers'
modeling_gemma3.py computes it (its oracle, tests/model/test_gemma3.py):

- every RMSNorm scales by ``1 + w`` and computes in float32, casting once at the end
  (Gemma3RMSNorm); the stored norm weights here are ``1 + w`` in float32;
- a layer has four of them, a sandwich: input and post-attention around attention,
  pre- and post-feedforward around the MLP; the post norms apply to the block's output
  before it is added to the residual; q and k are normalised per head as in qwen3;
- the MLP is GeGLU, ``gelu(gate, tanh approximation) * up`` (``hidden_activation``);
- the embeddings are scaled by ``sqrt(hidden_size)`` rounded to the model's dtype, in that dtype;
- attention scales by ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``;
- sliding layers (``layer_types``, ``sliding_window``) and full layers each have their own RoPE
  (``rope_parameters["sliding_attention"]`` / ``["full_attention"]``, the latter with the linear
  scaling of the 4B and larger configs);
- ``final_logit_softcapping`` (``cap * tanh(x / cap)``) when set. ``attn_logit_softcapping`` is a
  field of the config that neither transformers' Gemma 3 attention nor llama.cpp's gemma3 graph
  reads (Gemma 2's softcapping; Gemma 3's configs leave it unset): set or not, it is not applied here.

The quantised weight modes apply as they do to Llama (the same fused projection groups); the
fused decode ops (chatkv.model.fused_decode) do not: they compute Llama's layer. Stored keys move
to new positions layer by layer, each with its own RoPE (``shift_key_positions``: attention
sinks); ``rotate_keys``, which is given no layer, refuses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chatkv.errors import ModelNotFound, UnsupportedModel
from chatkv.kernels import AttentionMetadata, kv_quant
from chatkv.model.forward import LlamaModel, rope_inv_freq

#: transformers' ``hidden_activation`` names and the ``F.gelu`` approximation each computes
ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}
MODEL_TYPE = "gemma3_text"


def model_class(config) -> type[LlamaModel]:
    """The forward that runs ``config``'s model_type: ``Gemma3Model`` for gemma3_text, ``Qwen3_5Model``
    (chatkv.model.qwen3_5) for qwen3_5_text, else ``LlamaModel``."""
    model_type = getattr(config, "model_type", None)
    if model_type == "qwen3_5_text":
        from chatkv.model.qwen3_5 import Qwen3_5Model

        return Qwen3_5Model
    return Gemma3Model if model_type == MODEL_TYPE else LlamaModel


class _Rope:
    """A second RoPE table (the sliding layers'), grown as ``LlamaModel.rope`` grows the model's own."""

    rope = LlamaModel.rope

    def __init__(self, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype, device: torch.device):
        self.inv_freq, self.rope_scaling, self.dtype, self.device = inv_freq.to(device), scaling, dtype, device
        self._cos_sin = torch.empty(0, 2, inv_freq.shape[0] * 2, dtype=dtype, device=device)


class Gemma3Model(LlamaModel):
    """Gemma 3's text model: LlamaModel's stored weights plus the pre/post-feedforward norms, with
    Gemma's forward (module docstring). ``self.rope`` is the full attention layers' RoPE."""

    rope_layer_type = "full_attention"

    def __init__(self, config, weights, dtype, *args, **kwargs):
        activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if activation not in ACTIVATIONS:
            raise UnsupportedModel(
                f"gemma3_text with hidden_activation '{activation}' is not supported; "
                f"chatkv runs {', '.join(ACTIVATIONS)}"
            )
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModel("gemma3_text with use_bidirectional_attention (an embedding model) is not supported")
        types = list(config.layer_types)
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown or len(types) != config.num_hidden_layers:
            raise UnsupportedModel(
                f"gemma3_text layer_types {types} do not name one of sliding_attention/full_attention per layer"
            )
        super().__init__(config, weights, dtype, *args, **kwargs)
        self.approximate = ACTIVATIONS[activation]
        self.scale = config.query_pre_attn_scalar**-0.5
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        # as Gemma3TextScaledWordEmbedding: sqrt(hidden) rounded to the weights' dtype, multiplied in it
        self.embed_scale = torch.tensor(config.hidden_size**0.5).to(dtype)
        self.fused_decode = False  # the fused ops compute Llama's layer

        def norm(w: torch.Tensor) -> torch.Tensor:
            return 1.0 + w.float()  # Gemma3RMSNorm's (1 + weight), from the weight in the model's dtype

        def read(name: str) -> torch.Tensor:
            if name not in weights:
                raise ModelNotFound(f"weight '{name}' missing from the model's safetensors")
            return norm(weights[name].to(device=self.device, dtype=dtype))

        self.pre_ff_norms, self.post_ff_norms = [], []
        for i, (layer, kind) in enumerate(zip(self.layers, types)):
            layer.input_norm, layer.post_norm = norm(layer.input_norm), norm(layer.post_norm)
            if layer.qk_norm is None:
                raise UnsupportedModel(f"gemma3_text layer {i} has no self_attn.q_norm/k_norm weights")
            layer.qk_norm = norm(layer.qk_norm)
            layer.window = config.sliding_window if kind == "sliding_attention" else None
            self.pre_ff_norms.append(read(f"layers.{i}.pre_feedforward_layernorm.weight"))
            self.post_ff_norms.append(read(f"layers.{i}.post_feedforward_layernorm.weight"))
        self.norm = norm(self.norm)
        self.windows = sorted({l.window for l in self.layers}, key=lambda x: -1 if x is None else x)
        self.sliding = [layer.window is not None for layer in self.layers]
        local, local_scaling = rope_inv_freq(config, "sliding_attention")
        self.local_rope = _Rope(local, local_scaling, dtype, self.device)

    def rms(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Gemma3RMSNorm of ``x`` with the stored ``1 + w`` (float32), cast to the compute dtype."""
        return self._norm(x, weight, self.dtype)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * weight).to(dtype)

    def fused_norm_weights(self) -> list[torch.Tensor]:
        raise NotImplementedError("Gemma 3 does not compute through the fused decode ops")

    @torch.inference_mode()
    def shift_key_positions(self, kv: torch.Tensor, blocks: list[int], delta: int, quant: str | None = None) -> None:
        """``LlamaModel.shift_key_positions`` with each layer's own RoPE (sliding or full)."""
        if not blocks or delta == 0:
            return
        idx = torch.tensor(blocks, dtype=torch.long, device=kv.device)
        for layer in range(kv.shape[0]):
            keys = kv[layer, 0]
            inv_freq = self.local_rope.inv_freq if self.sliding[layer] else self.inv_freq
            keys.index_copy_(0, idx, self._rotate(keys.index_select(0, idx), delta, quant, inv_freq))

    @torch.inference_mode()
    def rotate_keys(self, stored: torch.Tensor, delta: int, quant: str | None = None) -> torch.Tensor:
        raise UnsupportedModel(
            "Gemma 3's sliding and full attention layers rotate keys with different RoPEs; "
            "moving one layer's keys needs its layer (shift_key_positions)"
        )

    @staticmethod
    def _rotate(stored: torch.Tensor, delta: int, quant: str | None, inv_freq: torch.Tensor) -> torch.Tensor:
        """``LlamaModel.rotate_keys`` with the RoPE of ``inv_freq``: the angle in float64, the rotation in float32."""
        angle = float(delta) * inv_freq.double()
        emb = torch.cat((angle, angle))
        cos, sin = emb.cos().float().to(stored.device), emb.sin().float().to(stored.device)
        half = angle.shape[0]
        sin[:half] = -sin[:half]
        k = kv_quant.dequantize(stored, quant, torch.float32) if quant else stored.float()
        k = k * cos + torch.cat((k[..., half:], k[..., :half]), dim=-1) * sin
        return kv_quant.quantize(k, quant) if quant else k.to(stored.dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: torch.Tensor,
        metas: dict[int | None, AttentionMetadata],
        logits_rows: torch.Tensor,
        quant: str | None = None,
    ) -> torch.Tensor:
        """One flattened step, as ``LlamaModel.forward`` (same arguments and result)."""
        t = input_ids.shape[0]
        rows = max(t, self.min_rows)  # decode rows padded for oneDNN's faster kernel, as LlamaModel does
        if rows > t:
            input_ids = torch.cat((input_ids, input_ids.new_zeros(rows - t)))
        h = (F.embedding(input_ids, self.embed) * self.embed_scale).to(self.residual_dtype)
        rd = self.residual_dtype  # the post norms' outputs join the residual in its dtype
        tables = {False: self.rope(positions), True: self.local_rope.rope(positions)}
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        slot_mapping = metas[self.layers[0].window].slot_mapping
        k_caches, v_caches = kv[:, 0].unbind(0), kv[:, 1].unbind(0)
        rows_keys = self.rows_keys(metas, quant)
        o_pad = h.new_zeros(rows - t, nh * d, dtype=self.dtype) if rows > t else None
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.layers, k_caches, v_caches)):
            qkv = layer.qkv(self.rms(h, layer.input_norm))
            qkv = (qkv[:t] if rows > t else qkv).view(t, nh + 2 * nkv, d)
            qk = self.rms(qkv[:, : nh + nkv], layer.qk_norm)
            cos, sin = tables[self.sliding[i]]
            qk = self.rotate(qk, cos, sin)
            q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :]
            self.store_kv(k_cache, v_cache, slot_mapping, k, v, quant=quant)
            o = self.attend(q, k_cache, v_cache, metas, layer.window, rows_keys, quant)
            if o_pad is not None:
                o = torch.cat((o, o_pad))
            h = h + self._norm(layer.o(o), layer.post_norm, rd)
            g, u = layer.gate_up(self.rms(h, self.pre_ff_norms[i])).chunk(2, dim=-1)
            m = layer.down(F.gelu(g, approximate=self.approximate) * u)
            h = h + self._norm(m, self.post_ff_norms[i], rd)
        logits = self.lm_head(self.rms(h.index_select(0, logits_rows), self.norm)).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
