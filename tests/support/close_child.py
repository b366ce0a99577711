"""Helper of tests/engine/test_close.py: one turn in a fresh interpreter that then ends without close().

    close_child.py MODEL_DIR DATA_DIR MODE

MODE "plain" (no loop thread) or "started" (``engine.start()``). Opens an Engine on DATA_DIR,
sends one turn whose KV is bigger than the size at which snapshot checksums are computed on
a thread pool, prints {"conv", "prompt_tokens", "generated_tokens", "tokens", "kv_bytes"} as
one JSON line, and returns: the interpreter exits without ``engine.close()``.

So that the turn's KV reaches the disk only in the exit path, the snapshot directory's lock
is held during the turn (as another process restoring from it would hold it) and let go by
an exit handler that runs after ``concurrent.futures`` has shut down (threading's exit hooks
run before ``atexit``'s) and before the snapshot writer's own (``atexit`` runs last-registered
first): the writer then writes while the interpreter is exiting.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import sys
from pathlib import Path

import torch

# ~190 tokens of the tiny tokenizer: with BIG_KV's 32 KiB of KV per token the snapshot is
# over storage.kv_store._PARALLEL_MIN_BYTES (4 MiB)
SYSTEM = (
    "You are a helpful assistant. " * 3 + "Key-value caches keep attention state between turns of a conversation. " * 8
)
QUESTION = "What is the capital of France? The quick brown fox jumps over the lazy dog."
GREEDY = dict(max_tokens=8, temperature=0.0)
NUM_BLOCKS = 64
# a tiny llama whose KV is large per token (8 KV heads of 128, 4 layers, float32) but whose weights stay small
BIG_KV = dict(
    hidden_size=64,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=128,
    num_hidden_layers=4,
)


def main() -> None:
    model_dir, data_dir, mode = sys.argv[1:4]
    torch.set_num_threads(1)
    from chatkv import Engine, SamplingParams
    from chatkv.config import EngineConfig

    engine = Engine(model_dir, EngineConfig(data_dir=data_dir, num_blocks=NUM_BLOCKS))
    if mode == "started":
        engine.start()
    s = engine.session(system=SYSTEM)  # the store and the snapshot directory are open now
    lock = os.open(Path(data_dir) / "kv" / ".lock", os.O_RDWR | os.O_CREAT, 0o600)  # storage.kv_segments.LOCK_NAME
    fcntl.flock(lock, fcntl.LOCK_EX)
    atexit.register(os.close, lock)  # closing the descriptor lets the lock go
    r = s.send(QUESTION, SamplingParams(**GREEDY))
    print(
        json.dumps(
            {
                "conv": s.id,
                "prompt_tokens": r.usage.prompt_tokens,
                "generated_tokens": r.usage.generated_tokens,
                "tokens": len(s.tokens),
                "kv_bytes": engine.kv_bytes_per_token * (r.usage.prompt_tokens + r.usage.generated_tokens - 1),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
