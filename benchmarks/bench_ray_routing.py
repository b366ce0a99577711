"""Replicas on Ray Serve (``chatkv serve --ray``): what routing costs per request, and what
cache affinity buys over round robin.

1. Routing overhead: the same small request (a stateless chat whose prompt is cached, one
   greedy token) sent one at a time, N times, to the single-process ``chatkv serve`` and to
   the Ray app (HTTP proxy -> ingress -> router -> engine replica); the difference of the
   median latencies is what the Ray hops add per request.
2. Cache hit ratio: 2 replicas, 16 sessions x 10 turns at once (``X-Session-Id``, 32 greedy
   tokens a reply), then 16 stateless chats x 10 turns (the whole history re-sent), under
   affinity routing, round robin and Ray's default (power of two choices), each on a fresh
   deployment. Reported per routing: the share of turns 2+'s prompt tokens found in the
   answering replica's memory, the share restored from the shared snapshots, the tokens
   computed, throughput and the median request latency.

Both servers run the same model, dtype and one torch thread per engine (a replica reserves
one of the machine's CPUs). The Ray processes (raylet, controller, proxy, replicas) are
counted in the "other processes" load figure, as they are not this process's children.

    .venv/bin/python benchmarks/bench_ray_routing.py [--tiny] [--sessions 16] [--turns 10] [--requests 200]
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench_serve import free_port, started, stop
from common import OtherLoad, load_average, print_table

NEW_TOKENS = 32
SYSTEM = "You are a helpful assistant. Answer in a few sentences."
QUESTIONS = [
    "Why is the sky blue?",
    "And at sunset?",
    "What about on Mars?",
    "Why are clouds white?",
    "What makes a rainbow?",
    "Why do stars twinkle?",
    "What colour is the ocean, and why?",
    "Why is snow white?",
    "How do polarised sunglasses work?",
    "Summarise what we said.",
]


def start_single(model_dir: Path, dtype: str, data_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-c",
        "import sys; from chatkv.cli import main; sys.exit(main())",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--data-dir",
        str(data_dir),
        "--dtype",
        dtype,
        "--log-level",
        "warning",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, env=env)
    return proc, started(proc, f"http://127.0.0.1:{port}", "chatkv serve")


async def post(client, url: str, body: dict, session: str | None = None) -> tuple[dict, dict, float]:
    t0 = time.perf_counter()
    async with client.post(
        url + "/v1/chat/completions", json=body, headers={"X-Session-Id": session} if session else {}
    ) as r:
        text = await r.text()
        took = time.perf_counter() - t0
        assert r.status == 200, (r.status, text)
        return json.loads(text), {k.lower(): v for k, v in r.headers.items()}, took


def session():  # aiohttp comes with ray[serve]
    import aiohttp

    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=600), connector=aiohttp.TCPConnector(limit=0, force_close=True)
    )


async def overhead(url: str, model: str, n: int) -> list[float]:
    """Latencies (ms) of ``n`` identical small requests, one at a time, after 10 to warm up."""
    body = {
        "model": model,
        "max_tokens": 1,
        "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}],
    }
    out = []
    async with session() as client:
        for i in range(n + 10):
            _, _, took = await post(client, url, body)
            if i >= 10:
                out.append(took * 1000)
    return out


async def chats(url: str, model: str, n: int, turns: int, salt: str, sessions: bool) -> tuple[float, list]:
    """``n`` chats at once; per request: usage, latency, the replica that answered, the turn."""
    out: list = []

    async def one(i: int, client) -> None:
        msgs = [{"role": "system", "content": f"{SYSTEM} ({salt} {i})"}]
        sid = "new" if sessions else None
        for t in range(turns):
            msgs.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
            send = msgs if (not sessions or t == 0) else msgs[-1:]
            body = {"model": model, "messages": send, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
            while True:
                try:
                    data, headers, took = await post(client, url, body, sid)
                    break
                except AssertionError as e:  # 409 session_busy: the previous turn's lease is not released yet
                    if "session_busy" not in str(e):
                        raise
                    await asyncio.sleep(0.01)
            sid = headers.get("x-session-id", sid)
            out.append(
                {
                    "usage": data["usage"],
                    "ms": took * 1000,
                    "replica": headers.get("x-chatkv-replica", "-"),
                    "turn": t,
                    "chat": i,
                }
            )
            msgs.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})

    start = time.perf_counter()
    async with session() as client:
        await asyncio.gather(*(one(i, client) for i in range(n)))
    return time.perf_counter() - start, out


def decisions(url: str) -> dict[str, float]:
    """The ingress's ``chatkv:router_decisions_total`` by reason (chat requests)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    return {
        s.labels["reason"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "chatkv:router_decisions_total" and s.labels.get("reason", "").startswith("chat:")
    }


