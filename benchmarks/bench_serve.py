"""Serving over HTTP: 1, 8 and 32 concurrent chats of 10 turns each through ``chatkv serve``,
against llama.cpp's ``llama-server`` and transformers serving the same requests one at a time.

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

Peer: llama.cpp's own HTTP server (``llama-server``, continuous batching over parallel slots) on
the packaged GGUF, the same threads, restarted for each number of chats with ``-np`` = that
number and ``-c`` = that many slots of one whole chat, warmed up like chatkv. Both compute with
the GGUF's Q4_1 weights (at ``--dtype bf16`` chatkv's default ``weights=auto`` runs them as its
int4 mode with bf16 activations; transformers, and chatkv at fp32, run them dequantised), with
different kernels, so greedy replies, hence later turns' histories, can differ a little. The same
client code, messages and sampling (a new connection per request for both: see run_clients);
each request also sends ``cache_prompt: true``, so a chat's next turn reuses the KV its slot kept
(llama-server's prefix cache), which it reports as ``cached_tokens``. Found through
``--llama-server PATH`` or ``$LLAMA_SERVER``; without it the rows are skipped with one line that
says how to build it (``LLAMA_BUILD``).

(Just past ~400 lines on purpose: the three servers' runs share one client and one table.)

chatkv serves with its default, ``deterministic`` (every reply the same whatever the load);
``--no-deterministic`` measures the batched kernels' path instead.

    .venv/bin/python benchmarks/bench_serve.py [--dtype bf16|fp32] [--clients 1,8,32] [--turns 10]
        [--llama-server PATH] [--no-deterministic]
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from common import ENGINE_DTYPES, OtherLoad, hf_generate, load_average, load_hf, parser, print_table, setup

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


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


LLAMA_BUILD = (
    "pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36, unpack, then in "
    "vendor/llama.cpp: cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF "
    "-DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF && "
    "cmake --build build --target llama-server -j2 (about 7 minutes on 2 cores)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM it if this process dies, so no server outlives a killed run."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def wait_ready(proc: subprocess.Popen, url: str, name: str, log: Path | None = None) -> None:
    """Poll ``url``/health until it answers 200 (llama-server answers 503 while loading)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = "" if log is None else "\n" + "".join(log.read_text(errors="replace").splitlines(True)[-20:])
            raise SystemExit(f"{name} did not start{tail}")
        time.sleep(0.1)


def started(proc: subprocess.Popen, url: str, name: str, log: Path | None = None) -> str:
    """``url`` once the server answers; stopped if it does not (or on Ctrl-C meanwhile)."""
    try:
        wait_ready(proc, url, name, log)
    except BaseException:
        stop(proc)
        raise
    return url


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_server(model_dir: Path, dtype: str, data_dir: Path, fast: bool = False) -> tuple[subprocess.Popen, str]:
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
        ENGINE_DTYPES[dtype],
        "--log-level",
        "warning",
        *(["--no-deterministic"] if fast else []),
    ]
    proc = subprocess.Popen(cmd, preexec_fn=_die_with_parent)
    return proc, started(proc, f"http://127.0.0.1:{port}", "chatkv serve")


def llama_server_path(option: str | None) -> tuple[Path | None, str]:
    """The llama-server binary from --llama-server or $LLAMA_SERVER, or (None, why it is skipped)."""
    given = option or os.environ.get("LLAMA_SERVER")
    if not given:
        return None, "no --llama-server PATH or $LLAMA_SERVER given"
    path = Path(given).expanduser()
    if not (path.is_file() and os.access(path, os.X_OK)):
        return None, f"{path} is not an executable file"
    return path, ""


def slot_context(turns: int) -> int:
    """Context for one slot: a whole chat (system ~40 tokens; a turn's question, reply and template
    ~55 tokens), with room to spare, in multiples of 512."""
    return 512 * math.ceil((128 + turns * 2 * (NEW_TOKENS + 16)) / 512)


