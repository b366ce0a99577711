"""Speed and memory at the sizes people run, beside llama.cpp on the same GGUF, in one run.

Random-weight models at real shapes (their text is noise; speed and memory do not depend on the
values), made with transformers and llama.cpp's own converter and quantiser as
``../shared/notes/real-size.md`` describes (``--make DIR``), or given as files (``--gguf``).
For each file:

- **llama.cpp**: ``llama-bench -t T -p 512 -n 128 -r R`` (pp512 and tg128 tok/s, its own means),
  peak RSS of the process (``/usr/bin/time -v``).
- **chatkv**: the file through its own converter (``weights=auto``: the file's 4-bit numbers),
  prefix caching and speculation off, in a child process: pp512 = 512 / time to first token of a
  512-token prompt, tg128 = tokens/s of 128 greedy tokens (EOS ignored), each the median of R;
  warm peak RSS after a 1,024-token prompt (the child's ``ru_maxrss``; the conversion of a first
  run happens in an earlier child, so the figure is a warm load's).
- **the roofline**: the read bandwidth of this machine on T threads, measured in the same run
  (the best of 5 sums of a 1 GiB float32 tensor), and the bytes a decode step reads (the file's
  tensors less the token embeddings, of which a step reads one row; a tied output matrix is read
  whole); tg128 x bytes / bandwidth is the share of the limit each engine reaches.

    .venv/bin/python benchmarks/bench_real_size.py --llama-bin DIR --gguf s17-Q4_K_M.gguf [--gguf ...]
    .venv/bin/python benchmarks/bench_real_size.py --llama-bin DIR --make /tmp/realsize --shape 1.7b

The CPU, the load before and after, and what other processes used meanwhile are printed:
benchmark on a quiet machine."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import OtherLoad, cpu_line, load_average, print_table

SHAPES = {  # name: LlamaConfig keywords (real-size.md)
    "1.7b": dict(  # SmolLM2-1.7B
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=32,
        tie_word_embeddings=True,
        rope_theta=130000.0,
    ),
    "8b-8layers": dict(  # Llama-3-8B's layer shapes, 8 of its 32 layers
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        rope_theta=500000.0,
    ),
}

CHILD = r"""
import json, resource, statistics, sys, time
from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams
path = sys.argv[1]
threads, repeats, prompt, gen = (int(a) for a in sys.argv[2:6])
e = Engine.from_pretrained(path, progress=False, threads=threads, enable_prefix_caching=False, speculative="off",
                           adaptive_threads=False)
if sys.argv[6] == "load":
    print(json.dumps({"loaded": True})); sys.exit(0)
vocab = e.runner.model.config.vocab_size
ids = lambda n, s: [(1000 + 7919 * (i + s)) % (vocab - 1000) + 500 for i in range(n)]
greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
e.generate(ids(32, 0), greedy(4))  # warm
pp, tg = [], []
for r in range(repeats):
    res = e.generate(ids(prompt, r + 1), greedy(1))
    pp.append(prompt / res.usage.ttft_s)
    res = e.generate(ids(16, r + 100), greedy(gen))
    tg.append(res.usage.tokens_per_s)
