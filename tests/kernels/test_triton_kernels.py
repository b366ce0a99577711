"""The Triton kernels' tests (tests/support/triton_kernel_cases.py), run in an interpreter of their own.

Without CUDA they run under Triton's interpreter, and ``TRITON_INTERPRET=1`` must be in place
before triton first decorates anything; in the whole suite other tests import triton earlier
(through torch), which left some kernels interpreted and some helpers compiled ("Cannot call
@triton.jit'd outside of the scope of a kernel"). A fresh process gives the cases a clean
triton. Every case must pass; none may be skipped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_triton_kernel_cases_pass_in_their_own_process():
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/support/triton_kernel_cases.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = out.stdout[-4000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    summary = out.stdout.strip().splitlines()[-1]
    assert re.search(r"\b(\d+) passed\b", summary) and "skipped" not in summary and "failed" not in summary, summary
    assert int(re.search(r"\b(\d+) passed\b", summary).group(1)) >= 82, summary
