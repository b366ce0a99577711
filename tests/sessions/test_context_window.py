"""Conversations longer than the context window: error, truncate and sink (StreamingLLM).

Oracles: transformers' greedy generate on the truncated prompt (truncate recomputes, so its
KV is a fresh conversation's), and tests/support/sink_reference.py (transformers' modules keeping
pre-RoPE keys and rotating them at the re-assigned positions) for sink windows.
"""

from __future__ import annotations

import pytest
import torch

from chatkv import InvalidRequest
from chatkv.config import EngineConfig
from chatkv.engine.core import Engine
from chatkv.engine.model_runner import BatchItem
from chatkv.engine.sampling import SamplingParams
from chatkv.sessions.context_window import ContextOverflow, ContextState, apply, plan
from tests.support.sink_reference import SinkReference
from tests.support.tiny import make_model

BS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    return make_model(d, "llama", seed=11, max_position_embeddings=4096), d


def engine_at(model_dir, data_dir, **kw) -> Engine:
    kw.setdefault("num_blocks", 192)
    return Engine(model_dir, EngineConfig(data_dir=str(data_dir), block_size=BS, **kw))


def message_with_delta(session, n: int) -> str:
    """A user message whose turn adds exactly ``n`` tokens to the session's context."""
    r = session._m.renderer
    delta = (lambda m: r.user_turn(m)) if session.tokens else (lambda m: session._m._delta(session, m))
    words = "quick brown fox jumps over the lazy dog what is the capital of France".split()
    text = ""
    i = 0
    while len(delta(text + "x")) < n:
        text += words[i % len(words)] + " "
        i += 1
    for tail in ("", "a", "ab", "abc", "k", "kv", "Paris", "Hello"):
        if len(delta(text + tail)) == n:
            return text + tail
    for cut in range(1, len(text)):  # trim characters until it fits exactly
        if len(delta(text[:-cut] + "x")) == n:
            return text[:-cut] + "x"
    raise AssertionError(f"no message adds exactly {n} tokens")


# -- the plan itself ---------------------------------------------------------------


def test_plan_boundaries_for_each_policy():
    st = ContextState(policy="error", turns=[10, 40, 70], prefix=10)
    assert plan(st, 100, 27, 64, 128, BS, 4).kind == "none"  # 127 tokens: one left for the reply
    with pytest.raises(ContextOverflow, match="128 tokens"):
        plan(st, 100, 28, 64, 128, BS, 4)
    st.policy = "truncate"
    assert plan(st, 100, 28 - 64 + 27, 1, 128, BS, 4).kind == "none"
    p = plan(st, 100, 20, 10, 128, BS, 4)  # 130 > 128: drop the oldest turn (30 tokens)
    assert (p.kind, p.turns, p.drop, p.cut) == ("truncate", 1, 30, 40)
    ctx = list(range(100))
    new = apply(st, p, ctx)
    assert new == ctx[:10] + ctx[40:] and st.turns == [10, 40] and st.dropped_turns == 1
    st = ContextState(policy="sink", turns=[10, 40, 70], prefix=10)
    p = plan(st, 100, 20, 10, 128, BS, 4)
    assert p.kind == "sink" and p.sink == 16 and p.drop % BS == 0 and p.drop >= 2
    new = apply(st, p, ctx)
    assert new == ctx[:16] + ctx[16 + p.drop :] and st.private and st.epoch == 1
    with pytest.raises(ContextOverflow, match="message takes"):
        plan(ContextState(policy="sink", turns=[10], prefix=10), 50, 128, 10, 128, BS, 4)


def test_bad_options_are_refused(model):
    _, d = model
    with pytest.raises(InvalidRequest, match="overflow"):
        EngineConfig.from_kwargs(overflow="forever")
    with pytest.raises(InvalidRequest, match="sink_tokens"):
        EngineConfig.from_kwargs(sink_tokens=-1)
    with pytest.raises(InvalidRequest, match="context_window"):
        EngineConfig.from_kwargs(context_window=float("nan"))
    with pytest.raises(InvalidRequest, match="exceeds the model's context"):
        Engine(d, EngineConfig(context_window=10**9, num_blocks=8))


# -- error and truncate at the exact boundary --------------------------------------


