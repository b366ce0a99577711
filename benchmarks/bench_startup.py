"""Start-up: one-shot ``chatkv --max-tokens 8 "..."``, wall time and peak memory, warm.

Each command runs ``--repeats`` times after one unmeasured run (so the model is converted, the
weight self-check's verdict cached and the files in the page cache: "warm"), each in its own
process, the commands interleaved round by round (a loaded machine's drift falls on all of them);
the median wall time, the median CPU time (user + system of the child: less sensitive to the load
than wall time) and the median peak RSS (``ru_maxrss`` of the child, from ``os.wait4``; this
benchmark imports no torch, so the figure is the child's own) are printed, with the ratio to the
baselines measured in the same run:

- ``import torch`` and ``import torch, transformers``: the floor any Python stack on these pays
  (a warm one-shot imports no transformers: chatkv.weights.direct_tokenizer);
- the one-shot with ``CHATKV_DIRECT_TOKENIZER=0``: transformers' tokenizer, as before that;
- llama.cpp (llama-cpp-python on the same packaged GGUF): load, 8 tokens of the same prompt.

    .venv/bin/python benchmarks/bench_startup.py [--repeats 3] [--before DIR]

``--before DIR``: also time an earlier chatkv installed into DIR (``git worktree add /tmp/old REV
&& .venv/bin/pip install --no-deps --no-build-isolation --target DIR /tmp/old``), run by this
venv's Python with the editable install of this checkout taken off the import path: the start-up
before and after a change, in one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
CHATKV = str(Path(PY).parent / "chatkv")
PROMPT = "What is the capital of France?"
GOAL_WALL, GOAL_MIB = 1.5, 700


def run(cmd: list[str], env: dict) -> tuple[float, float, float, str]:
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    out = p.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd[:3]}... failed with {status}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, out.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", default=None, help="a directory holding an earlier chatkv (pip install --target)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import cpu_line, load_average

    env = dict(os.environ)
    from chatkv.weights import ensure_default_model
    from chatkv.weights.gguf import packaged_gguf_path

    ensure_default_model()  # converted once, outside the timing
    commands = {
        "import torch": [PY, "-c", "import torch"],
        "import torch, transformers": [PY, "-c", "import torch, transformers"],
        "chatkv one-shot": [CHATKV, "--max-tokens", "8", PROMPT],
        "one-shot, hf tokenizer": (["env", "CHATKV_DIRECT_TOKENIZER=0", CHATKV, "--max-tokens", "8", PROMPT]),
    }
    if args.before:
        code = (
            "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
            f"sys.path.insert(0, {args.before!r}); from chatkv.tui.cli import main; "
            "sys.argv = ['chatkv'] + sys.argv[1:]; sys.exit(main())"
        )
        commands["chatkv one-shot, --before"] = [PY, "-c", code, "--max-tokens", "8", PROMPT]
    try:
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is not None:
            code = (
                "from llama_cpp import Llama; import sys; m = Llama(model_path=sys.argv[1], n_ctx=2048, n_threads=2, "
                "verbose=False); print(m.create_chat_completion([{'role': 'user', 'content': sys.argv[2]}], "
                "max_tokens=8, temperature=0)['choices'][0]['message']['content'])"
            )
            commands["llama.cpp one-shot"] = [PY, "-c", code, str(packaged_gguf_path()), PROMPT]
    except ImportError:
        pass
    failed = {}
    for name, cmd in list(commands.items()):
        try:
            run(cmd, env)  # warm
        except SystemExit as e:
            if name != "llama.cpp one-shot":
                raise
            failed[name] = str(e)  # the peer's build crashing is its report, not the end of this one
            del commands[name]
    runs = {name: [] for name in commands}
    for _ in range(args.repeats):  # interleaved
        for name, cmd in commands.items():
            runs[name].append(run(cmd, env))
    results = {
        name: tuple(statistics.median(r[i] for r in rs) for i in range(3)) + (rs[-1][3],) for name, rs in runs.items()
    }
    print(cpu_line())
    print(f"median of {args.repeats} warm runs, interleaved, load average {load_average()}")
    for name, why in failed.items():
        print(f"{name}: {why}")
    base = results.get("llama.cpp one-shot")
    print(f"{'command':28} {'wall s':>7} {'cpu s':>6} {'peak MiB':>9} {'wall/peak vs llama.cpp':>23}  output")
    for name, (wall, cpu, mib, out) in results.items():
        ratio = f"{wall / base[0]:.2f}x / {mib / base[2]:.2f}x" if base else "-"
        print(f"{name:28} {wall:7.2f} {cpu:6.2f} {mib:9.0f} {ratio:>23}  {out[:60]!r}")
    one, hf = results["chatkv one-shot"], results["one-shot, hf tokenizer"]
    print(
        f"direct tokenizer vs transformers': wall {one[0] / hf[0]:.2f}x, cpu {one[1] / hf[1]:.2f}x, "
        f"peak {one[2] / hf[2]:.2f}x"
    )
    wall, _, mib, _ = one
    print(
        f"goals: wall <= {GOAL_WALL} s: {'MET' if wall <= GOAL_WALL else 'not met'}; "
        f"peak <= {GOAL_MIB} MiB: {'MET' if mib <= GOAL_MIB else 'not met'}"
    )


if __name__ == "__main__":
    main()
