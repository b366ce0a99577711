"""A GGUF file's tokenizer, written as Hugging Face tokenizer files beside its converted weights.

The vocabulary, merges or scores, special tokens and chat template all come from the file's
``tokenizer.*`` metadata; transformers' GGUF reader builds the tokenizer from them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["save_tokenizer"]


def save_tokenizer(gguf_path: Path, meta: dict[str, Any], out: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    template = meta.get("tokenizer.chat_template")
    if template:
        tok.chat_template = template
    tokens_eos = meta.get("tokenizer.ggml.eos_token_id")
    if tokens_eos is not None:
        eos = tok.convert_ids_to_tokens(int(tokens_eos))
        if tok.eos_token != eos:
            tok.eos_token = eos
    ctx = meta.get(f"{meta.get('general.architecture')}.context_length")
    if ctx:
        tok.model_max_length = int(ctx)
    tok.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    if cfg_path.is_file():
        # transformers 5 names its fast tokenizer class "TokenizersBackend", which 4.x cannot
        # resolve; "PreTrainedTokenizerFast" is the same class in 5.x and exists in 4.x.
        tok_cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        changed = False
        if tok_cfg.get("tokenizer_class") == "TokenizersBackend":
            tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
            changed = True
        for junk in ("is_local", "local_files_only"):  # loading kwargs that 5.x echoes back
            if junk in tok_cfg:
                del tok_cfg[junk]
                changed = True
        if changed:
            cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if template and not (out / "chat_template.jinja").exists():
        # Older transformers keep the template only inside tokenizer_config.json; write
        # the standalone file as well so every reader finds it.
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