def figures(wall: float, out: list) -> dict:
    later = [o for o in out if o["turn"] > 0]
    prompt = sum(o["usage"]["prompt_tokens"] for o in later)
    moves = 0
    by_chat: dict = {}
    for o in sorted(out, key=lambda o: (o["chat"], o["turn"])):
        moves += o["chat"] in by_chat and by_chat[o["chat"]] != o["replica"]
        by_chat[o["chat"]] = o["replica"]
    return {
        "memory": sum(o["usage"]["chatkv"]["cached_tokens"] + o["usage"]["chatkv"]["host_tokens"] for o in later)
        / prompt,
        "restored": sum(o["usage"]["chatkv"]["restored_tokens"] for o in later) / prompt,
        "cached": sum(o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in later) / prompt,
        "computed": sum(o["usage"]["chatkv"]["computed_tokens"] for o in out),
        "tok/s": sum(o["usage"]["completion_tokens"] for o in out) / wall,
        "p50": statistics.median(o["ms"] for o in out),
        "moves": moves,
        "busiest": max(Counter(o["replica"] for o in out).values()) / len(out),
    }


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", default=None, help="a model directory (default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--tiny", action="store_true", help="a seeded random tiny model instead (a quick run)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--requests", type=int, default=200, help="small requests timed for the routing overhead")
    p.add_argument("--routings", default="affinity,round_robin,pow2")
    args = p.parse_args()
    load = OtherLoad()
    tmp = Path(tempfile.mkdtemp(prefix="chatkv-bench-ray-"))
    if args.tiny:
        from tests.support.tiny import make_model

        model_dir, args.dtype = tmp / "tiny", "float32"
        make_model(model_dir, "llama", seed=3, max_position_embeddings=4096)
    elif args.model:
        model_dir = Path(args.model)
    else:
        from chatkv.weights import ensure_default_model

        model_dir = ensure_default_model()
    model = model_dir.name

    proc, url = start_single(model_dir, args.dtype, tmp / "single")
    try:
        single = asyncio.run(overhead(url, model, args.requests))
    finally:
        stop(proc)

    import ray
    from ray import serve

    from chatkv.server.ray.deployments import QUIET, ReplicaOptions, ServeOptions, deploy

    ray.init(
        num_cpus=2,
        object_store_memory=128 * 2**20,
        include_dashboard=False,
        logging_level=logging.WARNING,
        runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=QUIET)
    url = f"http://127.0.0.1:{port}"
    results, routed = {}, None
    try:
        for routing in args.routings.split(","):
            engine = dict(data_dir=str(tmp / "shared"), dtype=args.dtype)
            deploy(
                ServeOptions(
                    ReplicaOptions(str(model_dir), model, engine),
                    replicas=2,
                    routing=routing,
                    replica_cpus=1.0,
                    app_name=f"bench-{routing}",
                )
            )
            asyncio.run(chats(url, model, 2, 2, f"warm {routing}", True))
            if routed is None:
                routed = asyncio.run(overhead(url, model, args.requests))
            for sessions in (True, False):
                before = decisions(url)
                results[routing, sessions] = figures(
                    *asyncio.run(chats(url, model, args.sessions, args.turns, f"{routing} {sessions}", sessions))
                )
                after = decisions(url)
                results[routing, sessions]["why"] = ", ".join(
                    f"{k.split(':')[-1]} {after[k] - before.get(k, 0):.0f}"
                    for k in sorted(after)
                    if after[k] > before.get(k, 0)
                )
            serve.delete(f"bench-{routing}")
    finally:
        serve.shutdown()
        ray.shutdown()

    s50, r50 = statistics.median(single), statistics.median(routed)
    print_table(
        f"routing overhead: {args.requests} requests one at a time (1 token, prompt cached), {model} {args.dtype}",
        ["server", "p50 ms", "p90 ms", "mean ms"],
        [
            [name, f"{statistics.median(x):.1f}", f"{sorted(x)[int(0.9 * len(x))]:.1f}", f"{statistics.mean(x):.1f}"]
            for name, x in (("chatkv serve (one process)", single), ("chatkv serve --ray (2 replicas)", routed))
        ],
    )
    print(f"Ray Serve adds {r50 - s50:.1f} ms per request (p50), {r50 / s50:.2f}x the single server's latency")
    rows = []
    for (routing, sessions), f in results.items():
        rows.append(
            [
                routing,
                "sessions" if sessions else "stateless",
                f"{f['memory']:.1%}",
                f"{f['restored']:.1%}",
                f"{f['cached']:.1%}",
                str(f["computed"]),
                str(f["moves"]),
                f"{f['busiest']:.0%}",
                f"{f['tok/s']:.1f}",
                f"{f['p50']:.0f}",
                f["why"] or "-",
            ]
        )
    print_table(
        f"2 replicas, {args.sessions} chats x {args.turns} turns x {NEW_TOKENS} tokens at once",
        [
            "routing",
            "client",
            "in memory (turns 2+)",
            "restored",
            "cached_tokens",
            "computed tokens",
            "replica changes",
            "busiest replica",
            "tok/s",
            "p50 ms",
            "router decisions",
        ],
        rows,
    )
    for sessions in (True, False):
        a = results.get(("affinity", sessions))
        for other in ("round_robin", "pow2"):
            b = results.get((other, sessions))
            if a and b:
                print(
                    f"{'sessions' if sessions else 'stateless'}: affinity / {other}: in-memory hit ratio "
                    f"{a['memory'] / max(b['memory'], 1e-9):.2f}x ({a['memory']:.1%} vs {b['memory']:.1%}), "
                    "tokens computed "
                    f"{a['computed'] / max(b['computed'], 1):.2f}x, tok/s {a['tok/s'] / b['tok/s']:.2f}x"
                )
    print(f"\nload average {load_average()}; {load} (Ray's own processes included)")


if __name__ == "__main__":
    main()
