"""Speculative decoding by prompt lookup: decode tok/s with ``speculative`` auto
(the default) and lookup against ``off``, the same engine and process, on the default model.

Workloads (chat-templated, greedy, EOS honoured, ``--tokens`` at most). Greedy speculation
computes each verified row as a plain decode row (chatkv.engine.model_runner), so the modes generate
the same tokens wherever the model's decode is batch-invariant (float32: the tests); in bf16 a
row decoded beside others of other lengths takes a masked attention whose rounding differs from
a lone decode's (as in plain continuous batching), so a near-tie can flip: the table says
whether auto's tokens are off's, and from which token they differ if not.

- input-grounded, as RAG and chat users run them: quote a retrieved source, rewrite a pasted
  code block, answer from a pinned document;
- free-form chat (nothing to look up: the adaptive off-switch's case).

Batch 1: each prompt alone, the request's decode rate (``usage.tokens_per_s``: tokens after
the first over the time after the first; prefill excluded). Batch 8: the 4 prompts twice in
one ``generate``, generated tokens over the call's wall time. Modes take turns within each
repeat, in reverse order every other repeat (background load and a drifting machine hit all
alike); medians. The modes share one engine (its speculator
is swapped between runs: the same weights, the same pool and prefix cache; every prompt is
cached before the timed runs, so each mode starts from the same cache state: greedy bf16 output
can depend on whether the prompt's last tokens were prefilled as a long or a short chunk).

``copied``: how many of off's tokens lie in a 4-token run found in the prompt, and in the prompt
or the reply before it: what prompt lookup could propose at best. A workload whose reply copies
little gains little whatever the policy (measured: the default model's answer from the pinned
document copies no 4-token run of the document; what speculation gains there comes from the
reply repeating itself). ``bound``: what a proposer with perfect foresight over those copied
tokens would gain at the row cost the run measured (``lookup_bound``): no lookup policy gains
more on that reply, so a workload whose bound is under its goal cannot meet it with this model.

The peer, in the same run: llama.cpp (llama-cpp-python on the packaged GGUF) plain and with its
``LlamaPromptLookupDecoding`` draft model (``num_pred_tokens=10``), the same prompt tokens and as
many tokens as chatkv's off generated, timestamped per token; the table prints
llama-lookup / llama-plain and chatkv-auto / llama-lookup (the goal: >= 1x on the grounded
workloads). llama.cpp's threads suffer far more than torch's from other load on the cores
(measured: 1-2 tok/s plain at load 5 on 2 cores, against ~160 quiet), so its rows mean
something only in a quiet run.

auto prices a verified row from the engine's own decode steps (chatkv.engine.speculative.StepCost):
the table's end prints the row cost it measured in this run, next to its prior.

    .venv/bin/python benchmarks/bench_speculative.py [--tokens 128] [--repeats 3] [--no-llama-cpp]
        [--workloads "free-form chat,rewrite code"] [--no-batch8] [--num-speculative-tokens 5]

(measured: 8 minutes without the peer with 1.6 of 2 cores busy elsewhere; a quiet run is shorter)
"""

from __future__ import annotations

import time

from common import (
    OtherLoad,
    common_prefix,
    cpu_line,
    goal,
    llama_decode,
    load_average,
    median,
    parser,
    prepare_llama_cpp,
    print_table,
    setup,
)

SOURCE = (
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 individual reefs "
    "and 900 islands stretching for over 2,300 kilometres over an area of approximately 344,400 square "
    "kilometres. The reef is located in the Coral Sea, off the coast of Queensland, Australia. It can be seen "
    "from outer space and is the world's biggest single structure made by living organisms. This reef structure "
    "is composed of and built by billions of tiny organisms, known as coral polyps."
)
CODE = """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
"""
DOCUMENT = (
    "Return policy. Items may be returned within 30 days of delivery for a full refund, provided they are "
    "unused and in their original packaging. To start a return, sign in to your account, open the order, and "
    "choose Return items. Refunds are issued to the original payment method within 5 business days after the "
    "returned item arrives at our warehouse. Shipping costs are not refunded unless the item arrived damaged."
)
WORKLOADS = {
    "quote a source": [
        {"role": "system", "content": "You answer using the retrieved source, quoting it exactly."},
        {"role": "user", "content": f"Source:\n{SOURCE}\n\nQuote the source's description of the reef word for word."},
    ],
    "rewrite code": [
        {"role": "user", "content": f"Add type hints to this Python function and return the whole function:\n\n{CODE}"},
    ],
    "answer from a pinned document": [
        {"role": "system", "content": f"Answer from this document only, quoting it.\n\nDocument:\n{DOCUMENT}"},
        {"role": "user", "content": "How do I return an item and when do I get my refund?"},
    ],
    "free-form chat": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."},
    ],
}
GROUNDED = [w for w in WORKLOADS if w != "free-form chat"]
MODES = ("off", "auto", "lookup")


