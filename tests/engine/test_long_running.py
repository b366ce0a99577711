"""A long-running check: with prefix caching off nothing accumulates.

Caching off must not leave a namespace root per request in the radix cache for ever (a leak
in a long-running process). Here 2,000 short requests (each prompt
spans a full block, which a caching cache would insert) leave the tree no bigger than before,
every block free, and the pool and cache consistent. Sessions with caching off recompute their
history each turn, and give exactly the replies they give with caching on.
"""

from __future__ import annotations

import pytest

from chatkv.config import EngineConfig
from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams
from tests.support.tiny import VOCAB

pytestmark = pytest.mark.tiny_model("llama", seed=13)

BLOCK = 8
REQUESTS, BATCH = 2000, 50
QUESTIONS = [
    "Hello, how are you today?",
    "What is the capital of France?",
    "The quick brown fox jumps over the lazy dog.",
    "Key-value caches keep attention state.",
]


def prompt(i: int) -> list[int]:
    """Ten tokens, distinct for every i < 381**2: one full block of 8 plus two (a caching cache
    would keep a node for each)."""
    n = VOCAB - 3
    return [3 + i % n, 3 + (i // n) % n] + [3 + (i * 7 + k * 31) % n for k in range(BLOCK)]


def test_2000_requests_with_caching_off_leave_no_tree_nodes(model_dir):
    e = Engine(model_dir, EngineConfig(num_blocks=128, block_size=BLOCK, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    assert len({tuple(prompt(i)) for i in range(REQUESTS)}) == REQUESTS
    before = e.kv_stats()
    first = None
    for start in range(0, REQUESTS, BATCH):
        results = e.generate([prompt(i) for i in range(start, start + BATCH)], params)
        assert len(results) == BATCH and all(r.finish_reason in ("stop", "length") for r in results)
        assert all(r.usage.cached_tokens == 0 for r in results), "caching off never shares"
        if first is None:
            first = [r.token_ids for r in results]
    after = e.kv_stats()
    assert after["tree_nodes"] <= before["tree_nodes"], (
        f"the tree grew from {before['tree_nodes']} to {after['tree_nodes']} nodes"
    )
    assert after["blocks_free"] == after["blocks_total"], "every block is back in the pool"
    assert after["blocks_cached"] == 0 and after["retained"] == 0 and after["pins"] == 0
    e.check_integrity()
    e.close()
    # the same requests with caching on give the same tokens (and do keep nodes: the check above means something)
    on = Engine(model_dir, EngineConfig(num_blocks=128, block_size=BLOCK))
    assert [r.token_ids for r in on.generate([prompt(i) for i in range(BATCH)], params)] == first
    assert on.kv_stats()["tree_nodes"] > 0
    on.close()


def run_sessions(model_dir, data_dir, caching: bool):
    e = Engine(
        model_dir, EngineConfig(data_dir=str(data_dir), num_blocks=64, block_size=BLOCK, enable_prefix_caching=caching)
    )
    greedy = dict(max_tokens=4, temperature=0.0)
    out = []
    a = e.session(system="You are a helpful assistant.", params=greedy)
    b = e.session(params=greedy)
    for q in QUESTIONS:
        for s in (a, b):
            r = s.send(q)
            out.append((r.text, r.finish_reason, s.tokens[r.usage.prompt_tokens :]))
            e.check_integrity()
    if not caching:
        assert r.usage.cached_tokens == 0 and r.usage.restored_tokens == 0, "caching off recomputes the history"
    a.close()
    a = e.resume(a.id)  # closed and reopened: the next turn goes on from the stored history
    r = a.send("And then?")
    out.append((r.text, r.finish_reason, a.tokens[r.usage.prompt_tokens :]))
    assert [m.role for m in a.messages()] == ["user", "assistant"] * (len(QUESTIONS) + 1)
    # many short chats, opened and closed, like a long-running server's
    before = e.kv_stats()["tree_nodes"]
    for i in range(30):
        with e.session(params=dict(max_tokens=1, temperature=0.0)) as s:
            out.append((s.send(QUESTIONS[i % len(QUESTIONS)] + f" {i}").text,))
    a.close()
    b.close()
    stats = e.kv_stats()
    if not caching:
        assert stats["tree_nodes"] <= before, "short chats with caching off leave no tree nodes"
        assert stats["blocks_free"] == stats["blocks_total"], "closed chats with caching off hold no block"
    e.check_integrity()
    e.close()
    return out


def test_sessions_with_caching_off_give_the_same_replies(model_dir, tmp_path):
    off = run_sessions(model_dir, tmp_path / "off", caching=False)
    on = run_sessions(model_dir, tmp_path / "on", caching=True)
    assert off == on
