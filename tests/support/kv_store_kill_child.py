"""Helper for the kill -9 test of KVStore (tests/storage/test_kv_store.py).

Run as a script it is a small fork server, so that torch is imported once and
not once per trial. It speaks lines on stdin/stdout:

    (prints)   ready
    go DIR  -> forks a writer that saves key "conv" into KVStore(DIR) forever,
               alternating versions A and B; prints the writer's pid
    reap PID -> waits for that (killed) writer; prints "reaped <wait status>"
    quit

The parent SIGKILLs each writer at a random moment and checks what is left.
"""

from __future__ import annotations

import torch

KEY = "conv"
FINGERPRINT = "kill-test-model"
KV_DTYPE = "bfloat16"
LAYERS, HEADS, HEAD_DIM = 4, 2, 64
TOKENS_A = 96  # version A holds a prefix of version B's tokens
TOKENS_B = 160


def versions():
    """The two versions the writer alternates: (token_ids, k, v) each.

    B's tokens extend A's, so one load with B's token ids verifies either.
    Tensor values differ between the versions, so a mix would be seen.
    """
    g = torch.Generator().manual_seed(1234)
    all_ids = torch.randint(0, 50_000, (TOKENS_B,), generator=g).tolist()
    out = {}
    for name, n in (("A", TOKENS_A), ("B", TOKENS_B)):
        k = [torch.randn(n, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
        v = [torch.randn(n, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
        out[name] = (all_ids[:n], k, v)
    return out


def _writer(root: str, data) -> None:
    from chatkv.storage.kv_store import KVStore

    store = KVStore(root)
    while True:
        for name in ("A", "B"):
            ids, k, v = data[name]
            store.save(KEY, ids, k, v, model_fingerprint=FINGERPRINT, kv_dtype=KV_DTYPE)


def main() -> None:
    torch.set_num_threads(1)
    import chatkv.storage.kv_store  # noqa: F401  (imported before forking)

    data = versions()
    from fork_server import serve  # tests/support/fork_server.py (tests/support/ is this script's sys.path[0])

    serve(lambda root: _writer(root, data))


if __name__ == "__main__":
    main()
