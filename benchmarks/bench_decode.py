"""Decode speed per weight mode: chatkv vs transformers ``generate`` (bf16) and llama.cpp, same threads.

For each weight mode (``--modes``; ``int4`` on the default model computes the GGUF's own
Q4_1 weights, ``h8``/``h4`` = the output matrix in int8/int4 too):

- batch 1: a short chat prompt, then N greedy tokens with EOS ignored; the rate excludes the
  prefill: (N - 1) / (time of token N - time of token 1), chatkv's ``decode_tokens_per_s``.
  transformers and llama.cpp (llama-cpp-python on the packaged GGUF: Q4_1, its own kernels)
  are timestamped per token the same way. Repeats are interleaved, medians reported.
- batch 8: 8 different chat prompts decoded together; aggregate tokens/s of the decode
  (8 x each sequence's decode rate). transformers: one left-padded ``generate`` of the 8.
  llama.cpp's batched peer is its server (benchmarks/bench_serve.py).
- TTFT of a 1k-token prompt (prefill and the first token; no cached prefix).
- peak resident memory (VmHWM) of a process that loads the mode, prefills the 1k-token prompt
  and decodes, with a KV pool of 2,048 tokens and no host tier, as llama.cpp's context of
  2,048 (a child process each).
- the same peak memory as its own table beside llama.cpp's, against the goal (at most
  llama.cpp's peak + 150 MB). ``--memory-only`` measures only that (``--modes int4,int4/copy``:
  the default, which dequantises each projection into a scratch buffer for steps of 64 rows or
  more, beside the resident bf16 copy it replaced).
- ``--gguf FILE``: another GGUF (a Q4_K_M, say), converted once into the data directory; chatkv
  and llama.cpp both run that file.
- ``--busy N``: batch-1 decode again with N processes spinning a pure-Python loop beside it
  (one busy core each), chatkv and llama.cpp in the same run; each one's slowdown against its
  own quiet rate, and chatkv vs llama.cpp under that load.

    .venv/bin/python benchmarks/bench_decode.py [--modes bf16,int8,int4,int4/h8] [--tokens 128] [--repeats 3] [--busy 1]
    .venv/bin/python benchmarks/bench_decode.py --memory-only --modes int4,int4/copy [--gguf FILE]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import (
    CHAT,
    BusyLoad,
    OtherLoad,
    common_prefix,
    cpu_line,
    goal,
    hf_generate,
    llama_decode,
    load_average,
    load_hf,
    load_llama_cpp,
    median,
    parser,
    print_table,
    setup,
)

GOAL_HF, GOAL_LLAMA = 3.0, 1.0
GOAL_MEMORY_MB = 150  # peak after the long prompt: at most llama.cpp's + this
PROMPTS = [
    "Explain in a few paragraphs why the sky is blue.",
    "Write a short story about a lighthouse keeper.",
    "What are the main causes of the French Revolution?",
    "Describe how a bicycle works.",
    "Give me a recipe for pancakes.",
    "Why do cats purr?",
    "Explain how vaccines train the immune system.",
    "What is the difference between weather and climate?",
]


def spec(mode: str) -> dict:
    """``int4/h8`` -> weights=int4, head_weights=int8; ``/lean``: the quantised kernel for prefill too
    (quant_dense_rows=0); ``/copy``: a resident bf16 copy for prefill (quant_dense="copy");
    ``/scratch``: dequantised into a scratch buffer per step (quant_dense="scratch")."""
    weights, *opts = mode.split("/")
    kw: dict = {"weights": weights}
    for o in opts:
        if o == "lean":
            kw["quant_dense_rows"] = 0
        elif o in ("copy", "scratch"):
            kw["quant_dense"] = o
        else:
            kw["head_weights"] = {"h8": "int8", "h4": "int4", "hf": "float"}[o]
    return kw


def load(model_dir: Path, mode: str):
    from chatkv.engine.core import Engine

    return Engine.from_pretrained(model_dir, **spec(mode))


def chatkv_decode(engine, ids, n):
    from chatkv.engine.sampling import SamplingParams

    r = engine.generate(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    assert r.usage.generated_tokens == n, r.usage.generated_tokens
    return r.usage.tokens_per_s, r.token_ids


def chatkv_batch(engine, prompts, n):
    from chatkv.engine.sampling import SamplingParams

    outs = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return sum(o.usage.tokens_per_s for o in outs)


def chatkv_ttft(engine, ids):
    from chatkv.engine.sampling import SamplingParams

    t = time.perf_counter()
    engine.generate(ids, SamplingParams(max_tokens=1, temperature=0))
    return time.perf_counter() - t


def hf_decode(model, ids, n):
    new, _, stamps = hf_generate(model, ids, n)
    return (n - 1) / (stamps[-1] - stamps[0]), new


def hf_batch(model, prompts, n):
    from transformers import StoppingCriteria, StoppingCriteriaList

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    stamps: list[float] = []

    class Stamp(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([Stamp()]),
        )
    return len(prompts) * (n - 1) / (stamps[-1] - stamps[0])


def llama_ttft(llm, ids):
    llm.reset()
    t = time.perf_counter()
    next(iter(llm.generate(ids, temp=0.0, top_k=1, reset=True)))
    return time.perf_counter() - t


def long_prompt(tokenizer, n: int) -> list[int]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.support.llama_cpp_reference import ppl_text  # Python's own pydoc topics

    return tokenizer(ppl_text())["input_ids"][:n]


def peak_rss(mode: str, args, model_dir: Path) -> dict | None:
    """``{"peak_mib", "rss_mib"}``: a child process loads ``mode`` (or llama.cpp), prefills a
    ``--prefill-tokens`` prompt and decodes 32 tokens; None if it failed."""
    cmd = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--threads",
        str(args.threads),
        "--model",
        str(model_dir),
        "--prefill-tokens",
        str(args.prefill_tokens),
    ] + (["--gguf", args.gguf] if args.gguf else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        print(f"memory child {mode} failed: {out.stderr.strip()[-400:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib_pair(got: dict | None) -> str:
    return "failed" if got is None else f"{got['peak_mib']:.0f} / {got['rss_mib']:.0f}"


def memory_table(mem: dict, prefill: int, gguf: str | None) -> None:
    """Each mode's peak beside llama.cpp's on the same GGUF, against ``GOAL_MEMORY_MB``."""
    lc = mem.get("llama.cpp")
    rows = []
    for m, got in mem.items():
        row = [m, mib_pair(got)]
        if got is not None and lc is not None and m != "llama.cpp":
            over_mb = (got["peak_mib"] - lc["peak_mib"]) * 2**20 / 1e6
            row += [
                f"{over_mb:+.0f} MB",
                f"<= +{GOAL_MEMORY_MB} MB  {'MET' if over_mb <= GOAL_MEMORY_MB else 'not met'}",
            ]
        else:
            row += ["", ""]
        rows.append(row)
    print_table(
        f"peak memory after a {prefill}-token prompt and 32 decoded tokens, MiB peak / after "
        f"(VmHWM / VmRSS of a child process; KV pool 2,048 tokens, no host tier; "
        f"{Path(gguf).name if gguf else 'the packaged GGUF, Q4_1'})",
        ["weights", "MiB peak / after", "peak vs llama.cpp", "goal"],
        rows,
    )


def child(mode: str, args) -> None:
    torch.set_num_threads(args.threads)
    from chatkv.weights import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    longp = long_prompt(tokenizer, args.prefill_tokens)
    if mode == "llama.cpp":
        llm = load_llama_cpp(args.threads, args.gguf)
        ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        llama_ttft(llm, longp)
        llama_decode(llm, llm.tokenize(ids.encode(), special=True), 32)
    else:
        from chatkv.engine.core import Engine

        # llama.cpp's context here: 2,048 tokens of KV, no host tier
        engine = Engine.from_pretrained(args.model, num_blocks=128, host_cache_bytes=0, **spec(mode))
        chatkv_ttft(engine, longp)
        chatkv_decode(engine, engine.encode_chat(CHAT), 32)
    # VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss over fork and execve, so a child
    # of this (big) benchmark process would report the parent's peak
    import gc

    gc.collect()
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    mib = lambda key: int(status[key].split()[0]) / 1024  # noqa: E731
    print(json.dumps({"peak_mib": mib("VmHWM"), "rss_mib": mib("VmRSS")}))


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--modes", default="bf16,int8,int4,int4/h8", help="weight modes, comma-separated")
    p.add_argument("--tokens", type=int, default=128, help="generated tokens per run")
    p.add_argument("--prefill-tokens", type=int, default=1024)
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory child processes")
    p.add_argument("--memory-only", action="store_true", help="only the peak-memory child processes (and their table)")
    p.add_argument("--busy", type=int, default=0, help="also decode beside N busy processes (one core each)")
    p.add_argument(
        "--gguf", default=None, help="a GGUF file (e.g. a Q4_K_M): converted once, and llama.cpp runs the same file"
    )
    p.add_argument("--child", default=None, help=argparse_hidden())
    args = p.parse_args()
    if args.child:
        return child(args.child, args)
    model_dir = setup(args)
    if args.gguf:
        from chatkv.storage.paths import data_dir
        from chatkv.weights.gguf import convert_gguf

        gguf = Path(args.gguf)
        model_dir = data_dir() / "models" / f"bench-{gguf.stem}"
        if not (model_dir / "config.json").is_file():
            convert_gguf(gguf, model_dir)
    other = OtherLoad()
    n, modes = args.tokens, args.modes.split(",")
    if args.memory_only:
        for m in modes:  # each quantised mode's self-check verdict cached first: a child's peak is then its own
            load(model_dir, m).close()
        mem = {m: peak_rss(m, args, model_dir) for m in modes + ([] if args.no_llama_cpp else ["llama.cpp"])}
        print(f"\n{cpu_line()}")
        print(f"threads={args.threads}, load average {load_average()}, {other}")
        return memory_table(mem, args.prefill_tokens, args.gguf)
    llm = None if args.no_llama_cpp or args.model else load_llama_cpp(args.threads, args.gguf)
    engines = {m: load(model_dir, m) for m in modes}
    hf = load_hf(model_dir, "bf16")
    first = engines[modes[0]]
    ids = first.encode_chat(CHAT)
    batch = [first.encode_chat([{"role": "user", "content": q}]) for q in PROMPTS]
    longp = long_prompt(first.tokenizer, args.prefill_tokens)
    for e in engines.values():  # warm up all
        chatkv_decode(e, ids, 8)
        chatkv_batch(e, batch, 4)
    hf_decode(hf, ids, 8)
    if llm is not None:
        llama_decode(llm, ids, 8)

    rate = {m: [] for m in modes}
    rate_b = {m: [] for m in modes}
    ttft = {m: [] for m in modes}
    toks: dict[str, list[int]] = {}
    ref, ref_b, lc, lc_ttft = [], [], [], []
    for _ in range(args.repeats):  # interleaved, so background load hits all alike
        for m, e in engines.items():
            r, toks[m] = chatkv_decode(e, ids, n)
            rate[m].append(r)
            rate_b[m].append(chatkv_batch(e, batch, n // 2))
            ttft[m].append(chatkv_ttft(e, [100 + len(ttft[m])] + longp))  # a fresh first token: no cached prefix
        r, toks["hf"] = hf_decode(hf, ids, n)
        ref.append(r)
        ref_b.append(hf_batch(hf, batch, n // 2))
        if llm is not None:
            r, toks["llama.cpp"] = llama_decode(llm, ids, n)
            lc.append(r)
            lc_ttft.append(llama_ttft(llm, longp))
    busy_rate: dict[str, list[float]] = {m: [] for m in modes}
    busy_lc: list[float] = []
    if args.busy:
        with BusyLoad(args.busy):
            for _ in range(args.repeats):
                for m, e in engines.items():
                    busy_rate[m].append(chatkv_decode(e, ids, n)[0])
                if llm is not None:
                    busy_lc.append(llama_decode(llm, ids, n)[0])
    mem = (
        {}
        if args.no_memory
        else {m: peak_rss(m, args, model_dir) for m in modes + (["llama.cpp"] if llm is not None else [])}
    )

    hf_rate, hf_b = median(ref), median(ref_b)
    lc_rate = median(lc) if lc else None
    rows, rows_b, rows_t = [], [], []
    for m in modes:
        r = median(rate[m])
        row = [m, f"{r:.1f}", f"{r / hf_rate:.2f}x", goal(r / hf_rate, GOAL_HF)]
        row += [f"{r / lc_rate:.2f}x", goal(r / lc_rate, GOAL_LLAMA)] if lc_rate else ["-", ""]
        row += [mib_pair(mem[m]) if m in mem else "-", f"{common_prefix(toks[m], toks['hf'])}/{n}"]
        rows.append(row)
        rb = median(rate_b[m])
        rows_b.append([m, f"{rb:.1f}", f"{rb / hf_b:.2f}x"])
        t = median(ttft[m])
        rows_t.append([m, f"{t * 1000:.0f}", f"{t / median(lc_ttft):.2f}x" if lc_ttft else "-"])
    print(f"\n{cpu_line()}")
    print(
        f"{len(ids)}-token chat prompt, {n} greedy tokens (EOS ignored), threads={args.threads}, "
        f"median of {args.repeats}, load average {load_average()}, {other}"
    )
    print(
        f"transformers bf16: {hf_rate:.1f} tok/s batch 1, {hf_b:.1f} batch 8"
        + (
            f"; llama.cpp ({Path(args.gguf).name if args.gguf else 'the packaged GGUF, Q4_1'}): "
            f"{lc_rate:.1f} tok/s batch 1, memory peak / after "
            f"{mib_pair(mem['llama.cpp']) if 'llama.cpp' in mem else '-'} MiB"
            if lc_rate
            else "; llama.cpp: llama_cpp not importable, skipped (pip install llama-cpp-python==0.3.36)"
        )
    )
    print_table(
        "batch-1 decode tokens/s (prefill excluded)",
        [
            "weights",
            "chatkv tok/s",
            "vs transformers bf16",
            "goal",
            "vs llama.cpp",
            "goal",
            "MiB peak / after",
            "greedy = transformers bf16",
        ],
        rows,
    )
    print_table(
        f"batch-8 decode, aggregate tokens/s ({n // 2} tokens each)",
        ["weights", "chatkv tok/s", "vs transformers bf16"],
        rows_b,
    )
    print_table(
        f"TTFT of a {len(longp)}-token prompt, ms"
        + (f" (llama.cpp {median(lc_ttft) * 1000:.0f} ms)" if lc_ttft else ""),
        ["weights", "chatkv ms", "vs llama.cpp"],
        rows_t,
    )
    if mem:
        memory_table(mem, args.prefill_tokens, args.gguf)
    if args.busy:
        lc_busy = median(busy_lc) if busy_lc else None
        rows_busy = []
        for m in modes:
            quiet, loud = median(rate[m]), median(busy_rate[m])
            row = [m, f"{quiet:.1f}", f"{loud:.1f}", f"{loud / quiet:.2f}x", goal(loud / quiet, 0.45)]
            row += [f"{loud / lc_busy:.2f}x", goal(loud / lc_busy, 1.0)] if lc_busy else ["-", ""]
            rows_busy.append(row)
        if lc_busy:
            rows_busy.append(["llama.cpp", f"{lc_rate:.1f}", f"{lc_busy:.1f}", f"{lc_busy / lc_rate:.2f}x", "", "", ""])
        print_table(
            f"batch-1 decode beside {args.busy} busy process(es), tokens/s (median of {args.repeats})",
            ["weights", "quiet", "busy", "busy / quiet", "goal", "vs llama.cpp busy", "goal"],
            rows_busy,
        )


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
