"""The quality gate of chunk KV reuse: rag_eval.py's questions answered with each
``rag_kv_reuse`` mode and recompute ratio against full prefill, on the same engine and prompts.

For every question the prompt is exactly a RAG turn's (system prompt, then the numbered top-3
hybrid sources, the citation instruction, the question). Full prefill answers it greedily first;
then, per configuration, the sources' KV is placed (chatkv.rag.placement.place: chunk KV from the
store, re-rotated, the selected rows recomputed) and

- **teacher-forced top-1 agreement**: full prefill's answer tokens are fed after the placed prompt
  in one forward; the share of answer positions whose argmax is full prefill's next token;
- the **free-running greedy answer** from the placed KV (the engine's own decode), scored like
  rag_eval's answers: EM, token F1, citation precision.

Each question's chunk KV is computed before any row is timed, so ``place ms/q`` is placement
alone (the first row does not pay for computing it).

The gate: F1 and citation precision within 2 points of full prefill, agreement >= 95%.
The control row recomputes every chunk token: placement then places nothing and the scheduler
computes the prompt in full prefill's own forwards, so its answers must be full prefill's token
for token ("same tokens" counts them; anything short of n/n is a bug). Its agreement is the
metric's own floor (teacher forcing computes the answer in one forward, decoding one token a
step: bf16 rounds them differently and flips near-ties), not a loss from reuse.
Full prefill and each configuration run in a radix namespace of their own, dropped after the
question: every answer starts from an empty cache (a previous question's cached system prompt,
computed in a forward of another length, would round differently: the first control runs
differed from full prefill by that and by placement's single forward).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rag_metrics import answer_row

from chatkv.kvcache.types import BlockTable

CONFIGS = (  # (label, mode, edge tokens, recompute ratio, blend's check layers: None = the engine's)
    ("blend 0%", "blend", 0, 0.0, None),
    ("blend 5%", "blend", 0, 0.05, None),
    ("blend 15%", "blend", 0, 0.15, None),
    ("blend 30%", "blend", 0, 0.30, None),
    ("blend 45%", "blend", 0, 0.45, None),
    ("blend 60%", "blend", 0, 0.60, None),
    ("edge 4", "edge", 4, 0.0, None),
    ("blend 100% (control)", "blend", 0, 1.0, None),  # every chunk token recomputed: full prefill through placement
)


@dataclass(eq=False)
class _Req:  # the KV record chatkv.kvcache.types.SequenceKV names, for one teacher-forced forward
    token_ids: list
    namespace: object
    prefix: object = None
    kv: BlockTable = field(default_factory=BlockTable)
    num_cached: int = 0


def _teacher_forced(engine, placed, tokens: list[int], n_prompt: int, namespace) -> tuple[int, int]:
    """(answer positions whose argmax is the next token of ``tokens``, positions) over the placed KV."""
    import torch

    from chatkv.engine.model_runner import BatchItem

    kv, runner = engine.kv, engine.runner
    req = _Req(tokens, namespace, prefix=placed.kept)
    kv.attach(req)
    try:
        start = req.kv.num_computed
        assert kv.reserve(req.kv, len(tokens) - start), "no room for a teacher-forced forward"
        logits = runner.forward(runner.build_batch([BatchItem(tokens[start:], start, req.kv.blocks, "all")]))
        rows = torch.arange(n_prompt - 1 - start, len(tokens) - 1 - start)
        pred = logits[rows].argmax(-1).tolist()
        gold = tokens[n_prompt:]
        return sum(int(p == g) for p, g in zip(pred, gold)), len(gold)
    finally:
        req.kv.num_computed = 0  # none of it is kept
        kv.release(req)


def _answer(engine, prompt, params, prefix, namespace):
    seq = engine.add_request(prompt, params, prefix=prefix, namespace=namespace)
    for _ in engine.drive(seq):
        pass
    engine.on_loop(lambda: engine.kv.drop_namespace(namespace))
    return seq.result()


def _warm(engine, cp, tokens: list[int], texts: list[str]) -> None:
    """The chunk KV placement will look up for ``tokens``, computed now, as placement would (the
    same chunks in one forward), so that the timings compare placement alone."""
    ids = [cp.chunk_ids(engine.tokenizer, t) for t in texts]
    spans = cp.find_spans(tokens, 0, ids)
    cp.entries(engine, cp.chunk_store(engine), [texts[i] for i, *_ in spans], [ids[i] for i, *_ in spans])


def parse_configs(spec: str) -> tuple:
    """``--reuse-configs blend:0.3,blend:0.45@1,edge:4``: the configurations to run (the control
    always runs); ``@N``: blend with N check layers (default: the engine's ``rag_check_layers``)."""
    out = []
    for part in filter(None, (x.strip() for x in spec.split(","))):
        mode, _, value = part.partition(":")
        value, _, layers = value.partition("@")
        try:
            checks = int(layers) if layers else None
            if mode == "blend" and 0 <= float(value) < 1 and (checks is None or checks >= 1):
                label = f"blend {float(value):.0%}" + (f" @{checks}" if checks else "")
                out.append((label, "blend", 0, float(value), checks))
                continue
            if mode == "edge" and int(value) > 0 and not layers:
                out.append((f"edge {int(value)}", "edge", int(value), 0.0, None))
                continue
        except ValueError:
            pass
        raise SystemExit(
            f"--reuse-configs: {part!r} is not blend:RATIO[@LAYERS] (0 <= RATIO < 1, LAYERS >= 1) or edge:TOKENS (> 0)"
        )
    return tuple(out) + CONFIGS[-1:]


def reuse_rows(
    kb, questions: list[dict], max_tokens: int, sources: int, system: str, configs: tuple = CONFIGS
) -> list[list[str]]:
    from chatkv import Engine
    from chatkv.engine.sampling import SamplingParams
    from chatkv.rag import placement as cp
    from chatkv.rag.context import canonical, source_texts, user_message

    engine = Engine.from_pretrained(rag_kv_disk=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    golds = [q["answer"] for q in questions]
    replies = {"full prefill": []}
    agree = {label: [0, 0] for label, *_ in configs}
    spent = {label: 0.0 for label, *_ in configs}
    reused = {label: [0, 0] for label, *_ in configs}
    same = {label: 0 for label, *_ in configs}  # answers token-identical to full prefill's
    shown = []
    try:
        t0 = time.perf_counter()
        for qi, q in enumerate(questions):
            hits = canonical(kb.search(q["question"], k=sources, mode="hybrid"))
            texts = source_texts(hits)  # as a turn's placement quotes them, labels included
            shown.append([h.text for h in hits])
            prompt = engine.encode_chat(
                [{"role": "system", "content": system}, {"role": "user", "content": user_message(q["question"], hits)}]
            )
            full = _answer(engine, prompt, params, None, ("rag-eval", qi, "full prefill"))
            replies["full prefill"].append(full.text)
            answer = list(prompt) + list(full.token_ids)
            engine.on_loop(lambda: _warm(engine, cp, answer, texts))  # so that no row's place ms/q computes chunk KV
            for label, mode, edge, ratio, checks in configs:
                ns = ("rag-eval", qi, label)
                t = time.perf_counter()
                placed = engine.on_loop(
                    lambda: cp.place(
                        engine, None, answer, 0, texts, ns, None, False, mode, edge, ratio, check_layers=checks
                    )
                )
                spent[label] += time.perf_counter() - t
                reused[label][0] += placed.reused
                reused[label][1] += placed.reused + placed.recomputed
                if len(full.token_ids):
                    a, n = engine.on_loop(lambda: _teacher_forced(engine, placed, answer, len(prompt), ns))
                    agree[label][0] += a
                    agree[label][1] += n
                else:
                    if placed.kept is not None:
                        engine.on_loop(lambda: engine.kv.drop(placed.kept))
                # free-running from the placed KV (the teacher-forced rows left it in the namespace's tree)
                # as a turn places them: through the prompt's last token but one
                placed = engine.on_loop(
                    lambda: cp.place(
                        engine,
                        None,
                        prompt,
                        0,
                        texts,
                        ns,
                        None,
                        False,
                        mode,
                        edge,
                        ratio,
                        upto=len(prompt) - 1,
                        check_layers=checks,
                    )
                )
                got = _answer(engine, prompt, params, placed.kept, ns)
                replies.setdefault(label, []).append(got.text)
                same[label] += int(list(got.token_ids) == list(full.token_ids))
            if qi % 10 == 9:
                print(f"  reuse eval: {qi + 1}/{len(questions)} questions, {time.perf_counter() - t0:.0f} s")
    finally:
        engine.close()
    base = answer_row(replies["full prefill"], golds, shown)
    rows = []
    for label, texts in replies.items():
        a = answer_row(texts, golds, shown)
        cp_ = a["citation_precision"]
        tf = agree.get(label)
        agreement = 1.0 if tf is None else (tf[0] / tf[1] if tf[1] else float("nan"))
        ok = (label == "full prefill") or (
            base["f1"] - a["f1"] <= 0.02
            and agreement >= 0.95
            and (cp_ is None or base["citation_precision"] is None or base["citation_precision"] - cp_ <= 0.02)
        )
        share = "-" if label not in reused else f"{reused[label][0] / max(reused[label][1], 1):.0%}"
        place_ms = "-" if label not in spent else f"{spent[label] / len(questions) * 1000:.0f}"
        rows.append(
            [
                label,
                str(a["n"]),
                share,
                "-" if label not in same else f"{same[label]}/{a['n']}",
                f"{a['em']:.1%}",
                f"{a['f1']:.1%}",
                "n/a" if cp_ is None else f"{cp_:.1%}",
                f"{agreement:.1%}",
                place_ms,
                "-" if label == "full prefill" else ("pass" if ok else "fail"),
            ]
        )
    return rows


HEADERS = [
    "KV",
    "n",
    "chunk tokens reused",
    "same tokens",
    "EM",
    "F1",
    "citation precision",
    "top-1 agreement",
    "place ms/q",
    "gate",
]
