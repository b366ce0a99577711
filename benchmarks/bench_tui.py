"""The chat app's own costs: launch to a ready input box, and what it adds to the first token.

- launch: from constructing ``ChatApp`` (no engine: it loads the model as ``chatkv`` does) to
  the input box enabled and focused, headless (Textual's ``run_test``). Cold = a fresh
  ``CHATKV_HOME``, so the default model is converted from its GGUF first; warm = the same
  home again (converted model on disk). ``--model DIR`` times a local model instead (no cold run).
- first token: for each turn, the SDK's own TTFT (``reply.usage.ttft_s``) against the app's
  (Enter to the first piece written into the reply's Markdown), and the app's share alone
  (the SDK yielding the first piece to it being on screen). Goal: the app adds < 50 ms.

- ``--beside-suite``: the same warm chat once more while the project's own tests run beside it
  (pytest on ``SUITE_FILES``, restarted until the chat ends: a CPU-bound multi-threaded load, under
  which an app whose threads wait on each other decodes at 1.0-1.2 tok/s), and the app's decode
  tok/s of both runs side by side (reply tokens / (done - first piece shown), turns 2..n) with the
  ratio.

    .venv/bin/python benchmarks/bench_tui.py [--model DIR] [--turns 6] [--no-cold] [--threads 2] [--beside-suite]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SUITE_FILES = ["tests/model/test_weight_paths.py", "tests/model/test_cpu_decode.py", "tests/engine/test_scheduler.py"]

QUESTIONS = [
    "What is the capital of France?",
    "And of Italy?",
    "Name a river in Paris.",
    "How long is it?",
    "Which sea does it reach?",
    "Thanks! One more: Spain?",
    "And Portugal?",
    "Summarise.",
]


async def launch(model: str | None, data_dir: str, turns: int, max_tokens: int) -> dict:
    from chatkv.tui.app import ChatApp
    from chatkv.tui.widgets.chat import ChatInput

    t0 = time.perf_counter()
    app = ChatApp(model=model, data_dir=data_dir, sampling=dict(max_tokens=max_tokens, temperature=0.0))
    out: dict = {"sdk_ttft": [], "app_ttft": [], "app_added": [], "tok_s": [], "sdk_tok_s": []}
    async with app.run_test(size=(100, 32)) as pilot:
        box = app.query_one(ChatInput)
        while app.engine is None or box.disabled or app.focused is not box or app.query_one("#loading").display:
            assert app.exit_code == 0, "the model failed to load"
            await asyncio.sleep(0.005)
        out["ready_s"] = time.perf_counter() - t0
        for q in QUESTIONS[:turns]:
            app.send(q)
            while app.generating:
                await asyncio.sleep(0.02)  # a wake-up costs the UI thread: not more often than the app redraws
            await pilot.pause()
            t = app.turn_timing
            if "first_shown" not in t or "sdk_ttft" not in t:
                continue
            out["sdk_ttft"].append(t["sdk_ttft"])
            out["app_ttft"].append(t["first_shown"] - t["sent"])
            out["app_added"].append(t["first_shown"] - t["first_piece"])
            usage = app.last_usage
            n = getattr(usage, "generated_tokens", None)
            if n and n > 1 and t.get("done", 0) > t["first_shown"]:
                out["tok_s"].append((n - 1) / (t["done"] - t["first_shown"]))
                out["sdk_tok_s"].append(usage.tokens_per_s)
        await app.quit_app()
    return out


def ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1000:.1f} ms" if xs else "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a local model directory (default: the packaged model)")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--no-cold", action="store_true", help="skip the cold run (conversion in a fresh CHATKV_HOME)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--beside-suite", action="store_true", help="the warm chat again beside a running test suite")
    a = p.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    print(f"threads {a.threads}, cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as home:
        if a.model is None and not a.no_cold:
            os.environ["CHATKV_HOME"] = home  # the converted default model goes here: a cold start
            cold = asyncio.run(launch(None, home, 1, a.max_tokens))
            print(f"launch to ready input, cold (conversion into a fresh CHATKV_HOME): {cold['ready_s']:.2f} s")
        warm = asyncio.run(launch(a.model, home, a.turns, a.max_tokens))
        print(f"launch to ready input, warm: {warm['ready_s']:.2f} s")
        sdk, app_t, added = warm["sdk_ttft"][1:], warm["app_ttft"][1:], warm["app_added"][1:]  # turn 1 opens the chat
        print(
            f"turns 2..{a.turns} (median): SDK TTFT {ms(sdk)}, app TTFT (Enter to first piece shown) {ms(app_t)}, "
            f"ratio {statistics.median(app_t) / max(statistics.median(sdk), 1e-9):.2f}x"
        )
        extra = statistics.median(app_t) - statistics.median(sdk)
        print(
            f"the app adds {extra * 1000:.1f} ms over the SDK's TTFT (of which SDK yield -> on screen "
            f"{ms(added)}; max {max(added) * 1000:.1f} ms); goal < 50 ms: {'met' if extra < 0.050 else 'NOT met'}"
        )
        if warm["tok_s"][1:]:
            print(
                f"decode while streaming, turns 2..{a.turns} (median): "
                f"the app shows {statistics.median(warm['tok_s'][1:]):.1f} "
                f"tok/s, the SDK reports {statistics.median(warm['sdk_tok_s'][1:]):.1f} tok/s for the same turns"
            )
        if a.beside_suite:
            busy = beside_suite(lambda: asyncio.run(launch(a.model, home, a.turns, a.max_tokens)))
            q, b = statistics.median(warm["tok_s"][1:]), statistics.median(busy["tok_s"][1:])
            sq, sb = statistics.median(warm["sdk_tok_s"][1:]), statistics.median(busy["sdk_tok_s"][1:])
            print(
                f"app decode, turns 2..{a.turns} (median): quiet {q:.1f} tok/s, beside the running suite {b:.1f} tok/s "
                f"({b / q:.2f}x of quiet); TTFT quiet {ms(app_t)}, beside the suite {ms(busy['app_ttft'][1:])}"
            )
            print(
                f"the SDK's own decode tok/s in the same turns: quiet {sq:.1f}, "
                f"beside the suite {sb:.1f} ({sb / sq:.2f}x)"
            )


def beside_suite(run):
    """``run()`` while pytest runs SUITE_FILES beside it (restarted until run returns), with the
    load average printed before and after."""
    import subprocess
    import threading

    stop = threading.Event()
    procs: list = []

    def suite():
        while not stop.is_set():
            p = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUITE_FILES],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            procs.append(p)
            while p.poll() is None and not stop.is_set():
                time.sleep(0.2)
            if p.poll() is None:
                p.kill()
                p.wait()

    th = threading.Thread(target=suite, daemon=True)
    th.start()
    time.sleep(15)  # the suite past its imports and model builds, into its tests
    try:
        print(f"beside the suite ({' '.join(SUITE_FILES)}): load average {os.getloadavg()[0]:.2f} at the start")
        out = run()
        print(f"load average {os.getloadavg()[0]:.2f} at the end; pytest runs started: {len(procs)}")
        return out
    finally:
        stop.set()
        th.join()


if __name__ == "__main__":
    main()
