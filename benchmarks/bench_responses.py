"""The Responses API's chain across a restart of ``chatkv serve`` (the goal: turn 4
reports at least 80% of its input as cached, restored, tokens).

Three chained responses (``previous_response_id``), ``chatkv serve`` stopped (SIGTERM: the
graceful shutdown spills the open sessions) and started again on the same data directory,
then turn 4 chained to turn 3. Its history's KV comes back from the snapshot on disk, so only
its own question is computed. Baseline: the same turn-4 prompt sent whole with ``store=false``
to the server restarted once more (what a server keeping its chains in memory, as vLLM does,
must do after a restart: recompute everything). Each server start answers one unrelated
warm-up request first. Figures are the
server's own (``usage``: input, cached = device + host + restored, restored; its TTFT).

    .venv/bin/python benchmarks/bench_responses.py [--dtype bf16|fp32] [--model DIR] [--new-tokens 64]
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import openai
from bench_serve import start_server, stop
from common import OtherLoad, cpu_line, dtypes, load_average, parser, print_table, setup

SYSTEM = (
    "You are a helpful assistant. Answer in a few sentences, plainly, and say so when you are not sure. "
    "Prefer short words and concrete examples."
)
QUESTIONS = ["Why is the sky blue?", "And at sunset?", "What about on Mars?", "Summarise what we said."]


def ask(c: openai.OpenAI, model: str, question: str, new_tokens: int, **extra):
    return c.responses.create(model=model, input=question, max_output_tokens=new_tokens, temperature=0, **extra)


@contextlib.contextmanager
def served(model_dir: Path, dtype: str, data: Path):
    """An openai client of ``chatkv serve`` on ``data``, stopped (SIGTERM: graceful) afterwards."""
    proc, url = start_server(model_dir, dtype, data)
    try:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    finally:
        stop(proc)


def warm(c: openai.OpenAI, model: str) -> None:
    """One unstored request sharing nothing with the chain, so no row pays the first request's costs."""
    c.responses.create(model=model, input="Say hello.", max_output_tokens=4, temperature=0, store=False)


def row(name: str, r) -> list[str]:
    u, split = r.usage, r.usage.model_extra["chatkv"]
    cached = u.input_tokens_details.cached_tokens
    return [
        name,
        str(u.input_tokens),
        str(cached),
        str(split["restored_tokens"]),
        str(split["computed_tokens"]),
        f"{cached / u.input_tokens:.0%}",
        f"{split['ttft_s'] * 1000:.0f}",
    ]


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=64, help="max_output_tokens of each turn (greedy)")
    args = p.parse_args()
    model_dir = setup(args)
    load = OtherLoad()
    for dtype in dtypes(args):
        with tempfile.TemporaryDirectory(prefix="chatkv-bench-responses-") as tmp:
            data = Path(tmp)
            with served(model_dir, dtype, data) as c:
                warm(c, model_dir.name)
                chain = [ask(c, model_dir.name, QUESTIONS[0], args.new_tokens, instructions=SYSTEM)]
                for q in QUESTIONS[1:3]:
                    chain.append(ask(c, model_dir.name, q, args.new_tokens, previous_response_id=chain[-1].id))
            with served(model_dir, dtype, data) as c:  # restarted: the chain's KV is on disk only
                warm(c, model_dir.name)
                four = ask(c, model_dir.name, QUESTIONS[3], args.new_tokens, previous_response_id=chain[-1].id)
            history = [{"role": "system", "content": SYSTEM}]
            for q, r in zip(QUESTIONS, chain):
                history += [{"role": "user", "content": q}, {"role": "assistant", "content": r.output_text}]
            history.append({"role": "user", "content": QUESTIONS[3]})
            with served(model_dir, dtype, data) as c:  # restarted again: nothing of the chain in memory
                warm(c, model_dir.name)
                whole = c.responses.create(
                    model=model_dir.name, input=history, max_output_tokens=args.new_tokens, temperature=0, store=False
                )
        rows = [row(f"turn {i + 1}", r) for i, r in enumerate(chain)]
        rows += [row("turn 4, after the restart", four), row("baseline: turn 4 sent whole, store=false", whole)]
        print_table(
            f"{model_dir.name} {dtype}, a 4-turn Responses chain across a restart of chatkv serve, "
            f"{args.new_tokens} tokens per reply, threads={args.threads}",
            ["request", "input", "cached", "restored", "computed", "cached/input", "TTFT ms"],
            rows,
        )
        ratio = four.usage.input_tokens_details.cached_tokens / four.usage.input_tokens
        ttft = four.usage.model_extra["chatkv"]["ttft_s"]
        base = whole.usage.model_extra["chatkv"]["ttft_s"]
        print(
            f"turn 4: {four.usage.input_tokens} input tokens, {ratio:.1%} cached (restored from disk): "
            f"goal >= 80% {'MET' if ratio >= 0.8 else 'not met'}; "
            f"TTFT {ttft * 1000:.0f} ms vs {base * 1000:.0f} ms recomputed "
            f"({base / ttft:.2f}x)"
        )
    print(f"\n{cpu_line()}\nload average {load_average()}; {load}")


if __name__ == "__main__":
    main()