def batch1(engine, ids, n, mode):
    from chatkv.engine.sampling import SamplingParams

    engine.scheduler.speculator = _speculators[mode]
    r = engine.generate(ids, SamplingParams(max_tokens=n, temperature=0))
    return r.usage.tokens_per_s, r


def batch8(engine, prompts, n, mode):
    from chatkv.engine.sampling import SamplingParams

    engine.scheduler.speculator = _speculators[mode]
    t = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0))
    return sum(o.usage.generated_tokens for o in outs) / (time.perf_counter() - t), outs


def copied(prompt: list[int], out: list[int], own: bool, n: int = 4) -> int:
    """How many of ``out``'s tokens lie in an ``n``-token run that occurs in ``prompt`` (``own``:
    or earlier in ``out``): the most that prompt lookup could propose and have accepted."""
    return sum(_hits(prompt, out, own, n))


def lookup_bound(prompt: list[int], out: list[int], row_cost: float, max_k: int) -> float:
    """The speed-up a proposer with perfect foresight would get on ``out`` at batch 1: at each
    step it proposes exactly the copied tokens ahead (``_hits``, up to ``max_k``), all accepted,
    and nothing where none is copied; a step of ``k`` proposals costs ``1 + row_cost * k`` plain
    steps and emits ``k + 1`` tokens. The ceiling of prompt lookup on this reply at this cost."""
    hit, pos, cost = _hits(prompt, out, True, 4), 0, 0.0
    while pos < len(out):
        k = 0
        while k < max_k and pos + k + 1 < len(out) and hit[pos + k]:  # guesses for out[pos:pos+k], then its own
            k += 1
        cost += 1 + row_cost * k
        pos += k + 1
    return len(out) / cost if cost else 1.0


def _hits(prompt: list[int], out: list[int], own: bool, n: int) -> list[bool]:
    seen = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    both = prompt + out
    hit = [False] * len(out)
    for i in range(len(out) - n + 1):
        if own:  # runs that start earlier (in the prompt's tail or the reply) are history now
            seen.add(tuple(both[len(prompt) + i - 1 : len(prompt) + i - 1 + n]))
        if tuple(out[i : i + n]) in seen:
            hit[i : i + n] = [True] * n
    return hit


