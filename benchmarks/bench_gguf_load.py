"""A downloaded GGUF file as the model: first load, warm load, disk, against llama.cpp on the same file.

For one GGUF file (a real-size one: ../shared/notes/real-size.md makes them), each in a process of
its own, the peak RSS from ``os.wait4`` (``ru_maxrss`` of the child) and the wall time:

- **first load**: empty data and cache directories: ``Engine.from_pretrained(FILE)`` prepares the
  file (chatkv.weights.prepared), loads the model and runs the weight self-check, then answers 8
  tokens;
- **warm load**: the same directories again: only the load and the 8 tokens;
- **llama.cpp** (``--llama-bin DIR``): ``llama-bench -t 2 -p 0 -n 8 -r 1`` on the same file (its
  peak RSS is the figure a user compares with);

and the time to read the file once (``cat FILE``, from the page cache: the floor of any first load).

Also the prepared directory's size on disk against the file's. ``--before DIR`` runs the same loads
with an earlier chatkv installed into DIR (``git worktree add /tmp/old REV && .venv/bin/pip install
--no-deps --no-build-isolation --target DIR /tmp/old``), this checkout's editable install taken off
the import path (bench_startup.py does the same). The child reports the load's own
time (``Engine.from_pretrained``) apart from the answer's.

    .venv/bin/python benchmarks/bench_gguf_load.py FILE.gguf [--llama-bin DIR] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import json, os, sys, time
if os.environ.get("BENCH_BEFORE"):  # an earlier chatkv (pip install --target DIR), this checkout's off the path
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, os.environ["BENCH_BEFORE"])
t = time.perf_counter()
from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams
engine = Engine.from_pretrained(sys.argv[1], progress=False, data_dir=sys.argv[2], num_blocks=64)
loaded = time.perf_counter() - t
out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
print(json.dumps({"load_s": loaded, "weights": engine.weights.label, "dir": str(engine.model_dir)}))
engine.close()
"""


def run(cmd: list[str], env: dict | None = None) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in GiB, stdout) of ``cmd`` run to its end."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    out = p.stdout.read()
    err = p.stderr.read()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{cmd[:3]}... failed: {err.decode(errors='replace')[-2000:]}")
    return wall, usage.ru_maxrss / 2**20, out.decode(errors="replace")


def du(path: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("--llama-bin", default=None, help="llama.cpp's build/bin (llama-cli)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--before", default=None, help="a directory holding an earlier chatkv (pip install --target)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import cpu_line, load_average

    gguf = Path(args.gguf).resolve()
    size = gguf.stat().st_size
    print(cpu_line())
    print(f"load average at start: {load_average()}")
    print(f"file: {gguf.name}, {size / 1e9:.3f} GB")
    firsts, warms = [], []
    for r in range(args.repeats):
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
            env = dict(os.environ, CHATKV_HOME=f"{tmp}/home", CHATKV_CACHE_DIR=f"{tmp}/cache")
            if args.before:
                env["BENCH_BEFORE"] = args.before
            cmd = [sys.executable, "-c", CHILD, str(gguf), f"{tmp}/home"]
            wall, rss, out = run(cmd, env)
            info = json.loads(out.strip().splitlines()[-1])
            firsts.append((wall, rss, info["load_s"]))
            disk = du(Path(info["dir"]))
            print(f"round {r + 1}: first load {info['load_s']:.1f} s (process {wall:.1f} s), peak RSS {rss:.2f} GiB")
            for _ in range(2):
                wall, rss, out = run(cmd, env)
                info = json.loads(out.strip().splitlines()[-1])
                warms.append((wall, rss, info["load_s"]))
                print(f"round {r + 1}: warm load {info['load_s']:.1f} s (process {wall:.1f} s), peak RSS {rss:.2f} GiB")
    print(f"weights: {info['weights']}")
    med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
    first_load, first_rss = med(firsts, 2), med(firsts, 1)
    warm_load, warm_rss = med(warms, 2), med(warms, 1)
    t = time.perf_counter()
    subprocess.run(["cat", str(gguf)], stdout=subprocess.DEVNULL, check=True)
    read_s = time.perf_counter() - t
    print(f"prepared directory on disk: {disk / 1e9:.3f} GB = {disk / size:.3f}x the file")
    print(f"reading the file once (page cache): {read_s:.2f} s")
    print(f"first load: {first_load:.1f} s, peak {first_rss:.2f} GiB")
    print(f"warm load: {warm_load:.1f} s, peak {warm_rss:.2f} GiB")
    print(f"first load / (2 x warm + read): {first_load / (2 * warm_load + read_s):.2f} (goal <= 1)")
    if args.llama_bin:
        bench = Path(args.llama_bin) / "llama-bench"
        cmd = [str(bench), "-m", str(gguf), "-t", "2", "-p", "0", "-n", "8", "-r", "1"]
        rs = [run(cmd)[:2] for _ in range(args.repeats)]
        llama_rss = statistics.median(r[1] for r in rs)
        wall = statistics.median(r[0] for r in rs)
        print(f"llama.cpp (llama-bench -n 8): process {wall:.1f} s, peak {llama_rss:.2f} GiB")
        print(f"peak RSS ratio to llama.cpp: first load {first_rss / llama_rss:.2f}x, warm {warm_rss / llama_rss:.2f}x")
    print(f"load average at end: {load_average()}")


if __name__ == "__main__":
    main()
