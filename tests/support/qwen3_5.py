"""A seeded tiny Qwen3.5 text model (transformers' ``qwen3_5_text``) saved as a Hugging Face directory
with tests.support.tiny's tokenizer, so chatkv's Engine loads it and transformers is its oracle.

Six layers, [linear, linear, full] twice, GQA in both kinds, partial rotary. Weights are redrawn at
scales that give O(1) activations and every norm a weight away from its initial value (a ``1 + w``
norm mistaken for ``w`` would show), as tests/model/test_qwen3_5.py draws them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.tiny import VOCAB, make_tokenizer


def make_qwen3_5(out_dir: Path, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Save the model in ``dtype`` to ``out_dir``; return the transformers model (in ``dtype``)."""
    from transformers import Qwen3_5ForCausalLM

    config = tiny_config(VOCAB, eos_token_id=2, bos_token_id=0)  # 2: <|im_end|>
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).eval()
    redraw(model, seed)
    model = model.to(dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    make_tokenizer(out_dir)
    return model


def redraw(model, seed: int) -> None:
    """Redraw a Qwen3.5 model's weights at scales that give O(1) activations, every norm a weight
    away from its initial value (so a ``w`` vs ``1 + w`` mistake shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.3 * r)  # the gated norm scales by w
            elif name.endswith("norm.weight"):
                p.copy_(0.3 * r)  # every other norm by 1 + w
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.1, 4, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * r)
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * r)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(r)
            else:  # projections: unit-variance outputs
                p.copy_(r / p.shape[-1] ** 0.5)


def tiny_config(vocab_size: int, **overrides):
    """The tiny Qwen3.5 config both the model tests and the engine tests use: 6 layers, [linear,
    linear, full] twice, GQA in both kinds, partial rotary; ``overrides`` (token ids) on top."""
    from transformers import Qwen3_5TextConfig

    fields = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        full_attention_interval=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    return Qwen3_5TextConfig(**{**fields, **overrides})
