"""Structured output on the default model, end to end (the library choice is
``bench_constraints.py``'s).

1. Validity: the 50 JSON schemas of ``benchmarks/data/structured_schemas.json`` (nested objects,
   arrays, enums, bounded numbers, optional fields, patterns, anyOf, $ref, tuples, allOf, ...),
   each asked of ``chatkv serve`` (its own process) by the ``openai`` client with
   ``response_format={"type": "json_schema", "json_schema": {..., "strict": true}}``, greedy and
   ``--sampled`` more seeded samples each; every reply that finishes by ``stop`` is validated
   with jsonschema (goal: 100%). The prompt shows the schema, as a caller would.
2. Cost at batch 1 (in-process engine, the same model and dtype, ``speculative`` off and auto):
   decode tok/s (``usage.tokens_per_s``: tokens after the first, per second) of each of the
   first ``--cost-schemas`` constrained replies against the same prompt unconstrained for the
   same number of tokens (EOS ignored), interleaved, ``--repeats`` rounds; the ratio is of the
   summed rates (goal >= 0.9x, judged with speculative off: the masks' cost alone; with auto,
   the default, the free baseline's continuation past its EOS tends to loop, which prompt
   lookup speeds up, so that row's ratio says more about the baseline than about the masks).
3. Cost to the others: 8 requests decoding ``--batch-tokens`` tokens together; the 4 free
   ones' tok/s beside 4 constrained ones (each an array of the data set's objects, at least 500
   items, so it runs as long as they do and every step has 8 rows) against the same 4 beside 4
   free ones (goal >= 0.98x).
4. Peer: llama.cpp (llama-cpp-python, the packaged GGUF, the same threads) on the same
   messages with its JSON-schema grammar, ``response_format={"type": "json_object", "schema":
   ...}``, greedy: validity of every schema (a schema its converter refuses is counted as
   refused), and its decode tok/s on the cost schemas constrained and unconstrained (EOS
   forbidden by logit bias, the same number of tokens); rates from the stream's token times.

Printed with the CPU, the load average and what other processes used during each part.

    .venv/bin/python benchmarks/bench_structured.py [--sampled 1] [--cost-schemas 10] [--repeats 3]
        [--batch-tokens 96] [--llama-schemas 10] [--threads N] [--no-llama]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jsonschema
from bench_serve import ENGINE_DTYPES, _die_with_parent, free_port, started, stop
from common import OtherLoad, cpu_line, goal, load_average, load_engine, parser, print_table, setup

DATA = Path(__file__).resolve().parent / "data" / "structured_schemas.json"
SYSTEM = "You are a helpful assistant. You answer with JSON only."
MAX_TOKENS = 256


def messages(case: dict) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": f"Give {case['ask']}. Reply with JSON matching this schema: {json.dumps(case['schema'])}",
        },
    ]


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


# -- 1. validity through chatkv serve -----------------------------------------------------------


async def _ask_all(url: str, cases: list[dict], sampled: int, concurrency: int) -> list[dict]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    gate = asyncio.Semaphore(concurrency)

    async def one(case: dict, seed: int | None) -> dict:
        extra = {"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed}
        async with gate:
            r = await client.chat.completions.create(
                model=model,
                messages=messages(case),
                max_tokens=MAX_TOKENS,
                **extra,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": case["name"], "schema": case["schema"], "strict": True},
                },
            )
        c = r.choices[0]
        return {
            "name": case["name"],
            "seed": seed,
            "finish": c.finish_reason,
            "text": c.message.content,
            "valid": c.finish_reason == "stop" and valid(c.message.content, case["schema"]),
            "tokens": r.usage.completion_tokens,
        }

    jobs = [one(c, None) for c in cases] + [one(c, s) for s in range(1, sampled + 1) for c in cases]
    try:
        return await asyncio.gather(*jobs)
    finally:
        await client.close()


def validity(model_dir: Path, dtype: str, cases: list[dict], sampled: int, concurrency: int) -> dict:
    data = Path(tempfile.mkdtemp(prefix="bench-structured-"))
    cmd = [
        sys.executable,
        "-c",
        "import sys; from chatkv.cli import main; sys.exit(main())",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port := free_port()),
        "--data-dir",
        str(data),
        "--dtype",
        ENGINE_DTYPES[dtype],
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, preexec_fn=_die_with_parent)
    url = started(proc, f"http://127.0.0.1:{port}", "chatkv serve")
    try:
        load, t0 = OtherLoad(), time.perf_counter()
        out = asyncio.run(_ask_all(url, cases, sampled, concurrency))
        wall = time.perf_counter() - t0
    finally:
        stop(proc)
    stopped = [o for o in out if o["finish"] == "stop"]
    return {
        "runs": out,
        "stopped": len(stopped),
        "valid": sum(o["valid"] for o in stopped),
        "wall": wall,
        "load": str(load),
        "tokens": sum(o["tokens"] for o in out),
    }


# -- 2 and 3. cost, in-process -------------------------------------------------------------------


def _decode_rate(results) -> float:
    """Summed decode tokens over summed decode time of ``results`` (GenerationResults)."""
    toks = sum(r.usage.generated_tokens - 1 for r in results)
    secs = sum((r.usage.generated_tokens - 1) / r.usage.tokens_per_s for r in results if r.usage.tokens_per_s > 0)
    return toks / secs if secs else 0.0


def batch1_cost(engine, prompts: list[list[int]], cases: list[dict], repeats: int) -> dict:
    from chatkv.engine.sampling import SamplingParams

    def one(ids, params):
        return engine.generate([ids], [params])[0]

    con, free, lengths = [], [], []
    one(prompts[0], SamplingParams(max_tokens=8, temperature=0))  # warm-up
    for _ in range(repeats):
        for ids, case in zip(prompts, cases):
            c = one(ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, json_schema=case["schema"]))
            n = c.usage.generated_tokens
            if n < 8:  # too short to time its decoding
                continue
            f = one(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            con.append(c)
            free.append(f)
            lengths.append(n)
    rc, rf = _decode_rate(con), _decode_rate(free)
    return {
        "constrained": rc,
        "free": rf,
        "ratio": rc / rf if rf else 0.0,
        "n": len(con),
        "tokens": statistics.median(lengths) if lengths else 0,
    }


def batch_cost(engine, prompts: list[list[int]], cases: list[dict], tokens: int, repeats: int) -> dict:
    from chatkv.engine.sampling import SamplingParams

    free = [SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True) for _ in range(8)]
    long = [{"type": "array", "items": cases[i]["schema"], "minItems": 500} for i in range(4)]
    mixed = free[:4] + [SamplingParams(max_tokens=tokens, temperature=0, json_schema=s) for s in long]
    ids = [prompts[i % len(prompts)] for i in range(8)]
    engine.generate(ids, mixed)  # warm-up: compiles the long schemas
    alone, beside, con = [], [], []
    for _ in range(repeats):
        a = engine.generate(ids, free)
        b = engine.generate(ids, mixed)
        alone.append(_decode_rate(a[:4]))
        beside.append(_decode_rate(b[:4]))
        con.append(_decode_rate(b[4:]))
        assert all(r.finish_reason == "length" for r in b), [r.finish_reason for r in b]
    ratios = [b / a for a, b in zip(alone, beside)]
    return {
        "alone": statistics.median(alone),
        "beside": statistics.median(beside),
        "constrained": statistics.median(con),
        "ratio": statistics.median(ratios),
    }


# -- 4. llama.cpp ------------------------------------------------------------------------------


def _llama_stream(llm, msgs: list[dict], **kw) -> tuple[str, str, int, float]:
    """(text, finish reason, tokens, decode tok/s from the stream's token times)."""
    stamps, pieces, finish = [], [], None
    for chunk in llm.create_chat_completion(msgs, temperature=0.0, stream=True, **kw):
        ch = chunk["choices"][0]
        piece = ch["delta"].get("content")
        if piece:
            stamps.append(time.perf_counter())
            pieces.append(piece)
        finish = ch.get("finish_reason") or finish
    n = len(stamps)
    rate = (n - 1) / (stamps[-1] - stamps[0]) if n > 1 and stamps[-1] > stamps[0] else 0.0
    return "".join(pieces), finish, n, rate


def llama_cpp(threads: int, cases: list[dict], cost_cases: int) -> dict | None:
    """llama.cpp on ``cases`` (validity), the first ``cost_cases`` of them timed as well."""
    from common import load_llama_cpp

    llm = load_llama_cpp(threads)
    if llm is None:
        return None
    load = OtherLoad()
    runs, con_t, con_s, free_t, free_s = [], 0, 0.0, 0, 0.0
    eos = llm.token_eos()
    llm.create_chat_completion(messages(cases[0]), max_tokens=8, temperature=0.0)  # warm-up
    for i, case in enumerate(cases):
        try:
            text, finish, n, rate = _llama_stream(
                llm,
                messages(case),
                max_tokens=MAX_TOKENS,
                response_format={"type": "json_object", "schema": case["schema"]},
            )
        except Exception as e:  # noqa: BLE001 - its schema converter refuses some keywords
            runs.append(
                {"name": case["name"], "finish": "refused", "valid": False, "why": f"{type(e).__name__}: {e}"[:120]}
            )
            continue
        runs.append(
            {
                "name": case["name"],
                "finish": finish,
                "valid": finish == "stop" and valid(text, case["schema"]),
                "text": text,
            }
        )
        if i < cost_cases and n >= 8 and rate > 0:
            _, _, m, free_rate = _llama_stream(llm, messages(case), max_tokens=n, logit_bias={eos: -1e9})
            if free_rate > 0:
                con_t, con_s = con_t + n - 1, con_s + (n - 1) / rate
                free_t, free_s = free_t + m - 1, free_s + (m - 1) / free_rate
    stopped = [r for r in runs if r["finish"] == "stop"]
    rc, rf = (con_t / con_s if con_s else 0.0), (free_t / free_s if free_s else 0.0)
    return {
        "runs": runs,
        "stopped": len(stopped),
        "valid": sum(r["valid"] for r in stopped),
        "refused": sum(r["finish"] == "refused" for r in runs),
        "constrained": rc,
        "free": rf,
        "ratio": rc / rf if rf else 0.0,
        "load": str(load),
    }


def main() -> None:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--sampled", type=int, default=1, help="seeded samples (temperature 1) per schema besides greedy")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight against chatkv serve")
    p.add_argument("--cost-schemas", type=int, default=10, help="schemas timed at batch 1")
    p.add_argument("--batch-tokens", type=int, default=96, help="tokens each request of the batch-8 rows decodes")
    p.add_argument(
        "--llama-schemas",
        type=int,
        default=10,
        help="schemas asked of llama.cpp (its grammar decodes slowly here: ~20 s a schema; 50 = all)",
    )
    p.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    args = p.parse_args()
    model_dir = setup(args)
    dtype = args.dtype if args.dtype != "both" else "bf16"
    cases = json.loads(DATA.read_text())
    print(cpu_line())
    print(
        f"load average at start: {load_average()}; model {model_dir.name}, {dtype}, {args.threads} threads", flush=True
    )
    t_all = time.perf_counter()

    v = validity(model_dir, dtype, cases, args.sampled, args.concurrency)
    print_table(
        f"Validity through chatkv serve (openai client): {len(cases)} JSON schemas, greedy + {args.sampled} "
        f"sampled each (max_tokens {MAX_TOKENS}; {v['tokens']} tokens in {v['wall']:.0f} s; {v['load']})",
        ["requests", "finished by stop", "valid (jsonschema)", "valid of stopped", "by length"],
        [
            [
                len(v["runs"]),
                v["stopped"],
                v["valid"],
                f"{100 * v['valid'] / max(v['stopped'], 1):.1f}%",
                len(v["runs"]) - v["stopped"],
            ]
        ],
    )
    print(f"goal 100% valid of those finished by stop: {'MET' if v['valid'] == v['stopped'] else 'not met'}")
    for r in v["runs"]:
        if r["finish"] == "stop" and not r["valid"]:
            print(f"  INVALID {r['name']} (seed {r['seed']}): {r['text'][:160]!r}")
    sys.stdout.flush()

    cost = {}
    for mode in ("off", "auto"):
        with tempfile.TemporaryDirectory() as d:
            engine = load_engine(model_dir, dtype, data_dir=d, speculative=mode)
            try:
                prompts = [
                    engine.tokenizer.apply_chat_template(messages(c), add_generation_prompt=True, tokenize=True)
                    for c in cases
                ]
                prompts = [list(x["input_ids"] if hasattr(x, "keys") else x) for x in prompts]
                load = OtherLoad()
                b1 = batch1_cost(engine, prompts[: args.cost_schemas], cases[: args.cost_schemas], args.repeats)
                b8 = batch_cost(engine, prompts, cases, args.batch_tokens, args.repeats)
                cost[mode] = (b1, b8, str(load))
                print(f"cost, speculative={mode}: done at {time.perf_counter() - t_all:.0f} s", flush=True)
            finally:
                engine.close()

    peer = None if args.no_llama else llama_cpp(args.threads, cases[: args.llama_schemas], args.cost_schemas)
    if peer is not None:
        print_table(
            f"llama.cpp (llama-cpp-python, packaged GGUF) with its JSON-schema grammar, greedy, the first "
            f"{len(peer['runs'])} schemas ({peer['load']})",
            ["requests", "finished by stop", "valid (jsonschema)", "valid of stopped", "by length", "refused"],
            [
                [
                    len(peer["runs"]),
                    peer["stopped"],
                    peer["valid"],
                    f"{100 * peer['valid'] / max(peer['stopped'], 1):.1f}%",
                    len(peer["runs"]) - peer["stopped"] - peer["refused"],
                    peer["refused"],
                ]
            ],
        )
        for r in peer["runs"]:
            if r["finish"] == "refused" or (r["finish"] == "stop" and not r["valid"]):
                print(f"  llama.cpp {r['name']}: {r.get('why') or 'invalid: ' + repr(r['text'][:120])}")

    crow = []
    for mode, (b1, b8, load) in cost.items():
        crow.append(
            [
                f"chatkv, speculative={mode}",
                f"{b1['constrained']:.1f}",
                f"{b1['free']:.1f}",
                f"{b1['ratio']:.3f}",
                goal(b1["ratio"], 0.9),
                f"{b8['beside']:.1f} / {b8['alone']:.1f}",
                f"{b8['ratio']:.3f}",
                goal(b8["ratio"], 0.98),
                load,
            ]
        )
    if peer is not None:
        crow.append(
            [
                "llama.cpp (its grammar)",
                f"{peer['constrained']:.1f}",
                f"{peer['free']:.1f}",
                f"{peer['ratio']:.3f}",
                "",
                "",
                "",
                "",
                peer["load"],
            ]
        )
    b1 = cost["off"][0]
    print_table(
        f"Cost: decode tok/s at batch 1 on {b1['n']} replies to the first {args.cost_schemas} schemas "
        f"(median {b1['tokens']:.0f} tokens; free: the same prompt, as many tokens, EOS ignored), and "
        f"batch 8 x {args.batch_tokens} tokens: 4 free requests beside 4 constrained vs beside 4 free",
        [
            "",
            "constrained",
            "free",
            "ratio",
            "goal",
            "batch 8: free tok/s beside constrained / beside free",
            "ratio",
            "goal",
            "load",
        ],
        crow,
    )
    print(
        "\nconstrained rows' own tok/s in the batch: "
        + ", ".join(f"{m} {c[1]['constrained']:.1f}" for m, c in cost.items())
    )
    print(f"total {time.perf_counter() - t_all:.0f} s; load average at end: {load_average()}")


if __name__ == "__main__":
    main()
