"""Serving over HTTP: 1, 8 and 32 concurrent chats of 10 turns each through ``chatkv serve``,
against transformers serving the same requests one at a time.

Each chat has a system prompt and 10 user turns; the client re-sends the whole history every
turn (stateless, as most OpenAI clients do) and streams 32 greedy tokens per reply, EOS
ignored. ``chatkv serve`` runs in its own process; the clients are ``openai.AsyncOpenAI`` over
loopback, measuring at the client: TTFT = first content chunk - request sent; ITL = per request
(last chunk - first chunk) / (completion tokens - 1); throughput = generated tokens / wall
time of the whole run; cached = prompt tokens reported cached / prompt tokens.

Baseline: transformers ``generate`` on the same prompts (the whole history recomputed every
turn, no KV kept), one request at a time, 2 chats of 10 turns: one-at-a-time serving has the
same rate whatever the number of clients, which only queue (a client behind N others waits N
service times more than the TTFT shown).

    .venv/bin/python benchmarks/bench_serve.py [--dtype bf16|fp32] [--clients 1,8,32] [--turns 10]
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from common import OtherLoad, ENGINE_DTYPES, hf_generate, load_average, load_hf, parser, print_table, setup

NEW_TOKENS = 32
SYSTEM = "You are a helpful assistant. Answer in a few sentences."
QUESTIONS = ["Why is the sky blue?", "And at sunset?", "What about on Mars?", "Why are clouds white?",
             "What makes a rainbow?", "Why do stars twinkle?", "What colour is the ocean, and why?",
             "Why is snow white?", "How do polarised sunglasses work?", "Summarise what we said."]


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def start_server(model_dir: Path, dtype: str, data_dir: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", "import sys; from chatkv.tui.cli import main; sys.exit(main())", "serve",
           "--model", str(model_dir), "--port", str(port), "--data-dir", str(data_dir), "--dtype", ENGINE_DTYPES[dtype],
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("chatkv serve did not start")
        time.sleep(0.2)


async def one_chat(client, model: str, turns: int, salt: int, out: list) -> None:
    msgs = [{"role": "system", "content": f"{SYSTEM} (client {salt})"}]
    for t in range(turns):
        msgs.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
        sent = time.perf_counter()
        first = last = None
        pieces, usage = [], None
        stream = await client.chat.completions.create(
            model=model, messages=msgs, max_tokens=NEW_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                last = time.perf_counter()
                first = first or last
                pieces.append(ch.choices[0].delta.content)
            if ch.usage is not None:
                usage = ch.usage
        n = usage.completion_tokens
        out.append({"ttft": first - sent, "itl": (last - first) / (n - 1) if n > 1 else None, "tokens": n,
                    "cached": usage.prompt_tokens_details.cached_tokens / usage.prompt_tokens, "turn": t})
        msgs.append({"role": "assistant", "content": "".join(pieces)})


async def run_clients(url: str, model: str, clients: int, turns: int, salt: int) -> tuple[float, list]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)
    out: list = []
    start = time.perf_counter()
    await asyncio.gather(*(one_chat(client, model, turns, salt + i, out) for i in range(clients)))
    wall = time.perf_counter() - start
    await client.close()
    return wall, out


def run_hf(model_dir: Path, dtype: str, turns: int, chats: int) -> tuple[float, list]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = load_hf(model_dir, dtype)

    def encode(msgs) -> list[int]:
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    hf_generate(model, encode([{"role": "user", "content": "warm up"}]), 4)
    out: list = []
    start = time.perf_counter()
    for c in range(chats):
        msgs = [{"role": "system", "content": f"{SYSTEM} (client {10_000 + c})"}]
        for t in range(turns):
            msgs.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
            new, began, stamps = hf_generate(model, encode(msgs), NEW_TOKENS)
            out.append({"ttft": stamps[0] - began, "itl": (stamps[-1] - stamps[0]) / (len(stamps) - 1),
                        "tokens": len(new), "cached": 0.0, "turn": t})
            msgs.append({"role": "assistant", "content": tok.decode(new, skip_special_tokens=True)})
    return time.perf_counter() - start, out


def row(name: str, wall: float, out: list) -> list[str]:
    tokens = sum(o["tokens"] for o in out)
    ttft = [o["ttft"] * 1000 for o in out]
    itl = [o["itl"] * 1000 for o in out if o["itl"] is not None]
    later = [o["cached"] for o in out if o["turn"] > 0]
    return [name, str(len(out)), f"{tokens / wall:.1f}", f"{pct(ttft, 50):.0f}", f"{pct(ttft, 99):.0f}",
            f"{pct(itl, 50):.1f}", f"{pct(itl, 99):.1f}", f"{statistics.mean(later) * 100:.1f}%" if later else "-"]


def main() -> None:
    p = parser(__doc__.split("\n", 1)[0])
    p.add_argument("--clients", default="1,8,32", help="comma-separated numbers of concurrent chats")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--baseline-chats", type=int, default=2, help="chats transformers serves (one request at a time)")
    args = p.parse_args()
    model_dir = setup(args)
    dtype = args.dtype if args.dtype != "both" else "bf16"
    load = OtherLoad()
    data_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"chatkv-bench-serve-{os.getpid()}"
    proc, url = start_server(model_dir, dtype, data_dir)
    rows = []
    try:
        model = model_dir.name
        asyncio.run(run_clients(url, model, 2, 2, 90_000))  # warm up
        for i, n in enumerate(int(x) for x in args.clients.split(",")):
            wall, out = asyncio.run(run_clients(url, model, n, args.turns, 1000 * (i + 1)))
            rows.append(row(f"chatkv serve, {n} concurrent", wall, out))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    wall, out = run_hf(model_dir, dtype, args.turns, args.baseline_chats)
    rows.append(row("transformers, one at a time", wall, out))
    print_table(f"{model_dir.name} {dtype}, {args.turns} turns x {NEW_TOKENS} tokens per chat, threads={args.threads}",
                ["server", "requests", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                 "cached (turns 2+)"], rows)
    print(f"\nload average {load_average()}; {load}")


if __name__ == "__main__":
    main()
