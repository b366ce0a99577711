"""KV dtypes: memory, decode speed and snapshots per kv dtype, bf16 KV the baseline in the same run.

All on the default model as ``Engine`` loads it (int4 weights, int8 output matrix, bf16
activations); only ``kv_dtype`` changes.

- **memory**, measured from the pool: ``BlockPool.bytes_per_token`` (checked against the pool
  tensor's bytes / its token slots), the KV of a 2,048-token conversation, and how many
  2,048-token sessions (128 blocks of 16) a 1 GiB pool holds: the blocks the engine sizes for
  ``kv_cache_bytes=1 GiB``, divided by 128.
- **decode tok/s** at batch 1 and 8 with 2,048 and 8,128 tokens of context per sequence (8,128:
  the model's 8,192 positions less the decode steps). The context KV is real: the first 8,128
  tokens of Python's pydoc topics prefilled once (bf16 KV, chunks of 512, not timed) and written
  into every sequence's own blocks in the dtype under test (``BlockPool.write``, which quantises),
  so 8 sequences read 8 separate copies; each sequence decodes its own tokens. Steps are the
  engine's model runner (``ModelRunner.forward`` over the block tables + argmax), no scheduler;
  ``--warmup`` steps first, then ``--steps`` timed steps; the dtypes take turns, ``--repeats``
  times, and the median step gives tok/s = batch / step time.
- **snapshot**: a session whose conversation holds ~2,048 tokens is spilled (the snapshot
  write), its files' bytes counted, the engine closed; then a new engine on a copy of that data
  directory resumes it and sends one more turn; the restore (``snapshots.restore``: files read,
  checked, imported into the pool) is timed, median of ``--repeats`` fresh copies.

    .venv/bin/python benchmarks/bench_kv_dtypes.py [--kv-dtypes bf16,fp32,int8,fp8] [--no-decode] [--no-snapshot]
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch
from common import OtherLoad, load_average, median, parser, print_table, setup

from chatkv.config import EngineConfig
from chatkv.engine.model_runner import BatchItem, ModelRunner

BLOCK = 16
SESSION = 2048  # tokens of one conversation in the memory and snapshot rows
GIB = 2**30


def runner(model, kv_dtype: str, **cfg) -> ModelRunner:
    cfg.setdefault("host_cache_bytes", 0)
    return ModelRunner(model, EngineConfig(kv_dtype=kv_dtype, block_size=BLOCK, **cfg))


def memory_rows(model, kv_dtypes: list[str]) -> list[list[str]]:
    rows, base = [], None
    for kv in kv_dtypes:
        pool = runner(model, kv, num_blocks=4).pool
        per = pool.bytes_per_token
        assert per * pool.num_blocks * pool.block_size == pool.kv.numel() * pool.kv.element_size(), kv
        sessions = runner(model, kv, kv_cache_bytes=GIB).pool.num_blocks // (SESSION // BLOCK)
        base = base or (per, sessions)
        rows.append(
            [
                kv,
                str(pool.kv.dtype).removeprefix("torch."),
                f"{per:,}",
                f"{per * SESSION / 1e6:.1f} MB",
                str(sessions),
                f"{per / base[0]:.2f}x",
                f"{sessions / base[1]:.2f}x",
            ]
        )
    return rows


def context_kv(model, tokenizer, n: int) -> torch.Tensor:
    """Float KV ``[layers, 2, n, kv_heads, head_dim]`` of the first ``n`` tokens of the pydoc text (bf16 KV)."""
    from tests.support.llama_cpp_reference import ppl_text

    ids = tokenizer(ppl_text())["input_ids"][:n]
    assert len(ids) == n
    r = runner(model, "bf16", num_blocks=-(-n // BLOCK))
    table = r.pool.allocate(-(-n // BLOCK))
    for s in range(0, n, 512):
        r.forward(r.build_batch([BatchItem(ids[s : s + 512], s, table, "none")]))
    return r.pool.read(table, n).clone()


class Decoder:
    """One kv dtype: a pool holding ``batch`` sequences of ``max(contexts)`` tokens of context each."""

    def __init__(self, model, kv_dtype: str, kv: torch.Tensor, batch: int, extra: int):
        self.ctx = kv.shape[2]
        per_seq = -(-(self.ctx + extra) // BLOCK)
        self.r = runner(model, kv_dtype, num_blocks=batch * per_seq)
        self.tables = [self.r.pool.allocate(per_seq) for _ in range(batch)]
        for t in self.tables:
            self.r.pool.write(t, 0, [kv[i, 0] for i in range(kv.shape[0])], [kv[i, 1] for i in range(kv.shape[0])])

    def steps(self, batch: int, context: int, n: int, warmup: int) -> list[float]:
        """Decode ``warmup + n`` steps of ``batch`` sequences over ``context`` tokens; the timed steps' seconds.
        The KV past ``context`` is overwritten by the new tokens, so every call starts at ``context``."""
        toks = [100 + 37 * j for j in range(batch)]  # distinct first tokens per sequence
        out = []
        for i in range(warmup + n):
            items = [BatchItem([toks[j]], context + i, self.tables[j], "last") for j in range(batch)]
            t0 = time.perf_counter()
            logits = self.r.forward(self.r.build_batch(items))
            toks = logits.argmax(-1).tolist()
            if i >= warmup:
                out.append(time.perf_counter() - t0)
        return out


def decode_rows(model, tokenizer, kv_dtypes, contexts, batches, steps, warmup, repeats):
    t0 = time.perf_counter()
    kv = context_kv(model, tokenizer, max(contexts))
    print(f"context KV: {kv.shape[2]} tokens prefilled in {time.perf_counter() - t0:.0f} s (not timed)", flush=True)
    decoders = {k: Decoder(model, k, kv, max(batches), warmup + steps) for k in kv_dtypes}
    del kv
    times = {(k, c, b): [] for k in kv_dtypes for c in contexts for b in batches}
    with torch.inference_mode():
        for _ in range(repeats):
            for c in contexts:
                for b in batches:
                    for k, d in decoders.items():  # the dtypes take turns: background load hits all alike
                        times[k, c, b] += d.steps(b, c, steps, warmup)
    rows = []
    for c in contexts:
        for b in batches:
            base = b / median(times[kv_dtypes[0], c, b])
            for k in kv_dtypes:
                rate = b / median(times[k, c, b])
                rows.append(
                    [f"{c:,}", str(b), k, f"{rate:.1f}", f"{median(times[k, c, b]) * 1000:.2f}", f"{rate / base:.2f}x"]
                )
    return rows


def snapshot_rows(model_dir: Path, tokenizer, kv_dtypes, repeats: int) -> list[list[str]]:
    from chatkv.engine.core import Engine
    from chatkv.engine.sampling import SamplingParams
    from tests.support.llama_cpp_reference import ppl_text

    one = SamplingParams(max_tokens=1, temperature=0.0)
    text = tokenizer.decode(tokenizer(ppl_text())["input_ids"][: SESSION - 30])
    rows, base = [], None
    for kv in kv_dtypes:
        root = Path(tempfile.mkdtemp(prefix=f"kvsnap-{kv}-"))
        data, template = root / "data", root / "template"
        make = lambda: Engine(model_dir, EngineConfig(data_dir=str(data), kv_dtype=kv, host_cache_bytes=0))  # noqa: E731
        try:
            e = make()
            s = e.session(system="You are a helpful assistant.")
            s.send(text, one)
            t0 = time.perf_counter()
            s.spill()
            write_s = time.perf_counter() - t0
            mgr = e.session_manager
            files = mgr.snapshots.segment_paths(s.id)
            size = sum(f.stat().st_size for f in files)
            tokens = mgr.store.get_snapshot(s.id).token_count
            sid = s.id
            e.close()
            shutil.copytree(data, template)
            restores = []
            for _ in range(repeats):
                shutil.rmtree(data)
                shutil.copytree(template, data)
                e = make()
                mgr = e.session_manager
                took: list[float] = []
                fn = mgr.snapshots.restore

                def timed(*a, _fn=fn, _took=took, **k):
                    t = time.perf_counter()
                    try:
                        return _fn(*a, **k)
                    finally:
                        _took.append(time.perf_counter() - t)

                mgr.snapshots.restore = timed
                r = e.resume(sid).send("Thanks.", one)
                assert took, "the turn did not restore from the snapshot"
                assert r.usage.restored_tokens >= tokens - BLOCK, (r.usage, tokens)
                restores.append(took[0])
                e.close()
            rst = median(restores)
            base = base or (size, rst)
            rows.append(
                [
                    kv,
                    str(tokens),
                    f"{size:,}",
                    f"{size / base[0]:.2f}x",
                    f"{write_s * 1000:.0f}",
                    f"{rst * 1000:.1f}",
                    f"{rst / base[1]:.2f}x",
                ]
            )
            print(f"  snapshot {kv}: {rows[-1]}", flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return rows


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--kv-dtypes", default="bf16,fp32,int8,fp8", help="the first is the baseline")
    p.add_argument("--contexts", default="2048,8128")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--steps", type=int, default=24, help="timed decode steps per repeat")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--snapshot-repeats", type=int, default=3, help="restores timed per kv dtype")
    p.add_argument("--no-decode", action="store_true")
    p.add_argument("--no-snapshot", action="store_true")
    args = p.parse_args()
    model_dir = setup(args)
    other = OtherLoad()
    from chatkv.engine.core import Engine

    kv_dtypes = args.kv_dtypes.split(",")
    engine = Engine(model_dir, EngineConfig(num_blocks=8, host_cache_bytes=0))
    model, tok = engine.model, engine.tokenizer
    print(f"model: {model_dir.name}, weights {engine.weights.label}; threads={args.threads}", flush=True)
    print_table(
        f"KV memory per kv dtype, measured from the pool (a session = {SESSION:,} tokens = {SESSION // BLOCK} blocks)",
        [
            "kv dtype",
            "pool tensor",
            "KV bytes / token",
            f"{SESSION:,}-token conversation",
            "sessions per GiB",
            f"bytes vs {kv_dtypes[0]}",
            f"sessions vs {kv_dtypes[0]}",
        ],
        memory_rows(model, kv_dtypes),
    )
    if not args.no_decode:
        contexts = [int(x) for x in args.contexts.split(",")]
        batches = [int(x) for x in args.batches.split(",")]
        with torch.inference_mode():
            rows = decode_rows(model, tok, kv_dtypes, contexts, batches, args.steps, args.warmup, args.repeats)
        print_table(
            f"decode tok/s (model runner steps, prefill not timed; median of {args.repeats} x {args.steps} steps)",
            ["context", "batch", "kv dtype", "tok/s", "ms / step", f"vs {kv_dtypes[0]}"],
            rows,
        )
        print(f"load average {load_average()}, {other}", flush=True)
    if not args.no_snapshot:
        rows = snapshot_rows(model_dir, tok, kv_dtypes, args.snapshot_repeats)
        print_table(
            f"snapshot of a ~{SESSION:,}-token conversation: size, write (spill), restore on a new engine "
            f"(median of {args.snapshot_repeats})",
            ["kv dtype", "tokens", "bytes", f"vs {kv_dtypes[0]}", "write ms", "restore ms", f"vs {kv_dtypes[0]}"],
            rows,
        )
    print(f"\nload average {load_average()}, {other}")


if __name__ == "__main__":
    main()
