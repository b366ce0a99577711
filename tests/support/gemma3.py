"""A seeded random tiny Gemma 3 text model (``gemma3_text``) saved as a Hugging Face directory.

Both layer types (sliding and full attention, five sliding layers then a full one as Gemma 3's
configs, cut to ``layers``), a sliding window shorter than the test prompts, GQA, head_dim
distinct from hidden / heads, and distinct RoPE bases per layer type with linear scaling on the
full layers (as gemma-3-4b's config). Norm weights are small random numbers (Gemma's norms scale
by ``1 + w``, so a norm left out or applied as ``w`` is caught). The tokenizer is tests.support.tiny's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.tiny import VOCAB, make_tokenizer

CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    query_pre_attn_scalar=24,  # not head_dim: the attention scale is its own
    sliding_window=8,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
    },
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=2,
)


def make_gemma3(out_dir: Path, seed: int = 0, dtype=torch.float32, **overrides):
    """Save a seeded random Gemma3ForCausalLM to ``out_dir``; return transformers' model (the oracle,
    with eager attention)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(**{**CONFIG, **overrides})
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    make_tokenizer(out_dir)
    model.config._attn_implementation = "eager"  # transformers' reference attention (softcapping included)
    return model