e.generate(ids(1024, 999), greedy(8))  # the memory figure's prompt
print(json.dumps({"pp": statistics.median(pp), "tg": statistics.median(tg),
                  "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def read_bandwidth(threads: int) -> float:
    """GB/s of summing a 1 GiB float32 tensor on ``threads`` threads, the best of 5."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(2**28)
        x.sum()
        best = min(_timed(x.sum) for _ in range(5))
    finally:
        torch.set_num_threads(before)
    return x.numel() * 4 / best / 1e9


def _timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def step_bytes(path: Path) -> int:
    """Bytes a decode step reads from ``path``'s tensors: all of them but the token embeddings
    (one row), unless the output matrix is tied to them (then read whole once)."""
    from gguf import GGUFReader  # the gguf package chatkv's converter reads with

    reader = GGUFReader(str(path))
    sizes = {t.name: t.n_bytes for t in reader.tensors}
    total = sum(sizes.values())
    if "output.weight" in sizes:
        total -= sizes.get("token_embd.weight", 0)
    return total


def llama_bench(bin_dir: Path, path: Path, threads: int, repeats: int) -> dict:
    """llama-bench with its defaults; where it crashes (its AMX repacking's prefill dies with
    SIGSEGV on some Intel Xeons with AMX), again with ``--repack 0``, which the result says."""
    try:
        return _llama_bench(bin_dir, path, threads, repeats, [])
    except subprocess.CalledProcessError as e:
        print(f"llama-bench on {path.name} exited {e.returncode}; again with --repack 0")
        return {**_llama_bench(bin_dir, path, threads, repeats, ["--repack", "0"]), "note": "--repack 0"}


def _llama_bench(bin_dir: Path, path: Path, threads: int, repeats: int, extra: list[str]) -> dict:
    cmd = [
        "/usr/bin/time",
        "-v",
        str(bin_dir / "llama-bench"),
        "-m",
        str(path),
        "-t",
        str(threads),
        "-p",
        "512",
        "-n",
        "128",
        "-r",
        str(repeats),
        "-o",
        "json",
        *extra,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0)
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", out.stderr).group(1)) / 2**20
    return {"pp": pp, "tg": tg, "rss_gib": rss}


def chatkv_bench(path: Path, threads: int, repeats: int) -> dict:
    here = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(here))
    args = [sys.executable, "-c", CHILD, str(path), str(threads), str(repeats), "512", "128"]
    subprocess.run([*args, "load"], check=True, env=env, capture_output=True)  # a first run converts
    out = subprocess.run([*args, "run"], check=True, env=env, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def make(directory: Path, shape: str, bin_dir: Path, tree: Path, tokenizer: Path) -> Path:
    """A random-weight model of ``shape`` as Q4_K_M, made as real-size.md says."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    out = directory / f"{shape}-Q4_K_M.gguf"
    if out.exists():
        return out
    cfg = LlamaConfig(
        vocab_size=49152,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        **SHAPES[shape],
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02) if p.ndim == 2 else p.fill_(1.0)
    hf = directory / f"hf-{shape}"
    model.save_pretrained(hf)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tokenizer / f).exists():
            (hf / f).write_bytes((tokenizer / f).read_bytes())
    f16 = directory / f"{shape}-f16.gguf"
    env = dict(os.environ, PYTHONPATH=f"{tree / 'gguf-py'}:{os.environ.get('PYTHONPATH', '')}")
    subprocess.run(
        [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f16", "--outfile", str(f16)],
        check=True,
        env=env,
    )
    subprocess.run([str(bin_dir / "llama-quantize"), str(f16), str(out), "Q4_K_M", "2"], check=True)
    f16.unlink()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bin", required=True, help="llama.cpp's build/bin (llama-bench, llama-quantize)")
    ap.add_argument("--gguf", action="append", default=[], help="a GGUF file (repeatable)")
    ap.add_argument("--make", help="make the --shape models in this directory first")
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), help="with --make (repeatable)")
    ap.add_argument("--llama-tree", help="with --make: llama.cpp's source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--tokenizer", help="with --make: a directory with the packaged model's tokenizer files")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    bin_dir = Path(args.llama_bin)
    files = [Path(f) for f in args.gguf]
    if args.make:
        if not (args.llama_tree and args.tokenizer):
            ap.error("--make needs --llama-tree and --tokenizer")
        files += [
            make(Path(args.make), s, bin_dir, Path(args.llama_tree), Path(args.tokenizer)) for s in args.shape or []
        ]
    if not files:
        ap.error("give --gguf FILE or --make DIR --shape S")
    print(cpu_line())
    print(f"load average before: {load_average()}")
    other = OtherLoad()
    bw = read_bandwidth(args.threads)
    print(f"read bandwidth, {args.threads} threads: {bw:.1f} GB/s")
    rows = []
    for path in files:
        need = step_bytes(path)
        peer = llama_bench(bin_dir, path, args.threads, args.repeats)
        ours = chatkv_bench(path, args.threads, args.repeats)
        roof = lambda tg: f"{tg * need / 1e9 / bw:.0%}"  # noqa: E731
        rows.append(
            [
                path.name + (f" (llama.cpp {peer['note']})" if "note" in peer else ""),
                f"{need / 2**30:.2f}",
                f"{peer['pp']:.1f} / {peer['tg']:.1f}",
                f"{ours['pp']:.1f} / {ours['tg']:.1f}",
                f"{ours['pp'] / peer['pp']:.2f}x / {ours['tg'] / peer['tg']:.2f}x",
                f"{roof(peer['tg'])} / {roof(ours['tg'])}",
                f"{peer['rss_gib']:.2f} / {ours['rss_gib']:.2f} ({ours['rss_gib'] / peer['rss_gib']:.2f}x)",
            ]
        )
    print_table(
        f"pp512 / tg128 tok/s, {args.threads} threads, median of {args.repeats} (llama-bench: its mean)",
        [
            "file",
            "GiB read a step",
            "llama.cpp pp / tg",
            "chatkv pp / tg",
            "ratio pp / tg",
            "of the roofline, llama.cpp / chatkv",
            "peak RSS GiB, llama.cpp / chatkv",
        ],
        rows,
    )
    print(f"\nload average after: {load_average()}; {other}")
    print(f"statistics: {statistics.__name__} medians; chatkv's RSS after a 1,024-token prompt")


if __name__ == "__main__":
    main()
