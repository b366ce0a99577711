"""KV dtype quality gate: quantised KV (int8, fp8) against bf16 KV on the default model.

One model (the default SmolLM2-135M-Instruct as ``Engine.from_pretrained`` loads it: the
GGUF's int4 weights, int8 output matrix, bf16 activations), one ``ModelRunner`` per kv dtype
over the engine's own block pool and forward (``EngineConfig(kv_dtype=...)``), so the only
difference between the rows is how K/V are stored: every query, in prefill chunks as in
decode steps, reads the stored (quantised) form of every earlier token, its own chunk's too.

- **agreement** (goal: int8 >= 98%): bf16-KV greedy continuations of ``--tokens`` tokens
  (EOS ignored, as tests/model/test_quant_weights.py does) for the 20 chat prompts of
  tests/support/llama_cpp_reference.py (chat template applied), decoded as one batch; then the same
  prompts through the dtype under test, teacher forced: every decode step feeds bf16's token,
  and a position agrees when the argmax is bf16's next token. Forcing runs the very steps of
  the free run (same batch, same shapes), so bf16 against itself is exactly 100% and the
  figure is the KV dtype's alone. **free-run**: each dtype's own greedy continuation, the mean
  number of tokens identical to bf16's before the first difference.
- **perplexity** (goal: int8 within 1% of bf16, fp8 within 3%): the first ``--ppl-tokens``
  (4,096) tokens of Python's own pydoc topics (``pydoc_data.topics``: datamodel, class,
  execmodel, ... as tests/llama_cpp_reference.ppl_text joins them; the same text on every
  machine with this Python), prefilled in chunks of 512 with logits for every token.
- **needle** (goal: every needle bf16 retrieves, the dtype retrieves too): ``--needles`` chat
  prompts of ~``--needle-tokens`` tokens: the same pydoc text as filler, the sentence
  'The secret passphrase is "blue pelican 42". Remember it.' at 10-60% of it (a different
  phrase each), the question "What is the secret passphrase?" last, and the reply begun with
  'The secret passphrase is "' (asked plainly, the 135M model often answers a PEP number from
  the filler, in bf16 too); greedy 10 tokens, retrieved when they contain the phrase.

    .venv/bin/python benchmarks/kv_quality.py [--kv-dtypes bf16,int8,fp8,fp16] [--prompts 20] [--tokens 256]

Prints one row per kv dtype and exits 1 if int8 or fp8 misses a goal.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import common_prefix  # noqa: E402 (benchmarks/common.py)

from chatkv.config import EngineConfig  # noqa: E402
from chatkv.engine.model_runner import BatchItem, ModelRunner  # noqa: E402

CHUNK = 512
BLOCK = 16
# goals per kv dtype: teacher-forced agreement (fraction), perplexity (relative to bf16), needles
GOALS: dict[str, dict] = {
    "int8": {"agree": 0.98, "ppl": 0.01, "needle": True},
    "fp8": {"ppl": 0.03, "needle": True},
}
NEEDLES = [  # (passphrase, where in the filler: fraction of its characters)
    ("blue pelican 42", 0.10),
    ("silver otter 17", 0.20),
    ("amber falcon 93", 0.30),
    ("green walrus 58", 0.45),
    ("violet heron 26", 0.60),
]
QUESTION = "What is the secret passphrase?"
ANSWER = 'The secret passphrase is "'  # the reply starts with it: the model has to copy the phrase


def load_engine(model_dir=None):
    """The default model as the engine loads it (its weights, its dtype); a tiny pool: the runners have their own."""
    from chatkv.engine.core import Engine

    return Engine.from_pretrained(model_dir, num_blocks=8, host_cache_bytes=0)


def kv_runner(model, kv_dtype: str, tokens: int) -> ModelRunner:
    """The engine's model runner with a pool of ``kv_dtype`` for ``tokens`` tokens (no host tier)."""
    return ModelRunner(
        model, EngineConfig(kv_dtype=kv_dtype, block_size=BLOCK, num_blocks=-(-tokens // BLOCK) + 1, host_cache_bytes=0)
    )


def _prefill(runner: ModelRunner, ids: list[int], table: list[int], logits: str):
    """Chunks of CHUNK tokens; yields (first position, logits of the chunk) ("all": every token, "last": the last's)."""
    for s in range(0, len(ids), CHUNK):
        last = s + CHUNK >= len(ids)
        mode = logits if logits == "all" or last else "none"
        out = runner.forward(runner.build_batch([BatchItem(ids[s : s + CHUNK], s, table, mode)]))
        if mode != "none":
            yield s, out


def _whole(n_tokens: int) -> int:
    """``n_tokens`` rounded up to whole blocks (each sequence has its own)."""
    return -(-n_tokens // BLOCK) * BLOCK


def _blocks(runner, n_tokens):
    return runner.pool.allocate(-(-n_tokens // runner.pool.block_size))


def greedy(
    runner: ModelRunner, prompts: list[list[int]], n: int, force: list[list[int]] | None = None
) -> list[list[int]]:
    """Greedy ``n`` tokens for each prompt, EOS ignored: each prompt prefilled, then decode steps of all together.

    The argmax after every step. With ``force`` (teacher forcing), step i feeds ``force[.][i - 1]``
    instead of the model's own previous token: the same steps, batch and shapes as the free run."""
    tables = [_blocks(runner, len(p) + n) for p in prompts]
    try:
        outs = []
        for p, t in zip(prompts, tables):
            ((_, out),) = _prefill(runner, p, t, "last")
            outs.append([int(out[-1].argmax())])
        feed = force or outs
        for i in range(1, n):
            items = [BatchItem([f[i - 1]], len(p) + i - 1, t, "last") for p, f, t in zip(prompts, feed, tables)]
            for o, row in zip(outs, runner.forward(runner.build_batch(items))):
                o.append(int(row.argmax()))
        return outs
    finally:
        for t in tables:
            runner.pool.decref(t)


def agreement(runner: ModelRunner, prompts: list[list[int]], ref: list[list[int]]) -> tuple[int, int]:
    """Teacher-forced top-1 agreement: positions where the argmax, after the prompt and ``ref``'s tokens
    before it, is ``ref``'s token."""
    pred = greedy(runner, prompts, len(ref[0]), force=ref)
    return sum(a == b for p, r in zip(pred, ref) for a, b in zip(p, r)), sum(map(len, ref))


def perplexity(runner: ModelRunner, ids: list[int]) -> float:
    """exp(mean NLL) of ids[1:], the KV stored in the runner's dtype, prefilled in chunks of CHUNK."""
    table = _blocks(runner, len(ids))
    nll, target = 0.0, torch.tensor(ids)
    try:
        for s, out in _prefill(runner, ids, table, "all"):
            logp = torch.log_softmax(out.float(), -1)
            nxt = target[s + 1 : s + 1 + len(out)]
            nll -= logp[: len(nxt)].gather(1, nxt[:, None]).sum().item()
    finally:
        runner.pool.decref(table)
    return math.exp(nll / (len(ids) - 1))


def ppl_ids(tokenizer, n: int) -> list[int]:
    from tests.support.llama_cpp_reference import ppl_text

    ids = tokenizer(ppl_text())["input_ids"][:n]
    assert len(ids) == n, (len(ids), n)
    return ids


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    from tests.support.llama_cpp_reference import prompt_ids

    return prompt_ids(tokenizer)[:n]


def needle_prompts(tokenizer, n_tokens: int, needles=NEEDLES) -> list[list[int]]:
    """Chat prompts of ~``n_tokens``: pydoc filler with one passphrase sentence at its place, the question last."""
    from tests.support.llama_cpp_reference import ppl_text

    filler = tokenizer.decode(tokenizer(ppl_text())["input_ids"][: n_tokens - 80])
    out = []
    for phrase, where in needles:
        cut = filler.rfind("\n", 0, int(len(filler) * where))  # at a line break
        doc = f'{filler[:cut]}\n\nThe secret passphrase is "{phrase}". Remember it.\n{filler[cut:]}'
        text = (
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"{doc}\n\n{QUESTION}"}], add_generation_prompt=True, tokenize=False
            )
            + ANSWER
        )
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


@dataclass
class Result:
    kv_dtype: str
    agree: tuple[int, int] = (0, 0)
    free_run: float = 0.0
    ppl: float = float("nan")
    needles: list[bool] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def agreement(self) -> float:
        return self.agree[0] / max(self.agree[1], 1)


def run_gate(
    model,
    tokenizer,
    kv_dtypes: list[str],
    prompts: int = 20,
    tokens: int = 256,
    ppl_tokens: int = 4096,
    needles: int = 5,
    needle_tokens: int = 4096,
    log=print,
) -> dict[str, Result]:
    """Measure every kv dtype against bf16 (always measured first). Returns {kv dtype: Result}."""
    kv_dtypes = ["bf16", *[k for k in kv_dtypes if k != "bf16"]]
    chats = chat_prompts(tokenizer, prompts)
    text = ppl_ids(tokenizer, ppl_tokens)
    hay = needle_prompts(tokenizer, needle_tokens, NEEDLES[:needles]) if needles else []
    size = max(_whole(ppl_tokens), sum(_whole(len(p) + tokens) for p in chats), sum(_whole(len(p) + 10) for p in hay))
    results: dict[str, Result] = {}
    ref: list[list[int]] = []
    for kv in kv_dtypes:
        t0 = time.perf_counter()
        runner = kv_runner(model, kv, size)
        r = results[kv] = Result(kv)
        conts = greedy(runner, chats, tokens)
        if kv == "bf16":
            ref = conts
        r.free_run = sum(common_prefix(a, b) for a, b in zip(conts, ref)) / len(ref)
        r.agree = agreement(runner, chats, ref)
        r.ppl = perplexity(runner, text)
        if hay:
            replies = [tokenizer.decode(o) for o in greedy(runner, hay, 10)]
            r.replies = replies
            r.needles = [phrase in reply.lower() for (phrase, _), reply in zip(NEEDLES, replies)]
        runner.pool.check_integrity()
        del runner
        r.seconds = time.perf_counter() - t0
        log(
            f"  {kv}: agreement {r.agreement:.2%}, free-run {r.free_run:.1f}, ppl {r.ppl:.4f}, "
            f"needles {sum(r.needles)}/{len(r.needles)} {r.needles} ({r.seconds:.0f} s)"
        )
    return results


def verdicts(results: dict[str, Result]) -> dict[str, list[str]]:
    """{kv dtype: the goals it misses}; empty list = passes. bf16 and dtypes without goals pass."""
    base = results["bf16"]
    out = {}
    for kv, r in results.items():
        g, miss = GOALS.get(kv, {}), []
        if "agree" in g and r.agreement < g["agree"]:
            miss.append(f"agreement {r.agreement:.2%} < {g['agree']:.0%}")
        if "ppl" in g and abs(r.ppl / base.ppl - 1) > g["ppl"]:
            miss.append(f"perplexity {r.ppl / base.ppl - 1:+.2%} beyond {g['ppl']:.0%}")
        if g.get("needle") and any(b and not x for b, x in zip(base.needles, r.needles)):
            miss.append("a needle bf16 retrieves is lost")
        out[kv] = miss
    return out


def table(results: dict[str, Result], n_tokens: int) -> tuple[list[str], list[list[str]]]:
    base = results["bf16"]
    fail = verdicts(results)
    header = [
        "kv dtype",
        "agreement (teacher forced)",
        f"free-run (of {n_tokens})",
        "perplexity",
        "vs bf16",
        "needles",
        "goal",
        "verdict",
    ]
    rows = []
    for kv, r in results.items():
        g = GOALS.get(kv)
        goal = (
            "baseline"
            if kv == "bf16"
            else ", ".join(
                ([f"agree >= {g['agree']:.0%}"] if "agree" in g else []) + [f"ppl within {g['ppl']:.0%}", "needles"]
            )
            if g
            else "(none)"
        )
        verdict = "-" if not g else ("PASS" if not fail[kv] else "FAIL: " + "; ".join(fail[kv]))
        rows.append(
            [
                kv,
                f"{r.agreement:.2%} ({r.agree[0]}/{r.agree[1]})",
                f"{r.free_run:.1f}",
                f"{r.ppl:.4f}",
                f"{r.ppl / base.ppl:.4f}x ({r.ppl / base.ppl - 1:+.2%})",
                f"{sum(r.needles)}/{len(r.needles)}",
                goal,
                verdict,
            ]
        )
    return header, rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv-dtypes", default="bf16,int8,fp8,fp16")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--ppl-tokens", type=int, default=4096)
    p.add_argument("--needles", type=int, default=5)
    p.add_argument("--needle-tokens", type=int, default=4096)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument(
        "--model", default=None, help="Hugging Face model directory (default: the packaged SmolLM2-135M-Instruct)"
    )
    p.add_argument("--show-replies", action="store_true", help="print each dtype's needle replies")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from common import OtherLoad, load_average, print_table

    other = OtherLoad()
    t0 = time.perf_counter()
    engine = load_engine(args.model)
    print(f"model: {engine.model_dir.name}, weights {engine.weights.label}, KV dtype under auto: {engine.kv_dtype}")
    with torch.inference_mode():
        results = run_gate(
            engine.model,
            engine.tokenizer,
            args.kv_dtypes.split(","),
            args.prompts,
            args.tokens,
            args.ppl_tokens,
            args.needles,
            args.needle_tokens,
        )
    if args.show_replies:
        for kv, r in results.items():
            for reply in r.replies:
                print(f"  {kv}: {reply!r}")
    header, rows = table(results, args.tokens)
    print_table(
        f"KV dtype quality, {args.prompts} chat prompts x {args.tokens} tokens, perplexity over "
        f"{args.ppl_tokens} tokens of pydoc topics, {args.needles} needles in ~{args.needle_tokens}-token prompts",
        header,
        rows,
    )
    fail = {k: v for k, v in verdicts(results).items() if v}
    print(f"\npassing: {', '.join(k for k in results if k not in fail)}; failing: {', '.join(fail) or 'none'}")
    print(f"{time.perf_counter() - t0:.0f} s, threads={args.threads}, load average {load_average()}, {other}")
    return 1 if fail else 0


if __name__ == "__main__":
    sys.exit(main())
