"""Turn-10 time to first token when the history's KV is on the device, in the host tier, on disk, or nowhere.

A 10-turn conversation (long user paragraphs, replies cut to 4 tokens, the message bank of
bench_session_restore.py) builds ~2k tokens of history; turn 10 adds ~35 tokens. Every case
runs the exact token ids of the same turn-10 prompt (a different turn-10 message per repeat,
so no repeat finds another's new tokens cached), in one process, same weights, dtype and
threads; the first token of every case is printed (they should agree):

  (a) device hit: the history's KV is in the device pool (the radix cache)
  (b) host hit: the history's KV was evicted to the host tier (``kv.cache.evict`` of the
      whole pool moves it there); admission copies it back into device blocks
  (c) disk restore: the history's KV only in the conversation's safetensors snapshot;
      ``Snapshots.restore`` loads and imports it, exactly what a turn of a spilled session
      does (minus the database writes), on an engine without a host tier
  (d) recompute: prefix caching off, the whole prompt computed

TTFT is the wall time from the call to the first generated token (restore and host copy
included). The run also prints what the host copy itself cost (ms, MB/s) and the tiers
counted in ``Usage``.

On CPU the "host tier" is a second CPU tensor: (b) costs one memcpy of the history's KV
inside the process; on CUDA it is pinned memory copied over PCIe on a side stream.

    .venv/bin/python benchmarks/bench_host_tier.py [--repeats 3] [--history 2100] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_session_restore import SYSTEM, CpuMeter, build_session, user_messages  # noqa: E402

CASES = "abcd"


def turn10_message(n: int) -> str:
    """Turn 10's message number ``n``: the same length for every n < 100, never a cache hit for another n."""
    return f"({n:02d}) Thanks. To finish, tell me in one short sentence which topic we discussed was the most fun."


def tiny_model(root: Path) -> Path:
    """A seeded random Llama (4 layers, hidden 256) with the tests' tokenizer: no download, no packaged model."""
    from tests.support.tiny import make_model

    d = root / "tiny-model"
    make_model(
        d,
        "llama",
        seed=0,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )
    return d


def first_token(e, prompt, prefix=None, restored=0):
    """Submit ``prompt`` (with ``prefix``, the KV of ``restored`` tokens read from disk), step to
    its first token; return (wall seconds, the token, usage)."""
    from chatkv.engine.sampling import SamplingParams

    t0 = time.perf_counter()
    seq = e.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), prefix=prefix)
    seq.num_restored = restored
    while not seq.finished:
        e.step()
    wall = time.perf_counter() - t0
    return wall, seq.generated_ids[0], seq.usage()


class CopyTimer:
    """Time the host tier's copies back to the device (benchmark-side wrapper of HostPool.load)."""

    def __init__(self, host):
        self.s, self.blocks = 0.0, 0
        load = host.load

        def timed(pool, host_ids, block_ids):
            t0 = time.perf_counter()
            load(pool, host_ids, block_ids)
            if host.cuda:
                torch.cuda.synchronize()
            self.s += time.perf_counter() - t0
            self.blocks += len(block_ids)

        host.load = timed


