"""Decode latency of running chats while a 2k-token prompt arrives, with and without chunked prefill.

Four requests decode (greedy, 96 tokens each) on a started engine; after their first
tokens a ~2k-token prompt is submitted. Each running request's gaps between tokens are
recorded from its stream, and those that span the long prompt's arrival-to-first-token
interval are reported (max and p90), for:

  chunked   max_batch_tokens=256: the long prompt is computed 256 tokens a step, each
            step also decoding the running requests
  whole     max_batch_tokens=4096: the long prompt is computed in one step; the running
            requests wait for it

Same process, same weights, same threads, SmolLM2-135M-Instruct bf16 (or --tiny).

    .venv/bin/python benchmarks/bench_chunked_prefill.py [--tiny] [--prompt 2048]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chatkv.config import EngineConfig  # noqa: E402
from chatkv.engine.core import Engine  # noqa: E402
from chatkv.engine.sampling import SamplingParams  # noqa: E402


def run(model_dir, budget: int, prompt_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as home:
        eng = Engine(
            model_dir, EngineConfig(data_dir=home, max_batch_tokens=budget, kv_cache_bytes=256 * 2**20)
        ).start()
        eng.generate("warm up", SamplingParams(max_tokens=4, temperature=0.0))
        params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
        stamps: list[list[float]] = [[] for _ in range(4)]

        def follow(i: int) -> None:
            for _ in eng.submit(f"Chat {i}: tell me about the history of paper making.", params):
                stamps[i].append(time.perf_counter())

        threads = [threading.Thread(target=follow, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        while min(len(s) for s in stamps) < 8:
            time.sleep(0.001)
        words = ("The river carried paper mills, salt and grain past the old town walls. " * 400).split()
        ids = eng.tokenizer(" ".join(words))["input_ids"][:prompt_tokens]
        t0 = time.perf_counter()
        long = eng.submit(ids, SamplingParams(max_tokens=1, temperature=0.0))
        r = long.result()
        t1 = t0 + r.usage.ttft_s
        for t in threads:
            t.join()
        eng.close()
    during = []
    for s in stamps:
        gaps = [(b - a, a, b) for a, b in zip(s, s[1:])]
        during += [g for g, a, b in gaps if b >= t0 and a <= t1]
    before = [b - a for s in stamps for a, b in zip(s[:8], s[1:8])]
    during.sort()
    return {
        "ttft_long_ms": (t1 - t0) * 1000,
        "gap_before_p50_ms": statistics.median(before) * 1000,
        "gap_during_max_ms": max(during) * 1000 if during else float("nan"),
        "gap_during_p90_ms": during[int(0.9 * (len(during) - 1))] * 1000 if during else float("nan"),
        "gaps_during": len(during),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--prompt", type=int, default=2048)
    args = ap.parse_args()
    if args.tiny:
        from tests.support.tiny import make_model

        model_dir = Path(tempfile.mkdtemp()) / "tiny"
        make_model(model_dir, "llama", seed=0, max_position_embeddings=4096)
    else:
        from chatkv.weights import ensure_default_model

        model_dir = ensure_default_model(None)
    rows = {name: run(model_dir, budget, args.prompt) for name, budget in (("chunked", 256), ("whole", 4096))}
    print(f"model {model_dir.name}; 4 chats decoding while a {args.prompt}-token prompt arrives")
    for name, r in rows.items():
        print(
            f"  {name:8s} long-prompt TTFT {r['ttft_long_ms']:7.0f} ms | "
            f"decode gap before {r['gap_before_p50_ms']:5.1f} ms, "
            f"during: max {r['gap_during_max_ms']:7.1f} ms, p90 {r['gap_during_p90_ms']:7.1f} ms "
            f"({r['gaps_during']} gaps)"
        )
    c, w = rows["chunked"], rows["whole"]
    print(
        f"  worst decode stall: whole {w['gap_during_max_ms'] / c['gap_during_max_ms']:.1f}x chunked's; "
        f"long prompt's TTFT: chunked {c['ttft_long_ms'] / w['ttft_long_ms']:.2f}x whole's"
    )


if __name__ == "__main__":
    main()