def test_error_policy_at_the_exact_boundary(model, tmp_path):
    _, d = model
    eng = engine_at(d, tmp_path, context_window=256, overflow="error")
    s = eng.session(system="You are a helpful assistant.")
    s.send("Hello, how are you today?", SamplingParams(max_tokens=8, temperature=0.0))
    before = len(s.messages())
    over = message_with_delta(s, 256 - len(s.tokens))  # exactly the window: no room for one token
    with pytest.raises(ContextOverflow, match="overflow='error'"):
        s.send(over, SamplingParams(max_tokens=8, temperature=0.0))
    assert len(s.messages()) == before  # refused before anything was stored
    fits = message_with_delta(s, 255 - len(s.tokens))
    r = s.send(fits, SamplingParams(max_tokens=8, temperature=0.0))
    assert r.usage.prompt_tokens == 255 and r.usage.generated_tokens == 1 and r.finish_reason == "length"
    eng.check_integrity()
    eng.close()


def test_truncate_at_the_exact_boundary_drops_whole_turns_and_matches_a_fresh_conversation(model, tmp_path):
    ref, d = model
    eng = engine_at(d, tmp_path, context_window=256, overflow="truncate")
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    a, s = eng.session(system="You are a helpful assistant."), eng.session(system="You are a helpful assistant.")
    for q in ("Hello", "Hi", "Paris"):  # two sessions with the same history
        assert a.send(q, greedy).context.dropped_tokens == 0
        assert s.send(q, greedy).context.dropped_tokens == 0
    assert a.tokens == s.tokens
    prefix = s.window.prefix
    turns = list(s.window.turns)
    ctx = list(s.tokens)
    reserve = 8  # min(max_tokens, window // 4)
    exact = message_with_delta(s, 256 - reserve - len(ctx))
    r = a.send(exact, greedy)  # prompt + reply room == window: nothing dropped
    assert r.context.dropped_tokens == 0 and r.usage.prompt_tokens == 256 - reserve
    over = 256 - reserve - len(ctx) + 1
    r = s.send(message_with_delta(s, over), greedy)  # one token over: the oldest whole turns go
    # as few as leave window // 8 = 32 tokens to spare (so the next turns need no recompute)
    n = next(n for n in range(1, len(turns)) if prefix + len(ctx) - turns[n] + over + reserve + 32 <= 256)
    assert r.context.dropped_turns == n and r.context.recomputed
    assert r.context.dropped_tokens == turns[n] - prefix
    prompt = s.tokens[: r.usage.prompt_tokens]
    assert prompt[:prefix] == ctx[:prefix] and prompt[prefix : len(ctx) - turns[n] + prefix] == ctx[turns[n] :]
    assert r.usage.prompt_tokens + reserve <= 256
    assert r.usage.cached_tokens >= prefix // BS * BS  # the system prompt still hits the cache
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert s.tokens[len(prompt) : len(prompt) + 8] == out[0, len(prompt) :].tolist()
    assert len(s.messages()) == 8  # stored messages are never deleted
    assert turns[0] == prefix
    eng.check_integrity()
    eng.close()


# -- sink: the reference, memory, restore ---------------------------------------------


