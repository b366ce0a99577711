"""Seeded random tiny models of the Llama family, saved as real Hugging Face directories.

Each directory has safetensors weights, config.json and a small byte-level BPE
tokenizer with a ChatML chat template, so both chatkv and transformers load it.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB = 384

CONFIGS = {
    # 2-4 layers, hidden 64-256, GQA everywhere
    "llama": dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, num_hidden_layers=2
    ),
    "qwen2": dict(
        hidden_size=128, num_attention_heads=8, num_key_value_heads=2, intermediate_size=256, num_hidden_layers=3
    ),
    "qwen3": dict(
        hidden_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=192,
        num_hidden_layers=2,
        head_dim=32,
    ),
    "mistral": dict(
        hidden_size=256, num_attention_heads=8, num_key_value_heads=4, intermediate_size=320, num_hidden_layers=4
    ),
}


def make_tokenizer(out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is.",
        "user assistant system You are a helpful assistant. Hello, how are you today?",
        "Key-value caches keep attention state between turns of a conversation.",
    ] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    fast.save_pretrained(str(out_dir))
    return fast


def make_model(out_dir: Path, model_type: str = "llama", seed: int = 0, dtype=torch.float32, **overrides):
    """Save a seeded random model of ``model_type`` to ``out_dir``; return the transformers model (the oracle)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(CONFIGS[model_type], vocab_size=VOCAB, max_position_embeddings=1024, tie_word_embeddings=False)
    kwargs.update(overrides)
    if model_type == "qwen2":
        kwargs.setdefault("use_sliding_window", False)
    config = AutoConfig.for_model(model_type, **kwargs)
    config.eos_token_id = 2  # <|im_end|>
    config.bos_token_id = 0
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # norms start at 1: perturb so a missing norm is caught
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    make_tokenizer(out_dir)
    return model


# A Qwen2.5-style chat template with tool support (Hermes <tool_call> format), as Qwen2.5 ships it
# but without its default system prompt's wording.
QWEN2_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def make_tool_model(out_dir: Path, seed: int = 0):
    """The tiny Qwen2-style model with a tool-capable chat template (QWEN2_TOOLS)."""
    from transformers import AutoTokenizer

    model = make_model(
        out_dir, "qwen2", seed=seed, max_position_embeddings=4096
    )  # the tool block is long in a 384-token vocabulary
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    tok.chat_template = QWEN2_TOOLS
    tok.save_pretrained(str(out_dir))
    return model
