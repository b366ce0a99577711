"""An independent StreamingLLM reference, built from transformers' own modules.

It keeps every cached key *before* RoPE and rotates all of them again at each forward,
at their current positions 0..n-1 in the window: the "same window computed with the
re-assigned positions" from scratch. chatkv instead keeps rotated keys and re-rotates
them in place by the position shift when its window moves (rotations compose); the
two must agree. Attention is computed naively in float32 (causal, GQA by repetition).
Dropping tokens from the window is ``drop(sink, n)``: keep the first ``sink`` cached
tokens and those after the next ``n``.
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


class SinkReference:
    def __init__(self, hf_model):
        self.hf = hf_model
        self.body = hf_model.model
        cfg = hf_model.config
        self.nh = cfg.num_attention_heads
        self.nkv = cfg.num_key_value_heads
        self.d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        n = cfg.num_hidden_layers
        self.k = [torch.zeros(0, self.nkv, self.d) for _ in range(n)]  # pre-RoPE keys, [tokens, kv_heads, d]
        self.v = [torch.zeros(0, self.nkv, self.d) for _ in range(n)]

    @property
    def length(self) -> int:
        return self.k[0].shape[0]

    def drop(self, sink: int, n: int) -> None:
        for i in range(len(self.k)):
            self.k[i] = torch.cat((self.k[i][:sink], self.k[i][sink + n :]))
            self.v[i] = torch.cat((self.v[i][:sink], self.v[i][sink + n :]))

    @torch.no_grad()
    def forward(self, ids: list[int]) -> torch.Tensor:
        """Append ``ids`` to the window; return their next-token logits ``[len(ids), vocab]`` (float32)."""
        t0, t = self.length, len(ids)
        h = self.body.embed_tokens(torch.tensor([ids]))
        positions = torch.arange(t0 + t)[None]
        cos, sin = self.body.rotary_emb(h, positions)
        scale = self.d**-0.5
        mask = torch.ones(t, t0 + t, dtype=torch.bool).tril(diagonal=t0)
        for i, layer in enumerate(self.body.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(1, t, self.nh, self.d)
            k = attn.k_proj(x).view(1, t, self.nkv, self.d)
            v = attn.v_proj(x).view(1, t, self.nkv, self.d)
            if hasattr(attn, "q_norm"):  # qwen3
                q, k = attn.q_norm(q), attn.k_norm(k)
            self.k[i] = torch.cat((self.k[i], k[0].float()))
            self.v[i] = torch.cat((self.v[i], v[0].float()))
            keys = self.k[i].transpose(0, 1)[None]  # [1, kv_heads, t0 + t, d], not yet rotated
            q = q.transpose(1, 2)
            q_rot, _ = apply_rotary_pos_emb(q, q, cos[:, t0:], sin[:, t0:])
            _, k_rot = apply_rotary_pos_emb(keys, keys, cos, sin)
            rep = self.nh // self.nkv
            k_rot = k_rot.repeat_interleave(rep, dim=1)
            vals = self.v[i].transpose(0, 1)[None].repeat_interleave(rep, dim=1)
            scores = (q_rot.float() @ k_rot.float().transpose(-1, -2)) * scale
            scores = scores.masked_fill(~mask, float("-inf"))
            o = (scores.softmax(-1) @ vals).transpose(1, 2).reshape(1, t, self.nh * self.d)
            h = h + attn.o_proj(o.to(h.dtype))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.hf.lm_head(self.body.norm(h))[0].float()
