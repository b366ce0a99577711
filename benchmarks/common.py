"""Shared loading and timing helpers for the benchmarks (chatkv, transformers and llama.cpp on the same model).

Every benchmark measures chatkv and its baseline in the same process, with the
same dtype and the same ``torch.set_num_threads``, after warming both up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

# run as `python benchmarks/<name>.py` from the repository root
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
ENGINE_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}

CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Explain in a few paragraphs why the sky is blue."},
]


def parser(description: str, default_dtype: str = "bf16") -> argparse.ArgumentParser:
    """Common flags; ``--dtype both`` runs bf16 then fp32 (see ``dtypes``)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--dtype",
        choices=[*sorted(DTYPES), "both"],
        default=default_dtype,
        help="weights/activations dtype for chatkv and transformers (both: bf16, then fp32)",
    )
    p.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads (and llama.cpp n_threads)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions; the median is reported")
    p.add_argument(
        "--model", default=None, help="Hugging Face model directory (default: the packaged SmolLM2-135M-Instruct)"
    )
    return p


def dtypes(args) -> list[str]:
    return ["bf16", "fp32"] if args.dtype == "both" else [args.dtype]


def setup(args) -> Path:
    """Set threads and return the model directory."""
    torch.set_num_threads(args.threads)
    if args.model:
        return Path(args.model)
    from chatkv.weights import ensure_default_model

    return ensure_default_model()


def load_engine(model_dir: Path, dtype: str, **config):
    from chatkv.engine.core import Engine

    return Engine.from_pretrained(model_dir, dtype=ENGINE_DTYPES[dtype], **config)


def load_hf(model_dir: Path, dtype: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype])
    model.eval()
    return model


def llama_decode(llm, ids, n):
    """llama.cpp's greedy decode of ``n`` tokens after ``ids``: (tok/s between the first and the
    last token, the tokens)."""
    stamps, toks = [], []
    for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        stamps.append(time.perf_counter())
        toks.append(tok)
        if len(toks) == n:
            break
    return (n - 1) / (stamps[-1] - stamps[0]) if n > 1 else 0.0, toks


_llama_cpp_checked: list[bool] = []


def prepare_llama_cpp():
    """llama_cpp, made safe on this CPU, or None if it is not installed.

    llama-cpp-python 0.3.36 built on an Intel Xeon with AMX segfaults on any eval of 2 or more
    tokens with its default weight repacking (the extra buffer types: its AMX / AVX-512
    repacked kernels), and not without it. A child process probes that once; where it
    crashes, every ``Llama`` made from then on loads without repacking, and this says so: the
    peer's figures are then a lower bound of what a fixed build would do."""
    try:
        import llama_cpp
    except ImportError:
        return None
    if not _llama_cpp_checked:
        from chatkv.weights import packaged_gguf_path

        code = (
            "import sys, llama_cpp; m = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, "
            "verbose=False); m.eval([100, 101, 102])"
        )
        try:
            ok = (
                subprocess.run(
                    [sys.executable, "-c", code, str(packaged_gguf_path())], capture_output=True, timeout=300
                ).returncode
                == 0
            )
        except subprocess.TimeoutExpired:
            ok = False
        _llama_cpp_checked.append(ok)
        if not ok:
            import llama_cpp.llama_cpp as low

            default = low.llama_model_default_params

            def params():
                p = default()
                p.use_extra_bufts = False
                return p

            low.llama_model_default_params = params
            print(
                "llama.cpp: its weight repacking (AMX / AVX-512 repacked kernels) crashes a multi-token batch in "
                "this build on this CPU (a segfault, probed in a child process); it runs WITHOUT repacking "
                "(use_extra_bufts=False), so its figures are a lower bound"
            )
    return llama_cpp


