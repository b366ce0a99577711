"""Helper of tests/sessions/test_write_behind.py: one conversation in a fresh interpreter, ended without close().

    write_behind_child.py MODEL_DIR DATA_DIR MODE

Opens an Engine on DATA_DIR, starts a conversation and sends the first three of
``QUESTIONS``, printing one JSON line per reply ({"conv", "n", "text", "prompt_tokens",
"generated_tokens", "tokens"}). Then MODE "exit" returns: the interpreter exits without
``engine.close()`` (atexit must still write the snapshot); MODE "hang" prints "done" and
sleeps until the parent SIGKILLs it.
"""

from __future__ import annotations

import json
import sys
import time

import torch

SYSTEM = "You are a helpful assistant."
GREEDY = dict(max_tokens=6, temperature=0.0)
QUESTIONS = [
    "Hello, how are you today?",
    "What is the capital of France?",
    "The quick brown fox jumps over the lazy dog.",
    "Key-value caches keep attention state.",
]
NUM_BLOCKS = 96


def main() -> None:
    model_dir, data_dir, mode = sys.argv[1:4]
    torch.set_num_threads(1)
    from chatkv.config import EngineConfig
    from chatkv.engine.core import Engine

    engine = Engine(model_dir, EngineConfig(data_dir=data_dir, num_blocks=NUM_BLOCKS))
    s = engine.session(system=SYSTEM, params=GREEDY)
    for n, q in enumerate(QUESTIONS[:3], 1):
        r = s.send(q)
        print(
            json.dumps(
                {
                    "conv": s.id,
                    "n": n,
                    "text": r.text,
                    "prompt_tokens": r.usage.prompt_tokens,
                    "generated_tokens": r.usage.generated_tokens,
                    "tokens": len(s.tokens),
                }
            ),
            flush=True,
        )
    if mode == "hang":
        print("done", flush=True)
        while True:
            time.sleep(1)


if __name__ == "__main__":
    main()