def test_sink_window_logits_match_the_reference(model, tmp_path):
    hf, d = model
    eng = engine_at(d, tmp_path, context_window=256, sink_tokens=4, overflow="sink")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    s = eng.session(system="You are a helpful assistant.")
    ref = SinkReference(hf)
    computed = 0  # tokens of the context whose KV the reference holds
    moves = 0
    for i in range(14):
        q = f"Question {i}: what is the capital of France, and why is the quick brown fox so quick?"
        r = s.send(q, greedy)
        if r.context.dropped_tokens:
            moves += 1
            ref.drop(r.context.sink_tokens, r.context.dropped_tokens)
            computed -= r.context.dropped_tokens
        prompt = s.tokens[: r.usage.prompt_tokens]
        generated = s.tokens[r.usage.prompt_tokens : r.usage.prompt_tokens + r.usage.generated_tokens]
        assert ref.length == computed
        logits = ref.forward(prompt[computed:] + generated[:-1])
        # teacher-forced: the reference's greedy choice at every step is chatkv's token
        assert logits[len(prompt) - computed - 1 :].argmax(-1).tolist() == generated
        computed = len(prompt) + len(generated) - 1
        assert r.usage.prompt_tokens + r.usage.generated_tokens <= 256
    assert moves >= 2 and s.window.private
    # the window's KV against the reference: logits of a probe continued from it
    kept = s.kept
    assert kept.kv_len == computed == ref.length
    kv = eng.kv
    blocks = kv._path_blocks(kept.node) + ([kept.tail_block] if kept.tail_block is not None else [])
    probe = s.tokens[kept.kv_len :] + eng.session_manager.renderer.user_turn("Tell me more about foxes.")
    extra = eng.runner.pool.allocate(-(-(kept.kv_len + len(probe)) // BS) - len(blocks))
    tail = []
    if kept.tail_block is not None:  # the probe writes after the tail's tokens: work on a copy of it
        tail = eng.runner.pool.allocate(1)
        eng.runner.pool.copy_blocks([kept.tail_block], tail)
        blocks = blocks[:-1] + tail
    got = eng.runner.forward(eng.runner.build_batch([BatchItem(probe, kept.kv_len, blocks + extra, "all")]))
    eng.runner.pool.decref(extra + tail)
    want = ref.forward(probe)
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    assert len(s.messages()) == 28
    eng.check_integrity()
    eng.close()


def test_a_20k_token_conversation_runs_in_the_memory_of_its_window(model, tmp_path):
    _, d = model
    window = 2048
    eng = engine_at(d, tmp_path, context_window=window, overflow="sink", num_blocks=window // BS + 24)
    s = eng.session(system="You are a helpful assistant.")
    long_q = "The quick brown fox jumps over the lazy dog. What is the capital of France? " * 40
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    total = 0
    while total < 20_000:
        r = s.send(long_q, params)
        total += r.usage.prompt_tokens - (r.usage.cached_tokens + r.usage.restored_tokens) + r.usage.generated_tokens
        st = eng.kv_stats()
        held = st["blocks_total"] - st["blocks_free"] - st["blocks_evictable"]
        assert s.kept.kv_len <= window
        assert held <= window // BS, f"{held} blocks held, the window is {window // BS}"
        assert r.usage.prompt_tokens + r.usage.generated_tokens <= window
    assert s.window.dropped_tokens > 15_000
    assert r.context.total_dropped_tokens == s.window.dropped_tokens
    eng.check_integrity()
    eng.close()


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])  # int8: shifted keys are requantised, then snapshotted
def test_a_sink_window_restores_from_disk_to_the_same_window(model, tmp_path, kv_dtype):
    _, d = model
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    qs = [f"Question {i}: what is the capital of France, and why is the quick brown fox so quick?" for i in range(11)]

    def engine(home):
        return engine_at(d, home, context_window=256, sink_tokens=4, overflow="sink", kv_dtype=kv_dtype)

    eng = engine(tmp_path / "a")
    s = eng.session(system="You are a helpful assistant.")
    for q in qs[:-1]:
        s.send(q, greedy)
    assert s.window.private and s.window.epoch >= 2
    sid, window_tokens = s.id, list(s.tokens)
    eng.close()  # no KV stays in memory
    eng = engine(tmp_path / "a")
    s = eng.resume(sid)
    assert s.tokens == window_tokens and s.window.private
    restored = s.send(qs[-1], greedy)
    # everything the window kept came from disk (this turn may have moved it further)
    assert restored.usage.restored_tokens >= 0.95 * (len(window_tokens) - restored.context.dropped_tokens)
    assert restored.usage.computed_tokens == restored.usage.prompt_tokens - restored.usage.restored_tokens
    eng.check_integrity()
    eng.close()
    eng = engine(tmp_path / "b")  # the same conversation, never interrupted
    u = eng.session(system="You are a helpful assistant.")
    for q in qs:
        last = u.send(q, greedy)
    assert last.text == restored.text and last.usage.prompt_tokens == restored.usage.prompt_tokens
    eng.close()


def test_overflow_is_per_session_and_saved(model, tmp_path):
    _, d = model
    eng = engine_at(d, tmp_path, context_window=256)
    s = eng.session(overflow="truncate")
    assert s.overflow == "truncate"
    with pytest.raises(InvalidRequest, match="overflow"):
        s.set_overflow("never")
    s.set_overflow("error")
    s.send("Hello, how are you today?", SamplingParams(max_tokens=4, temperature=0.0))
    sid = s.id
    eng.close()
    eng = engine_at(d, tmp_path, context_window=256)
    assert eng.resume(sid).overflow == "error"
    with pytest.raises(InvalidRequest, match="overflow"):
        eng.session(overflow=3)
    eng.close()


def test_a_message_longer_than_the_window_is_refused_before_anything_is_stored(model, tmp_path):
    _, d = model
    eng = engine_at(d, tmp_path, context_window=128, overflow="sink")
    s = eng.session()
    with pytest.raises(ContextOverflow, match="Shorten"):
        s.send("fox " * 400)
    assert s.messages() == []
    s.send("Hello", SamplingParams(max_tokens=4, temperature=0.0))
    with pytest.raises(ContextOverflow):
        s.send("fox " * 400)
    assert len(s.messages()) == 2
    eng.check_integrity()
    eng.close()