def med(xs):
    return statistics.median(xs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--history", type=int, default=2100, help="target history tokens before turn 10")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--model", default=None, help="Hugging Face model dir (default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--tiny", action="store_true", help="a seeded random tiny Llama instead (no packaged model needed)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    meter = CpuMeter()
    t_start = time.perf_counter()

    from chatkv.engine.core import Engine

    root = Path(tempfile.mkdtemp(prefix="chatkv-bench-host-"))
    try:
        if args.tiny:
            model_dir = tiny_model(root)
        elif args.model:
            model_dir = Path(args.model)
        else:
            from chatkv.weights import ensure_default_model

            model_dir = ensure_default_model()
        common = dict(dtype=args.dtype, device=args.device, kv_cache_bytes=192 * 2**20)

        # the engine of (c) builds the conversation, then spills it: its snapshot is what (c) restores
        disk = Engine.from_pretrained(model_dir, data_dir=str(root / "disk"), host_cache_bytes=0, **common)
        tok = disk.tokenizer
        sys_tokens = len(
            disk.session_manager.renderer.first(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}]
            )
        )
        messages = user_messages(tok, max(32, (args.history - sys_tokens) // 9 - 12))
        s = build_session(disk, messages, 4)
        history = list(s.tokens)
        renderer = disk.session_manager.renderer
        # one turn-10 message per case and repeat: no case finds another's new tokens cached
        prompts = [
            {c: history + renderer.user_turn(turn10_message(i * 4 + j)) for j, c in enumerate(CASES)}
            for i in range(args.repeats)
        ]
        s.spill()
        snaps = disk.session_manager.snapshots

        host = Engine.from_pretrained(model_dir, data_dir=str(root / "host"), **common)
        assert host.kv.host is not None and host.kv.host.nbytes >= len(history) * host.model.kv_bytes_per_token
        timer = CopyTimer(host.kv.host)
        recompute = Engine.from_pretrained(model_dir, data_dir=str(root / "off"), enable_prefix_caching=False, **common)
        warm = history[:64]
        for e in (host, recompute, disk):  # kernels warm on every engine
            first_token(e, warm)
        first_token(host, history)  # the history's KV into host's device pool

        rows = {k: [] for k in CASES}
        toks = {k: [] for k in CASES}
        usage = {}
        copy_s, copy_blocks, restore_s = [], [], []

        def record(case, wall, token, u):
            rows[case].append(wall)
            toks[case].append(token)
            usage.setdefault(case, u)

        for prompt in prompts:  # interleaved, so background load hits every case alike
            # (a) device hit
            record("a", *first_token(host, prompt["a"]))
            # (b) host hit: every cached block to host, then the next prompt
            host.kv.cache.evict(host.kv.pool.num_blocks)
            assert host.kv.cache.cached_blocks == 0 and host.kv.cached_len(prompt["b"]) > 0
            timer.s, timer.blocks = 0.0, 0
            record("b", *first_token(host, prompt["b"]))
            copy_s.append(timer.s)
            copy_blocks.append(timer.blocks)
            # (c) disk restore: nothing of the conversation in memory, then what a spilled session's turn does
            disk.kv.cache.evict(disk.kv.pool.num_blocks)
            t0 = time.perf_counter()
            kept, restored = snaps.restore(s.id, prompt["c"])
            restore_s.append(time.perf_counter() - t0)
            assert restored > 0, "the snapshot was not restored"
            _, t, u = first_token(disk, prompt["c"], prefix=kept, restored=restored)
            record("c", time.perf_counter() - t0, t, u)  # restore + admission + prefill of the new tokens
            # (d) recompute
            record("d", *first_token(recompute, prompt["d"]))
        stats = host.kv_stats()
        kv_bpt = host.model.kv_bytes_per_token
        for e in (host, disk, recompute):
            e.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    A, B, C, D = (med(rows[k]) for k in CASES)
    others = meter.others_share()
    print(
        f"\nHost tier: turn-10 TTFT of a {len(history)}-token chat (model {model_dir.name}, {args.dtype}, "
        f"{args.device}, {args.threads} threads, {args.repeats} repeats, medians)"
    )
    print(
        f"other processes used {others * 100:.0f}% of the machine's CPU time during this run"
        + ("  WARNING: contended, timings inflated" if others > 0.1 else "")
    )
    print(f"turn-10 prompt {len(prompts[0]['a'])} tokens, history {len(history)} tokens, KV {kv_bpt} bytes/token")
    names = {
        "a": "(a) device hit (radix cache)",
        "b": "(b) host hit (copied back from the host tier)",
        "c": "(c) disk restore (safetensors snapshot)",
        "d": "(d) recompute (prefix caching off)",
    }
    w = max(len(n) for n in names.values())
    print(f"\n{'case'.ljust(w)}  {'TTFT ms':>9}  {'x (b)':>7}  usage: cached / host / restored / computed")
    for k, t in zip(CASES, (A, B, C, D)):
        u = usage[k]
        print(
            f"{names[k].ljust(w)}  {t * 1000:>9.1f}  {t / B:>7.2f}  "
            f"{u.cached_tokens} / {u.host_tokens} / {u.restored_tokens} / {u.computed_tokens}"
        )
    ms = lambda xs: "[" + " ".join(f"{x * 1000:.1f}" for x in xs) + "]"  # noqa: E731
    print("\nsamples ms: " + " ".join(f"({k}) {ms(rows[k])}" for k in CASES))
    cb = med(copy_blocks)
    mb = cb * 16 * kv_bpt / 1e6
    print(
        f"host -> device copy in (b): {med(copy_s) * 1000:.2f} ms for {cb} blocks ({mb:.1f} MB, "
        f"{mb / max(med(copy_s), 1e-9):.0f} MB/s)"
    )
    print(
        f"disk -> device in (c): Snapshots.restore {med(restore_s) * 1000:.2f} ms (manifest, segments read from the "
        f"OS page cache, checks, import_kv), then the same prefill"
    )
    print(f"host tier stats: {', '.join(f'{k}={v}' for k, v in stats.items() if k.startswith(('host', 'evicted')))}")
    print("first token of each case: " + ", ".join(f"{k} {toks[k]}" for k in CASES))
    print("\nratios")
    print(f"  host hit vs disk restore: {C / B:.2f}x faster (goal > 1x)  {'MET' if C > B else 'NOT MET'}")
    print(f"  host hit vs recompute:    {D / B:.2f}x faster (goal > 1x)  {'MET' if D > B else 'NOT MET'}")
    print(f"  host hit / device hit:    {B / A:.2f}x")
    print(f"\ntotal bench time {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
