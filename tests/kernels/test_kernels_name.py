"""The folder ``kernels/`` never shadows another distribution's ``kernels`` from the repository's root.

chatkv imports the folder as ``chatkv.kernels`` (pyproject's package-dir). From the root, where pytest,
``python -c`` and the benchmarks put the folder on ``sys.path`` ahead of site-packages, an importable
top-level ``kernels`` would be found instead of Hugging Face's ``kernels``, which transformers 5.25
requires and imports at ``import transformers`` (``cannot import name 'CUDAProperties' from 'kernels'``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_at_root(code: str, pythonpath: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_the_bare_name_goes_to_the_other_distribution_and_chatkv_kernels_still_loads(tmp_path):
    other = tmp_path / "site" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("MARK = 'the other kernels'\nfrom kernels.sub import VALUE\n")
    (other / "sub.py").write_text("VALUE = 7\n")
    printed = run_at_root(
        "import sys; assert sys.path[0] == ''\n"  # the repository's root comes first, as under pytest
        "import kernels\n"
        "print(kernels.MARK, kernels.VALUE, kernels.__file__)\n"
        "import chatkv.kernels as ck\n"
        "print(ck.__name__, ck.__file__, ck.attention_backend('cpu')[1].__module__)\n",
        pythonpath=str(tmp_path / "site"),
    ).splitlines()
    assert printed[0] == f"the other kernels 7 {other / '__init__.py'}"
    assert printed[1] == f"chatkv.kernels {ROOT / 'kernels' / '__init__.py'} chatkv.kernels.attention"


def test_transformers_imports_from_the_root():
    """Whatever transformers is installed: its modules import, with its own ``kernels`` where it has one."""
    printed = run_at_root(
        "import importlib.metadata as md, kernels\n"
        "from transformers import AttentionInterface\n"
        "from transformers.models.llama.modeling_llama import apply_rotary_pos_emb\n"
        "try:\n"
        "    dist = md.distribution('kernels')\n"
        "except md.PackageNotFoundError:\n"
        "    dist = None\n"
        "print(kernels.__file__)\n"
        "print(dist.locate_file('kernels/__init__.py') if dist else '')\n"
    ).splitlines()
    if printed[1]:  # transformers >= 5.25 requires Hugging Face's kernels: the bare name is that one
        assert Path(printed[0]).resolve() == Path(printed[1]).resolve()
    else:
        assert Path(printed[0]) == ROOT / "kernels" / "__init__.py"
