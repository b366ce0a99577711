"""Conversations as trees: regenerate, edit and switch-after-restart costs.

bench_session_restore.py's workload: a 10-turn chat of long user paragraphs (~2k tokens of
history, replies cut to 4 tokens) on the default model (SmolLM2 via Engine.from_pretrained),
in one process, medians of ``--repeats`` (3):

  (a) regenerate at turn 10: wall time to the first token of ``stream_regenerate`` vs a normal
      turn 10 with the history cached (goal: within 1.1x), and vs transformers re-prefilling the
      whole turn-10 prompt (an app without a KV cache)
  (b) edit message 5 of 10: tokens computed vs the tokens from message 5 on, plus one block
  (c) switch back to a branch after a restart: the branch (10 turns) is left for an edit of
      message 5 (answered, written behind), the engine closed; a new engine on a fresh copy of
      the data dir resumes, switches back and sends a turn. Restore time (Snapshots.restore) vs
      recomputing the same turn with no snapshot on disk (goal >= 10x); the turns' TTFTs too.

The CPU model and the other processes' load are printed: on a shared 2-core machine the times
are noisy (ratios hold better than rates); the figures for the README come from a quiet run.

    CHATKV_HOME=/tmp/ckhome .venv/bin/python benchmarks/bench_branches.py [--repeats 3] [--history 2100]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_session_restore import (  # noqa: E402
    SYSTEM,
    hf_ttft_full,
    make_engine,
    timed_turn,
    turn10_message,
    user_messages,
)
from benchmarks.common import OtherLoad, cpu_line, load_average, median, print_table  # noqa: E402


def first_piece(stream) -> tuple[float, object]:
    """(seconds to the first yielded piece, the Reply) of a turn's stream."""
    t0, first, reply = time.perf_counter(), None, None
    for piece in stream:
        if first is None:
            first = time.perf_counter() - t0
        if not isinstance(piece, str):
            reply = piece
    return first, reply


def build(engine, messages, reply_tokens):
    """Turns 1-9 of the workload; returns (session, history length before message 5)."""
    s = engine.session(system=SYSTEM, params=dict(max_tokens=reply_tokens, temperature=0.0))
    before5 = 0
    for i, m in enumerate(messages):
        if i == 4:
            before5 = len(s.tokens)
        s.send(m)
    return s, before5