def start_llama_server(
    binary: Path, gguf: Path, threads: int, slots: int, turns: int, log: Path
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        str(binary),
        "-m",
        str(gguf),
        "-t",
        str(threads),
        "-np",
        str(slots),
        "-c",
        str(slots * slot_context(turns)),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--no-webui",
    ]
    with log.open("ab") as f:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    return proc, started(proc, f"http://127.0.0.1:{port}", "llama-server", log)


async def one_chat(client, model: str, turns: int, salt: int, out: list, extra: dict) -> None:
    msgs = [{"role": "system", "content": f"{SYSTEM} (client {salt})"}]
    for t in range(turns):
        msgs.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
        sent = time.perf_counter()
        first = last = None
        pieces, usage = [], None
        stream = await client.chat.completions.create(
            model=model,
            messages=msgs,
            max_tokens=NEW_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, **extra},
        )
        async for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                last = time.perf_counter()
                first = first or last
                pieces.append(ch.choices[0].delta.content)
            if ch.usage is not None:
                usage = ch.usage
        n = usage.completion_tokens
        out.append(
            {
                "ttft": first - sent,
                "itl": (last - first) / (n - 1) if n > 1 else None,
                "tokens": n,
                "cached": usage.prompt_tokens_details.cached_tokens / usage.prompt_tokens,
                "turn": t,
            }
        )
        msgs.append({"role": "assistant", "content": "".join(pieces)})


async def run_clients(
    url: str, model: str, clients: int, turns: int, salt: int, extra: dict | None = None
) -> tuple[float, list]:
    import openai

    # a new connection per request, for both servers: llama-server (cpp-httplib) now and then drops a
    # kept-alive connection the client reuses ("Server disconnected without sending a response")
    client = openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600, default_headers={"Connection": "close"}
    )
    out: list = []
    start = time.perf_counter()
    await asyncio.gather(*(one_chat(client, model, turns, salt + i, out, extra or {}) for i in range(clients)))
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
            out.append(
                {
                    "ttft": stamps[0] - began,
                    "itl": (stamps[-1] - stamps[0]) / (len(stamps) - 1),
                    "tokens": len(new),
                    "cached": 0.0,
                    "turn": t,
                }
            )
            msgs.append({"role": "assistant", "content": tok.decode(new, skip_special_tokens=True)})
    return time.perf_counter() - start, out


def pcts(out: list) -> dict:
    ttft = [o["ttft"] * 1000 for o in out]
    itl = [o["itl"] * 1000 for o in out if o["itl"] is not None]
    return {"TTFT p50": pct(ttft, 50), "TTFT p99": pct(ttft, 99), "ITL p50": pct(itl, 50), "ITL p99": pct(itl, 99)}


def rate(wall: float, out: list) -> float:
    return sum(o["tokens"] for o in out) / wall


def row(name: str, wall: float, out: list) -> list[str]:
    q = pcts(out)
    later = [o["cached"] for o in out if o["turn"] > 0]
    return [
        name,
        str(len(out)),
        f"{rate(wall, out):.1f}",
        f"{q['TTFT p50']:.0f}",
        f"{q['TTFT p99']:.0f}",
        f"{q['ITL p50']:.1f}",
        f"{q['ITL p99']:.1f}",
        f"{statistics.mean(later) * 100:.1f}%" if later else "-",
    ]


LLAMA_EXTRA = {"cache_prompt": True}  # reuse the KV the slot kept from this chat's previous turn


def run_llama(binary: Path, gguf: Path, threads: int, clients: list[int], turns: int, log: Path) -> dict:
    """llama-server restarted for each number of chats, -np = that number; the same chats as chatkv's."""
    results = {}
    for i, n in enumerate(clients):
        proc, url = start_llama_server(binary, gguf, threads, n, turns, log)
        try:
            asyncio.run(run_clients(url, gguf.stem, 2, 2, 90_000, LLAMA_EXTRA))  # warm up
            results[n] = asyncio.run(run_clients(url, gguf.stem, n, turns, 1000 * (i + 1), LLAMA_EXTRA))
        finally:
            stop(proc)
    return results