_speculators: dict = {}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated subset of: " + ", ".join(WORKLOADS)
    )
    p.add_argument("--no-batch8", action="store_true", help="skip the batch-8 table (a shorter A/B)")
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="proposals per sequence and step at most (default: the engine's)",
    )
    args = p.parse_args()
    chosen = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in chosen if w not in WORKLOADS]
    if unknown or not chosen:
        p.error(f"--workloads: unknown {unknown or 'none given'}; choose from {', '.join(WORKLOADS)}")
    for w in list(WORKLOADS):
        if w not in chosen:
            del WORKLOADS[w]
    model_dir = setup(args)
    print(cpu_line())
    print(f"load average at start: {load_average()}")
    load = OtherLoad()
    from chatkv.config import EngineConfig
    from chatkv.engine.core import Engine
    from chatkv.engine.speculative import Speculator

    engine = Engine.from_pretrained(model_dir)
    print(f"weights: {engine.weights.label}; threads {args.threads}")
    for mode in MODES:
        k = engine.config.num_speculative_tokens if args.num_speculative_tokens is None else args.num_speculative_tokens
        cfg = EngineConfig(speculative=mode, quant_dense_rows=engine.config.quant_dense_rows, num_speculative_tokens=k)
        _speculators[mode] = Speculator.from_config(cfg)
    ids = {w: engine.encode_chat(m) for w, m in WORKLOADS.items()}
    n = args.tokens
    for w in WORKLOADS:  # warm-up (and the prompts' KV in the prefix cache for every mode alike)
        batch1(engine, ids[w], 8, "auto")
    rate = {(w, m): [] for w in WORKLOADS for m in MODES}
    got: dict = {}
    rate8 = {m: [] for m in MODES}
    prompts8 = [ids[w] for w in WORKLOADS] * 2
    for rep in range(args.repeats):
        order = MODES if rep % 2 == 0 else MODES[::-1]  # a drifting machine favours no mode
        for w in WORKLOADS:
            for m in order:
                r, res = batch1(engine, ids[w], n, m)
                rate[w, m].append(r)
                got[w, m] = res
        for m in order if not args.no_batch8 else ():
            r, outs = batch8(engine, prompts8, n, m)
            rate8[m].append(r)
            got["batch8", m] = outs
    same = {}  # greedy agreement with off: bf16 rounding of a batched decode row can flip a near-tie
    for w in WORKLOADS:
        a, b = got[w, "auto"].token_ids, got[w, "off"].token_ids
        same[w] = "yes" if a == b else f"from token {common_prefix(a, b)}"

    lc = {}
    if not args.no_llama_cpp:
        lc = llama_peer(args, ids, {w: len(got[w, "off"].token_ids) for w in WORKLOADS})

    rows, peer_rows = [], []
    spec = _speculators["auto"]
    r_cost = spec.cost.row_cost
    for w in WORKLOADS:
        off, auto, look = (median(rate[w, m]) for m in MODES)
        u = got[w, "auto"].usage
        ul = got[w, "lookup"].usage
        target = 1.6 if w in GROUNDED else 0.97
        out = got[w, "off"].token_ids
        rows.append(
            [
                w,
                len(out),
                same[w],
                f"{copied(ids[w], out, False)} / {copied(ids[w], out, True)}",
                f"{off:.1f}",
                f"{auto:.1f}",
                f"{auto / off:.2f}x",
                goal(auto / off, target),
                f"{look:.1f} ({look / off:.2f}x)",
                f"{u.accepted_tokens}/{u.proposed_tokens} ({u.accepted_tokens / max(u.proposed_tokens, 1):.0%})",
                f"{ul.accepted_tokens}/{ul.proposed_tokens}",
                f"{lookup_bound(ids[w], out, r_cost, spec.max_k):.2f}x",
            ]
        )
        if w in lc:
            plain, lookup, lsame = lc[w]
            peer_rows.append(
                [
                    w,
                    f"{auto:.1f}",
                    f"{plain:.1f}",
                    f"{lookup:.1f}",
                    lsame,
                    f"{lookup / plain:.2f}x",
                    f"{auto / lookup:.2f}x",
                    goal(auto / lookup, 1.0) if w in GROUNDED else "-",
                ]
            )
    print_table(
        f"batch 1, decode tok/s (median of {args.repeats}), greedy, up to {n} tokens",
        [
            "workload",
            "tokens",
            "auto's = off's",
            "copied: prompt / +own",
            "off",
            "auto",
            "auto/off",
            "goal",
            "lookup (vs off)",
            "accepted/proposed auto",
            "lookup",
            "bound",
        ],
        rows,
    )
    print(
        "copied: how many of off's tokens lie in a 4-token run that occurs in the prompt / in the prompt or "
        "earlier in the reply (what prompt lookup can find at best)"
    )
    print(
        f"bound: the speed-up of a proposer with perfect foresight over those copied tokens (all its proposals "
        f"accepted, up to {spec.max_k} a step) at the row cost measured below (lookup_bound)"
    )
    if peer_rows:
        print_table(
            "the peer: llama.cpp (llama-cpp-python, the packaged GGUF), same prompt tokens and token counts, "
            "decode tok/s (median)",
            [
                "workload",
                "chatkv auto",
                "llama plain",
                "llama lookup",
                "lookup's = plain's",
                "llama-lookup / llama-plain",
                "chatkv-auto / llama-lookup",
                "goal",
            ],
            peer_rows,
        )
    if not args.no_batch8:
        off8, auto8, look8 = (median(rate8[m]) for m in MODES)
        acc = sum(o.usage.accepted_tokens for o in got["batch8", "auto"])
        prop = sum(o.usage.proposed_tokens for o in got["batch8", "auto"])
        print_table(
            f"batch 8 (the {len(WORKLOADS)} prompts twice, one generate), generated tok/s over wall time",
            ["off", "auto", "auto/off", "goal", "lookup (vs off)", "accepted/proposed auto"],
            [
                [
                    f"{off8:.1f}",
                    f"{auto8:.1f}",
                    f"{auto8 / off8:.2f}x",
                    goal(auto8 / off8, 1.0),
                    f"{look8:.1f} ({look8 / off8:.2f}x)",
                    f"{acc}/{prop}",
                ]
            ],
        )
    cost = spec.cost
    print(
        f"\nauto's verified-row cost, measured in this run: {cost.row_cost:.3f} of a one-row step "
        f"(median of {cost.samples} estimates; 0: the prior, {cost.prior})"
    )
    print(f"\nload average at end: {load_average()}; {load}")
    engine.close()


def llama_peer(args, ids, counts) -> dict:
    """{workload: (plain tok/s, LlamaPromptLookupDecoding tok/s, whether their tokens agree)} on the
    same prompt tokens, as many tokens as chatkv's off generated."""
    llama_cpp = prepare_llama_cpp()
    if llama_cpp is None:
        print("llama.cpp: llama-cpp-python not installed; no peer")
        return {}
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from chatkv.weights import packaged_gguf_path

    path = str(packaged_gguf_path())
    plain = llama_cpp.Llama(model_path=path, n_threads=args.threads, n_ctx=2048, verbose=False)
    look = llama_cpp.Llama(
        model_path=path,
        n_threads=args.threads,
        n_ctx=2048,
        verbose=False,
        draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10),
    )
    out = {}
    for w, toks in ids.items():
        n = counts[w]
        rp, rl = [], []
        for _ in range(args.repeats):
            r, a = llama_decode(plain, toks, n)
            rp.append(r)
            r, b = llama_decode(look, toks, n)
            rl.append(r)
        out[w] = (median(rp), median(rl), "yes" if a == b else f"from token {common_prefix(a, b)}")
    return out


if __name__ == "__main__":
    main()