def user_ids(s) -> list[int]:
    return [m.id for m in s.messages() if m.role == "user"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--history", type=int, default=2100, help="target history tokens before turn 10")
    p.add_argument("--reply-tokens", type=int, default=4)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--model", default=None, help="Hugging Face model dir (default: the packaged SmolLM2)")
    args = p.parse_args()
    R = args.repeats
    torch.set_num_threads(args.threads)
    print(cpu_line())
    print(f"load average at start: {load_average()}")
    load = OtherLoad()

    from chatkv.engine.sampling import SamplingParams
    from chatkv.weights import ensure_default_model

    one = SamplingParams(max_tokens=1, temperature=0.0)
    model_dir = Path(args.model) if args.model else ensure_default_model()
    root = Path(tempfile.mkdtemp(prefix="chatkv-bench-branches-"))
    try:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, args.dtype))
        hf.eval()
        data = root / "data"
        eng = make_engine(model_dir, data, args.dtype)
        tok = eng.tokenizer
        block = eng.kv.block_size
        eng.generate(tok("Warm up the kernels, please.")["input_ids"], SamplingParams(max_tokens=2, temperature=0.0))
        hf_ttft_full(hf, tok("Warm up the kernels, please.")["input_ids"])
        sys_tokens = len(
            eng.session_manager.renderer.first(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}]
            )
        )
        per_message = max(32, (args.history - sys_tokens) // 9 - (8 + args.reply_tokens))
        messages = user_messages(tok, per_message)

        # (a) a normal turn 10 (history cached), then regenerate it; one session per repeat
        turn_w, regen_w, regen_u, hf_w, prompts = [], [], [], [], []
        sessions = []
        for i in range(R):
            s, before5 = build(eng, messages, args.reply_tokens)
            w, r = timed_turn(s, turn10_message(i))
            turn_w.append(w)
            w2, r2 = first_piece(s.stream_regenerate(one))
            regen_w.append(w2)
            regen_u.append(r2.usage)
            prompts.append(s.tokens[: r2.usage.prompt_tokens])
            sessions.append((s, before5))
        hf_w = [hf_ttft_full(hf, prompts[i])[0] for i in range(R)]
        del hf

        # (b) edit message 5 of 10 (a different text per repeat, each a new sibling of it)
        edit_rows = []
        s, before5 = sessions[0]
        m5 = user_ids(s)[4]
        for i in range(R):
            r = s.edit(m5, f"({i}) Forget those notes; instead tell me one fact about rivers, in one sentence.", one)
            edit_rows.append((r.usage.computed_tokens, r.usage.prompt_tokens - before5, r.usage))
        for x, _ in sessions[1:]:
            x.delete()

        # (c) branch A (10 turns), left for an edit of message 5 (branch B, current); restart; switch back
        a, _ = build(eng, messages, args.reply_tokens)
        a.send(turn10_message(9))
        a_leaf = a.messages()[-1].id
        a.edit(user_ids(a)[4], "Forget those notes; instead tell me one fact about mountains, in one sentence.")
        a_id = a.id
        eng.close()
        template = root / "template"
        shutil.copytree(data, template)

        def after_restart(i: int, keep_snapshot: bool):
            shutil.rmtree(data)
            shutil.copytree(template, data)
            if not keep_snapshot:
                shutil.rmtree(data / "kv")
            e = make_engine(model_dir, data, args.dtype)
            snaps = e.session_manager.snapshots
            spent = {"restore": 0.0}
            inner = snaps.restore

            def timed(*a_, **k):
                t0 = time.perf_counter()
                try:
                    return inner(*a_, **k)
                finally:
                    spent["restore"] += time.perf_counter() - t0

            snaps.restore = timed  # benchmark-side timer around the engine's own call
            try:
                s2 = e.resume(a_id)
                s2.switch(a_leaf)
                w, r = timed_turn(s2, f"({i}) And one more word about that, please.")
                return w, spent["restore"], r.usage
            finally:
                e.close()

        restored = [after_restart(i, True) for i in range(R)]
        recomputed = [after_restart(i, False) for i in range(R)]
    finally:
        shutil.rmtree(root, ignore_errors=True)

    rows = []
    a_ratio = median(regen_w) / median(turn_w)
    rows.append(
        [
            "(a) regenerate turn 10 vs a normal turn 10 (cached)",
            f"{median(regen_w) * 1e3:.1f} ms",
            f"{median(turn_w) * 1e3:.1f} ms",
            f"{a_ratio:.2f}x",
            f"<= 1.1x  {'MET' if a_ratio <= 1.1 else 'not met'}",
        ]
    )
    rows.append(
        [
            "(a) regenerate vs transformers re-prefilling the prompt",
            f"{median(regen_w) * 1e3:.1f} ms",
            f"{median(hf_w) * 1e3:.1f} ms",
            f"{median(hf_w) / median(regen_w):.1f}x faster",
            "(baseline)",
        ]
    )
    comp = median([c for c, _, _ in edit_rows])
    bound = median([t for _, t, _ in edit_rows])
    rows.append(
        [
            "(b) edit message 5 of 10: tokens computed vs from message 5 on",
            f"{comp:.0f} tokens",
            f"{bound:.0f} (+{block})",
            f"{comp / bound:.2f}x",
            f"<= +1 block  {'MET' if comp <= bound + block else 'not met'}",
        ]
    )
    rs, rw = median([x[1] for x in restored]), median([x[0] for x in restored])
    cw = median([x[0] for x in recomputed])
    came_back = all(x[2].restored_tokens > 0 for x in restored)  # else the restore timed found nothing to read
    c_ok = came_back and cw / rs >= 10
    rows.append(
        [
            "(c) switch back after a restart: restore vs recomputing the turn",
            f"{rs * 1e3:.1f} ms",
            f"{cw * 1e3:.1f} ms",
            f"{cw / rs:.1f}x",
            f">= 10x  {'MET' if c_ok else 'not met' if came_back else 'not met: nothing restored'}",
        ]
    )
    rows.append(
        [
            "(c) the turn's TTFT: restored vs recomputed",
            f"{rw * 1e3:.1f} ms",
            f"{cw * 1e3:.1f} ms",
            f"{cw / rw:.1f}x",
            "",
        ]
    )
    print_table(
        f"Branches, SmolLM2 ({args.dtype}), ~{len(prompts[0])}-token turn-10 prompt, medians of {R}",
        ["case", "chatkv", "baseline", "ratio", "goal"],
        rows,
    )
    u = regen_u[0]
    print(f"\n(a) regenerate usage: prompt {u.prompt_tokens}, cached {u.cached_tokens}, computed {u.computed_tokens}")
    print(f"(b) edit usage: {edit_rows[0][2]}")
    print(f"(c) restored usage: {restored[0][2]}")
    print(f"(c) recomputed usage: {recomputed[0][2]}")
    print(
        f"samples ms: turn {[round(x * 1e3, 1) for x in turn_w]} regen {[round(x * 1e3, 1) for x in regen_w]} "
        f"hf {[round(x * 1e3, 1) for x in hf_w]} restore {[round(x[1] * 1e3, 1) for x in restored]} "
        f"recompute {[round(x[0] * 1e3, 1) for x in recomputed]}"
    )
    print(f"\nload average at end: {load_average()}; {load}")


if __name__ == "__main__":
    main()