def main() -> None:
    p = parser(__doc__.split("\n", 1)[0])
    p.add_argument("--clients", default="1,8,32", help="comma-separated numbers of concurrent chats")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--baseline-chats", type=int, default=2, help="chats transformers serves (one request at a time)")
    p.add_argument(
        "--llama-server",
        metavar="PATH",
        default=None,
        help="llama.cpp's llama-server binary (default: $LLAMA_SERVER); without one its rows are skipped",
    )
    p.add_argument(
        "--no-deterministic",
        action="store_true",
        help="serve with oneDNN's batched kernels (chatkv serve --no-deterministic): the fast path's figures",
    )
    args = p.parse_args()
    model_dir = setup(args)
    dtype = args.dtype if args.dtype != "both" else "bf16"
    clients = [int(x) for x in args.clients.split(",")]
    llama, why = llama_server_path(args.llama_server)
    if llama is not None and args.model:
        llama, why = None, "--model is not the packaged model, whose GGUF llama-server loads"
    load = OtherLoad()
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    data_dir = tmp / f"chatkv-bench-serve-{os.getpid()}"
    llama_log = tmp / f"llama-server-bench-{os.getpid()}.log"
    proc, url = start_server(model_dir, dtype, data_dir, args.no_deterministic)
    rows, chatkv, peer = [], {}, {}
    try:
        model = model_dir.name
        asyncio.run(run_clients(url, model, 2, 2, 90_000))  # warm up
        for i, n in enumerate(clients):
            chatkv[n] = asyncio.run(run_clients(url, model, n, args.turns, 1000 * (i + 1)))
            rows.append(row(f"chatkv serve, {n} concurrent", *chatkv[n]))
    finally:
        stop(proc)
    if llama is not None:
        from chatkv.weights.gguf import packaged_gguf_path

        try:
            peer = run_llama(llama, packaged_gguf_path(), args.threads, clients, args.turns, llama_log)
        except SystemExit as e:  # it did not start: the other rows still stand
            why = str(e)
        rows += [row(f"llama-server -np {n}, {n} concurrent", *peer[n]) for n in peer]
    wall, out = run_hf(model_dir, dtype, args.turns, args.baseline_chats)
    rows.append(row("transformers, one at a time", wall, out))
    hf_rate = rate(wall, out)
    print_table(
        f"{model_dir.name} {dtype}, {args.turns} turns x {NEW_TOKENS} tokens per chat, threads={args.threads}",
        ["server", "requests", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "cached (turns 2+)"],
        rows,
    )
    print(
        "\nchatkv / transformers one at a time, tok/s: "
        + ", ".join(f"{rate(*chatkv[n]) / hf_rate:.2f}x ({n} chat{'s' * (n != 1)})" for n in clients)
    )
    if peer:
        print("chatkv / llama-server (latency ratios below 1: chatkv faster):")
        for n in clients:
            a, b = pcts(chatkv[n][1]), pcts(peer[n][1])
            print(
                f"  {n} chat{'s' * (n != 1)}: tok/s {rate(*chatkv[n]) / rate(*peer[n]):.2f}x; "
                + "; ".join(f"{k} {a[k] / b[k]:.2f}x" for k in a)
            )
        same = "the same, int4 with bf16 activations" if dtype == "bf16" else "dequantised to fp32"
        print(
            f"llama-server: {llama}, the GGUF's Q4_1 weights (chatkv: {same}), -t {args.threads}, -np = chats, "
            f"-c = chats x {slot_context(args.turns)}, restarted per row and warmed up like chatkv; "
            "cache_prompt on (its prefix cache: a request goes to the idle slot whose kept prompt matches best "
            f"and reuses that KV); both over HTTP with the same client; log {llama_log}"
        )
    else:
        print(f"llama.cpp row skipped: {why}; build llama-server with: {LLAMA_BUILD}")
    print(f"\nload average {load_average()}; {load}")


if __name__ == "__main__":
    main()