def load_llama_cpp(threads: int, gguf: str | Path | None = None):
    """llama.cpp on ``gguf`` (default: the packaged GGUF; its own quantised weights), or None if
    llama_cpp is not installed."""
    llama_cpp = prepare_llama_cpp()
    if llama_cpp is None:
        return None
    from chatkv.weights import packaged_gguf_path

    path = gguf or packaged_gguf_path()
    return llama_cpp.Llama(model_path=str(path), n_threads=threads, n_ctx=2048, verbose=False)


def hf_generate(model, ids: list[int], n: int):
    """Greedy ``n`` new tokens with transformers (EOS ignored); returns (new token ids, start time, per-token times).

    The timestamps are taken when each new token is produced (a StoppingCriteria is called
    once per generated token), so ``(n - 1) / (t[-1] - t[0])`` is the decode rate without the prefill,
    the same definition as chatkv's ``decode_tokens_per_s``.
    """
    from transformers import StoppingCriteria, StoppingCriteriaList

    stamps: list[float] = []

    class Stamp(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([Stamp()]),
        )
    new = out[0, len(ids) :].tolist()
    assert len(new) == n, (len(new), n)
    return new, start, stamps


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share before their first difference."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def cpu_line() -> str:
    """The CPU model, its ISA flags that matter to the kernels, the cores, and torch's ISA level."""
    from chatkv.model.self_check import cpu_model

    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    isa = [
        f
        for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_int8")
        if f in flags
    ]
    return (
        f"CPU: {cpu_model()} ({os.cpu_count()} cores; {' '.join(isa) or 'no AVX-512'}; "
        f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()})"
    )


class BusyLoad:
    """``n`` processes each spinning a pure-Python loop (one busy core each) while the block runs."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        import subprocess

        code = "import time\nend = time.time() + 3600\nwhile time.time() < end: pass"
        self.procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(self.n)]
        time.sleep(1.0 if self.n else 0)  # let them take their cores
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()


def each_ms(f, calls: int) -> list[float]:
    """Milliseconds of each of ``calls`` calls of ``f``, in order (an engine's steps one by one:
    the first ones after a change are compared with the rest)."""
    out = []
    for _ in range(calls):
        t = time.perf_counter()
        f()
        out.append((time.perf_counter() - t) * 1000)
    return out


def best_of(f, calls: int, runs: int = 5, warm: int = 3, clock=time.perf_counter) -> float:
    """Microseconds per call of ``f``: the best of ``runs`` runs of ``calls`` calls, after ``warm``
    calls (``clock``: perf_counter for wall time, thread_time for this thread's CPU time)."""
    for _ in range(warm):
        f()
    best = float("inf")
    for _ in range(runs):
        t = clock()
        for _ in range(calls):
            f()
        best = min(best, (clock() - t) / calls * 1e6)
    return best


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _busy_cpu_seconds() -> float | None:
    """CPU seconds the whole machine spent busy since boot (Linux /proc/stat), or None."""
    from chatkv.model.cpu_threads import _HZ, _machine_busy_ticks

    ticks = _machine_busy_ticks()
    return None if ticks is None else ticks / _HZ


class OtherLoad:
    """How much of the machine's CPU other processes used while the benchmark ran.

    ``str()`` gives e.g. "other processes used 0.05 of 2 cores": anything well above 0
    means the figures were taken on a busy machine (ratios hold better than rates).
    """

    def __init__(self):
        self.busy0, self.own0, self.wall0 = _busy_cpu_seconds(), self._own(), time.monotonic()

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def __str__(self) -> str:
        busy = _busy_cpu_seconds()
        if busy is None or self.busy0 is None:
            return "other load: n/a"
        other = (busy - self.busy0) - (self._own() - self.own0)
        cores = max(other, 0.0) / (time.monotonic() - self.wall0)
        return f"other processes used {cores:.2f} of {os.cpu_count()} cores"


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    print(f"\n{title}")
    print("  ".join(str(h).ljust(w) for h, w in zip(header, widths)))
    print(line)
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))


def goal(ratio: float, target: float) -> str:
    return f">= {target:g}x  {'MET' if ratio >= target else 'not met'}"
