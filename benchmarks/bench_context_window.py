"""Conversations longer than the context: the StreamingLLM result and memory held per policy.

Part 1, perplexity per 512-token span over a long natural-prose text that ships offline
(the Python reference manual's topic texts, ``pydoc_data.topics``, 6k+ tokens), read by
the packaged SmolLM2-135M-Instruct in chunks of 64 tokens, in one run:

  full    the whole text in context (baseline; it fits the model's 8k context)
  sink    a window of ``--window`` tokens keeping 16 attention-sink tokens (4 rounded up to
          a block) and the most recent ones, keys re-rotated to the new positions
  window  the same window without sinks (sink_tokens=0): StreamingLLM's failing baseline

The window is moved with the engine's own ``KVManager.slide`` over the engine's paged
blocks, exactly as a chat session moves it, by at least window/8 tokens at a time.

Part 2, memory held vs conversation length (1k..20k tokens) for each overflow policy:
a chat of long user messages (replies of 16 tokens), KV blocks held by the engine
(not free, not evictable cache) after each turn, with ``--context-window`` tokens.
``error`` stops at the window by design.

    .venv/bin/python benchmarks/bench_context_window.py [--window 1024] [--tokens 6144] [--tiny]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chatkv.engine.detokenize import TextStream  # noqa: E402
from chatkv.engine.model_runner import BatchItem  # noqa: E402
from chatkv.engine.sampling import SamplingParams  # noqa: E402
from chatkv.engine.sequence import Sequence  # noqa: E402
from chatkv.sessions.context_window import ContextState, apply, plan  # noqa: E402


def long_text() -> str:
    import pydoc_data.topics as t

    keys = ["datamodel", "class", "execmodel", "import", "exceptions", "naming", "types", "specialnames"]
    return "\n\n".join(t.topics[k] for k in keys if k in t.topics)


def stream_nll(engine, ids: list[int], window: int | None, sink_tokens: int, chunk: int = 64, tag="") -> list[float]:
    """Negative log-likelihood of every token after the first, reading ``ids`` in chunks with
    the KV window moved as a sink-mode session moves it (``window`` None: no window). Runs
    with different ``tag`` never share cached KV."""
    kv, runner = engine.kv, engine.runner
    bs = kv.block_size
    st = ContextState(policy="sink", turns=[0], prefix=0)
    context: list[int] = []
    kept = None
    nll: list[float] = []
    pos = 0
    while pos < len(ids):
        new = ids[pos : pos + chunk]
        if window is not None:
            p = plan(st, len(context), len(new), 1, window, bs, sink_tokens)
            if p.kind == "sink":
                old_ns = ("bench", tag, st.epoch) if st.private else None
                context = apply(st, p, context)
                kept = kv.slide(
                    kept, context, p.sink, p.drop, ("bench", tag, st.epoch), engine.shift_keys, old_namespace=old_ns
                )
        ns = ("bench", tag, st.epoch)
        seq = Sequence(
            0,
            context + new,
            len(context) + len(new),
            SamplingParams(),
            None,
            frozenset(),
            10**9,
            TextStream(engine.tokenizer, []),
            retain=True,
            prefix=kept,
        )
        seq.namespace = ns
        kv.attach(seq)
        assert seq.num_computed == len(context), (seq.num_computed, len(context))
        assert kv.reserve(seq.kv, len(new)), "the KV pool is too small for the window"
        item = BatchItem(new, seq.num_computed, seq.block_table, "all")
        logits = runner.forward(runner.build_batch([item]))
        seq.num_computed += len(new)
        logp = torch.log_softmax(logits.float(), -1)
        targets = ids[pos + 1 : pos + 1 + len(new)]
        nll.extend(-logp[i, t].item() for i, t in enumerate(targets))
        kept = kv.release(seq, retain=True)
        context = context + new
        pos += len(new)
    kv.drop(kept)
    return nll


def spans(nll: list[float], size: int = 512) -> list[float]:
    return [math.exp(sum(nll[i : i + size]) / len(nll[i : i + size])) for i in range(0, len(nll), size)]


def perplexity(engine, window: int, n_tokens: int) -> None:
    ids = engine.tokenizer(long_text())["input_ids"][:n_tokens]
    print(f"\n## Perplexity per 512-token span, {len(ids)} tokens, window {window}, chunks of 64")
    rows = {}
    for name, w, sink in (("full", None, 0), ("sink", window, 4), ("window", window, 0)):
        t = time.perf_counter()
        rows[name] = spans(stream_nll(engine, ids, w, sink, tag=name))
        print(f"  {name:6s} ({time.perf_counter() - t:5.1f} s): " + " ".join(f"{x:7.2f}" for x in rows[name]))
    late = slice(math.ceil(window / 512), None)  # spans after the window first moved
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    f, s, w = mean(rows["full"][late]), mean(rows["sink"][late]), mean(rows["window"][late])
    print(
        f"  after the first move: full {f:.2f}, sink {s:.2f} ({s / f:.2f}x full), "
        f"window without sinks {w:.2f} ({w / f:.2f}x full, {w / s:.2f}x sink)"
    )


def eng_tokenizer(model_dir):
    from chatkv.weights import load_tokenizer

    return load_tokenizer(model_dir)


def memory(model_dir, window: int, max_tokens: int, tiny: bool) -> None:
    from chatkv.config import EngineConfig
    from chatkv.engine.core import Engine

    print(f"\n## KV held vs conversation length, context_window {window}")
    words = long_text().split()
    n = 40
    while n < len(words) and len(eng_tokenizer(model_dir)(" ".join(words[:n]))["input_ids"]) < window // 5:
        n += 20
    text = " ".join(words[:n])  # a message of about a fifth of the window
    for policy in ("sink", "truncate", "error"):
        with tempfile.TemporaryDirectory() as home:
            eng = Engine(model_dir, EngineConfig(data_dir=home, context_window=window, overflow=policy))
            per_block = eng.model.kv_bytes_per_token * eng.kv.block_size
            s = eng.session(system="You are a helpful assistant.")
            total, marks, line = 0, [1000, 2000, 5000, 10000, 20000], []
            t = time.perf_counter()
            try:
                while total < max_tokens:
                    r = s.send(text, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
                    total += (
                        r.usage.prompt_tokens - r.usage.cached_tokens - r.usage.restored_tokens - r.usage.host_tokens
                    )
                    total += r.usage.generated_tokens
                    st = eng.kv_stats()
                    held = (st["blocks_total"] - st["blocks_free"] - st["blocks_evictable"]) * per_block / 2**20
                    while marks and total >= marks[0]:
                        line.append(f"{marks.pop(0) // 1000}k: {held:5.1f} MB")
            except Exception as e:  # noqa: BLE001 - error policy: the turn past the window is refused
                line.append(f"refused at {total} tokens ({type(e).__name__})")
            print(f"  {policy:8s} ({time.perf_counter() - t:5.1f} s): " + ", ".join(line))
            eng.close()
    print(f"  (the window's own KV: {window * eng.model.kv_bytes_per_token / 2**20:.1f} MB)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=6144)
    ap.add_argument("--context-window", type=int, default=2048)
    ap.add_argument("--conversation", type=int, default=20000)
    ap.add_argument("--tiny", action="store_true", help="a seeded random tiny model (smoke run)")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    from chatkv.config import EngineConfig
    from chatkv.engine.core import Engine

    if args.tiny:
        from tests.support.tiny import make_model

        model_dir = Path(tempfile.mkdtemp()) / "tiny"
        make_model(model_dir, "llama", seed=0, max_position_embeddings=8192)
    else:
        from chatkv.weights import ensure_default_model

        model_dir = ensure_default_model(None)
    print(f"model {model_dir.name}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as home:
        eng = Engine(model_dir, EngineConfig(data_dir=home, kv_cache_bytes=256 * 2**20))
        perplexity(eng, args.window, args.tokens)
        eng.close()
    memory(model_dir, args.context_window, args.conversation, args.tiny)


if __name__ == "__main__":
    main()
